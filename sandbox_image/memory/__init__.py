"""The memory guard and the figures it reads: what the sandbox uses, and what each sample holds (``sockets.py``
also tells a slot process what a finished sample left in flight in Unix sockets)."""

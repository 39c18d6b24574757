"""The memory guard and the figures it reads: what the sandbox uses, and what each sample holds."""

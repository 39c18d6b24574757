"""Model-written programs that reward code runs: ``run`` and ``run_tests`` (``execution.py``), the program runner and
its monitors, one slot's programs (``program.py``), the languages, and what crosses between a slot process and the
runner (``run_requests.py``)."""

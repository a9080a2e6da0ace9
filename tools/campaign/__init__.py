"""A fault campaign against the example project: ``python -m tools.campaign --help``.

The runner (``runner``) starts the example under gunicorn on a store topology
(``topology``, ``stores``), sends keyed charges from retrying clients that record every
attempt in a history (``history``, ``clients``), injects faults on a schedule
(``faults``), and hands the history and the provider's ledger to the checker
(``checker``), which counts every execution per key. docs/reliability.md has the rules and
the results.
"""

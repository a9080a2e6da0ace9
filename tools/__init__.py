"""Tools shared by the tests and the benchmarks: the live-server harness (``server``), the
HTTP fuzz (``fuzz``, run as ``python -m tools.fuzz``), PgBouncer (``pgbouncer``) and the
thread helpers (``threads``). Not shipped in the wheel; imported from the repository root."""

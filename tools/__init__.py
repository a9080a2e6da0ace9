"""Tools shared by the tests and the benchmarks: the live-server harness (``server``), the
HTTP fuzz (``fuzz``, run as ``python -m tools.fuzz``), PgBouncer (``pgbouncer``), the
fault campaign (``campaign``, run as ``python -m tools.campaign``) and the thread helpers
(``threads``). Not shipped in the wheel; imported from the repository root."""

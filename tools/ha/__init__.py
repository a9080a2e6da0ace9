"""The high-availability topologies people run, on this machine, for tests and campaigns:
a Redis master and replica under three Sentinels (``sentinel``), and PostgreSQL with a
streaming replica under Patroni and etcd (``patroni``). Each is a context manager with the
same small interface (``Topology``, which the campaign runner's ``tools.campaign.topology``
adapts): ``env`` for the example project's settings, ``failover()`` (a clean switch-over)
and ``kill_primary()`` (SIGKILL of the primary, then the topology's own promotion; the
killed node comes back as a replica before it returns, unless ``rejoin=False``)."""

from __future__ import annotations

from typing import Protocol


class Topology(Protocol):
    """What a campaign needs from a topology: start it (``__enter__``), point the app at it
    (``env``: environment variables for ``example_project/settings.py``), fail it over, and
    stop it (``__exit__``). ``failover()`` and ``kill_primary()`` return once a new primary
    serves, and return its name (``host:port``)."""

    name: str

    @property
    def env(self) -> dict[str, str]: ...

    def __enter__(self) -> Topology: ...

    def __exit__(self, *exc: object) -> None: ...

    def failover(self) -> str: ...

    def kill_primary(self, *, rejoin: bool = True) -> str: ...

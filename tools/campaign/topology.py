"""What the campaign runner needs of a store topology, and how it finds one.

A topology is the store side of a campaign: the servers it starts (a PostgreSQL, a Redis,
a cluster, a Sentinel group, a Patroni cluster), the environment the example project reads
to reach them (``env``: ``DATABASE_URL``, ``EXAMPLE_REDIS_URL``, …), and the store-side
faults it can inject. The runner starts it, starts the example under gunicorn with ``env``,
and on the fault schedule calls ``inject(fault)``; what ``inject`` returns is recorded in
the history with the fault's start and end, so the checker can tell which executions a
fault may excuse.

The HA topologies (``tools/ha/sentinel.py``: ``SentinelTopology``; ``tools/ha/patroni.py``:
``PatroniTopology(sync: bool)``) are context managers with an ``env`` and ``failover()`` /
``kill_primary()``; ``adapt`` wraps them into this interface (faults ``failover`` and
``kill-primary``), so they need not import anything from here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol


class Topology(Protocol):
    """A running store (or group of stores) the example project talks to."""

    #: The name in the campaign's table (``postgres``, ``redis``, ``cluster``, …).
    name: str
    #: What the example's settings read to reach the store(s): ``DATABASE_URL`` for the
    #: database (the runner provides one when the topology is not a database),
    #: ``EXAMPLE_REDIS_URL``, ``CAMPAIGN_*`` options of the campaign settings.
    env: dict[str, str]
    #: The store-side faults ``inject`` knows (``restart``, ``stall``, ``failover``, …).
    faults: frozenset[str]

    def start(self) -> None:
        """Start the servers and wait until they serve; fill in ``env``."""

    def stop(self) -> None:
        """Stop every process ``start`` started and remove their data; safe to call twice."""

    def inject(self, fault: str, seconds: float) -> str:
        """Inject ``fault`` for about ``seconds`` (a stall, an outage) and return when it is
        over, with a line for the history saying what was done (``"SIGKILL master 7441,
        replica 7444 promoted in 2.1 s"``)."""
        ...


class Adapted:
    """An HA topology object (context manager, ``env``, ``failover()``, ``kill_primary()``)
    as a ``Topology``: ``failover`` and ``kill-primary`` call its methods; ``stall`` and
    the rest are not offered."""

    def __init__(self, name: str, inner: Any) -> None:
        self.name = name
        self.inner = inner
        self.env: dict[str, str] = {}
        self.faults = frozenset(
            fault
            for fault, method in (("failover", "failover"), ("kill-primary", "kill_primary"))
            if callable(getattr(inner, method, None))
        )
        self._entered = False

    def start(self) -> None:
        self.inner.__enter__()
        self._entered = True
        self.env = dict(self.inner.env)

    def stop(self) -> None:
        if self._entered:
            self._entered = False
            self.inner.__exit__(None, None, None)

    def inject(self, fault: str, seconds: float) -> str:
        method: Callable[[], Any] = getattr(self.inner, fault.replace("-", "_"))
        result = method()
        return f"{fault}: {result}" if result is not None else fault


class TopologyMissing(RuntimeError):
    """``--store sentinel|patroni`` without the module that builds it."""


HA_TOPOLOGIES = {
    "sentinel": ("tools.ha.sentinel", "SentinelTopology"),
    "patroni": ("tools.ha.patroni", "PatroniTopology"),
}


def ha_topology(store: str, **options: Any) -> Adapted:
    """The HA topology ``store`` (``sentinel``, ``patroni``), imported only when asked for:
    the campaign runs without it, and says what is missing when it is asked for."""
    module_name, class_name = HA_TOPOLOGIES[store]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise TopologyMissing(
            f"--store {store} needs {module_name} (class {class_name}), which is not in this "
            f"checkout ({error}); the database, redis and cluster stores run without it."
        ) from error
    factory = getattr(module, class_name, None)
    if factory is None:
        raise TopologyMissing(f"{module_name} has no {class_name}")
    return Adapted(store, factory(**options))

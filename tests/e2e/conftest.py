"""Fixtures for the e2e tests: a fresh e2e database and gunicorn (and uvicorn) servers of the
example.

Every test here is marked ``e2e`` and skipped unless ``DATABASE_URL`` names PostgreSQL or
MariaDB (``pytest_collection_modifyitems`` below).

These tests speak HTTP (a few also read the e2e database with the driver). They don't use
pytest-django's ``db`` fixture: the e2e database is created, migrated and dropped here, next
to the test database.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tools.server import (
    SUPPORTED_VENDORS,
    Database,
    Server,
    create_database,
    database_vendor,
    drop_database,
    e2e_database,
    migrate,
    new_key,
    start_server,
    start_uvicorn,
)

_servers: list[Server] = []
HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is an ``e2e`` test, run on PostgreSQL or MariaDB only."""
    on_sqlite = pytest.mark.skipif(
        database_vendor() not in SUPPORTED_VENDORS,
        reason="e2e tests run on PostgreSQL or MariaDB/MySQL (set DATABASE_URL)",
    )
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(on_sqlite)


@pytest.fixture(scope="session")
def e2e_db() -> Iterator[Database]:
    vendor = database_vendor()
    if vendor not in SUPPORTED_VENDORS:
        pytest.skip(f"e2e tests need PostgreSQL or MariaDB/MySQL (DATABASE_URL), not {vendor}")
    database = e2e_database(os.environ["DATABASE_URL"])
    create_database(database)
    try:
        migrate(database)
        yield database
    finally:
        drop_database(database)


@pytest.fixture(scope="session")
def server(e2e_db: Database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The example under gunicorn with 4 sync workers and its default settings, shared."""
    log_path = tmp_path_factory.mktemp("gunicorn") / "shared.log"
    shared = start_server(e2e_db, log_path, warm_up=True)
    _servers.append(shared)
    yield shared
    _servers.remove(shared)
    shared.stop()


@pytest.fixture
def start_example(e2e_db: Database, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start a gunicorn of the test's own with ``EXAMPLE_*`` settings; stopped after it."""
    started: list[Server] = []

    def start(**example_settings: str) -> Server:
        log_path = tmp_path / f"gunicorn-{len(started)}.log"
        new = start_server(e2e_db, log_path, example_settings)
        started.append(new)
        _servers.append(new)
        return new

    yield start
    for own in started:
        _servers.remove(own)
        own.stop()
        print(f"--- gunicorn on port {own.port} ---\n{own.log()}")


@pytest.fixture(scope="session")
def uvicorn_example(
    e2e_db: Database, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Server]]:
    """``uvicorn_example(workers=1, settings_module=..., **example_settings)``: the example's
    ASGI application under uvicorn with ``workers`` processes, the example's settings (or a
    test project's built on them) and these ``EXAMPLE_*`` settings. Started on
    first use and shared by the tests asking for the same configuration; stopped at the end
    of the session."""
    started: dict[tuple[int, str, tuple[tuple[str, str], ...]], Server] = {}
    logs = tmp_path_factory.mktemp("uvicorn")

    def get(
        workers: int = 1, settings_module: str = "example_project.settings", **example_settings: str
    ) -> Server:
        configuration = (workers, settings_module, tuple(sorted(example_settings.items())))
        if configuration not in started:
            log_path = logs / f"uvicorn-{len(started)}.log"
            new = start_uvicorn(
                e2e_db, log_path, example_settings, workers=workers, settings_module=settings_module
            )
            started[configuration] = new
            _servers.append(new)
        return started[configuration]

    yield get
    for own in started.values():
        _servers.remove(own)
    # Each waits for its graceful shutdown: stop them together.
    stopping = [threading.Thread(target=own.stop) for own in started.values()]
    for thread in stopping:
        thread.start()
    for thread in stopping:
        thread.join()


@pytest.fixture(autouse=True)
def _show_gunicorn_logs() -> Iterator[None]:
    """Print what the running servers logged during a test; pytest shows it on failure."""
    offsets = {id(running): len(running.log()) for running in _servers}
    yield
    for running in _servers:
        logged = running.log()[offsets.get(id(running), 0) :]
        if logged:
            print(f"--- {running.name} on port {running.port} ---\n{logged}")


@pytest.fixture
def key() -> str:
    """A fresh random Idempotency-Key."""
    return new_key()

"""The example project's database settings (``example_project/settings.py``), read in this
process with a given environment: where it prepares statements, its connections outlive a
request, or nothing would be prepared (docs/store.md, "PostgreSQL: prepared statements")."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

PG_URL = "postgres://root@127.0.0.1:5432/example"


@pytest.fixture(autouse=True)
def _reload_after() -> Iterator[None]:
    """Leave the module as this process's environment makes it."""
    yield
    import example_project.settings

    importlib.reload(example_project.settings)


def example_database(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    for name in ("EXAMPLE_PG_PREPARE_THRESHOLD", "EXAMPLE_CONN_MAX_AGE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import example_project.settings

    database: dict[str, Any] = importlib.reload(example_project.settings).DATABASES["default"]
    return database


def test_prepared_statements_come_with_persistent_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = example_database(monkeypatch, DATABASE_URL=PG_URL)

    assert database["OPTIONS"]["prepare_threshold"] == 5
    assert database["CONN_MAX_AGE"] == 60
    assert database["CONN_HEALTH_CHECKS"] is True


def test_connection_age_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    database = example_database(monkeypatch, DATABASE_URL=PG_URL, EXAMPLE_CONN_MAX_AGE="5")

    assert database["CONN_MAX_AGE"] == 5


def test_without_prepared_statements_connections_close_after_each_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = example_database(
        monkeypatch, DATABASE_URL=PG_URL, EXAMPLE_PG_PREPARE_THRESHOLD="off"
    )

    assert "prepare_threshold" not in database.get("OPTIONS", {})
    assert database.get("CONN_MAX_AGE", 0) == 0


def test_on_sqlite_nothing_is_prepared_or_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    database = example_database(monkeypatch)

    assert "prepare_threshold" not in database.get("OPTIONS", {})
    assert database.get("CONN_MAX_AGE", 0) == 0

"""The package's folders by role (docs/layout.md), and the public import paths that the move
kept: each old path is the moved module itself, so imports, dotted settings and patches
made through it behave as before."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from django.utils.module_loading import import_string

import idempotency_django

PACKAGE = Path(idempotency_django.__file__).parent

# old public path -> where the code lives now
PUBLIC_PATHS = {
    "idempotency_django.decorators": "idempotency_django.adapters.decorators",
    "idempotency_django.drf": "idempotency_django.adapters.drf",
    "idempotency_django.ninja": "idempotency_django.adapters.ninja",
    "idempotency_django.middleware": "idempotency_django.adapters.middleware",
    "idempotency_django.tasks": "idempotency_django.adapters.tasks",
    "idempotency_django.celery": "idempotency_django.adapters.celery",
    "idempotency_django.admin": "idempotency_django.operations.admin",
    "idempotency_django.purge": "idempotency_django.operations.purge",
    "idempotency_django.health": "idempotency_django.operations.health",
    "idempotency_django.keys": "idempotency_django.core.keys",
    "idempotency_django.fingerprint": "idempotency_django.core.fingerprint",
    "idempotency_django.codecs": "idempotency_django.core.codecs",
    "idempotency_django.responses": "idempotency_django.core.responses",
    "idempotency_django.accounts": "idempotency_django.core.accounts",
    "idempotency_django.downstream": "idempotency_django.core.downstream",
}

# What the docs tell users to import or to name in settings, by its public path.
DOCUMENTED_NAMES = [
    "idempotency_django.decorators.idempotent",
    "idempotency_django.drf.IdempotentMixin",
    "idempotency_django.drf.IdempotencyAPIException",
    "idempotency_django.ninja.idempotent",
    "idempotency_django.middleware.IdempotencyMiddleware",
    "idempotency_django.tasks.idempotent_task",
    "idempotency_django.tasks.claim_once",
    "idempotency_django.celery.IdempotentTask",
    "idempotency_django.purge.purged",
    "idempotency_django.health.idempotency_health_view",
    "idempotency_django.keys.default_account",
    "idempotency_django.keys.default_endpoint",
    "idempotency_django.keys.default_fingerprint",
    "idempotency_django.keys.tenant_header",
    "idempotency_django.keys.request_host",
    "idempotency_django.responses.is_definitive",
    "idempotency_django.responses.problem_response",
    "idempotency_django.accounts.forget_account",
    "idempotency_django.downstream.downstream_key_for",
    "idempotency_django.downstream.downstream_key",
    "idempotency_django.codecs.FernetCodec",
    "idempotency_django.client.IdempotentClient",
    "idempotency_django.client.downstream_key",
    "idempotency_django.client.downstream_key_for",
    "idempotency_django.store.database.DatabaseStore",
    "idempotency_django.store.redis.RedisStore",
    "idempotency_django.signals.outcome_not_stored",
    "idempotency_django.exceptions.IdempotencyError",
]

# The top level holds the Django app's own modules (what Django and settings look for by
# name), the public paths above, and the role folders: nothing else.
APP_MODULES = {"__init__", "apps", "models", "conf", "checks", "signals", "exceptions", "testing"}
FOLDERS = {"adapters", "core", "store", "client", "operations", "metrics"}
DJANGO_FOLDERS = {"migrations", "management", "templates"}


@pytest.mark.parametrize("old", sorted(PUBLIC_PATHS))
def test_an_old_public_path_is_the_moved_module_itself(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(PUBLIC_PATHS[old])


@pytest.mark.parametrize("dotted", DOCUMENTED_NAMES)
def test_every_documented_name_imports_by_its_public_path(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    assert import_string(dotted) is getattr(importlib.import_module(module), name)


def test_a_patch_through_the_public_path_reaches_the_code() -> None:
    from idempotency_django.core import keys as real
    from idempotency_django.keys import parse_key

    with mock.patch("idempotency_django.keys.parse_key", return_value="patched"):
        assert real.parse_key("abc") == "patched"
    assert real.parse_key is parse_key


def test_the_top_level_holds_the_app_the_public_paths_and_the_role_folders() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    public = {old.rsplit(".", 1)[1] for old in PUBLIC_PATHS}
    assert modules == APP_MODULES | public, "a new module belongs in a role folder"
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name[0] != "_"}
    assert folders == FOLDERS | DJANGO_FOLDERS
    for name in public:  # a public path holds no code of its own
        lines = (PACKAGE / f"{name}.py").read_text().splitlines()
        assert "sys.modules[__name__] = _module" in lines, name


def run_without(package: str, body: str) -> subprocess.CompletedProcess[str]:
    """``body`` run in a fresh interpreter where ``package`` cannot be imported, on this
    process's import path (the tests' settings, wherever the package is installed)."""
    program = (
        "import sys\n"
        "class Without:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {package!r} or name.startswith({package + '.'!r}):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Without())\n"
    ) + body
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.project.settings",
            "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
        },
        check=False,
    )


def test_the_client_needs_no_django() -> None:
    """The client package runs where Django is not installed (a worker, a script)."""
    result = run_without(
        "django",
        "from idempotency_django.client import IdempotentClient, check_key, downstream_key\n"
        "print(check_key('order-1'), downstream_key('order-1', 'charge', 'acct'))\n",
    )
    assert result.returncode == 0, result.stderr
    from idempotency_django.downstream import downstream_key

    assert result.stdout.split() == ["order-1", downstream_key("order-1", "charge", "acct")]


def test_the_server_needs_no_httpx() -> None:
    """The client's transport is an extra: the app, its adapters and its commands import
    without it (only ``core/wire.py`` is shared, and it needs the standard library only)."""
    result = run_without(
        "httpx",
        "import django\n"
        "django.setup()\n"
        "import idempotency_django.decorators, idempotency_django.drf, idempotency_django.tasks\n"
        "import idempotency_django.middleware, idempotency_django.purge, idempotency_django.admin\n"
        "from idempotency_django.downstream import downstream_key_for\n"
        "print('ok')\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]

"""The documentation is true and complete: every setting, system check, problem type, signal
and management command option is documented in ``docs/``, every code snippet the docs
and the README show runs here (the docs include it from ``tests/docs_snippets``), and every
shell line names commands, options, modules and extras that exist."""

from __future__ import annotations

import base64
import importlib
import importlib.metadata
import importlib.util
import json
import pkgutil
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand
from django.dispatch import Signal
from django.test import Client, RequestFactory, override_settings

import idempotency_django
from idempotency_django import checks, exceptions
from idempotency_django.core import keys
from tests import records
from tests.conftest import PACKAGE_DEFAULTS
from tests.docs_snippets import client as client_snippet
from tests.docs_snippets import downstream, signals_metrics, tasks
from tests.models import SideEffect

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = Path(idempotency_django.__file__).resolve().parent


def page(name: str) -> str:
    return (DOCS / name).read_text()


def all_pages() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(DOCS.glob("*.md"))}


# --- everything is documented ----------------------------------------------------------------


def render(value: Any) -> str:
    """A default as the settings page writes it."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        items = [render(item) for item in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return repr(value)


def test_every_setting_has_a_section_with_its_default() -> None:
    """One section per setting, in the order of ``conf.DEFAULTS``, as Django's settings
    reference is written: name, default, type, related checks, then what it does."""
    sections = re.findall(
        r"^## `([A-Z_]+)`\n\nDefault: `([^`]*)` · type: ([^·\n]+) · checks: (.*)\n\n\S",
        page("settings.md"),
        re.M,
    )
    assert [name for name, *_ in sections] == list(PACKAGE_DEFAULTS), "settings.md != DEFAULTS"
    known = check_ids()
    for name, default, _type, related in sections:
        assert default == render(PACKAGE_DEFAULTS[name]), f"{name}: documented default {default}"
        for check in re.findall(
            r"\[`([EW]\d{3})`\]\(checks\.md#idempotency_django(\w+)\)", related
        ):
            assert f"idempotency_django.{check[0]}" in known, f"{name}: {check[0]}"
            assert check[1] == check[0].lower(), f"{name}: the link to {check[0]}"


def check_ids() -> set[str]:
    """Every check id the package can report: each ``checks.Error/Warning(id=...)``."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        found |= set(re.findall(r"id=\"(idempotency_django\.[EW]\d{3})\"", path.read_text()))
    return found


def test_every_system_check_id_has_an_entry() -> None:
    ids = check_ids()
    assert len(ids) >= 29  # E001-E024, W001-W005, W020 today: the scan finds them
    documented = set(re.findall(r"^## `(idempotency_django\.[EW]\d{3})`", page("checks.md"), re.M))
    assert documented == ids


def import_the_package() -> None:
    """Every module, so that every exception class and signal is defined."""
    for module in pkgutil.walk_packages(idempotency_django.__path__, "idempotency_django."):
        if ".migrations" not in module.name:
            importlib.import_module(module.name)


def problem_slugs() -> set[str]:
    import_the_package()
    seen, todo = set(), [exceptions.IdempotencyError]
    while todo:
        cls = todo.pop()
        seen.add(cls.slug)
        todo.extend(cls.__subclasses__())
    return seen - {exceptions.IdempotencyError.slug}


def test_every_problem_type_has_an_entry() -> None:
    slugs = problem_slugs()
    assert {"key-missing", "response-unreadable", "work-not-committed"} <= slugs
    documented = set(re.findall(r"^## `([a-z-]+)`", page("problems.md"), re.M))
    assert documented == slugs


def defined_signals() -> set[str]:
    """Signals defined by the package (not ones it imports, such as Django's)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found = re.findall(
            r"^(\w+) = (?:Idempotency)?Signal\((?:use_caching=True)?\)", path.read_text(), re.M
        )
        for name in found:
            names.add(f"{module}.{name}")
    return names


def test_every_signal_has_a_row() -> None:
    signals = defined_signals()
    assert "idempotency_django.signals.outcome_not_stored" in signals
    assert "idempotency_django.operations.purge.purged" in signals
    text = page("signals.md")
    for name in signals:
        public = name.replace(".operations.", ".")  # the public path the docs use
        assert f"| `{name.rsplit('.', 1)[1]}` |" in text or f"`{public}`" in text, name
    for qualified in signals:  # each really is a Signal
        module, name = qualified.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(module), name), Signal)


BASE_OPTIONS = {action.dest for action in BaseCommand().create_parser("manage.py", "x")._actions}


def test_every_management_command_option_is_documented() -> None:
    text = page("operations.md")
    commands = [name for name, app in get_commands().items() if app == "idempotency_django"]
    assert sorted(commands) == [
        "idempotency_health",
        "purge_idempotency_keys",
        "reseal_idempotency_responses",
    ]
    for command in commands:
        assert f"`{command}`" in text
        parser = load_command_class("idempotency_django", command).create_parser(
            "manage.py", command
        )
        options = [
            max(action.option_strings, key=len)
            for action in parser._actions
            if action.dest not in BASE_OPTIONS and action.option_strings
        ]
        assert options, command
        for option in options:
            assert re.search(rf"^\| `{option}[ `].*\|", text, re.M), f"{command} {option}"


# --- every snippet runs ------------------------------------------------------------------------

ALLOWED_INCLUDES = ("tests/docs_snippets/", "tests/test_", "example_project/")


def test_docs_show_python_only_from_files_the_suite_runs() -> None:
    for path, text in all_pages().items():
        assert not re.search(r"^```+\s*(python|py|pycon)\b", text, re.M), path
        assert not re.search(r"^```+\s*\{code-block\}\s*(python|py)", text, re.M), path
        for include in re.findall(r"^```+\s*\{literalinclude\}\s*(\S+)", text, re.M):
            target = (DOCS / include).resolve().relative_to(ROOT).as_posix()
            assert target.startswith(ALLOWED_INCLUDES), f"{path.name}: {target}"
            assert (ROOT / target).exists(), target


def test_the_readmes_python_is_a_snippet_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S)
    assert blocks, "the README's quickstart"
    snippets = "\n".join(p.read_text() for p in (ROOT / "tests/docs_snippets").glob("*.py"))
    for block in blocks:
        assert block in snippets, block


def test_the_readmes_links_into_the_repository_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert "docs/index.md" in links
    for link in links:
        assert (ROOT / link).exists(), link


def shell_lines() -> list[tuple[str, str]]:
    """Every command line of the docs' and the README's shell blocks (``$`` prompts, comments
    and continuations folded), with the page it is on."""
    sources = {
        **{p.name: t for p, t in all_pages().items()},
        "README.md": (ROOT / "README.md").read_text(),
    }
    found = []
    for name, text in sources.items():
        for block in re.findall(r"^```(?:sh|bash|console)\n(.*?)^```", text, re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.removeprefix("$ ")
                if line and not line.startswith(("{", "[")):  # console output
                    found.append((name, line))
    return found


def commands_of(line: str) -> list[list[str]]:
    return [shlex.split(part, comments=True) for part in line.split("&&")]


def test_shell_snippets_name_real_commands_options_modules_and_extras() -> None:
    """What the shell snippets run exists as written: a management command and its options
    (parsed by the command's own parser), a ``python -m`` module, an extra of this package."""
    extras = set(importlib.metadata.metadata("idempotency-django").get_all("Provides-Extra") or ())
    commands = get_commands()
    checked = 0
    installed: set[tuple[str, str]] = set()  # (page, module) a line before installs
    for name, line in shell_lines():
        for words in commands_of(line):
            if "install" in words and "pip" in " ".join(words[: words.index("install")]):
                installed |= {(name, word) for word in words if re.fullmatch(r"[a-z_]+", word)}
            if "manage.py" in words:
                command, *args = words[words.index("manage.py") + 1 :]
                if command in ("migrate", "runserver"):
                    continue  # Django's own
                assert commands.get(command) == "idempotency_django", f"{name}: {line}"
                parser = load_command_class("idempotency_django", command).create_parser(
                    "manage.py", command
                )
                parser.parse_args(args)  # a wrong option is a CommandError
                checked += 1
            elif words[:2] == ["python", "-m"] and words[2] not in ("venv", "pytest"):
                if (name, words[2]) not in installed:  # else the page installs it first
                    assert importlib.util.find_spec(words[2]) is not None, f"{name}: {line}"
                checked += 1
            for word in words:
                for group in re.findall(
                    r"\[([a-z,]+)\]", word if "." in word or "django" in word else ""
                ):
                    unknown = set(group.split(",")) - extras
                    assert not unknown, f"{name}: {line}: no extra {unknown}"
    assert checked >= 8


def basic(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{user}".encode()).decode()}


@pytest.fixture
def customer(db: None) -> User:
    return User.objects.create_user("carol", password="carol")


@pytest.fixture
def docs_client(customer: User) -> Client:
    return Client(headers=basic("carol"))


pytestmark = pytest.mark.urls("tests.docs_snippets.urls")


@pytest.mark.parametrize("path", ["/orders/", "/cbv/orders/"])
def test_quickstart_views_run_once_and_replay(docs_client: Client, path: str) -> None:
    send = {"content_type": "application/json", "headers": {"Idempotency-Key": "k1"}}
    first = docs_client.post(path, {"item": "book"}, **send)
    again = docs_client.post(path, {"item": "book"}, **send)

    assert (first.status_code, again.status_code) == (201, 201)
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert SideEffect.objects.count() == 1


def test_drf_snippet_protects_create_and_the_action(docs_client: Client) -> None:
    for path in ("/drf/charges/", "/drf/charges/7/refund/", "/drf/orders/"):
        for _ in range(2):
            response = docs_client.post(
                path,
                {"label": "x"},
                content_type="application/json",
                headers={"Idempotency-Key": f"k-{path}"},
            )
            assert response.status_code == 201, response.content
        assert response["Idempotent-Replayed"] == "true"
    assert SideEffect.objects.count() == 3


def test_ninja_snippet_protects_the_router_and_the_operation(docs_client: Client) -> None:
    for path in ("/ninja/charges/", "/ninja/refunds/"):
        for _ in range(2):
            response = docs_client.post(
                path,
                {"amount": 5},
                content_type="application/json",
                headers={"Idempotency-Key": f"k-{path}"},
            )
            assert response.status_code == 201, response.content
        assert response["Idempotent-Replayed"] == "true"
    assert SideEffect.objects.count() == 2


def test_downstream_snippet_sends_the_provider_the_same_key_on_a_rerun(
    docs_client: Client,
) -> None:
    order = SideEffect.objects.create(label="order")
    downstream.stripe.calls.clear()
    headers = {"Idempotency-Key": "pay-1"}
    docs_client.post(f"/orders/{order.pk}/pay/", headers=headers)
    records.delete()  # as after a released key: the view runs again
    docs_client.post(f"/orders/{order.pk}/pay/", headers=headers)

    first, second = downstream.stripe.calls
    assert first["idempotency_key"] == second["idempotency_key"]


SETTINGS_SNIPPETS = ROOT / "tests/docs_snippets/settings"
BASE_SETTINGS = ROOT / "tests/project/settings.py"


def settings_snippets() -> list[str]:
    return sorted(p.stem for p in SETTINGS_SNIPPETS.glob("*.py") if p.stem != "__init__")


@pytest.fixture(autouse=True)
def _encryption_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the encryption snippet reads its keys from, as a deployment sets it."""
    from cryptography.fernet import Fernet

    keys = ",".join(Fernet.generate_key().decode() for _ in range(2))
    monkeypatch.setenv("IDEMPOTENCY_ENCRYPTION_KEYS", keys)


def paste(name: str) -> dict[str, Any]:
    """A settings module with the snippet pasted at its end, as a user pastes it into theirs:
    the test project's settings, then the snippet's text. Returns the settings the snippet
    sets (its upper-case names)."""
    snippet = (SETTINGS_SNIPPETS / f"{name}.py").read_text()
    module: dict[str, Any] = {"__name__": "pasted_settings", "__file__": str(BASE_SETTINGS)}
    exec(compile(BASE_SETTINGS.read_text() + "\n" + snippet, "pasted_settings", "exec"), module)
    names = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*=", snippet, re.M))
    return {name: module[name] for name in names}


def test_the_docs_show_every_settings_snippet_whole() -> None:
    """What a page shows of a settings snippet is the whole file the paste test loads."""
    shown = set()
    for path, text in all_pages().items():
        for include, options in re.findall(
            r"^```+\s*\{literalinclude\}\s*(\S+)\n((?::.*\n)*)", text, re.M
        ):
            target = (DOCS / include).resolve()
            if target.parent == SETTINGS_SNIPPETS:
                assert options.strip() == ":language: python", f"{path.name}: {include}"
                shown.add(target.stem)
    assert shown == set(settings_snippets())


@pytest.mark.parametrize("name", settings_snippets())
def test_settings_snippets_read_as_a_user_writes_them(name: str) -> None:
    """Every name a settings snippet sets is a setting: IDEMPOTENCY or one of Django's. A
    snippet that set ``REDIS_STORE = {...}`` would be pasted and silently ignored."""
    from django.conf import global_settings

    names = set(paste(name))
    assert names, f"{name}: sets nothing"
    for setting in names:
        assert setting == "IDEMPOTENCY" or hasattr(global_settings, setting), (name, setting)


@pytest.mark.parametrize("name", settings_snippets())
def test_settings_snippets_pasted_pass_the_system_checks(name: str) -> None:
    """Each snippet, pasted into a settings module, leaves every system check quiet (the
    database snippet is PostgreSQL's: it is connected to in the prepared-statements test)."""
    from django.core.checks import run_checks

    pasted = paste(name)
    pasted.pop("DATABASES", None)
    before = run_checks()
    with override_settings(**pasted):
        from django.conf import settings

        for setting, value in pasted.items():
            assert getattr(settings, setting) == value
        reported = [message for message in run_checks() if message not in before]
        assert reported == [], name
        assert checks.check_settings() == []
        assert checks.check_middleware() == []


def test_the_redis_store_snippet_selects_the_redis_store() -> None:
    """Pasted as shown, the store in use is the Redis store at the snippet's URL: the
    snippet once set a name no one reads, and the database store stayed."""
    from idempotency_django.store.base import get_store
    from idempotency_django.store.redis import RedisStore

    for name, cluster in (("redis_store", False), ("redis_cluster", True)):
        idempotency = paste(name)["IDEMPOTENCY"]
        with override_settings(IDEMPOTENCY=idempotency):
            store = get_store()
            assert isinstance(store, RedisStore), name
            assert store.options()["URL"] == idempotency["STORE_OPTIONS"]["URL"]
            assert bool(store.options()["CLUSTER"]) is cluster
    from idempotency_django.store.redis_sentinel import sentinel_config

    for name in ("redis_sentinel", "redis_sentinel_options"):
        idempotency = paste(name)["IDEMPOTENCY"]
        with override_settings(IDEMPOTENCY=idempotency):
            store = get_store()
            assert isinstance(store, RedisStore), name
            config = sentinel_config(store.options())
            assert config is not None, name
            assert config.service == "mymaster"
            assert len(config.sentinels) == 3


@pytest.mark.redis
def test_the_redis_store_snippet_keeps_records_in_redis_not_the_database(
    docs_client: Client,
) -> None:
    """The snippet pasted, its URL pointed at a real Redis as a user points it at theirs: a
    request runs once, its retry is replayed, and the record is in Redis under the
    snippet's prefix, none in the database."""
    from tests.conftest import REDIS_URL
    from tools import redis_cluster

    try:
        client = redis_cluster.connect(REDIS_URL)
        client.ping()
    except Exception as error:  # any failure to reach it: no Redis here
        pytest.skip(f"needs a Redis at {REDIS_URL}: {error}")
    idempotency = paste("redis_store")["IDEMPOTENCY"]
    idempotency["STORE_OPTIONS"] = {**idempotency["STORE_OPTIONS"], "URL": REDIS_URL}
    redis_cluster.flush(REDIS_URL)
    send = {"content_type": "application/json", "headers": {"Idempotency-Key": "r1"}}
    with override_settings(IDEMPOTENCY=idempotency):
        first = docs_client.post("/orders/", {"item": "x"}, **send)
        again = docs_client.post("/orders/", {"item": "x"}, **send)

    assert (first.status_code, again.status_code) == (201, 201)
    assert again["Idempotent-Replayed"] == "true"
    assert SideEffect.objects.count() == 1
    assert [key.decode() for key in client.scan_iter("idem:*")], "no record in Redis"
    from idempotency_django.models import IdempotencyRecord

    assert IdempotencyRecord.objects.count() == 0
    redis_cluster.flush(REDIS_URL)


def test_tenant_snippets_name_the_requests_tenant(rf: RequestFactory) -> None:
    request = rf.post("/", headers={"X-Org": "acme"}, HTTP_HOST="Shop.Example.com:8000")
    request.tenant = SimpleNamespace(schema_name="acme_schema")  # django-tenants sets it

    with override_settings(ALLOWED_HOSTS=[".example.com"]):
        assert keys.request_host(request) == "shop.example.com"
    assert paste("tenant_header")["IDEMPOTENCY"]["TENANT"](request) == "acme"
    assert paste("tenant_schema")["IDEMPOTENCY"]["TENANT"](request) == "acme_schema"


def test_guest_snippet_gives_each_guest_session_its_own_downstream_key(
    rf: RequestFactory, db: None
) -> None:
    from django.contrib.sessions.backends.db import SessionStore

    def guest_request(session: SessionStore) -> Any:
        request = rf.post("/pay/", headers={"Idempotency-Key": "order-1042"})
        request.session = session
        return request

    one, other = SessionStore(), SessionStore()
    first = downstream.guest_payment_key(guest_request(one))

    assert downstream.guest_payment_key(guest_request(one)) == first
    assert downstream.guest_payment_key(guest_request(other)) != first


def test_tenancy_snippet_names_and_finds_a_tenant() -> None:
    tenancy = paste("tenancy")["IDEMPOTENCY"]
    assert tenancy["ACCOUNT_DISPLAY"]("tenant-7") == "Acme Ltd (tenant-7)"
    assert tenancy["ACCOUNT_SEARCH"]("acme") == ["tenant-7"]


def test_replay_hook_snippet_marks_replays(docs_client: Client) -> None:
    send = {"content_type": "application/json", "headers": {"Idempotency-Key": "h"}}
    with override_settings(IDEMPOTENCY=paste("replay_hook")["IDEMPOTENCY"]):
        first = docs_client.post("/orders/", {"item": "x"}, **send)
        again = docs_client.post("/orders/", {"item": "x"}, **send)
    assert "Cache-Control" not in first
    assert again["Cache-Control"] == "no-store"


def test_task_snippets_run_once_per_key(db: None) -> None:
    tasks.mailer.sent.clear()
    tasks.provider.captures.clear()
    assert tasks.send_receipt("m-1", 42) == tasks.send_receipt("m-1", 42)
    message = SimpleNamespace(id="msg-1", body=b"{}", payment_id="pay-9")
    assert tasks.on_message(message) == tasks.on_message(message) == {"capture": "cap-1"}
    tasks.send_receipt_for_order(7)
    tasks.send_receipt_for_order(7)  # a plain call runs under its key: once
    assert tasks.mailer.sent == [42, 7]
    assert tasks.provider.captures == ["pay-9"]
    assert tasks.send_order_receipt.name.endswith("send_order_receipt")


@pytest.mark.django_db(transaction=True)
def test_purge_task_snippet_returns_the_counts() -> None:
    assert tasks.purge_idempotency_keys()["total"] == 0


def test_signals_snippet_counts_by_endpoint(docs_client: Client) -> None:
    signals_metrics.connect()
    send = {"content_type": "application/json", "headers": {"Idempotency-Key": "s"}}
    docs_client.post("/orders/", {"item": "x"}, **send)
    docs_client.post("/orders/", {"item": "x"}, **send)

    def value(event: str) -> float | None:
        labels = {"event": event, "endpoint": "POST /orders/"}
        return signals_metrics.REGISTRY.get_sample_value("idempotency_events_total", labels)

    assert (value("claimed"), value("replayed")) == (1.0, 1.0)


class Order:
    def __init__(self) -> None:
        self.payment_key, self.total, self.card_token = "order-1-payment", 1000, "tok_visa"
        self.paid: list[tuple[str, bool]] = []

    def mark_paid(self, charge: str, replayed: bool) -> None:
        self.paid.append((charge, replayed))

    def mark_declined(self) -> None:
        raise AssertionError("not declined")


def test_client_snippet_pays_once_through_a_retry() -> None:
    """The server answers 503 first, then 201, then (asked again) its replay."""
    answers = iter([(503, {}), (201, {"id": "ch_1"}), (201, {"id": "ch_1"})])
    keys = []

    def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        status, body = next(answers)
        replayed = {"Idempotent-Replayed": "true"} if len(keys) == 3 else {}
        return httpx.Response(status, json=body, headers={"Retry-After": "0", **replayed})

    payments = client_snippet.payments_client(httpx.MockTransport(server))
    order = Order()
    client_snippet.pay(payments, order)
    client_snippet.pay(payments, order)

    assert keys == ["order-1-payment"] * 3
    assert order.paid == [("ch_1", False), ("ch_1", True)]


def test_prepared_statements_snippet_makes_psycopg_prepare(db: None) -> None:
    from django.db import connections

    connection = connections["default"]
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's option")
    snippet = paste("prepared_statements")["DATABASES"]["default"]
    params = {**connection.settings_dict}
    params["OPTIONS"] = {**connection.settings_dict.get("OPTIONS", {})}
    params["OPTIONS"].update(snippet["OPTIONS"])
    params["CONN_MAX_AGE"] = snippet["CONN_MAX_AGE"]
    wrapper = type(connection)(params, alias=connection.alias)  # a connection of its own
    try:
        wrapper.ensure_connection()
        assert wrapper.connection.prepare_threshold == 5
    finally:
        wrapper.close()


# --- every install command refers to something that exists ----------------------------------

OWN_NAME = re.compile(r"^idempotency[-_]django(\[[a-z,]+\])?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def install_requirements() -> list[tuple[str, str]]:
    """What every ``pip install`` of the README, SECURITY.md, CONTRIBUTING.md and the docs
    installs, and every requirement line naming this package (``idempotency-django[drf] @
    git+…``)."""
    sources = {
        **{p.name: t for p, t in all_pages().items()},
        "README.md": (ROOT / "README.md").read_text(),
        "SECURITY.md": (ROOT / "SECURITY.md").read_text(),
        "CONTRIBUTING.md": (ROOT / "CONTRIBUTING.md").read_text(),
    }
    found = []
    for name, text in sources.items():
        text = text.replace("\\\n", " ")
        for command in re.findall(r"pip install ([^`\n&|#]+)", text):
            words = re.findall(r'"([^"]+)"|(\S+)', command)
            found += [(name, q or w) for q, w in words if not (q or w).startswith("-")]
        for line in re.findall(r"(idempotency-django\S* @ [^\s`\"]+)", text):
            found.append((name, line))
    return found


def test_every_install_command_refers_to_something_that_exists() -> None:
    """A newcomer's install is a commit of this repository, a path in it (the clone, a
    wheel ``python -m build`` makes), or a third-party package: never a tag (none is
    guaranteed), a branch, or this package by name from an index it is not on yet."""
    import subprocess

    extras = set(importlib.metadata.metadata("idempotency-django").get_all("Provides-Extra") or ())
    wheel = f"idempotency_django-{idempotency_django.__version__}-py3-none-any.whl"
    has_git = (ROOT / ".git").exists()
    kinds = set()
    for name, requirement in install_requirements():
        requirement = requirement.strip()
        target, _, where = (part.strip() for part in requirement.partition(" @ "))
        for group in re.findall(r"\[([a-z,]+)\]", requirement):
            assert not set(group.split(",")) - extras, f"{name}: {requirement}: no such extra"
        if where:  # name @ url
            assert OWN_NAME.match(target), f"{name}: {requirement}"
            if where.startswith("git+"):
                ref = where.rsplit("@", 1)[1]
                assert COMMIT.match(ref), f"{name}: {requirement}: pin a commit, not {ref!r}"
                if has_git:  # an unpacked sdist has no history to look in
                    exists = subprocess.run(
                        ["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}:pyproject.toml"],
                        capture_output=True,
                        check=False,
                    )
                    assert exists.returncode == 0, f"{name}: {ref} is not a commit here"
                kinds.add("commit")
            else:
                assert where.startswith("file://"), requirement
                assert where.endswith(wheel), f"{name}: {requirement}: build makes {wheel}"
                kinds.add("wheel")
        elif requirement.startswith((".", "dist/")):
            path = re.sub(r"\[[a-z,]+\]$", "", requirement)
            if path.startswith("dist/"):
                assert path == f"dist/{wheel}", f"{name}: {requirement}: build makes {wheel}"
                kinds.add("wheel")
            else:
                assert (ROOT / path / "pyproject.toml").exists(), f"{name}: {requirement}"
                kinds.add("path")
        else:
            assert not OWN_NAME.match(requirement), f"{name}: {requirement}: not on an index"
            kinds.add("third party")
    assert kinds == {"commit", "wheel", "path", "third party"}


def test_the_wheel_the_docs_name_is_the_one_build_makes() -> None:
    """``python -m build`` names the wheel after the normalized name and the version."""
    text = page("install-from-git.md")
    version = idempotency_django.__version__
    assert f"dist/idempotency_django-{version}-py3-none-any.whl" in text
    assert "python -m build --wheel" in text


def test_the_project_urls_name_files_of_the_repository() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    with (ROOT / "pyproject.toml").open("rb") as file:
        named = tomllib.load(file)["project"]["urls"]
    assert set(named) >= {"Documentation", "Changelog", "Security"}
    for path in named.values():
        assert (ROOT / path).is_file(), path

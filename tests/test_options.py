"""The one definition of the options (``options.Options``): every adapter takes what it
declares, named as it declares, and each option has its docs entry."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from idempotency_django.adapters import decorators, drf, tasks
from idempotency_django.core import options
from idempotency_django.core.options import DRF, OPTIONS, TASK, VIEW, Options

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _overloaded_keywords() -> list[str]:
    """The keyword-only arguments of ``@idempotent``'s typed overloads (spelled out for type
    checkers), read from the source: ``typing.get_overloads`` needs Python 3.11."""
    tree = ast.parse(inspect.getsource(decorators))
    overloads = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name == "idempotent"
        and any(getattr(d, "id", None) == "overload" for d in node.decorator_list)
    ]
    assert len(overloads) == 2
    return [argument.arg for argument in overloads[1].args.kwonlyargs]


def test_the_decorators_overload_names_exactly_the_view_options() -> None:
    assert sorted(_overloaded_keywords()) == sorted(options.names(VIEW))


def test_the_mixin_declares_an_attribute_for_exactly_the_drf_options() -> None:
    declared = {
        name
        for name in vars(drf.IdempotentMixin)
        if name.startswith("idempotency_") and name != "idempotency_actions"
    }
    methods = {name for name in declared if callable(getattr(drf.IdempotentMixin, name))}

    assert declared - methods == {f"idempotency_{name}" for name in options.names(DRF)}
    assert {f"idempotency_{name}": name for name in options.names(DRF)} == drf._OPTION_ATTRIBUTES


@pytest.mark.parametrize("entry", [tasks.claim_once, tasks.idempotent_task])
def test_the_task_api_takes_exactly_the_task_options(entry: Any) -> None:
    own = {"scope", "key", "name", "fingerprint", "fingerprint_args"}
    parameters = set(inspect.signature(entry).parameters) - own

    assert parameters == set(options.names(TASK))


def test_every_option_has_a_setting_or_says_why_not() -> None:
    without = {option.name for option in OPTIONS if option.setting is None}

    assert without == {"fingerprint_fields", "fingerprint", "key"}
    assert {option.name for option in OPTIONS if not option.where} == {"key"}  # a DRF hook's


@pytest.mark.parametrize(
    ("where", "page", "spelled"),
    [
        (VIEW, "decorator.md", "`{name}:"),
        (DRF, "drf.md", "`idempotency_{name}`"),
        (TASK, "tasks.md", "`{name}`"),
    ],
)
def test_every_option_has_its_docs_entry(where: str, page: str, spelled: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")

    missing = [name for name in options.names(where) if spelled.format(name=name) not in text]

    assert missing == []


def test_an_unknown_argument_is_refused_naming_the_view() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^my view: unknown argument 'colour'$"):
        Options.given({"colour": "red"}, "my view", VIEW)
    # An option of another adapter is unknown to this one.
    with pytest.raises(ImproperlyConfigured, match=r"my task: unknown argument 'methods'"):
        Options.given({"methods": ["POST"]}, "my task", TASK)


def test_none_is_not_given_except_where_it_is_a_value() -> None:
    given = Options.given(
        {"in_flight": None, "lease_seconds": None, "ttl_seconds": None}, "v", TASK
    )

    assert given.in_flight is options._UNSET  # the setting, at request time
    assert given.lease_seconds is options._UNSET
    assert given.ttl_seconds is None  # keep forever, as TTL_SECONDS = None


def test_a_value_is_validated_as_its_setting_is_naming_the_view() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^v: in_flight='later': expected one of"):
        Options.given({"in_flight": "later"}, "v", VIEW)


def test_an_option_left_out_is_read_from_the_setting_when_it_is_used(settings: Any) -> None:
    declared = Options.given({}, "v", VIEW)
    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 5}
    assert declared.policy().max_response_bytes == 5

    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 7}  # setting_changed: the cache is dropped
    assert declared.policy().max_response_bytes == 7

    own = Options.given({"max_response_bytes": 3}, "v", VIEW)
    assert own.policy().max_response_bytes == 3

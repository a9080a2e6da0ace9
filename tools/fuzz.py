#!/usr/bin/env python
"""Fuzz the example payments API over HTTP, then check that nothing failed and that no key
charged twice.

    python -m tools.fuzz --seed 12 --requests 300 \
        --database-url postgres://root@127.0.0.1:5432/fuzz_pg
    python -m tools.fuzz --seed 12 --requests 300 \
        --database-url mysql://root@127.0.0.1:3306/fuzz_my
    python -m tools.fuzz --requests 5000 \
        --database-url postgres://root@127.0.0.1:5432/fuzz_pg

The first two are what CI runs (about 300 requests per database, well under a minute). The
third is a longer run with a random seed: the seed is printed first, and ``--seed`` with it
(and the same ``--requests``) sends the same requests again.

The database named by ``--database-url`` is (re)created, migrated and dropped at the end
(``--keep`` keeps it). The example project runs in it under gunicorn (4 sync workers) and
under uvicorn (1 worker), both on 127.0.0.1, with a 20 ms fake card provider. Three of the
example's four protected endpoints get traffic: ``/charges/`` (plain view), ``/api/charges/``
(DRF) and ``/async/charges/`` (async view), each mostly under the server it is written for
and sometimes under the other. ``/ninja/charges/`` is not fuzzed: ``test_example_ninja.py``
sends it the bad-input cases.

First the corpus of fixed cases (``CORPUS``: each input that once caused a 5xx, and one of
each class of bad input, with the answer it must get on each endpoint; the e2e tests in
``test_example_input.py`` send the same cases), then seeded random scenarios until
``--requests`` requests were sent. A scenario is one key's story: a request, and sometimes
its retries (identical, or the same JSON formatted differently, the key in its quoted form,
through the other server), concurrent duplicates, a different body under the same key, or
a key that differs from it only in case or a trailing space.
Requests vary:

- keys: length (1 to 9000), quoting (``"k"``, unbalanced, escaped, with parameters), bytes
  outside visible ASCII (obs-text, UTF-8, control characters, NUL, tab), lists (``a, b``,
  two header lines), the header name's case, no key at all;
- bodies: JSON edge cases (numbers out of range or with fractions, bools, strings, NaN,
  nesting up to 100 000 deep, invalid UTF-8, lone surrogates, NUL, a byte order mark,
  UTF-16, duplicate names, truncation), forms, multipart (valid, broken, without boundary,
  too many fields or files), binary, empty, and bodies over ``DATA_UPLOAD_MAX_MEMORY_SIZE``;
- media types (and their case and parameters), methods, query strings, credentials,
  ``Accept``, chunked transfer encoding and ``Expect: 100-continue``.

Requests are written byte by byte on raw sockets (``requests`` and ``http.client`` would
normalise the odd ones), one per connection. Then the checks, each a violation that makes
the exit code 1:

- no 5xx, except the example's documented 504 for a ``tok_timeout`` card;
- every request answered (no reset, closed or timed-out connection);
- every 4xx the application answers (not gunicorn or uvicorn refusing a request they cannot
  parse) is ``application/problem+json`` with its status in the body;
- each corpus case gets the status and problem type it must get;
- a ``POST`` without an ``Idempotency-Key`` never charges;
- in the database, after the run: a key that got a 2xx has exactly one charge, no key has
  two, no charge is without a 2xx for its key (the client encodes the key in the amount it
  charges: ``amount = 1 000 000 + key number x 10 + variant``), and no idempotency record
  is left in progress;
- retries agree: the same request again gets the same status (a 409 while the first is in
  flight aside), a charge's retries replay its first answer byte for byte, a different
  body under a used key never charges, and a key differing only in case or a trailing space
  is a key of its own (not a replay, not a 422).

It always ends: each request has a timeout, and a hard deadline (``--max-seconds``) stops
the servers, drops the database and exits with code 3.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from requests.structures import CaseInsensitiveDict

from tools import redis_cluster
from tools.server import (
    CHARGES_TABLE,
    IN_PROGRESS,
    RECORDS_TABLE,
    Database,
    Outcome,
    Server,
    create_database,
    database,
    drop_database,
    migrate,
    query,
    start_server,
    start_uvicorn,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

PROVIDER_DELAY_MS = "20"
AMOUNT_BASE = 1_000_000  # amount = AMOUNT_BASE + key number * 10 + variant
MAX_AMOUNT = 2_147_483_647  # example_project.payments.service.MAX_AMOUNT
UPLOAD_LIMIT = 2_621_440  # Django's DATA_UPLOAD_MAX_MEMORY_SIZE (the example keeps it)
OVER_LIMIT = UPLOAD_LIMIT + 65_536
HTTP_TIMEOUT = 20.0
CLIENTS = 8
SHOWN = 5  # violations printed in full, of each kind
PROBLEM = "application/problem+json"
EXAMPLE = "urn:example-payments:"
LIBRARY = "urn:idempotency-django:problem:"
USERS = {"alice": "alice", "bob": "bob"}

# --- raw HTTP -------------------------------------------------------------------------------


@dataclass
class Request:
    """One HTTP/1.1 request exactly as it goes on the wire (``Host``, ``Connection: close``
    and the body's framing are added by ``encode``)."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    chunked: bool = False

    def encode(self) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (self.method, self.target), b"Host: 127.0.0.1"]
        lines += [b"%s: %s" % (name, value) for name, value in self.headers]
        lines.append(b"Connection: close")
        if self.chunked:
            lines.append(b"Transfer-Encoding: chunked")
            body = b"".join(
                b"%x\r\n%s\r\n" % (len(part), part) for part in _pieces(self.body, 4096)
            )
            body += b"0\r\n\r\n"
        else:
            lines.append(b"Content-Length: %d" % len(self.body))
            body = self.body
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    def describe(self, limit: int = 400) -> str:
        """The request as bytes (a Python literal), the body cut at ``limit`` bytes."""
        head = self.encode().partition(b"\r\n\r\n")[0]
        body = self.body[:limit]
        more = f" … ({len(self.body)} bytes in all)" if len(self.body) > limit else ""
        framing = " (chunked)" if self.chunked else ""
        return f"{head!r}\n      body{framing}: {body!r}{more}"


def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


class NoResponse(Exception):
    """The connection ended without a complete HTTP response."""


def send(port: int, request: Request, timeout: float = HTTP_TIMEOUT) -> Outcome:
    """Send ``request`` to 127.0.0.1:``port`` on a connection of its own and read the whole
    answer (interim 1xx answers skipped); ``NoResponse`` if there is none."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A server may answer (413, 400) before reading a large body, and close.
            sock.sendall(request.encode())
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError as exc:
            if not received:
                raise NoResponse(f"connection reset: {exc}") from exc
        except TimeoutError as exc:
            raise NoResponse(f"no complete answer within {timeout}s") from exc
    return parse_response(bytes(received), head=request.method == b"HEAD")


def parse_response(data: bytes, *, head: bool = False) -> Outcome:
    """The final answer in ``data`` (everything read from the connection)."""
    status, lines, rest = _head(data)
    while 100 <= status < 200:  # an interim answer (100 Continue): the final one follows
        status, lines, rest = _head(rest)
    headers: CaseInsensitiveDict[str] = CaseInsensitiveDict()
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip()] = value.strip()
    if head or status in (204, 304):
        return Outcome(status, headers, b"")
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        return Outcome(status, headers, _dechunk(rest))
    length = headers.get("Content-Length")
    if length is not None:
        if len(rest) < int(length):
            raise NoResponse(f"{status}: body cut at {len(rest)} of {length} bytes")
        rest = rest[: int(length)]
    return Outcome(status, headers, rest)


def _head(data: bytes) -> tuple[int, list[bytes], bytes]:
    """The status, header lines and what follows them, of the answer ``data`` starts with."""
    header, found, rest = data.partition(b"\r\n\r\n")
    if not found:
        raise NoResponse(f"no complete status line and headers in {data[:200]!r}")
    lines = header.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise NoResponse(f"not an HTTP response: {lines[0]!r}")
    return int(parts[1]), lines, rest


def _dechunk(data: bytes) -> bytes:
    body = bytearray()
    while True:
        size_line, found, data = data.partition(b"\r\n")
        if not found:
            raise NoResponse("chunked body cut short")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        if len(data) < size + 2:
            raise NoResponse("chunked body cut short")
        body += data[:size]
        data = data[size + 2 :]


# --- endpoints, keys and shots --------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    server: str  # "gunicorn" or "uvicorn"
    path: str
    kind: str  # "plain", "drf" or "async": which view answers

    def __str__(self) -> str:
        return f"{self.server} {self.path}"


PLAIN, DRF, ASYNC = "/charges/", "/api/charges/", "/async/charges/"
KINDS = {PLAIN: "plain", DRF: "drf", ASYNC: "async"}
# Where each view runs in production (gunicorn for the sync ones, uvicorn for the async one)
# gets most of the traffic; each also runs under the other server.
ENDPOINTS = {
    Endpoint("gunicorn", PLAIN, "plain"): 25,
    Endpoint("gunicorn", DRF, "drf"): 25,
    Endpoint("uvicorn", ASYNC, "async"): 25,
    Endpoint("gunicorn", ASYNC, "async"): 9,
    Endpoint("uvicorn", PLAIN, "plain"): 8,
    Endpoint("uvicorn", DRF, "drf"): 8,
}
CORPUS_ENDPOINTS = [e for e in ENDPOINTS if ENDPOINTS[e] == 25]


@dataclass
class Key:
    """One scenario's key: its account and endpoint path. Every charge a request of it can
    make is of ``amount`` (+ a variant below 10), so a charge in the database names its key."""

    number: int
    account: str
    path: str
    amount: int


@dataclass(frozen=True)
class Expect:
    """The answer a corpus case must get: a status and, for a problem, its type."""

    status: int
    type: str | None = None


@dataclass
class Shot:
    endpoint: Endpoint
    request: Request
    label: str
    key: Key | None  # None: an account that won't authenticate
    keyless: bool = False  # no Idempotency-Key header at all
    card: str | None = None  # the card the body names (a tok_timeout may answer 504)
    expect: Expect | None = None
    answer: Outcome | None = None
    error: str | None = None
    index: int = -1

    @property
    def replayed(self) -> bool:
        answer = self.answer
        return answer is not None and answer.headers.get("Idempotent-Replayed") == "true"


@dataclass
class Scenario:
    """Steps run one after the other; the shots of one step are sent at once."""

    label: str
    steps: list[list[Shot]]
    identical: bool = False  # every shot is the same request (retries of one)
    mismatch: list[Shot] = field(default_factory=list)  # a different body, same key
    fresh: list[Shot] = field(default_factory=list)  # another key, however like the first

    @property
    def shots(self) -> list[Shot]:
        return [shot for step in self.steps for shot in step]


def authorization(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


def charge_json(amount: int | str, card: str = "tok_visa", currency: str = "EUR") -> bytes:
    return b'{"amount": %s, "currency": "%s", "card": "%s"}' % (
        str(amount).encode(),
        currency.encode(),
        card.encode(),
    )


def multipart(fields: list[tuple[str, bytes]], boundary: bytes = b"fuzzboundary") -> bytes:
    parts = [
        b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'
        % (boundary, name.encode(), value)
        for name, value in fields
    ]
    return b"".join(parts) + b"--%s--\r\n" % boundary


def multipart_files(files: list[tuple[bytes, bytes]], boundary: bytes = b"fuzzboundary") -> bytes:
    parts = [
        b'--%s\r\nContent-Disposition: form-data; name="card"; filename="%s"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n%s\r\n" % (boundary, name, content)
        for name, content in files
    ]
    return b"".join(parts) + b"--%s--\r\n" % boundary


def multipart_file(name: bytes, content: bytes) -> bytes:
    return multipart_files([(name, content)])


JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"
MULTIPART = b"multipart/form-data; boundary=fuzzboundary"

# --- the corpus of fixed cases --------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A fixed request (for a fresh key and ``amount``) and the answer it must get on each
    kind of endpoint."""

    name: str
    body: Callable[[int], bytes]
    content_type: bytes | None = JSON
    expect: Expect = Expect(400, f"{EXAMPLE}invalid-charge")
    on: dict[str, Expect] = field(default_factory=dict)  # per endpoint kind, if it differs
    method: bytes = b"POST"
    key: bytes | None = None  # None: a fresh valid key
    card: str | None = None

    def expected(self, kind: str) -> Expect:
        return self.on.get(kind, self.expect)

    def request(self, path: str, key: str, amount: int) -> Request:
        """This case as alice, on ``path``, with ``key`` unless the case has its own."""
        headers = [(b"Authorization", authorization("alice", "alice"))]
        headers.append((b"Idempotency-Key", self.key if self.key is not None else key.encode()))
        if self.content_type is not None:
            headers.append((b"Content-Type", self.content_type))
        return Request(self.method, path.encode(), headers, self.body(amount))


INVALID_CHARGE = Expect(400, f"{EXAMPLE}invalid-charge")
INVALID_JSON = Expect(400, f"{EXAMPLE}invalid-json")
UNSUPPORTED = Expect(415, f"{EXAMPLE}unsupported-media-type")
TOO_LARGE = Expect(413, f"{LIBRARY}body-too-large")
CREATED = Expect(201)

CORPUS: list[Case] = [
    # Inputs that were each a 500 once.
    Case("amount 10**400", lambda a: charge_json(10**400)),
    Case("amount 2**31 (past the column)", lambda a: charge_json(2**31)),
    Case("array nested 5000 deep", lambda a: b"[" * 5000, expect=INVALID_JSON),
    Case("object nested 5000 deep", lambda a: b'{"a":' * 5000, expect=INVALID_JSON),
    # Amounts: a JSON number with no fraction, 1 to MAX_AMOUNT.
    Case(
        "amount MAX_AMOUNT",
        lambda a: charge_json(MAX_AMOUNT, "tok_declined"),
        expect=Expect(402, f"{EXAMPLE}card-declined"),
        card="tok_declined",
    ),
    Case(
        "amount 1000.0 (a whole number)",
        lambda a: charge_json(f"{a}.0"),
        expect=CREATED,
        card="tok_visa",
    ),
    Case("amount with a fraction", lambda a: charge_json(f"{a}.5")),
    Case("amount true", lambda a: charge_json("true")),
    Case("amount a string", lambda a: charge_json(f'"{a}"')),
    Case("amount 0", lambda a: charge_json(0)),
    Case("amount 5000 digits", lambda a: charge_json("9" * 5000)),
    Case("amount 1e999999999", lambda a: charge_json("1e999999999")),
    # Not JSON, or not JSON a column can hold.
    Case("NaN", lambda a: charge_json("NaN"), expect=INVALID_JSON),
    Case("Infinity", lambda a: charge_json("-Infinity"), expect=INVALID_JSON),
    Case(
        "nested 33 deep in a field",
        lambda a: charge_json(a)[:-1] + b', "x": ' + b"[" * 33 + b"]" * 33 + b"}",
        expect=INVALID_JSON,
    ),
    Case("invalid UTF-8", lambda a: charge_json(a).replace(b"EUR", b"E\xffR"), expect=INVALID_JSON),
    Case("UTF-16", lambda a: charge_json(a).decode().encode("utf-16"), expect=INVALID_JSON),
    Case("byte order mark", lambda a: b"\xef\xbb\xbf" + charge_json(a), expect=INVALID_JSON),
    Case("lone surrogate", lambda a: charge_json(a, currency="\\ud800ab"), expect=INVALID_JSON),
    Case("NUL escaped", lambda a: charge_json(a, currency="EU\\u0000"), expect=INVALID_JSON),
    Case("NUL byte", lambda a: charge_json(a) + b"\x00", expect=INVALID_JSON),
    Case("truncated", lambda a: charge_json(a)[:-3], expect=INVALID_JSON),
    Case("top-level array", lambda a: b"[" + charge_json(a) + b"]"),
    # DRF reads an empty body as no data: every field missing.
    Case("empty body", lambda a: b"", expect=INVALID_JSON, on={"drf": INVALID_CHARGE}),
    # Media types: the API takes application/json only.
    Case("text/plain", lambda a: charge_json(a), content_type=b"text/plain", expect=UNSUPPORTED),
    Case("no Content-Type", lambda a: charge_json(a), content_type=None, expect=UNSUPPORTED),
    Case("Content-Type */*", lambda a: charge_json(a), content_type=b"*/*", expect=UNSUPPORTED),
    Case(
        "upper-case media type",
        lambda a: charge_json(a),
        content_type=b"Application/JSON",
        expect=CREATED,
        card="tok_visa",
    ),
    Case(
        "charset=latin-1 (JSON is UTF-8)",
        lambda a: charge_json(a),
        content_type=b"application/json; charset=latin-1",
        expect=CREATED,
        card="tok_visa",
    ),
    Case(
        "form",
        lambda a: b"amount=%d&currency=EUR&card=tok_visa" % a,
        content_type=FORM,
        expect=UNSUPPORTED,
    ),
    Case(
        "multipart",
        lambda a: multipart([("amount", b"%d" % a), ("currency", b"EUR")]),
        content_type=MULTIPART,
        expect=UNSUPPORTED,
    ),
    Case(
        "multipart with a file",
        lambda a: multipart_file(b"card.bin", bytes(range(256))),
        content_type=MULTIPART,
        expect=UNSUPPORTED,
    ),
    Case(
        "multipart cut short",
        lambda a: b"--fuzzboundary\r\nContent-Disp",
        content_type=MULTIPART,
        expect=UNSUPPORTED,
    ),
    # Django refuses it (handler400); DRF's parser is JSON only.
    Case(
        "multipart without a boundary",
        lambda a: multipart([("amount", b"1")]),
        content_type=b"multipart/form-data",
        expect=Expect(400, f"{EXAMPLE}bad-request"),
        on={"drf": UNSUPPORTED},
    ),
    # Over DATA_UPLOAD_MAX_MEMORY_SIZE: the app answers before the view.
    Case(
        "body over the upload limit",
        lambda a: b'{"pad": "' + b"x" * OVER_LIMIT + b'"}',
        expect=TOO_LARGE,
    ),
    Case(
        "form over the upload limit",
        lambda a: b"pad=" + b"x" * OVER_LIMIT,
        content_type=FORM,
        expect=TOO_LARGE,
    ),
    # Methods and keys.
    Case(
        "PUT",
        lambda a: charge_json(a),
        method=b"PUT",
        expect=Expect(405, f"{EXAMPLE}method-not-allowed"),
    ),
    Case(
        "key with a byte outside ASCII",
        lambda a: charge_json(a),
        key=b"fuzz-\xe9",
        expect=Expect(400, f"{LIBRARY}key-malformed"),
    ),
    Case(
        "key a, b",
        lambda a: charge_json(a),
        key=b"a, b",
        expect=Expect(400, f"{LIBRARY}key-malformed"),
    ),
    # The example's one documented 5xx: the provider timed out (not stored).
    Case(
        "provider timeout",
        lambda a: charge_json(a, "tok_timeout"),
        expect=Expect(504, f"{EXAMPLE}provider-timeout"),
        card="tok_timeout",
    ),
]


# --- the random requests --------------------------------------------------------------------


# Request bodies: label -> weight.
BODIES = {
    "valid": 40,
    "valid, formatted": 6,
    "valid, charset": 2,
    "valid, odd parameters": 1,
    "valid, upper-case media type": 1,
    "valid, large": 1,
    "duplicate names": 2,
    "bad amount": 8,
    "bad currency": 2,
    "bad card": 2,
    "bad field types": 2,
    "missing fields": 2,
    "not an object": 2,
    "deep": 5,
    "deep in a field": 2,
    "NaN or Infinity": 2,
    "invalid UTF-8": 3,
    "lone surrogate": 2,
    "NUL": 2,
    "control character": 1,
    "byte order mark": 1,
    "UTF-16": 1,
    "truncated": 2,
    "trailing garbage": 1,
    "empty": 3,
    "blank": 1,
    "binary": 2,
    "compressed": 1,
    "form": 3,
    "form, odd": 1,
    "form as JSON": 1,
    "JSON as form": 1,
    "multipart": 3,
    "multipart, a file": 1,
    "multipart, broken": 3,
    "multipart, another boundary": 1,
    "multipart, no boundary": 1,
    "multipart, too many fields": 1,
    "multipart, too many files": 1,
    "multipart, over the upload limit": 1,
    "over the upload limit": 1,
    "many names": 1,
    "odd media type": 4,
}
ODD_MEDIA_TYPES = [
    b"text/plain",
    b"text/json",
    b"application/merge-patch+json",
    b"application/vnd.api+json",
    b"application/xml",
    b"*/*",
    b"a/b/c",
    b";;;",
    b"application/json, text/plain",
    b"application/jsonx",
    b"json",
    b" ",
]


def _weighted(rng: random.Random, table: dict[Any, int]) -> Any:
    return rng.choices(list(table), weights=list(table.values()))[0]


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([33, 100, 999, 1000, 5000, 100_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"a":', b"}]")])
    closed = rng.random() < 0.5
    return opener * depth + (b"1" + closer * depth if closed else b"")


class Generator:
    """Seeded scenarios; ``Key`` numbers and amounts are handed out in order."""

    def __init__(self, rng: random.Random, amount_base: int = AMOUNT_BASE) -> None:
        self.rng = rng
        self.amount_base = amount_base
        self.keys: list[Key] = []

    def new_key(self, account: str, path: str) -> Key:
        key = Key(len(self.keys), account, path, self.amount_base + len(self.keys) * 10)
        self.keys.append(key)
        return key

    def token(self) -> str:
        return f"fz{self.rng.getrandbits(64):016x}"

    # -- the parts of a request

    def key_header(self, token: str) -> tuple[str, list[tuple[bytes, bytes]]]:
        """A label and the ``Idempotency-Key`` header lines (``[]``: none)."""
        t = token.encode()
        r = self.rng
        choices: dict[str, Callable[[], list[tuple[bytes, bytes]]]] = {
            "plain": lambda: [(b"Idempotency-Key", t)],
            "quoted": lambda: [(b"Idempotency-Key", b'"%s"' % t)],
            "padded": lambda: [(b"Idempotency-Key", b" \t%s \t" % t)],
            "lowercase name": lambda: [(b"idempotency-key", t)],
            "255 characters": lambda: [(b"Idempotency-Key", t.ljust(255, b"k"))],
            "256 characters": lambda: [(b"Idempotency-Key", t.ljust(256, b"k"))],
            "quoted, 255 characters": lambda: [(b"Idempotency-Key", b'"%s"' % t.ljust(255, b"q"))],
            "quoted, a space inside": lambda: [(b"Idempotency-Key", b'"%s %s"' % (t, t))],
            "punctuation": lambda: [(b"Idempotency-Key", t + b"!#$%&'*+-.^_`|~/:@[]")],
            "long": lambda: [(b"Idempotency-Key", t * r.choice([60, 500]))],
            "one character": lambda: [(b"Idempotency-Key", bytes([r.randrange(0x21, 0x7F)]))],
            "empty": lambda: [(b"Idempotency-Key", b"")],
            "blank": lambda: [(b"Idempotency-Key", b"   ")],
            "empty quotes": lambda: [(b"Idempotency-Key", b'""')],
            "unbalanced quote": lambda: [(b"Idempotency-Key", r.choice([b'"%s', b'%s"']) % t)],
            "escaped quote": lambda: [(b"Idempotency-Key", b'"%s\\"x\\\\"' % t)],
            "parameters": lambda: [(b"Idempotency-Key", b'"%s";a=1' % t)],
            "list": lambda: [(b"Idempotency-Key", b"%s, %s" % (t, t[::-1]))],
            "list without space": lambda: [(b"Idempotency-Key", b"%s,%s" % (t, t[::-1]))],
            "two headers": lambda: [(b"Idempotency-Key", t), (b"Idempotency-Key", t[::-1])],
            "same header twice": lambda: [(b"Idempotency-Key", t), (b"Idempotency-Key", t)],
            "obs-text": lambda: [(b"Idempotency-Key", t + bytes([r.randrange(0x80, 0x100)]))],
            "UTF-8": lambda: [(b"Idempotency-Key", t + "-ключ-€".encode())],
            "control": lambda: [(b"Idempotency-Key", t + bytes([r.randrange(1, 0x20)]))],
            "DEL": lambda: [(b"Idempotency-Key", t + b"\x7f")],
            "tab inside": lambda: [(b"Idempotency-Key", t[:4] + b"\t" + t[4:])],
            "NUL": lambda: [(b"Idempotency-Key", t + b"\x00")],
            "missing": lambda: [],
        }
        weights = {name: 1 for name in choices}
        weights.update(plain=30, quoted=5, padded=3, missing=4)
        name = _weighted(r, weights)
        return name, choices[name]()

    def auth(self, account: str) -> tuple[str, bytes, bool]:
        """A label, the ``Authorization`` value (``b""``: none) and whether it authenticates
        as ``account``."""
        options = {
            "valid": 90,
            "lowercase scheme": 2,
            "none": 2,
            "wrong password": 2,
            "unknown user": 1,
            "not base64": 1,
            "not UTF-8": 1,
            "bearer": 1,
        }
        name = _weighted(self.rng, options)
        value = {
            "valid": authorization(account, USERS[account]),
            "lowercase scheme": b"basic " + authorization(account, USERS[account])[6:],
            "none": b"",
            "wrong password": authorization(account, "wrong"),
            "unknown user": authorization("mallory", "mallory"),
            "not base64": b"Basic %%%%",
            "not UTF-8": b"Basic " + base64.b64encode(b"\xff\xfe:\xff"),
            "bearer": b"Bearer " + self.token().encode(),
        }[name]
        return name, value, name in ("valid", "lowercase scheme")

    def query(self) -> bytes:
        r = self.rng
        options: dict[bytes, int] = {
            b"": 70,
            b"?": 2,
            b"?a=1": 3,
            b"?a=1&a=2&b=": 2,
            b"?format=json": 2,
            b"?format=api": 2,
            b"?format=xml": 2,
            b"?amount=1&card=tok_timeout": 2,
            b"?%ff%fe=%00%c3%28": 2,
            b"?q=%E2%82%AC%F0%9F%98%80": 2,
            b"?;;&&==&": 2,
            b"?long=" + b"x" * 3000: 1,
            b"?very-long=" + b"y" * 9000: 1,
            b"?raw=\xe9": 1,
        }
        return bytes(_weighted(r, options))

    def method(self) -> bytes:
        options = {
            b"POST": 88,
            b"GET": 2,
            b"HEAD": 1,
            b"PUT": 2,
            b"PATCH": 2,
            b"DELETE": 1,
            b"OPTIONS": 1,
            b"FOO": 1,
            b"post": 1,
        }
        return bytes(_weighted(self.rng, options))

    def body(self, amount: int) -> tuple[str, bytes | None, bytes, str | None]:
        """A label, a Content-Type (``None``: no header), the body, and the card it names
        (which charges if the rest of the request is valid: the checks need not guess)."""
        r = self.rng
        card = r.choice(["tok_visa", "tok_visa", "tok_visa", "tok_declined", "tok_timeout"])
        name = _weighted(r, BODIES)
        content_type, body = self.make_body(name, amount, card)
        return name, content_type, body, card

    def make_body(self, name: str, amount: int, card: str) -> tuple[bytes | None, bytes]:
        r = self.rng
        valid = charge_json(amount, card)
        match name:
            case "valid":
                return JSON, valid
            case "valid, formatted":
                return JSON, self.formatted(amount, card)
            case "valid, charset":
                return b"application/json; charset=utf-8", valid
            case "valid, odd parameters":
                return r.choice([b"application/json; charset=\xff", b"application/json;;"]), valid
            case "valid, upper-case media type":
                return b"Application/JSON", valid
            case "valid, large":
                return JSON, valid[:-1] + b', "pad": "' + b"p" * 1_000_000 + b'"}'
            case "duplicate names":
                return JSON, valid.replace(b"{", b'{"amount": "x", ', 1)
            case "bad amount":
                return JSON, charge_json(self.bad_amount(amount), card)
            case "bad currency":
                return JSON, charge_json(amount, card, self.bad_currency())
            case "bad card":
                return JSON, charge_json(amount, r.choice(["tok_unknown", "", "TOK_VISA"]))
            case "bad field types":
                return JSON, b'{"amount": %d, "currency": ["EUR"], "card": {"id": 1}}' % amount
            case "missing fields":
                return JSON, r.choice([b"{}", b'{"amount": 5}', b'{"card": "tok_visa"}'])
            case "not an object":
                return JSON, r.choice([b"[]", b'"charge"', b"42", b"null", b"true", b"[1,2]"])
            case "deep":
                return JSON, _deep(r)
            case "deep in a field":
                return JSON, valid[:-1] + b', "x": ' + b"[" * r.choice([32, 33, 500]) + b"}"
            case "NaN or Infinity":
                return JSON, charge_json(r.choice(["NaN", "Infinity", "-Infinity"]), card)
            case "invalid UTF-8":
                return JSON, valid.replace(b"EUR", self.bad_utf8())
            case "lone surrogate":
                return JSON, valid.replace(b"EUR", r.choice([b"\\ud800ab", b"E\\udfffR"]))
            case "NUL":
                nul = r.choice([valid.replace(b"EUR", b"EU\\u0000"), valid + b"\x00"])
                return JSON, r.choice([nul, b"\x00" + valid])
            case "control character":
                return JSON, valid.replace(b"EUR", b"E\x01R")
            case "byte order mark":
                return JSON, b"\xef\xbb\xbf" + valid
            case "UTF-16":
                return JSON, valid.decode().encode(r.choice(["utf-16", "utf-16-be"]))
            case "truncated":
                return JSON, valid[: r.randrange(1, len(valid))]
            case "trailing garbage":
                return JSON, valid + b"}{,"
            case "empty":
                return r.choice([JSON, None, FORM, MULTIPART]), b""
            case "blank":
                return JSON, b" \r\n\t "
            case "binary":
                content_type = r.choice([JSON, b"application/octet-stream", None])
                return content_type, r.randbytes(r.randrange(1, 4096))
            case "compressed":
                return JSON, zlib.compress(valid)
            case "form":
                return FORM, b"amount=%d&currency=EUR&card=%s" % (amount, card.encode())
            case "form, odd":
                return FORM, b"amount=%ff&&=&currency=%00" + b"&a=1" * 1200
            case "form as JSON":
                return JSON, b"amount=%d&currency=EUR" % amount
            case "JSON as form":
                return FORM, valid
            case "multipart":
                fields = [("amount", b"%d" % amount), ("currency", b"EUR"), ("card", b"tok_visa")]
                return MULTIPART, multipart(fields)
            case "multipart, a file":
                return MULTIPART, multipart_files([(b"x.bin", r.randbytes(256))])
            case "multipart, broken":
                return MULTIPART, self.broken_multipart(amount)
            case "multipart, another boundary":
                return b"multipart/form-data; boundary=other", multipart([("a", b"1")])
            case "multipart, no boundary":
                return b"multipart/form-data", multipart([])
            case "multipart, too many fields":
                return MULTIPART, multipart([(f"f{i}", b"1") for i in range(1100)])
            case "multipart, too many files":
                return MULTIPART, multipart_files([(b"%d" % i, b"z") for i in range(120)])
            case "multipart, over the upload limit":
                return MULTIPART, multipart_files([(b"big.bin", b"x" * OVER_LIMIT)])
            case "over the upload limit":
                return r.choice([JSON, FORM]), b'{"pad": "' + b"x" * OVER_LIMIT + b'"}'
            case "many names":
                names = b",".join(b'"k%d": %d' % (i, i) for i in range(20_000))
                return JSON, b"{" + names + b"}"
            case _:  # "odd media type"
                return r.choice(ODD_MEDIA_TYPES), valid

    def formatted(self, amount: int, card: str) -> bytes:
        """The JSON value of ``charge_json(amount, card)``, written another way."""
        r = self.rng
        number = r.choice(
            [
                f"{amount}",
                f"{amount}.0",
                f"{amount}E0",
                f"{amount}0e-1",
                f"{amount / 1000}e3" if amount % 1000 == 0 else f"{amount}.000",
            ]
        )
        names = [b'"amount"', b'"\\u0061mount"'][r.randrange(2)]
        fields = [
            b"%s:%s" % (names, number.encode()),
            b'"currency" : "\\u0045UR"',
            b'"card":\n"%s"' % card.encode(),
        ]
        r.shuffle(fields)
        return b"  {" + b" ,\t".join(fields) + b"}\r\n"

    def bad_amount(self, amount: int) -> str:
        return str(
            self.rng.choice(
                [
                    "0",
                    "-1",
                    "-0",
                    f"{amount}.5",
                    f"{amount}.0001",
                    f'"{amount}"',
                    "true",
                    "false",
                    "null",
                    "[]",
                    "{}",
                    str(10**400),
                    str(2**31),
                    str(2**63),
                    str(2**64),
                    "1e400",
                    "1e-7",
                    "1E999999999",
                    "9" * 5000,
                    "-" + "9" * 50,
                    "0.0",
                ]
            )
        )

    def bad_currency(self) -> str:
        return str(
            self.rng.choice(
                [
                    "EURO",
                    "EU",
                    "",
                    "E R",
                    "123",
                    "\u0395\u03a5\u03a1",
                    "€UR",
                    "\\u00e9ur",
                    "EUR\\n",
                    "eu\\u0000",
                ]
            )
        )

    def bad_utf8(self) -> bytes:
        return bytes(
            self.rng.choice(
                [
                    b"\xff\xfe",
                    b"\xc0\xaf",
                    b"\xed\xa0\x80",
                    b"E\xc3",
                    b"\xf8\x88\x80\x80\x80",
                    b"\x80UR",
                ]
            )
        )

    def broken_multipart(self, amount: int) -> bytes:
        whole = multipart([("amount", b"%d" % amount), ("currency", b"EUR")])
        return bytes(
            self.rng.choice(
                [
                    whole[: len(whole) // 2],
                    whole[:-4],
                    whole.replace(b"\r\n\r\n", b"\r\n", 1),
                    whole.replace(b"Content-Disposition", b"Content-Dispo\x00sition"),
                    b"--fuzzboundary\r\n\r\n--fuzzboundary--",
                    b"garbage without a boundary",
                    b'--fuzzboundary\r\nContent-Disposition: form-data; name="a"\r\n\r\n'
                    + b"v" * 5000,
                ]
            )
        )

    # -- scenarios

    def endpoint(self) -> Endpoint:
        return _weighted(self.rng, ENDPOINTS)  # type: ignore[no-any-return]

    def request(
        self,
        key: Key,
        key_lines: list[tuple[bytes, bytes]],
        auth: bytes,
        content_type: bytes | None,
        body: bytes,
        *,
        method: bytes = b"POST",
        query: bytes = b"",
        extra: list[tuple[bytes, bytes]] | None = None,
        chunked: bool = False,
    ) -> Request:
        headers: list[tuple[bytes, bytes]] = []
        if auth:
            headers.append((b"Authorization", auth))
        headers += key_lines
        if content_type is not None:
            headers.append((b"Content-Type", content_type))
        headers += extra or []
        return Request(method, key.path.encode() + query, headers, body, chunked)

    def extra_headers(self) -> tuple[list[tuple[bytes, bytes]], bool]:
        """Headers beyond the key, auth and media type, and whether to send chunked."""
        r = self.rng
        extra: list[tuple[bytes, bytes]] = []
        if r.random() < 0.06:
            extra.append(
                (
                    b"Accept",
                    r.choice(
                        [
                            b"text/html",
                            b"application/xml",
                            b"*/*",
                            b"application/problem+json",
                            b"\xff/\xff",
                        ]
                    ),
                )
            )
        if r.random() < 0.03:
            extra.append((b"Expect", b"100-continue"))
        if r.random() < 0.02:
            extra.append((b"Content-Encoding", b"gzip"))
        return extra, r.random() < 0.05

    def scenario(self) -> Scenario:
        r = self.rng
        kind = _weighted(r, {"charge": 45, "odd body": 30, "odd key": 12, "odd request": 13})
        endpoint = self.endpoint()
        account = r.choice(["alice", "alice", "alice", "bob"])
        key = self.new_key(account, endpoint.path)
        token = self.token()
        auth_label, auth, authenticates = "valid", authorization(account, USERS[account]), True
        key_label, key_lines = "plain", [(b"Idempotency-Key", token.encode())]
        body_label, body = "valid", b""
        content_type: bytes | None = JSON
        card: str | None = r.choice(["tok_visa", "tok_visa", "tok_declined", "tok_timeout"])
        method, query, chunked = b"POST", b"", False
        extra: list[tuple[bytes, bytes]] = []
        if kind == "charge":
            body = charge_json(key.amount, card or "tok_visa")
        elif kind == "odd body":
            body_label, content_type, body, card = self.body(key.amount)
        elif kind == "odd key":
            key_label, key_lines = self.key_header(token)
            body = charge_json(key.amount, card or "tok_visa")
        else:
            auth_label, auth, authenticates = self.auth(account)
            method, query = self.method(), self.query()
            extra, chunked = self.extra_headers()
            body_label, content_type, body, card = self.body(key.amount)
            if r.random() < 0.3:
                key_label, key_lines = self.key_header(token)
        details = ", ".join(
            part
            for part in (
                f"key {key_label}" if key_label != "plain" else "",
                f"body {body_label}" if body_label != "valid" else "",
                f"auth {auth_label}" if auth_label != "valid" else "",
                method.decode("latin-1") if method != b"POST" else "",
                f"query {query[:20]!r}" if query else "",
                "chunked" if chunked else "",
            )
            if part
        )
        label = f"{kind}: {details}" if details else kind

        def shot(request: Request, on: Endpoint = endpoint, what: str = label) -> Shot:
            return Shot(
                on,
                request,
                what,
                key if authenticates else None,
                keyless=not key_lines,
                card=card if method == b"POST" else None,
            )

        first = self.request(
            key,
            key_lines,
            auth,
            content_type,
            body,
            method=method,
            query=query,
            extra=extra,
            chunked=chunked,
        )
        steps = [[shot(first)]]
        scenario = Scenario(label, steps, identical=True)
        shape = _weighted(
            r,
            {"once": 40, "retries": 30, "concurrent": 15, "mismatch": 8, "respelled": 7, "twin": 4},
        )

        def either() -> Endpoint:
            """The endpoint, or now and then the same path under the other server (a chunked
            body stays on one: under WSGI, Django reads a chunked body as empty)."""
            return self.other_server(endpoint) if r.random() < 0.3 and not chunked else endpoint

        if shape == "retries":
            steps += [[shot(first, either())] for _ in range(r.randint(1, 3))]
        elif shape == "concurrent":
            steps[0] += [shot(first, either()) for _ in range(r.randint(1, 3))]
        elif shape == "mismatch" and kind == "charge" and card != "tok_timeout":
            changed = charge_json(key.amount + r.randint(1, 9), card or "tok_visa")
            mismatched = shot(
                self.request(key, key_lines, auth, content_type, changed),
                what=f"{label} (then another body under its key)",
            )
            steps.append([mismatched])
            scenario.mismatch.append(mismatched)
        elif shape == "respelled" and kind == "charge":
            # The same key (quoted, padded) and the same JSON value (formatted another way):
            # one request to the server, so a replay, never a 422.
            spelled = r.choice([b'"%s"', b" %s\t"]) % token.encode()
            again = self.request(
                key,
                [(b"Idempotency-Key", spelled)],
                auth,
                content_type,
                self.formatted(key.amount, card or "tok_visa"),
            )
            steps.append([shot(again, what=f"{label} (then respelled)")])
            scenario.identical = False
            scenario.label += " respelled"
        elif shape == "twin" and kind == "charge":
            # Another key that a case- or space-insensitive comparison (MariaDB's default
            # collation) would take for the first: its own charge, not a replay or a 422.
            twin_key = self.new_key(account, endpoint.path)
            twin = r.choice([token.upper().encode(), b'"%s "' % token.encode()])
            request = self.request(
                twin_key,
                [(b"Idempotency-Key", twin)],
                auth,
                content_type,
                charge_json(twin_key.amount, card or "tok_visa"),
            )
            fresh = Shot(
                endpoint, request, f"{label} (then its twin {twin!r})", twin_key, card=card
            )
            steps.append([fresh])
            scenario.fresh.append(fresh)
        return scenario

    def other_server(self, endpoint: Endpoint) -> Endpoint:
        server = "uvicorn" if endpoint.server == "gunicorn" else "gunicorn"
        return Endpoint(server, endpoint.path, endpoint.kind)

    def corpus(self) -> list[Scenario]:
        scenarios = []
        for case in CORPUS:
            for endpoint in CORPUS_ENDPOINTS:
                key = self.new_key("alice", endpoint.path)
                request = case.request(endpoint.path, self.token(), key.amount)
                shot = Shot(
                    endpoint,
                    request,
                    f"corpus: {case.name}",
                    key,
                    card=case.card,
                    expect=case.expected(endpoint.kind),
                )
                scenarios.append(Scenario(shot.label, [[shot]]))
        return scenarios


# --- running --------------------------------------------------------------------------------


def fire(shot: Shot, ports: dict[str, int]) -> None:
    try:
        shot.answer = send(ports[shot.endpoint.server], shot.request)
    except (NoResponse, OSError) as exc:
        shot.error = f"{type(exc).__name__}: {exc}"


def play(scenario: Scenario, ports: dict[str, int]) -> None:
    for step in scenario.steps:
        if len(step) == 1:
            fire(step[0], ports)
            continue
        threads = [threading.Thread(target=fire, args=(shot, ports)) for shot in step]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def run_all(scenarios: list[Scenario], ports: dict[str, int], clients: int) -> None:
    pending = list(reversed(scenarios))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                scenario = pending.pop()
            play(scenario, ports)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def plan(
    rng: random.Random, total: int, *, corpus: bool = True, amount_base: int = AMOUNT_BASE
) -> tuple[Generator, list[Scenario]]:
    """The corpus (unless not ``corpus``), then random scenarios, ``total`` requests in all;
    the charges' amounts start at ``amount_base``."""
    generator = Generator(rng, amount_base)
    scenarios = generator.corpus()[:total] if corpus else []
    count = len(scenarios)
    while count < total:
        scenario = generator.scenario()
        shots = scenario.shots
        if count + len(shots) > total:
            scenario.steps = [[shots[0]]]
            scenario.mismatch, scenario.fresh = [], []
        scenarios.append(scenario)
        count += len(scenario.shots)
    index = 0
    for scenario in scenarios:
        for shot in scenario.shots:
            shot.index = index
            index += 1
    return generator, scenarios


# --- checking -------------------------------------------------------------------------------


def from_application(answer: Outcome) -> bool:
    """Answered by Django (its SecurityMiddleware marks every response), not refused by
    gunicorn or uvicorn before the request reached it."""
    return answer.headers.get("X-Content-Type-Options") == "nosniff"


def problem_of(answer: Outcome) -> dict[str, Any] | None:
    if answer.headers.get("Content-Type") != PROBLEM:
        return None
    try:
        problem = answer.json()
    except ValueError:
        return None
    return problem if isinstance(problem, dict) else None


def describe(shot: Shot) -> str:
    answer = shot.answer
    got = (
        f"{answer.status_code} {answer.headers.get('Content-Type')} {answer.content[:300]!r}"
        if answer is not None
        else shot.error
    )
    return (
        f"#{shot.index} {shot.label} on {shot.endpoint}\n"
        f"      request: {shot.request.describe()}\n      answer: {got}"
    )


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str


def check_answers(shots: list[Shot]) -> list[Violation]:
    found = []
    for shot in shots:
        answer = shot.answer
        if answer is None:
            found.append(Violation("dropped connection", describe(shot)))
            continue
        status = answer.status_code
        problem = problem_of(answer)
        if status >= 500 and not (
            status == 504
            and shot.card == "tok_timeout"
            and problem is not None
            and problem.get("type") == f"{EXAMPLE}provider-timeout"
        ):
            found.append(Violation(f"a {status}", describe(shot)))
            continue
        if 400 <= status < 500 and from_application(answer):
            # A HEAD answer has no body to look into.
            head = shot.request.method == b"HEAD"
            if answer.headers.get("Content-Type") != PROBLEM or (
                not head and (problem is None or problem.get("status") != status)
            ):
                found.append(Violation(f"a {status} not application/problem+json", describe(shot)))
        if shot.expect is not None:
            got_type = problem.get("type") if problem is not None else None
            if status != shot.expect.status or (
                shot.expect.type is not None and got_type != shot.expect.type
            ):
                expected = f"{shot.expect.status} {shot.expect.type or ''}".rstrip()
                found.append(
                    Violation("corpus case answered wrong", f"{expected}: {describe(shot)}")
                )
        if shot.keyless and shot.request.method == b"POST" and 200 <= status < 300:
            found.append(Violation("a 2xx without an Idempotency-Key", describe(shot)))
        if status == 201 and shot.key is not None:
            try:
                amount = answer.json().get("amount")
            except (ValueError, AttributeError):
                amount = None
            if not isinstance(amount, int) or amount // 10 != shot.key.amount // 10:
                found.append(Violation("a 201 for another key's amount", describe(shot)))
    return found


def check_scenarios(scenarios: list[Scenario]) -> list[Violation]:
    """Retries agree: the same request gets the same answer, a stored answer is replayed
    byte for byte, a different body under a used key never charges."""
    found = []
    for scenario in scenarios:
        for shot in scenario.mismatch:
            if shot.answer is not None and 200 <= shot.answer.status_code < 300:
                found.append(Violation("a different body under a used key charged", describe(shot)))
        for shot in scenario.fresh:
            if shot.answer is not None and (shot.answer.status_code == 422 or shot.replayed):
                found.append(Violation("a new key taken for another", describe(shot)))
        # What the application answered (gunicorn and uvicorn refuse different odd requests
        # before it sees them), a 409 for a request still in flight aside.
        settled = [
            shot
            for shot in scenario.shots
            if shot.answer is not None
            and from_application(shot.answer)
            and not _in_flight(shot)
            and shot not in scenario.mismatch
            and shot not in scenario.fresh
        ]
        if len(settled) < 2:
            continue
        listing = "\n    ".join(describe(shot) for shot in settled)
        statuses = sorted({shot.answer.status_code for shot in settled if shot.answer})
        if scenario.identical and len(statuses) > 1:
            found.append(Violation("one request, different answers", f"{statuses}\n    {listing}"))
        stored = [shot for shot in settled if shot.answer and shot.answer.status_code in (201, 402)]
        ran = [shot for shot in stored if not shot.replayed]
        bodies = {shot.answer.content for shot in stored if shot.answer}
        if stored and (len(ran) != 1 or len(bodies) != 1):
            found.append(Violation("retries not replays", f"{len(ran)} ran:\n    {listing}"))
    return found


def _in_flight(shot: Shot) -> bool:
    if shot.answer is None or shot.answer.status_code != 409:
        return False
    problem = problem_of(shot.answer)
    return problem is not None and problem.get("type") == f"{LIBRARY}in-flight"


def check_database(
    database: Database, generator: Generator, shots: list[Shot], *, shared: bool = False
) -> list[Violation]:
    """One charge per key that got a 2xx, none for the others, nothing left in progress.

    ``shared``: the database has other clients' charges and keys (the e2e tests'); look only
    at the charges of this run's amounts and the records of its keys (``fz…``)."""
    keys, base = generator.keys, generator.amount_base
    users = {str(name): pk for pk, name in query(database, "SELECT id, username FROM auth_user")}
    charged: dict[int, list[int]] = defaultdict(list)
    found = []
    for account_id, amount in query(database, f"SELECT account_id, amount FROM {CHARGES_TABLE}"):
        number = (int(amount) - base) // 10
        if 0 <= number < len(keys) and users[keys[number].account] == account_id:
            charged[number].append(int(amount))
        elif shared and not 0 <= number < len(keys):
            continue
        else:
            detail = f"account {account_id}, amount {amount}"
            found.append(Violation("a charge of no key", detail))
    answered: dict[int, list[int]] = defaultdict(list)
    for shot in shots:
        if shot.key is not None and shot.answer is not None:
            answered[shot.key.number].append(shot.answer.status_code)
    for key in keys:
        charges = charged.get(key.number, [])
        statuses = answered.get(key.number, [])
        what = (
            f"key #{key.number} ({key.account} {key.path}): charges {charges}, answers {statuses}"
        )
        if len(charges) > 1:
            found.append(Violation("a key charged more than once", what))
        elif charges and not any(200 <= status < 300 for status in statuses):
            found.append(Violation("a charge without a 2xx", what))
        elif not charges and 201 in statuses:
            found.append(Violation("a 201 without a charge", what))
    column = '"key"' if database.vendor == "postgresql" else "`key`"  # a reserved word
    where = f"state = '{IN_PROGRESS}'" + (f" AND {column} LIKE 'fz%'" if shared else "")
    rows = query(database, f"SELECT COUNT(*) FROM {RECORDS_TABLE} WHERE {where}")
    if int(rows[0][0]):
        found.append(Violation("records left in progress", f"{rows[0][0]} after every answer"))
    return found


def check(
    database: Database,
    generator: Generator,
    scenarios: list[Scenario],
    *,
    shared: bool = False,
    redis_store: bool = False,
) -> list[Violation]:
    """Every check, after the run (``shared``: see ``check_database``; ``redis_store``: the
    server kept its records in Redis, so the records table must be empty)."""
    shots = [shot for scenario in scenarios for shot in scenario.shots]
    found = check_database(database, generator, shots, shared=shared)
    if redis_store:
        rows = query(database, f"SELECT COUNT(*) FROM {RECORDS_TABLE}")
        if int(rows[0][0]):
            detail = f"{rows[0][0]} rows in {RECORDS_TABLE}: the server did not use Redis"
            found.append(Violation("records in the database on the Redis store", detail))
    return found + check_answers(shots) + check_scenarios(scenarios)


# --- main -----------------------------------------------------------------------------------


def database_at(url: str) -> Database:
    """``--database-url``, parsed and checked as every e2e helper does (``server.database``)."""
    try:
        return database(url)
    except ValueError as exc:
        raise SystemExit(f"--database-url: {exc}") from exc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fuzz the example API over HTTP (see the module docstring)."
    )
    parser.add_argument(
        "--database-url",
        required=True,
        help="postgres://… or mysql://…; this database is recreated and dropped",
    )
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--requests", type=int, default=300, help="in all, corpus included")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="concurrent scenarios")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="hard deadline for the whole run (exit code 3)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database and server logs")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="serve on the Redis store at this URL (EXAMPLE_REDIS_URL; its database is "
        "flushed first), e.g. redis://127.0.0.1:6379/4 or redis+cluster://127.0.0.1:7100/0",
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    return args


class Run:
    """What the hard deadline must clean up."""

    def __init__(self, database: Database, keep: bool) -> None:
        self.database = database
        self.keep = keep
        self.servers: list[Server] = []
        self.finished = threading.Event()

    def kill_servers(self) -> None:
        for server in self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)

    def deadline(self, seconds: float) -> None:
        if self.finished.wait(seconds):
            return
        print(f"FUZZ FAILED: hard deadline of {seconds:.0f}s reached", flush=True)
        self.kill_servers()
        if not self.keep:
            with contextlib.suppress(Exception):
                drop_database(self.database)
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(
        f"fuzz seed {seed} ({args.requests} requests): python -m tools.fuzz "
        f"--database-url {args.database_url} --seed {seed} --requests {args.requests}",
        flush=True,
    )
    started = time.monotonic()
    database = database_at(args.database_url)
    run = Run(database, args.keep)
    threading.Thread(target=run.deadline, args=(args.max_seconds,), daemon=True).start()
    generator, scenarios = plan(random.Random(seed), args.requests)
    shots = [shot for scenario in scenarios for shot in scenario.shots]
    logs = Path(tempfile.mkdtemp(prefix="fuzz-"))
    settings = {"EXAMPLE_PROVIDER_DELAY_MS": PROVIDER_DELAY_MS}
    if args.redis_url:
        redis_cluster.flush(args.redis_url)
        settings["EXAMPLE_REDIS_URL"] = args.redis_url
    try:
        create_database(database)
        migrate(database)
        gunicorn = start_server(database, logs / "gunicorn.log", settings)
        run.servers.append(gunicorn)
        uvicorn = start_uvicorn(database, logs / "uvicorn.log", settings)
        run.servers.append(uvicorn)
        ready = time.monotonic()
        print(
            f"{database.vendor} {database.name}: gunicorn :{gunicorn.port} (4 workers), "
            f"uvicorn :{uvicorn.port}; ready in {ready - started:.1f}s",
            flush=True,
        )
        run_all(scenarios, {"gunicorn": gunicorn.port, "uvicorn": uvicorn.port}, args.clients)
        sent = time.monotonic()
        violations = check(database, generator, scenarios, redis_store=bool(args.redis_url))
        report(shots, violations, sent - ready)
        if violations:
            for server in (gunicorn, uvicorn):
                print(f"--- {server.name} log (errors) ---\n{_errors(server.log())}")
    finally:
        for server in run.servers:
            server.stop()
        if not args.keep:
            drop_database(database)
        else:
            print(f"kept database {database.name} and logs in {logs}")
        run.finished.set()
    total = time.monotonic() - started
    verdict = "FAILED" if violations else "PASSED"
    print(
        f"FUZZ {verdict}: seed {seed}, {len(shots)} requests, {len(violations)} violations, "
        f"{total:.1f}s in all",
        flush=True,
    )
    return 1 if violations else 0


def report(shots: list[Shot], violations: list[Violation], seconds: float) -> None:
    by_endpoint: dict[Endpoint, Counter[str]] = defaultdict(Counter)
    refused = Counter[str]()
    for shot in shots:
        answer = shot.answer
        status = str(answer.status_code) if answer is not None else "none"
        by_endpoint[shot.endpoint][status] += 1
        if answer is not None and not from_application(answer):
            refused[f"{shot.endpoint.server} {answer.status_code}"] += 1
    print(f"sent {len(shots)} requests in {seconds:.1f}s:")
    for endpoint in ENDPOINTS:
        counts = by_endpoint.get(endpoint, Counter())
        listing = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
        print(f"  {endpoint!s:24} {sum(counts.values()):4}  {listing}")
    if refused:
        listing = ", ".join(f"{what}: {n}" for what, n in sorted(refused.items()))
        print(f"refused by the server itself (unparseable request): {listing}")
    kinds = Counter(violation.kind for violation in violations)
    for kind, count in kinds.most_common():
        print(f"VIOLATIONS: {count} x {kind}")
    for kind in kinds:  # the first few of each kind
        for violation in [v for v in violations if v.kind == kind][:SHOWN]:
            print(f"VIOLATION {kind}: {violation.detail}")


def _errors(log: str, limit: int = 200) -> str:
    lines = log.splitlines()
    keep = [i for i, line in enumerate(lines) if "Traceback" in line or "Error" in line]
    if not keep:
        return "(no errors logged)"
    return "\n".join(lines[keep[0] : keep[0] + limit])


if __name__ == "__main__":
    sys.exit(main())

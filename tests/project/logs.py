"""What a log handler could write for captured records: to prove what never reaches a log."""

from __future__ import annotations

import logging

# Attributes every LogRecord has: anything else on a record came in through ``extra``.
STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def everything_logged(records: list[logging.LogRecord]) -> list[str]:
    """Every string a handler could write for ``records``: the message before and after
    formatting, its arguments, and every field added through ``extra`` (as ``str``, not
    ``repr``, so that a raw control character stays visible to the caller)."""
    texts = []
    for record in records:
        texts += [record.getMessage(), str(record.msg)]
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        texts += [str(arg) for arg in args]
        texts += [
            f"{name}={value}"
            for name, value in vars(record).items()
            if name not in STANDARD_ATTRIBUTES
        ]
    return texts

"""How the example's DRF endpoint reads a body: its parser and the negotiation that picks it
(``DEFAULT_PARSER_CLASSES`` and ``DEFAULT_CONTENT_NEGOTIATION_CLASS`` in the settings).

A module of its own: DRF imports both while ``rest_framework.views`` is still loading, so
this module must not import views or viewsets (``api.py`` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import IO, Any

from rest_framework import exceptions, negotiation, parsers
from rest_framework.parsers import BaseParser
from rest_framework.request import Request

from example_project.payments import jsonbody


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, reading the body with ``jsonbody.loads`` (the plain views' parser):
    a body nested too deep (``RecursionError`` in DRF's own), not UTF-8, with ``NaN`` or
    with text no column can store is a ``ParseError`` (400), never a 500."""

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            return jsonbody.loads(stream.read())
        except jsonbody.InvalidJSON as error:
            raise exceptions.ParseError(str(error)) from None


class ContentNegotiation(negotiation.DefaultContentNegotiation):
    """DRF's negotiation, choosing a parser the way the plain views check the media type:
    the request's ``Content-Type`` (without parameters, in any case, as RFC 9110 has it)
    must be the parser's. DRF's own takes a wildcard such as ``*/*`` as a match for any
    parser, and compares case-sensitively (``Application/JSON`` would be a 415)."""

    def select_parser(self, request: Request, parsers: Iterable[BaseParser]) -> BaseParser | None:
        media_type = request.content_type.partition(";")[0].strip().lower()
        return next((parser for parser in parsers if parser.media_type == media_type), None)

"""Outcomes that stop a request before (or instead of) its view, one class per problem type.

Each carries what its RFC 9457 problem response needs; ``responses.problem_response``
turns one into an ``application/problem+json`` response in one overridable place.
Client errors subclass Django's ``BadRequest`` (``PermissionDenied`` for the 403) so that,
raised anywhere else, Django's own handling still answers 4xx rather than 500. Every
problem type: docs/problems.md.
"""

from __future__ import annotations

from django.core.exceptions import BadRequest, PermissionDenied


class IdempotencyError(Exception):
    status: int = 400
    slug: str = "error"
    title: str = "Idempotency error"
    retry_after: int | None = None

    def __init__(self, detail: str = "", *, retry_after: int | None = None) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        if retry_after is not None:
            self.retry_after = retry_after


class KeyMissing(IdempotencyError, BadRequest):
    status = 400
    slug = "key-missing"
    title = "Idempotency-Key is missing"


class KeyMalformed(IdempotencyError, BadRequest):
    status = 400
    slug = "key-malformed"
    title = "Idempotency-Key is malformed"


class BodyTooLarge(IdempotencyError, BadRequest):
    status = 413
    slug = "body-too-large"
    title = "Request body is too large to fingerprint"


class AnonymousNotAllowed(IdempotencyError, PermissionDenied):
    status = 403
    slug = "anonymous"
    title = "Idempotency-Key requires an authenticated client"


class KeyMismatch(IdempotencyError):
    status = 422
    slug = "key-mismatch"
    title = "Idempotency-Key is already used"


class InFlight(IdempotencyError):
    status = 409
    slug = "in-flight"
    title = "A request is outstanding for this Idempotency-Key"


class QuotaExceeded(IdempotencyError):
    """The account has ``MAX_IN_FLIGHT_PER_ACCOUNT`` requests in progress already: refused
    before its claim, with ``Retry-After``, as a rate limit is."""

    status = 429
    slug = "quota-exceeded"
    title = "Too many requests of this account are in progress"


class ResponseNotStored(IdempotencyError):
    status = 409
    slug = "response-not-stored"
    title = "The request was processed but its response was not stored"


class StoreUnavailable(IdempotencyError):
    status = 503
    slug = "store-unavailable"
    title = "The idempotency store is unavailable"


class WorkNotCommitted(IdempotencyError):
    """The view answered, then its transaction failed to commit for a reason of its own (a
    deferred constraint, a serialization failure) and was rolled back: a 500, as Django
    answers a view whose transaction fails, and the key is released. Not a 503: the same
    request would most likely fail the same way, so it is nothing to wait for."""

    status = 500
    slug = "work-not-committed"
    title = "The request's work could not be committed"

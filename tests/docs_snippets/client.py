"""The retrying client, used where the intent is made."""


class TemporaryFailure(Exception):
    """Yours: the outcome is still unknown; try again later, with the same key."""


# docs:start
import httpx

from idempotency_django.client import IdempotentClient, RetryPolicy


def payments_client(transport=None):
    return IdempotentClient(
        httpx.Client(
            base_url="https://payments.example",
            auth=("alice", "alice"),
            timeout=10,
            transport=transport,
        ),
        policy=RetryPolicy(max_attempts=5, deadline=30),
    )


def pay(payments, order):
    # The key is made once, where the intent is made, and kept with it: every attempt,
    # every worker and every re-run of this job sends the same one. Never make it here
    # per call, and never in the retry loop.
    result = payments.post(
        "/charges/",
        # e.g. f"order-{order.pk}-payment", or a UUID saved on the order:
        key=order.payment_key,
        json={"amount": order.total, "currency": "eur", "card": order.card_token},
    )
    if result.status_code == 201:
        order.mark_paid(result.json()["id"], replayed=result.replayed)
    elif result.status_code == 402:
        order.mark_declined()  # definitive: not retried, and replayed if asked again
    elif result.gave_up:
        # still unknown (503, 409 in flight …): retry later, with the same key
        raise TemporaryFailure
    return result


# docs:end

"""Queue consumers: ``@idempotent_task``, ``claim_once``, Celery tasks and the purge."""

from types import SimpleNamespace


class mailer:  # stands in for your mail service: counts what it sends
    sent: list[int] = []

    @staticmethod
    def send_receipt(order_id):
        mailer.sent.append(order_id)
        return SimpleNamespace(id=f"mail-{len(mailer.sent)}")


class provider:  # stands in for a payment provider
    captures: list[str] = []

    @staticmethod
    def capture(payment_id):
        provider.captures.append(payment_id)
        return SimpleNamespace(id=f"cap-{len(provider.captures)}")


# docs:task
from idempotency_django.tasks import idempotent_task


@idempotent_task(scope="receipts", key="message_id")
def send_receipt(message_id: str, order_id: int) -> dict:
    mail = mailer.send_receipt(order_id)  # runs at most once per message_id
    return {
        "order": order_id,
        "mail": mail.id,
    }  # stored as JSON, returned to every repeat


# docs:task-end


# docs:claim-once
from idempotency_django.tasks import claim_once


def on_message(message):
    with claim_once("payments", message.id, fingerprint=message.body) as run:
        if run.done:
            return run.result  # an earlier delivery did the work
        capture = provider.capture(message.payment_id)
        run.result = {"capture": capture.id}
    return run.result


# docs:claim-once-end


# docs:celery
from celery import shared_task

from idempotency_django.celery import IdempotentTask


@shared_task(base=IdempotentTask)
def send_order_receipt(order_id: int) -> dict:
    mail = mailer.send_receipt(order_id)
    return {
        "order": order_id,
        "mail": mail.id,
    }  # JSON: stored, returned to every repeat


# When your code can publish the same job twice, key it by the job, not the message:
@shared_task(base=IdempotentTask, idempotency={"scope": "receipts", "key": "order_id"})
def send_receipt_for_order(order_id: int) -> dict:
    mail = mailer.send_receipt(order_id)
    return {"order": order_id, "mail": mail.id}


# docs:celery-end


# docs:purge
from idempotency_django.purge import purge_records


@shared_task
def purge_idempotency_keys() -> dict:
    return (
        purge_records().as_dict()
    )  # {"expired": …, "stale": …, "total": …, "batches": …}


# docs:purge-end

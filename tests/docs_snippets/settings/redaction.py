from idempotency_django.codecs import drop_json_fields

IDEMPOTENCY = {"REDACT_RESPONSE": drop_json_fields("card.number", "customer.email")}

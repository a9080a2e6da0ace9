from idempotency_django.keys import tenant_header

IDEMPOTENCY = {"TENANT": tenant_header("X-Org")}  # the header's value, or None

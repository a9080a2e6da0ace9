IDEMPOTENCY = {
    # The host name, lower-cased, without its port, as Django validates it
    # (ALLOWED_HOSTS).
    "TENANT": "idempotency_django.keys.request_host",
}

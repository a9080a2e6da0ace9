IDEMPOTENCY = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "URL": "redis://redis.internal:6379/0",  # or rediss:// (TLS), unix:// (socket)
        "KEY_PREFIX": "idem",  # keys are idem:{<sha256>}
        "SOCKET_TIMEOUT": 1.0,  # seconds; longer is an unknown outcome
        "CONNECT_TIMEOUT": 1.0,
    },
}

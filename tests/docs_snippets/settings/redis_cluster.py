IDEMPOTENCY = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "URL": "redis://redis-node-1:6379/0",  # any node: the client finds the others
        "CLUSTER": True,
    },
}

IDEMPOTENCY = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        # Every Sentinel (any that answers names the master), the service they
        # monitor, and the master's database: the store talks to the master they name.
        "URL": (
            "redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379"
            "/mymaster/0"
        ),
        "WAIT_REPLICAS": 1,  # a claim or an outcome no replica has is not trusted
    },
}

IDEMPOTENCY = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "SENTINELS": [
            ("sentinel-1", 26379),
            ("sentinel-2", 26379),
            ("sentinel-3", 26379),
        ],
        "SERVICE_NAME": "mymaster",
        "SENTINEL_PASSWORD": None,  # the Sentinels' own requirepass, if they have one
        "URL": "rediss://:master-password@unused/0",  # TLS, password, db of the master
    },
}

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "shop",
        "CONN_MAX_AGE": 60,  # or None: prepared statements live on the connection
        "OPTIONS": {"prepare_threshold": 5},
    }
}

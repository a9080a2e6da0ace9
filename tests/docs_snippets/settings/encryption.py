import os

IDEMPOTENCY = {
    "RESPONSE_CODEC": "idempotency_django.codecs.FernetCodec",
    # Newest first: the first key encrypts, every key decrypts.
    "ENCRYPTION_KEYS": os.environ["IDEMPOTENCY_ENCRYPTION_KEYS"].split(","),
}

"""``IDEMPOTENCY`` settings the documentation shows; ``tests/test_docs.py`` runs the system
checks on each."""

import os

# docs:basic
IDEMPOTENCY = {"LEASE_SECONDS": 10, "TTL_SECONDS": 24 * 60 * 60}
# docs:basic-end


def encryption():
    # docs:encryption
    IDEMPOTENCY = {
        "RESPONSE_CODEC": "idempotency_django.codecs.FernetCodec",
        # Newest first: the first key encrypts, every key decrypts.
        "ENCRYPTION_KEYS": os.environ["IDEMPOTENCY_ENCRYPTION_KEYS"].split(","),
    }
    # docs:encryption-end
    return IDEMPOTENCY


# docs:redaction
from idempotency_django.codecs import drop_json_fields

REDACTING = {"REDACT_RESPONSE": drop_json_fields("card.number", "customer.email")}
# docs:redaction-end


# docs:replay-hook
def mark_replay(response, stored):
    response["Cache-Control"] = "no-store"


REPLAY_HOOKED = {"REPLAY_HOOK": "tests.docs_snippets.settings_examples.mark_replay"}
# docs:replay-hook-end


# docs:tenancy
def tenant_account(request):  # ACCOUNT: the tenant, not the user
    return f"tenant-{request.user.tenant_id}" if request.user.is_authenticated else None


TENANTS = {"tenant-7": "Acme Ltd"}  # yours: a Tenant model


def tenant_name(account):  # ACCOUNT_DISPLAY: "tenant-7" -> "Acme Ltd (tenant-7)"
    return f"{TENANTS.get(account, '?')} ({account})"


def accounts_named(term):  # ACCOUNT_SEARCH: "Acme" -> ["tenant-7"]
    return [account for account, name in TENANTS.items() if term.lower() in name.lower()]


TENANCY = {
    "ACCOUNT": "tests.docs_snippets.settings_examples.tenant_account",
    "ACCOUNT_DISPLAY": "tests.docs_snippets.settings_examples.tenant_name",
    "ACCOUNT_SEARCH": "tests.docs_snippets.settings_examples.accounts_named",
}
# docs:tenancy-end

# docs:middleware
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # ... your own ...
    "idempotency_django.middleware.IdempotencyMiddleware",  # last
]
# docs:middleware-end

# docs:prepared-statements
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "shop",
        "CONN_MAX_AGE": 60,  # or None: prepared statements live on the connection
        "OPTIONS": {"prepare_threshold": 5},
    }
}
# docs:prepared-statements-end


# docs:redis-store
REDIS_STORE = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "URL": "redis://redis.internal:6379/0",  # rediss:// for TLS, unix:// for a socket
        "KEY_PREFIX": "idem",  # keys are idem:{<sha256>}
        "SOCKET_TIMEOUT": 1.0,  # seconds; longer is an unknown outcome
        "CONNECT_TIMEOUT": 1.0,
    },
}
# docs:redis-store-end


# docs:redis-cluster
REDIS_CLUSTER = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "URL": "redis://redis-node-1:6379/0",  # any node: the client discovers the others
        "CLUSTER": True,
    },
}
# docs:redis-cluster-end

# docs:redis-sentinel
REDIS_SENTINEL = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        # Every Sentinel (any that answers names the master), the service they monitor,
        # and the master's database: the store always talks to the master they name.
        "URL": "redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/mymaster/0",
        "WAIT_REPLICAS": 1,  # a claim or an outcome no replica has is not trusted
    },
}
# docs:redis-sentinel-end

# docs:redis-sentinel-options
REDIS_SENTINEL_OPTIONS = {
    "STORE": "idempotency_django.store.redis.RedisStore",
    "STORE_OPTIONS": {
        "SENTINELS": [("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379)],
        "SERVICE_NAME": "mymaster",
        "SENTINEL_PASSWORD": None,  # the Sentinels' own requirepass, if they have one
        "URL": "rediss://:master-password@unused/0",  # TLS, password and db of the master
    },
}
# docs:redis-sentinel-options-end


# docs:tenant-host
SCOPED_BY_HOST = {
    # The host name, lower-cased, without its port, as Django validates it (ALLOWED_HOSTS).
    "TENANT": "idempotency_django.keys.request_host",
}
# docs:tenant-host-end

# docs:tenant-header
from idempotency_django.keys import tenant_header

SCOPED_BY_HEADER = {"TENANT": tenant_header("X-Org")}  # the header's value, or None


def schema_tenant(request):  # with django-tenants: the tenant its middleware found
    return request.tenant.schema_name


SCOPED_BY_SCHEMA = {"TENANT": "tests.docs_snippets.settings_examples.schema_tenant"}
# docs:tenant-header-end


# docs:principals
NAMESPACED = {
    # A principal that is not a user: "<app_label>.<model>:<pk>" (users keep their pk).
    "NAMESPACE_PRINCIPALS": True,
}
# docs:principals-end

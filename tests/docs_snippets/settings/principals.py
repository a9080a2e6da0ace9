IDEMPOTENCY = {
    # A principal that is not a user: "<app_label>.<model>:<pk>" (users keep their pk).
    "NAMESPACE_PRINCIPALS": True,
}

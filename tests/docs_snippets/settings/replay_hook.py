def mark_replay(response, stored):
    response["Cache-Control"] = "no-store"


# The function, or its dotted path in your code ("myapp.hooks.mark_replay"):
IDEMPOTENCY = {"REPLAY_HOOK": mark_replay}

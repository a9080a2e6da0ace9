def mark_replay(response, stored):
    response["Cache-Control"] = "no-store"


IDEMPOTENCY = {"REPLAY_HOOK": mark_replay}  # or its dotted path, "myapp.hooks.mark_replay"

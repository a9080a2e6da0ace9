"""The adapters: how each kind of entry point (a view decorator, DRF, django-ninja, the
middleware, tasks, Celery) hands a request or a task to the core, and the OpenAPI
description of what they answer.
"""

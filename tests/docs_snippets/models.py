"""The snippets' "your model": the test app's one-row-per-run model, under the name the
docs give it."""

from tests.models import SideEffect as Order

__all__ = ["Order"]

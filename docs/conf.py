"""Sphinx configuration: furo, and MyST so that the pages stay Markdown. Built in CI with
``sphinx-build -W -n --keep-going docs docs/_build`` (warnings are errors, nitpicky)."""

project = "idempotency_django"
author = "idempotency_django maintainers"
copyright = "idempotency_django maintainers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "idempotency_django"
myst_heading_anchors = 3  # links such as [x](transactions.md#atomic) resolve
myst_enable_extensions = ["colon_fence"]
# Plain-text blocks (benchmark runs, a crontab line) wrap instead of scrolling: their
# lines are records, not code to paste line by line, and a copy keeps the original lines.
html_static_path = ["_static"]
html_css_files = ["wrap-text.css"]

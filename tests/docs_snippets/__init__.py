"""The code the documentation shows. Each page includes these files
(``literalinclude``) rather than copying them, and ``tests/test_docs.py`` imports and
runs every one, so a snippet that stops working fails the suite. README.md's Python
blocks must appear, verbatim, in one of these files."""

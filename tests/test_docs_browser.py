"""The browser check of the built docs (``tools/docs_browser.py``) fails where a reader would
trip: a tiny Sphinx site with a table wider than its column, a code line that does not fit,
a broken link and a search that finds nothing is reported on each count, and the same site
without them passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import docs_browser

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (docs_browser.CHROMIUM.exists() and docs_browser.CHROMEDRIVER.exists()),
        reason="needs Debian's chromium and chromium-driver: apt-get install chromium "
        "chromium-driver",
    ),
]

CONF = 'project = "planted"\nextensions = ["myst_parser"]\nhtml_theme = "furo"\n'
WIDE_CELL = "`" + "x" * 60 + "`"


def build(tmp_path: Path, pages: dict[str, str]) -> Path:
    """Built by sphinx-build in its own process, as CI builds the docs (in this one, the
    suite's warnings-as-errors would stop on Sphinx's own deprecations)."""
    pytest.importorskip("selenium.webdriver", reason="selenium: pip install -e '.[test]'")
    for module in ("sphinx", "furo", "myst_parser"):
        pytest.importorskip(module, reason="builds a planted site: pip install -e '.[docs]'")
    source = tmp_path / "source"
    source.mkdir()
    (source / "conf.py").write_text(CONF)
    for name, text in pages.items():
        (source / name).write_text(text)
    out = tmp_path / "html"
    command = [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(source), str(out)]
    subprocess.run(command, check=True, timeout=120)
    return out


def fitting_site(tmp_path: Path) -> dict[str, str]:
    return {
        "index.md": "# Home\n\nAbout Redis.\n\n```{toctree}\nother\n```\n\n"
        "| a | b |\n|---|---|\n| one | two |\n\n[other](other.md)\n",
        "other.md": "# Other\n\n```sh\npython manage.py purge_idempotency_keys\n```\n",
    }


def test_a_site_that_fits_passes(tmp_path: Path) -> None:
    site = build(tmp_path, fitting_site(tmp_path))
    report = docs_browser.check_site(
        site, screenshots=tmp_path / "shots", search_terms=("Redis", "purge")
    )

    assert report.problems == []
    assert report.pages == ["genindex.html", "index.html", "other.html", "search.html"]
    assert report.search_hits == {"Redis": 1, "purge": 1}
    assert sorted(p.name for p in (tmp_path / "shots").iterdir()) == [
        "genindex.png",
        "index.png",
        "other.png",
        "search.png",
    ]


def test_a_wide_table_a_long_line_a_broken_link_and_an_empty_search_fail(
    tmp_path: Path,
) -> None:
    pages = fitting_site(tmp_path)
    pages["index.md"] += (
        "\n## Wide\n\n| a | b | c |\n|---|---|---|\n"
        f"| {WIDE_CELL} | {WIDE_CELL} | {WIDE_CELL} |\n\n"
        '<a href="missing.html">gone</a> <a href="other.html#nowhere">nowhere</a>\n'
    )
    pages["other.md"] += "\n```sh\necho " + "y" * 150 + "\n```\n"
    site = build(tmp_path, pages)

    report = docs_browser.check_site(site, search_terms=("Redis", "Celery"))

    problems = "\n".join(report.problems)
    assert "index.html: a table under 'Wide" in problems
    assert "other.html: a pre" in problems
    assert "index.html: broken link to missing.html" in problems
    assert "index.html: broken link to other.html#nowhere" in problems
    assert "search.html: nothing found for 'Celery'" in problems
    assert "'Redis'" not in problems
    assert len(report.problems) == 5, problems

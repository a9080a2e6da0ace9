"""The built documentation as a reader sees it: every page in headless Chromium.

``python -m tools.docs_browser BUILD_DIR`` serves a built HTML site (``sphinx-build -b html
docs BUILD_DIR``) on 127.0.0.1, loads every page at 1280 px (``--width``) and fails when:

- a page scrolls sideways;
- a table or code block is wider than its column (its scrollWidth, or that of a wrapper
  between it and the page's main column, against the wrapper's clientWidth): the reader
  would have to scroll inside it to read the end of a row or a line;
- an internal link (``<a href>``, ``<img src>``) names a file the site does not have, or an
  anchor its page does not have;
- the search page finds nothing for one of the ``--search`` terms (default: Redis, purge,
  Celery), as a newcomer would type them.

It keeps a full-page screenshot of each page (``--screenshots``, default
``build/docs-screenshots``) and prints that directory. A pixel measure catches what reading
the Markdown cannot: a theme's column, a long unbreakable word, a table of prose. Pages are
found from the build directory, so a new page is checked without a change here.

Needs Debian's ``chromium`` and ``chromium-driver`` and ``selenium`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SEARCH_TERMS = ("Redis", "purge", "Celery")
PAGE_HEIGHT = 900
SEARCH_SECONDS = 20.0
# Sub-pixel layout rounds either way: a pixel more is not a scrollbar a reader sees.
TOLERANCE_PX = 1
# A theme's box may reach a little into the margin beside the column (furo pads its table
# wrapper by 3 px for the shadow): that is the design, not a line cut off.
MARGIN_PX = 16

# Run in the page: every table and code block wider than the box that holds it, up to the
# main column. ``pre`` scrolls inside itself (and inside furo's ``.highlight``), a table
# inside its ``.table-wrapper``: any box on the way that scrolls means a reader scrolls.
OVERFLOWS_JS = """
const tolerance = arguments[0], margin = arguments[1];
const column = document.querySelector('article[role=main]') || document.body;
const found = [];
for (const element of document.querySelectorAll('table, pre')) {
  if (!column.contains(element) || element.closest('.search')) continue;
  let node = element, worst = 0, box = null;
  while (node && node !== column) {
    // Only a box that clips or scrolls hides the end of a line; a visible overflow is
    // caught below, against the column.
    const over = node.scrollWidth - node.clientWidth;
    if (getComputedStyle(node).overflowX !== 'visible' && over > worst) {
      worst = over; box = node;
    }
    node = node.parentElement;
  }
  const own = element.getBoundingClientRect(), edge = column.getBoundingClientRect();
  const wider = Math.max(own.right - edge.right, edge.left - own.left);
  if (wider > margin && wider > worst) { worst = wider; box = column; }
  if (worst > tolerance) {
    const heading = (() => {
      let n = element;
      while (n && n !== column) {
        let s = n.previousElementSibling;
        while (s) {
          if (/^H[1-6]$/.test(s.tagName)) return s.textContent.replace(/[¶#]/g, '').trim();
          const all = s.querySelectorAll ? s.querySelectorAll('h1,h2,h3,h4,h5,h6') : [];
          if (all.length) return all[all.length - 1].textContent.replace(/[¶#]/g, '').trim();
          s = s.previousElementSibling;
        }
        n = n.parentElement;
      }
      return '';
    })();
    found.push({
      tag: element.tagName.toLowerCase(),
      over: Math.round(worst),
      width: box.clientWidth,
      heading: heading,
      text: element.textContent.trim().slice(0, 60),
    });
  }
}
return found;
"""

PAGE_FACTS_JS = """
const root = document.documentElement;
return {
  sideways: Math.max(root.scrollWidth, document.body.scrollWidth) - root.clientWidth,
  height: Math.max(root.scrollHeight, document.body.scrollHeight),
  ids: Array.from(document.querySelectorAll('[id], a[name]'), e => e.id || e.name),
  links: Array.from(document.querySelectorAll('a[href], img[src]'), e => e.href || e.src),
};
"""

SEARCH_JS = """
const out = document.getElementById('search-results');
const title = out && out.querySelector('h2');
if (!title || title.textContent.indexOf('Search Results') !== 0) return null;
return {hits: out.querySelectorAll('ul.search li').length};
"""


@dataclass
class Report:
    """What the reader would trip over, page by page."""

    pages: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    search_hits: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """The checker reports what matters; a line per request would bury it."""


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """The site over HTTP, as a reader gets it (the search page fetches its index, which
    a ``file://`` page may not); yields the base URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """Debian's headless Chromium under Selenium, as the admin's browser tests drive it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def html_pages(site: Path) -> list[str]:
    """Every page of the site, relative to it: what a reader can reach, not the theme's
    assets or the sources Sphinx copies beside them."""
    return sorted(
        path.relative_to(site).as_posix()
        for path in site.rglob("*.html")
        if not path.relative_to(site).parts[0].startswith("_")
    )


def set_width(driver: Any, width: int, height: int = PAGE_HEIGHT) -> None:
    """The viewport itself, not the window around it: what CSS media queries see."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def screenshot(driver: Any, path: Path, width: int, height: int) -> None:
    """The whole page, not only its first screen."""
    import base64

    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def broken_links(
    site: Path, base: str, links: dict[str, list[str]], ids: dict[str, set[str]]
) -> list[str]:
    """Internal links to a missing file, or to an anchor their page does not have."""
    problems = []
    for page, targets in links.items():
        for target in sorted(set(targets)):
            if not target.startswith(base):
                continue  # another site, a mailto: the reader's browser's business
            url = urllib.parse.urlsplit(target)
            path = urllib.parse.unquote(url.path)
            relative = path.removeprefix(urllib.parse.urlsplit(base).path) or "index.html"
            if relative.endswith("/"):
                relative += "index.html"
            if not (site / relative).is_file():
                problems.append(f"{page}: broken link to {relative}")
            elif (
                url.fragment
                and relative in ids
                and urllib.parse.unquote(url.fragment) not in ids[relative]
            ):
                problems.append(f"{page}: broken link to {relative}#{url.fragment}")
    return problems


def search(driver: Any, base: str, term: str) -> int:
    """How many pages the site's own search lists for ``term``."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base + "search.html?" + urllib.parse.urlencode({"q": term}))
    finished = WebDriverWait(driver, SEARCH_SECONDS).until(lambda d: d.execute_script(SEARCH_JS))
    return int(finished["hits"])


def check_site(
    site: Path,
    *,
    width: int = 1280,
    screenshots: Path | None = None,
    search_terms: Sequence[str] = SEARCH_TERMS,
) -> Report:
    """Load every page of the built site at ``width`` px and report what does not fit,
    what does not resolve and what the search does not find."""
    site = site.resolve()
    report = Report(pages=html_pages(site))
    if not report.pages:
        report.problems.append(f"{site}: no HTML pages (build the docs first)")
        return report
    links: dict[str, list[str]] = {}
    ids: dict[str, set[str]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="docs-browser-") as profile,
        serve(site) as base,
        chromium(Path(profile)) as driver,
    ):
        set_width(driver, width)
        for page in report.pages:
            driver.get(base + page)
            facts = driver.execute_script(PAGE_FACTS_JS)
            ids[page] = set(facts["ids"])
            links[page] = facts["links"]
            if facts["sideways"] > TOLERANCE_PX:
                report.problems.append(
                    f"{page}: the page scrolls sideways by {facts['sideways']} px at {width} px"
                )
            for over in driver.execute_script(OVERFLOWS_JS, TOLERANCE_PX, MARGIN_PX):
                where = f" under '{over['heading']}'" if over["heading"] else ""
                report.problems.append(
                    f"{page}: a {over['tag']}{where} is {over['over']} px wider than its "
                    f"{over['width']} px column at {width} px ({over['text']!r}…)"
                )
            if screenshots is not None:
                shot = screenshots / Path(page).with_suffix(".png")
                screenshot(driver, shot, width, facts["height"])
        report.problems.extend(broken_links(site, base, links, ids))
        if search_terms and "search.html" not in report.pages:
            report.problems.append("search.html: no search page")
        elif search_terms:
            set_width(driver, width)
            for term in search_terms:
                report.search_hits[term] = hits = search(driver, base, term)
                if not hits:
                    report.problems.append(f"search.html: nothing found for {term!r}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docs_browser", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("site", type=Path, help="the built HTML (sphinx-build -b html docs DIR)")
    parser.add_argument("--width", type=int, default=1280, help="viewport width in px")
    parser.add_argument(
        "--screenshots",
        type=Path,
        default=Path("build/docs-screenshots"),
        help="where each page's full-page screenshot is written",
    )
    parser.add_argument(
        "--search",
        action="append",
        metavar="TERM",
        help="a word the search must find (repeatable; default: Redis, purge, Celery)",
    )
    args = parser.parse_args(argv)
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        print(f"needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver")
        return 2
    screenshots = args.screenshots.resolve() / str(args.width)
    report = check_site(
        args.site,
        width=args.width,
        screenshots=screenshots,
        search_terms=args.search or SEARCH_TERMS,
    )
    found = ", ".join(f"{term!r}: {hits}" for term, hits in report.search_hits.items())
    print(f"{len(report.pages)} pages at {args.width} px; search hits {found or 'not run'}")
    print(f"screenshots: {screenshots}")
    for problem in report.problems:
        print(f"FAIL {problem}")
    print("ok" if report.ok else f"{len(report.problems)} problems")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

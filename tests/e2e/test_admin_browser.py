"""The admin in a real headless browser: Debian's Chromium driven by Selenium, against the
example project under gunicorn on PostgreSQL or MariaDB.

An operator finds a key that a dead worker left stuck in progress, and releases it; the
client's next retry then runs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.server import (
    REPO_ROOT,
    Database,
    InFlightRequest,
    Server,
    example_env,
    new_amount,
    new_key,
    retry_until,
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
BROWSER_MISSING = not (CHROMIUM.exists() and CHROMEDRIVER.exists())

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        BROWSER_MISSING,
        reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
        "apt-get install chromium chromium-driver",
    ),
]

ADMIN = ("admin", "admin")
RECORDS = "/admin/idempotency_django/idempotencyrecord/"
WAIT_SECONDS = 30
REPLAYED = "Idempotent-Replayed"


@pytest.fixture(scope="module")
def admin_user(e2e_db: Database) -> tuple[str, str]:
    """A superuser of the example project, made the way an operator would make one."""
    username, password = ADMIN
    result = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "createsuperuser",
            "--noinput",
            "--username",
            username,
            "--email",
            f"{username}@example.com",
        ],
        cwd=REPO_ROOT,
        env=example_env(e2e_db.url, DJANGO_SUPERUSER_PASSWORD=password),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 or "already taken" in result.stderr, result.stderr
    return ADMIN


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')"
    )
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
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT_SECONDS)
    try:
        yield driver
    finally:
        driver.quit()


class AdminPage:
    """What the operator does in the admin, in the browser."""

    def __init__(self, driver: Any, server: Server) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions
        from selenium.webdriver.support.ui import Select, WebDriverWait

        self.driver = driver
        self.base_url = server.base_url
        self.by = By
        self.until = expected_conditions
        self.select = Select
        self.wait = WebDriverWait(driver, WAIT_SECONDS)

    def find(self, css: str) -> Any:
        return self.driver.find_element(self.by.CSS_SELECTOR, css)

    def find_all(self, css: str) -> list[Any]:
        return list(self.driver.find_elements(self.by.CSS_SELECTOR, css))

    def submit_and_wait(self, button: Any) -> None:
        """Click a submit button and wait for the page it loads."""
        page = self.find("body")
        button.click()
        self.wait.until(self.until.staleness_of(page))
        self.wait.until(
            lambda driver: driver.execute_script("return document.readyState") == "complete"
        )

    def log_in(self, username: str, password: str) -> None:
        self.driver.get(f"{self.base_url}/admin/login/?next={RECORDS}")
        self.find("#id_username").send_keys(username)
        self.find("#id_password").send_keys(password)
        self.submit_and_wait(self.find("input[type=submit]"))
        assert self.driver.current_url.endswith(RECORDS), self.driver.current_url
        assert "Select idempotency record" in self.driver.title, self.driver.page_source

    def search(self, text: str) -> list[str]:
        """Search the records; return the text of each row found."""
        self.driver.get(f"{self.base_url}{RECORDS}")
        box = self.find("#searchbar")
        box.send_keys(text)
        self.submit_and_wait(self.find("#changelist-search input[type=submit]"))
        return [row.text for row in self.find_all("#result_list tbody tr")]

    def run_action_on_all_rows(self, action: str) -> list[str]:
        """Tick every row shown, run ``action``; return the messages the admin answers with."""
        for checkbox in self.find_all("#result_list input.action-select"):
            checkbox.click()
        self.select(self.find("select[name=action]")).select_by_value(action)
        self.submit_and_wait(self.find("button[name=index]"))
        return self.messages()

    def messages(self) -> list[str]:
        """The messages the admin answered with (not its standing notice about bodies stored
        in clear, which tops every page of the records while no codec is set)."""
        return [
            m.text for m in self.find_all("ul.messagelist:not(.idempotency-bodies-in-clear) li")
        ]


def test_operator_releases_a_stuck_key_and_the_retry_runs(
    server: Server,
    start_example: Any,
    admin_user: tuple[str, str],
    browser: Any,
    key: str,
) -> None:
    body = {"amount": new_amount(), "currency": "EUR", "card": "tok_visa"}

    # A worker claims the key and dies in the middle of the charge. Its lease was an hour
    # (a long-running view's), so for an hour every retry would be refused.
    doomed = start_example(
        EXAMPLE_PROVIDER_DELAY_MS="60000",
        EXAMPLE_LEASE_SECONDS="3600",
        EXAMPLE_MAX_RUN_SECONDS="3600",
    )
    request = InFlightRequest(doomed, body, key=key).start()
    request.wait_sent()

    admin = AdminPage(browser, server)
    admin.log_in(*admin_user)
    # The operator searches for the key until the worker has claimed it.
    rows, _ = retry_until(
        lambda: admin.search(key), lambda found: len(found) == 1, within=WAIT_SECONDS, every=0.2
    )
    assert "in progress" in rows[0], rows
    doomed.kill_workers()
    request.wait_done()
    assert request.outcome is None  # the client never got an answer

    before = server.charge_count()
    refused = server.post_charge(body, key=key)
    assert refused.status_code == 409, refused.text
    assert refused.json()["type"] == "urn:idempotency-django:problem:in-flight"

    # "Release" refuses: the dead worker's lease is still live in the database.
    assert admin.search(key) == rows
    messages = admin.run_action_on_all_rows("release")
    assert len(messages) == 1
    assert messages[0].startswith("Skipped 1 record still running"), messages
    assert admin.search(key) == rows
    # The operator knows the worker is dead, and force-releases it after a confirmation.
    admin.run_action_on_all_rows("force_release")
    assert "live: the view may still be running" in admin.find("#force-release-records").text
    admin.submit_and_wait(admin.find("form input[type=submit]"))
    messages = admin.messages()
    assert messages == [
        "Force-released 1 record: the next retry with its key runs the view, even if the "
        "first attempt is still running."
    ]
    assert admin.search(key) == []

    # The client's next retry runs: one new charge, not a replay.
    retry = server.post_charge(body, key=key)
    assert retry.status_code == 201, retry.text
    assert REPLAYED not in retry.headers
    assert server.charge_count() == before + 1
    assert retry.json()["id"] in server.charge_ids()
    replay = server.post_charge(body, key=key)
    assert replay.headers.get(REPLAYED) == "true"
    assert replay.json()["id"] == retry.json()["id"]


OVERVIEW = f"{RECORDS}overview/"


def test_operator_opens_the_overview_and_follows_the_oldest_claim_in_flight(
    server: Server,
    start_example: Any,
    admin_user: tuple[str, str],
    browser: Any,
    key: str,
    tmp_path: Path,
) -> None:
    # Traffic: a few charges, and one whose worker is still in the provider's call.
    for _ in range(3):
        answered = server.post_charge(
            {"amount": new_amount(), "currency": "EUR", "card": "tok_visa"}, key=new_key()
        )
        assert answered.status_code == 201, answered.text
    slow = start_example(EXAMPLE_PROVIDER_DELAY_MS="60000")
    body = {"amount": new_amount(), "currency": "EUR", "card": "tok_visa"}
    request = InFlightRequest(slow, body, key=key).start()
    request.wait_sent()

    admin = AdminPage(browser, server)
    admin.log_in(*admin_user)
    # From the records' list, the operator opens the overview.
    admin.submit_and_wait(admin.find("a.idempotency-overview-link"))
    assert browser.current_url.endswith(OVERVIEW), browser.current_url

    def in_flight() -> str:
        browser.get(f"{server.base_url}{OVERVIEW}")
        return str(admin.find("#panel-in-flight").text)

    shown, _ = retry_until(in_flight, lambda text: key in text, within=WAIT_SECONDS, every=0.2)
    assert "Oldest: " in shown, shown
    busiest = admin.find("#busiest-endpoints").text
    assert "POST /charges/" in busiest, busiest
    assert admin.find("#panel-purge-lag").text
    assert admin.find("#panel-table-size").text.startswith("Table size (estimated)")
    browser.save_screenshot(str(tmp_path / "admin-overview.png"))  # for a failure's report

    # The oldest claim's link opens its record: in progress, under this key.
    admin.submit_and_wait(admin.find("#panel-in-flight .oldest a"))
    assert key in admin.find("#content").text
    assert "in progress" in admin.find("#content").text

    slow.kill_workers()
    request.wait_done()

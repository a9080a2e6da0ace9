"""Take the screenshot of the admin overview that the docs show (``docs/images/``).

Runs the example project under ``runserver`` with ``EXAMPLE_DEBUG=1`` (so that the admin's
CSS is served) against ``--database-url`` (the records of ``benchmarks/admin_scale.py``'s 10M
table, for a page with real figures), makes a superuser, logs in with Debian's headless
Chromium and saves the page::

    python -m tools.overview_screenshot \\
        --database-url postgres://root@127.0.0.1:5432/admin_pg --port 8000

A claim in flight is added first (a row in progress under a live lease), so that the panel
shows an oldest claim and its link; it is deleted afterwards.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tools.server import REPO_ROOT, database, example_env, query

OUTPUT = REPO_ROOT / "docs" / "images" / "admin-overview.png"
TABLE = "idempotency_django_idempotencyrecord"
KEY = "8f14e45f-ceea-467f-a0e6-screenshot01"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    db = database(args.database_url)
    env = example_env(db.url, EXAMPLE_DEBUG="1", DJANGO_SUPERUSER_PASSWORD="admin")
    subprocess.run(
        [sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "admin",
         "--email", "admin@example.com"],
        cwd=REPO_ROOT, env=env, capture_output=True, check=False,
    )  # fmt: skip
    now = "now()" if db.vendor == "postgresql" else "UTC_TIMESTAMP(6)"
    later = (
        "now() + interval '10 minutes'"
        if db.vendor == "postgresql"
        else "UTC_TIMESTAMP(6) + INTERVAL 10 MINUTE"
    )
    key_column = "key" if db.vendor == "postgresql" else "`key`"
    query(db, f"DELETE FROM {TABLE} WHERE {key_column} = '{KEY}'")
    query(
        db,
        f"INSERT INTO {TABLE} (account, endpoint, {key_column}, fingerprint, state, token, "
        "lease_expires_at, response_headers, created_at, expires_at) VALUES ('42', "
        f"'POST /api/v1/charges/', '{KEY}', 'v1:0', 'in_progress', 'screenshot', {later}, "
        f"'[]', {now} - {'interval ' if db.vendor == 'postgresql' else 'INTERVAL '}"
        f"{chr(39) + '95 seconds' + chr(39) if db.vendor == 'postgresql' else '95 SECOND'}, "
        f"{later})",
    )
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{args.port}"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{args.port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{base}/admin/login/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        shoot(base, args.output)
    finally:
        server.terminate()
        server.wait(30)
        query(db, f"DELETE FROM {TABLE} WHERE {key_column} = '{KEY}'")
    print(args.output)
    return 0


def shoot(base: str, output: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        overview = "/admin/idempotency_django/idempotencyrecord/overview/"
        driver.get(f"{base}/admin/login/?next={overview}")
        driver.find_element(By.ID, "id_username").send_keys("admin")
        driver.find_element(By.ID, "id_password").send_keys("admin")
        driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        for _ in range(600):
            if driver.current_url.endswith(overview) and driver.find_elements(
                By.ID, "busiest-endpoints"
            ):
                break
            time.sleep(0.1)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1280, max(800, int(height)))
        output.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(output))
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())

"""A PgBouncer of our own, in transaction-pooling mode, in front of the test PostgreSQL.

``start_pgbouncer(database)`` writes a configuration into a directory of its own (every
database of the server, ``auth_type = trust``, a pool of ``pool_size`` server connections
per database and user), starts ``pgbouncer`` on a free port and waits until it answers;
``PgBouncer.url(database)`` is the ``DATABASE_URL`` that goes through it. Debian's package
(``apt-get install pgbouncer``; 1.18 on bookworm) is enough: ``.ci/run`` installs it.
PgBouncer refuses to run as root, so under root it is started with ``-u`` (the owner of
``/usr/sbin/pgbouncer``'s configuration, ``postgres``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tools.server import Database, free_port

READY_WITHIN_SECONDS = 15.0


def pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )


def pgbouncer_version(binary: str) -> str:
    """``1.18.0``, from ``pgbouncer --version``'s first line."""
    output = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    return output.split()[1]


@dataclass
class PgBouncer:
    process: subprocess.Popen[bytes]
    port: int
    version: str
    directory: Path
    _log_file: Any = field(repr=False)

    @property
    def log_path(self) -> Path:
        return self.directory / "pgbouncer.log"

    def url(self, database: Database) -> str:
        """``database``'s URL, through this PgBouncer."""
        parts = urlsplit(database.url)
        user = parts.username or "root"
        return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{self.port}"))

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: immediate shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log_file.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_pgbouncer(database: Database, *, pool_size: int = 2) -> PgBouncer:
    """PgBouncer in transaction mode on a free port, in front of ``database``'s server."""
    binary = pgbouncer_binary()
    if binary is None:
        raise FileNotFoundError("pgbouncer is not installed (apt-get install pgbouncer)")
    host = database.config.get("HOST") or "127.0.0.1"
    port = database.config.get("PORT") or 5432
    user = database.config.get("USER") or "root"
    listen = free_port()
    # Not under pytest's temporary directory: its parents are closed to other users.
    directory = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    (directory / "userlist.txt").write_text(f'"{user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={host} port={port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {listen}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {directory / 'userlist.txt'}",
                "pool_mode = transaction",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 500",
                # Django and psycopg send none of these, but a client may.
                "ignore_startup_parameters = extra_float_digits,options",
                "",
            ]
        )
    )
    command = [binary, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:  # "PgBouncer should not run as root"
        owner = pwd.getpwnam("postgres")
        for path in (directory, *directory.iterdir()):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        command[1:1] = ["-u", "postgres"]
    log_file = (directory / "pgbouncer.log").open("wb")
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    bouncer = PgBouncer(process, listen, pgbouncer_version(binary), directory, log_file)
    try:
        _wait_ready(bouncer, database)
    except BaseException:
        bouncer.stop()
        raise
    return bouncer


def _wait_ready(bouncer: PgBouncer, database: Database) -> None:
    import psycopg

    deadline = time.monotonic() + READY_WITHIN_SECONDS
    while True:
        if bouncer.process.poll() is not None:
            raise AssertionError(
                f"pgbouncer exited ({bouncer.process.returncode}):\n{bouncer.log()}"
            )
        with (
            contextlib.suppress(psycopg.OperationalError),
            psycopg.connect(bouncer.url(database), connect_timeout=2) as connection,
        ):
            connection.execute("SELECT 1")
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"pgbouncer not ready within {READY_WITHIN_SECONDS}s:\n{bouncer.log()}"
            )
        time.sleep(0.1)  # polling the port is the readiness check

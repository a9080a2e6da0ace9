"""One campaign run: the store topology, the example under gunicorn, the clients, the
nemesis, the checker. ``python -m tools.campaign --help`` (``__main__``) drives it.

Two gunicorn masters (``--workers`` sync workers each, ports 8440 and 8441) serve the
example project with the campaign settings (``tools.campaign.settings``); the clients spread
their attempts over both. The second runs under libfaketime when ``skew`` is among the
faults. Everything a run writes is in its directory (``--out``, else a temporary one):
``history.jsonl``, ``ledger/ledger.jsonl`` (the provider's), ``server-<pid>.jsonl``,
``charges.json`` (the accounts' charges after the run), ``run.json``, the servers' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from tools.campaign import checker, faults, network, stores, topology
from tools.campaign.clients import USERS, Clients
from tools.campaign.history import History
from tools.server import (
    REPO_ROOT,
    Database,
    Server,
    create_database,
    database,
    drop_database,
    manage,
    project_env,
    query,
)

SETTINGS = "tools.campaign.settings"
HTTP_PORTS = (8440, 8441)
APP_DATABASE = os.environ.get(
    "CAMPAIGN_APP_DATABASE_URL", "postgres://root@127.0.0.1:5432/camp_app"
)
DEFAULT_FAULTS = {
    "postgres": "kill,pause,pause-short,skew,stall,terminate",
    "mariadb": "kill,pause,pause-short,skew,stall,terminate",
    "redis": "kill,pause,pause-short,skew,stall,sleep,terminate,restart",
    "cluster": "kill,pause,stall,failover",
    "sentinel": "kill,pause,failover",
    "patroni": "kill,pause,kill-primary",
}


def log(text: str) -> None:
    print(f"[campaign {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def make_topology(args: argparse.Namespace) -> topology.Topology:
    store = args.store
    if store == "database":
        store = args.database
    if store in ("postgres", "mariadb"):
        return stores.DatabaseTopology(store, args.database_url, own_server=args.own_server)
    if store == "redis":
        return stores.RedisTopology()
    if store == "cluster":
        return stores.ClusterTopology(wait_replicas=args.wait_replicas)
    if store == "sentinel":
        return topology.ha_topology("sentinel")
    if store == "patroni":
        return topology.ha_topology("patroni", sync=args.sync)
    raise SystemExit(f"unknown --store {args.store}")


class AppServer(Server):
    """A gunicorn master on ``host`` (the app's namespace under ``--network``)."""

    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def spawn(
    env: dict[str, str],
    port: int,
    workers: int,
    log_path: Path,
    net: network.Network | None = None,
) -> AppServer:
    log_file = log_path.open("wb")
    host = network.APP_IP if net is not None else "127.0.0.1"
    argv = [
        sys.executable, "-m", "gunicorn", "example_project.wsgi:application",
        "-w", str(workers), "-k", "sync", "-b", f"{host}:{port}",
        "--no-control-socket", "--timeout", "120",
    ]  # fmt: skip
    process = subprocess.Popen(
        net.command(argv) if net is not None else argv,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    server = AppServer(process=process, port=port, log_path=log_path, _log_file=log_file)
    server.host = host
    return server


def _migrations_digest() -> str:
    import django

    hasher = hashlib.sha256(repr(django.VERSION).encode())
    for path in sorted(REPO_ROOT.glob("*/**/migrations/*.py")):
        if "tests" not in path.parts:
            hasher.update(path.read_bytes())
    return hasher.hexdigest()[:10]


def prepare_database(db: Database, env: dict[str, str]) -> None:
    """The example's schema and demo users in ``db`` (created anew). PostgreSQL: copied
    from a migrated template database named after the migrations' digest, made once
    (``CREATE DATABASE … TEMPLATE``: a second instead of a dozen for ``migrate``). The
    template stays, as a cache: drop the ``camp_tpl_*`` databases to remove it."""
    if db.vendor != "postgresql":
        create_database(db)
        manage(env, "migrate", "--noinput", "-v", "0")
        return
    template = db.renamed(f"camp_tpl_{_migrations_digest()}")
    exists = query(
        template.renamed("postgres"),
        "SELECT 1 FROM pg_database WHERE datname = %s",
        [template.name],
    )
    if not exists:
        create_database(template)
        manage({**env, "DATABASE_URL": template.url}, "migrate", "--noinput", "-v", "0")
    drop_database(db)
    query(template.renamed("postgres"), f'CREATE DATABASE "{db.name}" TEMPLATE "{template.name}"')


def _charges(server: AppServer) -> dict[str, list[dict[str, Any]]]:
    return {
        user: requests.get(f"{server.base_url}/charges/", auth=(user, password), timeout=60).json()[
            "results"
        ]
        for user, password in USERS.items()
    }


def run(args: argparse.Namespace) -> checker.Result:
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    fault_list = faults.parse(
        args.faults
        if args.faults is not None
        else DEFAULT_FAULTS.get(
            args.database if args.store == "database" else args.store, "kill,pause"
        )
    )
    directory = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="camp-run-"))
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "ledger").mkdir(parents=True)
    history = History(directory / "history.jsonl")
    store = make_topology(args)
    servers: list[AppServer] = []
    net = network.Network(directory) if args.network else None
    net_env: dict[str, str] = {}
    app_db = None
    started = time.time()
    try:
        log(f"{store.name}: starting the store")
        store.start()
        offered = store.faults | faults.APP_FAULTS | (network.FAULTS if net else frozenset())
        missing = [f for f in fault_list if f not in offered]
        if missing:
            raise SystemExit(f"--store {store.name} cannot inject {', '.join(missing)}")
        env_store = dict(store.env)
        if "DATABASE_URL" not in env_store:
            app_db = database(APP_DATABASE)
            env_store["DATABASE_URL"] = app_db.url
        overrides = {
            "EXAMPLE_LEASE_SECONDS": str(args.lease),
            "EXAMPLE_MAX_RUN_SECONDS": str(args.max_run),
            "EXAMPLE_PROVIDER_DELAY_MS": str(args.provider_delay_ms),
            "EXAMPLE_PROVIDER_REPLY_MS": str(args.provider_reply_ms),
            "EXAMPLE_PROVIDER_LEDGER": str(directory / "ledger"),
            "EXAMPLE_PROVIDER_DEDUPLICATE": "1" if args.deduplicate else "0",
            "EXAMPLE_CONN_MAX_AGE": "60",
            "CAMPAIGN_DIR": str(directory),
            "CAMPAIGN_DEFECT": args.defect or "",
            **{k: v for k, v in env_store.items() if k != "DATABASE_URL"},
        }
        env = project_env(SETTINGS, env_store["DATABASE_URL"], pythonpath=[REPO_ROOT], **overrides)
        log("migrating")
        if isinstance(store, stores.DatabaseTopology) or app_db is not None:
            prepare_database(database(env_store["DATABASE_URL"]), env)
        else:  # a topology's own database (Patroni's): created by it, on its servers
            manage(env, "migrate", "--noinput", "-v", "0")
        if net is not None:
            if isinstance(store, stores.ClusterTopology):
                raise SystemExit("--network: a cluster's nodes announce 127.0.0.1 addresses")
            net.start()
            net_env = {"DATABASE_URL": net.route(env["DATABASE_URL"], store=app_db is None)}
            if "EXAMPLE_REDIS_URL" in env:
                net_env["EXAMPLE_REDIS_URL"] = net.route(env["EXAMPLE_REDIS_URL"], store=True)
            net.start_relay()
        skewed = "skew" in fault_list
        for index, port in enumerate(HTTP_PORTS):
            server_env = dict(env)
            if index == 1 and skewed:
                server_env.update(faults.faketime_env())
            log_path = directory / f"gunicorn-{port}.log"
            if index == 1 and net is not None:
                # Only the second server is behind the faulty network: the first still
                # reaches the store, and takes over what the second cannot finish.
                server_env.update(net_env)
                servers.append(spawn(server_env, port, args.workers, log_path, net))
            else:
                servers.append(spawn(server_env, port, args.workers, log_path))
        for server in servers:
            server.wait_ready(within=60)
        log(
            f"serving on {HTTP_PORTS}; {args.seconds} s of traffic, "
            f"faults {faults.describe(fault_list)}, seed {seed}"
        )

        traffic_start = time.time()
        now = time.monotonic()
        traffic_end = now + args.seconds
        longest = 1.5 * args.lease + 1.0 + 30.0  # a pause, or a failover's wait
        drain_end = traffic_end + longest + args.lease + args.max_run + 10
        nemesis = faults.Nemesis(
            fault_list,
            history,
            workers=lambda: [pid for s in servers for pid in s.worker_pids()],
            ledger=directory / "ledger" / "ledger.jsonl",
            lease=args.lease,
            seed=seed,
            inject_store=store.inject,
            inject_network=net.inject if net is not None else None,
            skewed=skewed,
            skew_workers=lambda: servers[1].worker_pids(),
        )
        clients = Clients(
            [(server.host, server.port) for server in servers],
            history,
            run_id=f"{seed:x}-{int(traffic_start) % 100000}",
            seed=seed,
            lease=args.lease,
            traffic_end=traffic_end,
            drain_end=drain_end,
            timeout=args.client_timeout or args.lease + 1.0,
        )
        injector = threading.Thread(target=nemesis.run, args=(traffic_end,), name="nemesis")
        if fault_list:
            injector.start()
        clients.run(args.clients)
        nemesis.stopping.set()
        if injector.is_alive():
            injector.join()
        log(f"{len(clients.keys)} keys; final replays")
        clients.final_replays()
        (directory / "charges.json").write_text(json.dumps(_charges(servers[0])))
        run_info = {
            "store": store.name
            + (f" ({args.defect})" if args.defect else "")
            + (" +dedup" if args.deduplicate else ""),
            "faults": fault_list,
            "seed": seed,
            "lease": args.lease,
            "max_run": args.max_run,
            "deduplicate": args.deduplicate,
            "network": bool(args.network),
            # Wall-clock offsets of the app servers (libfaketime), by port: the times their
            # processes wrote in the ledger and the request log are corrected by them.
            "skew": {str(HTTP_PORTS[1]): faults.SKEW_SECONDS} if skewed else {},
            "traffic_start": traffic_start,
            "seconds": time.time() - started,
            "command": " ".join(["python -m tools.campaign", *sys.argv[1:]]),
            "nemesis_errors": nemesis.errors,
            "client_crashes": clients.crashes,
        }
        (directory / "run.json").write_text(json.dumps(run_info, indent=1))
    finally:
        history.close()
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
        if net is not None:
            with contextlib.suppress(Exception):
                net.stop()
        with contextlib.suppress(Exception):
            store.stop()
        if app_db is not None:
            with contextlib.suppress(Exception):
                drop_database(app_db)
    result = checker.check(directory)
    for error in run_info["nemesis_errors"] + run_info["client_crashes"]:
        result.violations.append(f"campaign error: {error}")
    result.run["directory"] = str(directory)
    return result

"""The network between the app servers and their store, made faulty on purpose.

``--network`` runs the second app server in a network namespace of its own (``camp-app``;
the first stays here and reaches the store directly, so it can take over what the second
cannot finish),
joined to this one by a veth pair (``camp-h`` here, ``camp-a`` there) on link-local
addresses that never leave the machine (169.254.40.1 and .2/30). The stores keep listening
on 127.0.0.1: a small TCP relay (``python -m tools.campaign.network relay``, started
here) listens on 169.254.40.1 for each and forwards to it, so every byte between the app
and its store crosses the veth pair. Faults:

- ``partition`` (shorter than the lease) and ``partition-long`` (1.5 x the lease + 1 s):
  ``iptables -j DROP`` in the app's namespace for the store's relayed ports: packets
  vanish, connections hang until their timeouts, as in a real partition;
- ``delay``: every chunk relayed is held 300 ms (+-100 ms). ``tc netem`` would be the tool,
  but the kernel here has no ``sch_netem`` ("Specified qdisc kind is unknown"), so the
  relay delays instead.

Everything is removed at the end (``Network.stop``: the namespace, the veth pair, the
relay), and at the start if a previous run left it behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

NAMESPACE = "camp-app"
HOST_IF, APP_IF = "camp-h", "camp-a"
HOST_IP, APP_IP = "169.254.40.1", "169.254.40.2"
RELAY_PORTS = (8452, 8453, 8454, 8455)
FAULTS = frozenset({"partition", "partition-long", "delay"})
DELAY_SECONDS = (0.2, 0.4)


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=30)


class Network:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.delay_file = directory / "relay-delay"
        self.relay: subprocess.Popen[bytes] | None = None
        self.routes: dict[str, tuple[int, int]] = {}  # url -> (relay port, target port)
        self.store_ports: list[int] = []

    def start(self) -> None:
        self.stop()
        _ip("netns", "add", NAMESPACE)
        _ip("link", "add", HOST_IF, "type", "veth", "peer", "name", APP_IF)
        _ip("link", "set", APP_IF, "netns", NAMESPACE)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        _ip("link", "set", HOST_IF, "up")
        _ip("netns", "exec", NAMESPACE, "ip", "addr", "add", f"{APP_IP}/30", "dev", APP_IF)
        _ip("netns", "exec", NAMESPACE, "ip", "link", "set", APP_IF, "up")
        _ip("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up")

    def route(self, url: str, *, store: bool) -> str:
        """``url`` (a database or Redis URL on 127.0.0.1) as the app in the namespace
        reaches it: through a relay port on ``HOST_IP``. ``store``: partitions cut it."""
        parts = urlsplit(url)
        target = parts.port or {"postgres": 5432, "mysql": 3306}.get(parts.scheme, 6379)
        relay = RELAY_PORTS[len(self.routes)]
        self.routes[url] = (relay, target)
        if store:
            self.store_ports.append(relay)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@{HOST_IP}:{relay}" if auth else f"{HOST_IP}:{relay}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start_relay(self) -> None:
        self.delay_file.write_text("0")
        pairs = [f"{relay}={target}" for relay, target in self.routes.values()]
        self.relay = subprocess.Popen(
            [sys.executable, "-m", "tools.campaign.network", "relay",
             "--delay-file", str(self.delay_file), *pairs],
            cwd=Path(__file__).resolve().parents[2],
            stdout=(self.directory / "relay.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        time.sleep(0.5)  # the relay binds its ports at once; a failed bind exits it
        if self.relay.poll() is not None:
            raise RuntimeError(f"the relay exited: {(self.directory / 'relay.log').read_text()}")

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", NAMESPACE, *argv]

    def inject(self, fault: str, seconds: float) -> str:
        if fault in ("partition", "partition-long"):
            rules = [
                ["-p", "tcp", "-d", HOST_IP, "--dport", str(port), "-j", "DROP"]
                for port in self.store_ports
            ]
            for rule in rules:
                _ip("netns", "exec", NAMESPACE, "iptables", "-A", "OUTPUT", *rule)
            try:
                time.sleep(seconds)  # the partition's length is the fault
            finally:
                for rule in rules:
                    _ip("netns", "exec", NAMESPACE, "iptables", "-D", "OUTPUT", *rule)
            return f"iptables DROP app -> store ports {self.store_ports} for {seconds:.1f} s"
        if fault == "delay":
            self.delay_file.write_text("1")
            try:
                time.sleep(seconds)
            finally:
                self.delay_file.write_text("0")
            low, high = (round(bound * 1000) for bound in DELAY_SECONDS)
            return f"relay delays every chunk {low}-{high} ms for {seconds:.1f} s"
        raise ValueError(f"no network fault {fault!r}")

    def stop(self) -> None:
        if self.relay is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.relay.pid, 9)
            self.relay.wait(10)
            self.relay = None
        _ip("netns", "del", NAMESPACE, check=False)
        _ip("link", "del", HOST_IF, check=False)


# --- the relay ---------------------------------------------------------------------------


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: list[bool]
) -> None:
    try:
        while data := await reader.read(65536):
            if delayed[0]:
                await asyncio.sleep(random.uniform(*DELAY_SECONDS))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _relay(pairs: list[tuple[int, int]], delay_file: Path) -> None:
    delayed = [False]

    def handler(target: int):  # type: ignore[no-untyped-def]
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
            except OSError:
                writer.close()
                return
            await asyncio.gather(
                _pipe(reader, up_writer, delayed), _pipe(up_reader, writer, delayed)
            )

        return handle

    for listen, target in pairs:
        await asyncio.start_server(handler(target), HOST_IP, listen)
    while True:
        with contextlib.suppress(OSError):
            delayed[0] = delay_file.read_text().strip() == "1"
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.campaign.network")
    commands = parser.add_subparsers(dest="command", required=True)
    relay = commands.add_parser("relay", help="relay HOST_IP:LISTEN to 127.0.0.1:TARGET")
    relay.add_argument("--delay-file", type=Path, required=True)
    relay.add_argument("pairs", nargs="+", help="LISTEN=TARGET")
    commands.add_parser("clean", help="remove a namespace and veth pair left behind")
    args = parser.parse_args(argv)
    if args.command == "clean":
        Network(Path(".")).stop()
        return 0
    pairs = [tuple(int(p) for p in pair.split("=")) for pair in args.pairs]
    asyncio.run(_relay(pairs, args.delay_file))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())

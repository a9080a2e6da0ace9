#!/usr/bin/env python
"""What ``WAIT_REPLICAS`` costs a claim on the local Redis Cluster.

    python -m tools.redis_cluster start
    python -m benchmarks.redis_wait --rounds 7 --claims 2000

Interleaved rounds of: a claim as the store sends it without the option (one ``SET NX PX``
through the cluster client), and with it (``SET NX PX`` then ``WAIT 1 timeout`` on the
node's connection, one round trip: ``store/redis_cluster.write_and_wait``), and that path
with ``WAIT 0`` (answered at once), which tells the path's cost from the replica's ack. Prints each
round's microseconds per claim and the median ratio; no assertion (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import django
from redis.cluster import RedisCluster

# The store package imports the models: any settings will do for this module.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
django.setup()

from idempotency_django.store.redis_cluster import connect, write_and_wait  # noqa: E402
from tools import redis_cluster  # noqa: E402


def plain(client: RedisCluster, keys: list[str]) -> float:
    started = time.perf_counter()
    for key in keys:
        client.set(key, "token", nx=True, px=60_000)
    return (time.perf_counter() - started) / len(keys) * 1e6


def waited(client: RedisCluster, keys: list[str], replicas: int = 1) -> float:
    started = time.perf_counter()
    for key in keys:
        write_and_wait(client, key, ["SET", key, "token", "NX", "PX", 60_000], replicas, 1000)
    return (time.perf_counter() - started) / len(keys) * 1e6


def piped(client: RedisCluster, keys: list[str]) -> float:
    """The same pipeline with ``WAIT 0`` (answered at once): the path's own cost."""
    return waited(client, keys, replicas=0)


NAMES = ("SET NX PX", "SET NX PX + WAIT 0", "SET NX PX + WAIT 1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--claims", type=int, default=2000)
    args = parser.parse_args(argv)
    if not redis_cluster.healthy():
        print("no healthy Redis Cluster: python -m tools.redis_cluster start")
        return 2
    client = connect(redis_cluster.cluster_url(), cluster=True)
    assert isinstance(client, RedisCluster)
    run = uuid.uuid4().hex[:8]
    results: dict[str, list[float]] = {name: [] for name in NAMES}
    for number in range(args.rounds):
        keys = [f"bench:{{{run}-{number}-{i}}}" for i in range(args.claims)]
        # Alternate which goes first, so that neither always meets a warmer machine.
        order = list(zip(NAMES, (plain, piped, waited), strict=True))
        for name, measure in order if number % 2 == 0 else order[::-1]:
            results[name].append(measure(client, [f"{measure.__name__}{key}" for key in keys]))
    for name, values in results.items():
        listing = " ".join(f"{value:.0f}" for value in values)
        print(f"{name:20} median {statistics.median(values):6.0f} us/claim  ({listing})")
    base = statistics.median(results[NAMES[0]])
    for name in NAMES[1:]:
        ratio = statistics.median(results[name]) / base
        print(f"{name}: {ratio:.2f}x a plain claim (median of {args.rounds} interleaved rounds)")
    for node in redis_cluster.masters():
        with redis_cluster.client(node.port) as connection:
            for key in connection.scan_iter(match="*bench:*", count=1000):
                connection.delete(key)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

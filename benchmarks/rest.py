"""A swarm at rest against bare hivemind DHT nodes: CPU and DHT operations of idle peers, from /proc, in one run.

A coordinator and the stage servers of `peer demo`'s spec (peer/cli/demo.toml: 2 stages x 2 servers) join
and serve, with no trainer; beside them run as many bare hivemind `DHT` nodes (benchmarks/bare_dht.py:
hivemind's own class, nothing of ours), bootstrapped from one another. Once every peer serves and a settling
time has passed, over one window: each peer's CPU, all its processes together (the peer itself, hivemind's DHT
process, its p2p daemon) and each of them apart, read from /proc; and the DHT operations each peer made
(`swarm_dht_operations_total` of its metrics endpoint, by operation and kind of key). Goal (issue 48): a peer at rest
<= 0.005 of one core (five times a bare node) and <= 0.2 DHT operations a second.

    python benchmarks/rest.py [--window S] [--settle S] [--quick]

Last line: `cores_per_peer` (mean over the swarm's peers), `cores_max` (the busiest peer), `cores_per_bare`,
`over_bare` (cores_per_peer / cores_per_bare), `dht_ops_per_s` (mean per peer), `dht_ops_max`, and per role and
kind of process (`cores_server_peer`, `cores_server_reaper`, `cores_server_dht`, `cores_server_p2pd`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cputime import process_times  # noqa: E402
from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, Processes, loopback_coordinator, loopback_join  # noqa: E402

DEMO_SPEC = Path(__file__).resolve().parent.parent / "peer" / "cli" / "demo.toml"
SERVERS = [f"server{stage}{replica}" for stage in range(2) for replica in "ab"]
METRICS = re.compile(r"Prometheus metrics at (http://\S+/metrics)\.")
BARE = re.compile(r"Bare DHT node at (\S+)")
DHT_OPS = re.compile(r'^swarm_dht_operations_total\{kind="([^"]+)",operation="(\w+)"\} (\S+)$', re.MULTILINE)
START_TIMEOUT = 180.0  # s for the swarm to serve


def dht_operations(url: str) -> dict[str, float]:
    """The DHT operations a peer made so far, from its metrics endpoint: {"operation kind": count}."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return {f"{op} {kind}": float(v) for kind, op, v in DHT_OPS.findall(response.read().decode())}


def start(procs: Processes, work: Path) -> dict[str, str]:
    """The coordinator and the servers, serving; {peer name: its metrics URL}."""
    shutil.copy(DEMO_SPEC, work / "run.toml")
    info = work / "coordinator.json"
    procs.start("coordinator", loopback_coordinator("run.toml", str(info)))
    Processes.wait_until(info.exists, 60, "the coordinator's start")
    maddr = json.loads(info.read_text())["join"].split()[-1]
    for name in SERVERS:
        procs.start(name, loopback_join(maddr, name, "--stage", name[6]))
    Processes.wait_until(lambda: all(SERVING.search(procs.log(n)) for n in SERVERS), START_TIMEOUT, "the servers")
    urls = {}
    for name in ["coordinator", *SERVERS]:
        Processes.wait_until(lambda n=name: METRICS.search(procs.log(n)), 30, f"{name}'s metrics endpoint")
        urls[name] = METRICS.search(procs.log(name)).group(1)
    return urls


def start_bare(procs: Processes, count: int) -> list[str]:
    """`count` bare hivemind DHT nodes, each bootstrapped from the first; their names."""
    script = [sys.executable, str(Path(__file__).resolve().parent / "bare_dht.py")]
    names, first = [], []
    for i in range(count):
        name = f"bare{i}"
        procs.start(name, first, command=script)
        Processes.wait_until(lambda n=name: BARE.search(procs.log(n)), 60, f"bare DHT node {i}")
        if not first:
            first = [BARE.search(procs.log(name)).group(1)]
        names.append(name)
    return names


def measure(procs: Processes, names: list[str], urls: dict[str, str], window: float) -> tuple[dict, dict]:
    """Over `window` seconds: {name: {kind: cores}} and {name: {"operation kind": DHT operations a second}} (peers
    with metrics)."""
    roots = {name: procs.procs[name][0].pid for name in names}
    before = {name: process_times(pid) for name, pid in roots.items()}
    ops_before = {name: dht_operations(url) for name, url in urls.items()}
    started = time.monotonic()
    time.sleep(window)  # the measured window itself: nothing to poll for
    elapsed = time.monotonic() - started
    ops = {}
    for name, url in urls.items():
        after = dht_operations(url)
        ops[name] = {k: (v - ops_before[name].get(k, 0.0)) / elapsed for k, v in after.items()}
    cores = {}
    for name, pid in roots.items():
        after, by_kind = process_times(pid), {}
        for p, (kind, seconds) in after.items():
            spent = seconds - before[name].get(p, (kind, 0.0))[1]
            by_kind[kind] = by_kind.get(kind, 0.0) + spent / elapsed
        cores[name] = by_kind
    return cores, ops


def report(cores: dict, ops: dict, bare: list[str], figures: Figures) -> None:
    peers = [n for n in cores if n not in bare]
    print(f"{'process':>12} {'cores':>8} {'peer':>8} {'reaper':>8} {'dht':>8} {'p2pd':>8} {'DHT ops/s':>10}")
    for name in [*peers, *bare]:
        kinds = cores[name]
        rate = f"{sum(ops[name].values()):10.2f}" if name in ops else f"{'-':>10}"
        print(
            f"{name:>12} {sum(kinds.values()):8.4f} {kinds.get('peer', 0):8.4f} {kinds.get('reaper', 0):8.4f} "
            f"{kinds.get('dht', 0):8.4f} "
            f"{kinds.get('p2pd', 0):8.4f} {rate}"
        )
    per_peer = [sum(cores[n].values()) for n in peers]
    per_bare = statistics.mean(sum(cores[n].values()) for n in bare)
    figures["cores_per_peer"] = statistics.mean(per_peer)
    figures["cores_max"] = max(per_peer)
    figures["cores_per_bare"] = per_bare
    figures["over_bare"] = statistics.mean(per_peer) / max(per_bare, 1e-4)  # a bare node's floor: 0.0001 core
    totals = {name: sum(rates.values()) for name, rates in ops.items()}
    figures["dht_ops_per_s"] = statistics.mean(totals.values())
    figures["dht_ops_max"] = max(totals.values())
    for role, members in (("coordinator", ["coordinator"]), ("server", SERVERS)):
        kinds = sorted({k for n in members for k in ops[n]})
        spent = {k: statistics.mean(ops[n].get(k, 0.0) for n in members) for k in kinds}
        print(f"DHT ops/s of a {role}, by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in spent.items() if v > 0))
    for role, members in (("coordinator", ["coordinator"]), ("server", SERVERS)):
        for kind in ("peer", "reaper", "dht", "p2pd"):
            figures[f"cores_{role}_{kind}"] = statistics.mean(cores[n].get(kind, 0.0) for n in members)
    print(
        f"a peer at rest: {figures['cores_per_peer']:.4f} of a core (goal <= 0.005), "
        f"{figures['over_bare']:.1f}x a bare hivemind node; {figures['dht_ops_per_s']:.2f} DHT operations a second "
        "(goal <= 0.2)",
        flush=True,
    )


def body(args: argparse.Namespace, figures: Figures) -> None:
    window = args.window or (15.0 if args.quick else 60.0)
    settle = args.settle if args.settle is not None else (5.0 if args.quick else 20.0)
    with workdir(args.workdir, "swarmtrain-rest-") as work:
        procs = Processes(work)
        try:
            urls = start(procs, work)
            bare = start_bare(procs, len(urls))
            time.sleep(settle)  # the swarm's first announcements and rounds of reads pass: at rest from here
            cores, ops = measure(procs, [*urls, *bare], urls, window)
            report(cores, ops, bare, figures)
        finally:
            procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=0.0, help="s measured (default 60; quick 15)")
    parser.add_argument("--settle", type=float, default=None, help="s after every peer serves (default 20; quick 5)")
    add_quick(parser, "a 15 s window after 5 s of settling")
    add_workdir(parser)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(parser, body)


if __name__ == "__main__":
    main()

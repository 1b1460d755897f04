"""Averaging: our all-reduce (peer.server.allreduce, gRPC with mutual TLS, in the peer's process) against
hivemind's DecentralizedAverager (its own process, p2pd with libp2p's encryption), on the same tensors, in one run.

Two phases, each with `--peers` worker processes averaging `--size-mb` MB of float32 shaped like a model's
parameters, one round at a time at a shared clock's start times:

1. loopback, both paths: CPU per averaged byte per peer, every process of the peer from /proc (ours: the
   worker; hivemind's: the worker, its averager and DHT processes and their p2p daemons), over the round's
   own window. Goal: ours <= 0.35x hivemind's.
2. the WAN lab (benchmarks/lab.py, needs root): each worker in its own network namespace capped at `--rate`
   Mbit/s both ways; the round's wall time (the latest worker's finish minus the common start) against the
   butterfly bound 2(n-1)/n * size / bandwidth, and each host's bytes (interface counters) against the
   butterfly's 2(n-1)/n * size each way. Goal: ours <= 1.15x the bound, every round ok. Beside it, in the same
   lab: raw TCP moving the same bytes at once (each peer 2 x size / n to every other, nothing waiting on
   anything: the lab's own ceiling, `tcp_ratio`, and ours over it, `over_tcp`), and hivemind's for
   `--hivemind-wan-rounds` rounds (its matchmaking counts in its time).

Environment, for experiments: SWARMTRAIN_BENCH_PIECE_BYTES (averaging.piece_bytes of the workers, default 1 MiB),
SWARMTRAIN_BENCH_DEBUG=1 (each worker logs a timeline of its rounds: pieces sent, slice reduced, verdicts).

Worker i fills its tensors with base + i + r in round r, so every peer's result must be base + (n-1)/2 + r
(within the codec's precision); a round is ok when every worker got it from the whole group.

    sudo .venv/bin/python benchmarks/averaging.py [--rate 100] [--size-mb 48] [--rounds 5] [--quick]

Also, per path: what a peer's processes took at their largest (VmHWM, added up) beyond what they held before the
rounds (code, the base tensors), over the averaged tensors' bytes: a round's inputs are 1x of it, the rest is
what averaging holds (ours: the averaged output; hivemind's: its averager's shared copy and more).

Last line: key=value pairs: cpu_ns_per_byte_ours, cpu_ns_per_byte_hivemind, cpu_ratio (ours / hivemind),
rss_over_size_ours, rss_over_size_hivemind, tcp_ratio, tcp_rounds_ok, ratio
(ours, median WAN round / bound), rounds_ok, bound_s, median_s, max_s, bytes_per_peer_over_bound,
hivemind_ratio, hivemind_rounds_ok, over_tcp, status. Without the lab (not root) the WAN phase is skipped
(wan=skipped). `--quick`: 4 MB, 2 rounds, no hivemind WAN rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.averaging_workers import template_shapes, wait_json, worker, write_json  # noqa: E402
from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402

COMPRESSIONS = ("none", "fp16", "bf16", "int8")
QUICK = {"size_mb": 4.0, "rounds": 2, "cpu_rounds": 2, "hivemind_wan_rounds": 0, "start_timeout": 90.0}
EXIT_WAIT = 15.0  # s the workers have, together, to leave once every result is in
PATHS = ("ours", "hivemind")


# --- parent: starts the workers (on loopback or in the lab), reports ---


class Failed(RuntimeError):
    """A worker failed or a wait timed out; the message says which and where the logs are."""


def _log(work: Path, i: int) -> str:
    with contextlib.suppress(OSError):
        return (work / f"w{i}" / "worker.log").read_text(errors="replace")
    return ""


def _check_alive(procs: list[subprocess.Popen], work: Path, allow_done: bool = False) -> None:
    for i, proc in enumerate(procs):
        code = proc.poll()
        if code is not None and (code != 0 or not allow_done):
            raise Failed(f"worker {i} exited (status {code}):\n{_log(work, i)[-3000:]}")


def _sleep_until(when: float, procs: list[subprocess.Popen], work: Path) -> None:
    while (left := when - time.time()) > 0:
        _check_alive(procs, work, allow_done=True)
        time.sleep(min(left, 0.2))


def _results(work: Path, n: int) -> list[list[dict]]:
    """Each worker's rounds so far."""
    results: list[list[dict]] = [[] for _ in range(n)]
    for i in range(n):
        with contextlib.suppress(OSError, ValueError):
            results[i] = json.loads((work / f"result{i}.json").read_text())
    return results


def _let_leave(procs: list[subprocess.Popen]) -> None:
    """Give the workers EXIT_WAIT s to leave on their own; kill those still there."""
    deadline = time.monotonic() + EXIT_WAIT
    for i, proc in enumerate(procs):
        try:
            proc.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"worker {i} did not exit within {EXIT_WAIT:.0f} s; killing it", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def size_bytes(args: argparse.Namespace) -> int:
    return sum(4 * _numel(s) for s in template_shapes(args.size_mb))


def _start(args, work: Path, path: str, rounds: int, hosts: list | None) -> list[subprocess.Popen]:
    """The workers of one phase: in the lab's hosts, or on loopback (each under our process, killed with it)."""
    from peer.process.lifetime import tied_to_me

    common = [
        *("--workdir", str(work), "--peers", str(args.peers), "--size-mb", str(args.size_mb), "--path", path),
        *("--rounds", str(rounds), "--compression", args.compression),
        *("--averaging-timeout", str(args.averaging_timeout), "--start-timeout", str(args.start_timeout)),
    ]
    procs = []
    for i in range(args.peers):
        home = work / f"w{i}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(home / "tmp"))  # own p2p daemon sockets
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        ip = hosts[i].ip if hosts else "127.0.0.1"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(i), "--ip", ip, *common]
        with open(home / "worker.log", "wb") as log:
            if hosts:
                procs.append(hosts[i].popen(argv, cwd=home, stdout=log, stderr=subprocess.STDOUT, env=env))
            else:
                kwargs = dict(cwd=home, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                procs.append(subprocess.Popen(tied_to_me(argv), **kwargs))
    return procs


def run_phase(args, work: Path, path: str, rounds: int, hosts: list | None, period: float) -> list:
    """One phase's rounds; each round's interface counters (lab hosts) before it, and after the last."""
    work.mkdir(parents=True, exist_ok=True)
    procs = _start(args, work, path, rounds, hosts)
    counters = []
    try:
        n = args.peers
        deadline = time.monotonic() + args.start_timeout
        while not all((work / f"ready{i}.json").exists() for i in range(n)):
            _check_alive(procs, work)
            if time.monotonic() > deadline:
                raise Failed(f"the {path} workers were not ready within {args.start_timeout:.0f} s; logs in {work}")
            time.sleep(0.1)
        ready = [wait_json(work / f"ready{i}.json", args.start_timeout) for i in range(n)]
        start = time.time() + 1.0
        peers, endpoints = [r["peer"] for r in ready], [r["endpoint"] for r in ready]
        write_json(work / "go.json", {"start": start, "period": period, "peers": peers, "endpoints": endpoints})
        for r in range(rounds):
            _sleep_until(start + r * period - 0.3, procs, work)
            counters.append([h.counters() for h in hosts] if hosts else [])
        deadline = time.monotonic() + max(0.0, start + rounds * period - time.time()) + args.averaging_timeout + 30
        while not all(len(x) == rounds for x in _results(work, n)):
            _check_alive(procs, work, allow_done=True)
            if time.monotonic() > deadline:
                raise Failed(f"the {path} rounds did not finish in time; logs in {work}")
            time.sleep(0.1)
        counters.append([h.counters() for h in hosts] if hosts else [])
        write_json(work / "done.json", {})
    finally:
        _let_leave(procs)
    return counters


def summary(args, work: Path, rounds: int, bound: float | None, counters: list) -> dict:
    """Per phase: ok rounds, times, CPU per byte per peer, and (lab) bytes per peer over the butterfly's."""
    n, size = args.peers, size_bytes(args)
    results = _results(work, n)
    entries = [[results[i][r] for i in range(n)] for r in range(min(map(len, results)))]
    times = [max(e["seconds"] for e in round_) for round_ in entries]
    out = {
        "rounds_ok": sum(all(e["ok"] for e in round_) for round_ in entries),
        "rounds": rounds,
        "times": times,
        "cpu_ns_per_byte": statistics.mean(e["cpu_s"] for round_ in entries for e in round_) / size * 1e9,
        "errors": sorted({e["error"] for round_ in entries for e in round_ if e.get("error")}),
        # what a peer's processes took at their largest (each process's own peak, added up) beyond what they held
        # before the rounds, over the averaged tensors' bytes: a round's inputs (1x) and whatever averaging adds
        "rss_over_size": max(e["peak_rss"] - e.get("rss_before", e["peak_rss"]) for round_ in entries for e in round_)
        / size,
    }
    if bound:
        butterfly = 2 * (n - 1) / n * size
        ratios = [
            max(b - a for a, b in zip(counters[r][i], counters[r + 1][i], strict=True)) / butterfly
            for r in range(len(entries))
            for i in range(n)
        ]
        out["bytes_ratio"] = statistics.mean(ratios) if ratios else float("nan")
    return out


def loopback_phase(args, work: Path, figures: Figures) -> None:
    period = max(4.0, args.size_mb / 8)  # loopback rounds take well under a second per 10 MB
    cpu = {}
    for path in PATHS:
        run_phase(args, work / f"loopback-{path}", path, args.cpu_rounds, None, period)
        s = summary(args, work / f"loopback-{path}", args.cpu_rounds, None, [])
        cpu[path] = s["cpu_ns_per_byte"]
        times = ", ".join(f"{t:.2f}" for t in s["times"])
        print(
            f"loopback {path:>8}: {s['rounds_ok']}/{s['rounds']} rounds ok, wall {times} s, "
            f"{s['cpu_ns_per_byte']:.2f} ns of CPU per averaged byte per peer, peak RSS +{s['rss_over_size']:.2f}x "
            f"the averaged bytes {'; '.join(s['errors'])}",
            flush=True,
        )
        figures[f"cpu_ns_per_byte_{path}"] = f"{s['cpu_ns_per_byte']:.2f}"
        figures[f"loopback_rounds_ok_{path}"] = f"{s['rounds_ok']}/{s['rounds']}"
        figures[f"rss_over_size_{path}"] = f"{s['rss_over_size']:.2f}"
    figures["cpu_ratio"] = f"{cpu['ours'] / cpu['hivemind']:.3f}"
    print(f"CPU per byte: ours {cpu['ours'] / cpu['hivemind']:.3f}x hivemind's (goal <= 0.35)", flush=True)


def wan_phase(args, work: Path, figures: Figures) -> None:
    from benchmarks.lab import Lab, LabError, check_available, cleanup_stale

    try:
        check_available()
    except LabError as e:
        print(f"WAN lab unavailable ({e}): skipped", flush=True)
        figures["wan"] = "skipped"
        return
    cleanup_stale()
    n, size = args.peers, size_bytes(args)
    bound = 2 * (n - 1) / n * size * 8 / (args.rate * 1e6)
    print(f"WAN lab: {n} peers at {args.rate:g} Mbit/s, butterfly bound {bound:.2f} s", flush=True)
    medians: dict[str, float] = {}
    for path, rounds in (("tcp", args.rounds), ("ours", args.rounds), ("hivemind", args.hivemind_wan_rounds)):
        if rounds < 1:
            continue
        period = bound * (2.5 if path == "hivemind" else 1.5) + 4.0  # hivemind's matchmaking takes its time too
        with Lab() as lab:
            hosts = [lab.add_host(f"avg{i}", args.rate) for i in range(n)]
            counters = run_phase(args, work / f"wan-{path}", path, rounds, hosts, period)
        s = summary(args, work / f"wan-{path}", rounds, bound, counters)
        median = statistics.median(s["times"])
        times = ", ".join(f"{t:.2f}" for t in s["times"])
        print(
            f"WAN {path:>8}: {s['rounds_ok']}/{rounds} rounds ok, wall {times} s, median {median / bound:.3f}x the "
            f"bound, {s['bytes_ratio']:.3f}x the butterfly's bytes {'; '.join(s['errors'])}",
            flush=True,
        )
        prefix = {"ours": "", "tcp": "tcp_", "hivemind": "hivemind_"}[path]
        figures[f"{prefix}ratio"] = f"{median / bound:.3f}"
        figures[f"{prefix}rounds_ok"] = f"{s['rounds_ok']}/{rounds}"
        medians[path] = median
        if path == "ours":
            figures.update(bound_s=f"{bound:.2f}", median_s=f"{median:.2f}", max_s=f"{max(s['times']):.2f}")
            figures["bytes_per_peer_over_bound"] = f"{s['bytes_ratio']:.3f}"

    if "tcp" in medians and "ours" in medians:  # what the lab's own TCP leaves: ours over raw TCP moving the same bytes
        figures["over_tcp"] = f"{medians['ours'] / medians['tcp']:.3f}"
        print(f"ours over raw TCP moving the same bytes at once: {medians['ours'] / medians['tcp']:.3f}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="averaging.py",
        description="Our all-reduce against hivemind's averager: CPU per averaged byte on loopback, and rounds of n "
        "peers in WAN-lab namespaces behind a bandwidth cap against the butterfly bound (needs root).",
    )
    parser.add_argument("--rate", type=float, default=100.0, help="each peer's cap in Mbit/s, both ways (default 100)")
    parser.add_argument("--peers", type=int, default=4, help="peers averaging together (default 4)")
    parser.add_argument("--size-mb", type=float, default=48.0, help="MB (1e6 bytes) of float32 (default 48; quick 4)")
    parser.add_argument("--rounds", type=int, default=5, help="our WAN rounds (default 5; quick 2)")
    parser.add_argument("--cpu-rounds", type=int, default=3, help="loopback rounds of each path (default 3; quick 2)")
    parser.add_argument(
        "--hivemind-wan-rounds", type=int, default=2, help="hivemind's WAN rounds, for comparison (default 2; quick 0)"
    )
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none", help="averaging codec (default none)")
    parser.add_argument("--averaging-timeout", type=float, default=60.0, help="s a round may take (default 60)")
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="s for the workers to be ready (default 120; quick 90)"
    )
    add_workdir(parser, "the workers' logs")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: run worker i
    parser.add_argument("--path", choices=(*PATHS, "tcp"), default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--ip", default="127.0.0.1", help=argparse.SUPPRESS)
    add_quick(parser, "4 MB, 2 rounds of each, no hivemind WAN rounds")
    return parser


def body(args: argparse.Namespace, figures: Figures) -> None:
    if args.peers < 2 or args.rounds < 1 or args.cpu_rounds < 1 or args.size_mb <= 0 or args.rate <= 0:
        print(
            "averaging.py: need --peers >= 2, --rounds >= 1, --cpu-rounds >= 1, --size-mb > 0, --rate > 0",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from benchmarks.credential import make_authority
    from benchmarks.lab import LabError

    with workdir(args.workdir, "swarmtrain-avg-") as work:
        for stale in work.rglob("*.json"):  # a reused workdir: old ready/result files would be read as new
            stale.unlink()
        make_authority(work)
        print(
            f"{args.peers} peers, {size_bytes(args) / 1e6:.1f} MB of float32, codec {args.compression}; logs in {work}"
        )
        try:
            loopback_phase(args, work, figures)
            wan_phase(args, work, figures)
        except (Failed, LabError, OSError, TimeoutError) as e:  # a worker that failed, a wait that timed out
            raise SystemExit(f"averaging.py: {e}") from None


def main() -> None:
    parser = build_parser()
    args = parser.parse_known_args()[0]
    if args.worker is not None:  # a worker: its output is its log, not a report
        args.workdir = str(Path(args.workdir))
        sys.exit(worker(parser.parse_args()))
    if args.quick:  # the quick defaults; flags given still win
        parser.set_defaults(**QUICK)
    run(parser, body)


if __name__ == "__main__":
    main()

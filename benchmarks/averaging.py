"""Averaging time of 4 replicas behind 100 Mbit/s links, against the butterfly all-reduce's bound.

What is measured: the wall time of one averaging round of `peer.server.averaging.GradientAverager` (hivemind's
DecentralizedAverager under our matchmaking, with the run's averaging codec) among `--peers` peers, each
in its own network namespace of the WAN lab (benchmarks/lab.py, needs root) capped at `--rate` Mbit/s
both ways. The bound is the butterfly all-reduce's: each peer sends (and receives) 2(n-1)/n of the
tensors' size, so a round takes at least 2(n-1)/n * size / bandwidth (matchmaking not counted).

How: each lab host runs a worker (this script with --worker): a DHT node (worker 0 first, the others
join it), then a GradientAverager over `--size-mb` MB of float32 tensors shaped like a model's
parameters. The parent waits until every worker is ready, then gives them a common start time;
round r starts on every worker at start + r * period (one shared clock), and each calls
average(tensors, samples=1, epoch=r, expected=<every worker's peer id>). Worker i fills its tensors with base + i + r,
so the result must be base + (n-1)/2 + r (checked within the codec's precision). A round's time is
the latest worker's finish minus the common start; a round is ok when every worker averaged in a
full group and got the right mean. Bytes per round are each host's interface counters (IP headers,
DHT chatter and all), compared with the butterfly's 2(n-1)/n * size each way.

    sudo .venv/bin/python benchmarks/averaging.py [--rate 100] [--size-mb 48] [--rounds 5] [--quick]

Last line: key=value pairs: ratio (median round time / bound), rounds_ok, bound_s, median_s, mean_s,
max_s, bytes_per_peer_over_bound (mean over hosts and rounds of max(tx, rx) / the butterfly's) and
status (benchmarks/report.py); when a round fails to finish (or on Ctrl+C), those of the rounds before.
Goal: ratio <= 1.3 with every round ok. `--quick`: 2 rounds of 4 MB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402

COMPRESSIONS = ("none", "fp16", "bf16", "int8")
# worst expected error of the mean, as a fraction of the inputs' largest magnitude (two roundings per value)
TOLERANCE = {"none": 1e-5, "fp16": 1e-3, "bf16": 8e-3, "int8": 1.2e-2}
COLUMNS = 1024  # width of the template's matrices
QUICK = {"size_mb": 4.0, "rounds": 2, "period": 4.0, "averaging_timeout": 30.0, "start_timeout": 60.0}
EXIT_WAIT = 15.0  # s the workers have, together, to leave once every result is in


# --- worker: runs inside one lab host ---


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see half a file


def _wait_json(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {path.name}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def template_shapes(size_mb: float) -> list[tuple[int, ...]]:
    """Shapes of about `size_mb` MB (1e6 bytes) of float32: four large matrices, two smaller ones and a vector."""
    elements = max(8, int(size_mb * 1e6 / 4))
    shapes: list[tuple[int, ...]] = []
    for fraction in (0.24, 0.24, 0.2, 0.2, 0.05, 0.05):
        rows = int(elements * fraction) // COLUMNS
        if rows:
            shapes.append((rows, COLUMNS))
    rest = elements - sum(r * c for r, c in shapes)
    return [*shapes, (rest,)] if rest else shapes


def make_spec(compression: str, timeout: float):
    from peer.config import RunSpec

    return RunSpec.from_dict(
        {
            "name": "avgbench",
            "compression": {"averaging": compression},
            "averaging": {"averaging_timeout": timeout},
        }
    )


def worker(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    mp.set_start_method("fork", force=True)  # hivemind forks (as peer/cli/main.py sets it)
    import torch

    from dht.identity import Identity
    from dht.node import SwarmDHT
    from peer.process.lifetime import start_reaper
    from peer.server.averaging import GradientAverager

    start_reaper()  # before hivemind's processes: they, their p2p daemons and sockets end with this worker
    torch.set_num_threads(1)
    if args.verbose:  # why a part failed is logged at debug level only
        logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.DEBUG)
    work, me = Path(args.workdir), args.worker
    initial = [] if me == 0 else [_wait_json(work / "dht0.json", args.start_timeout)["maddr"]]
    dht = SwarmDHT(Identity.generate(), initial, [f"/ip4/{args.ip}/tcp/0"], [], 60.0, 10.0)
    averager = None
    try:
        if me == 0:
            maddrs = [m for m in dht.visible_maddrs() if f"/ip4/{args.ip}/" in m]
            if not maddrs:
                raise RuntimeError(f"the DHT announces {dht.visible_maddrs()}, not the lab address {args.ip}")
            _write_json(work / "dht0.json", {"maddr": maddrs[0]})
        shapes = template_shapes(args.size_mb)
        generator = torch.Generator().manual_seed(0)  # every worker makes the same base
        base = [0.1 * torch.randn(shape, generator=generator) for shape in shapes]
        spec = make_spec(args.compression, args.averaging_timeout)
        averager = GradientAverager(dht, "avgbench", base, spec)
        _write_json(work / f"ready{me}.json", {"elements": sum(t.numel() for t in base), "peer": dht.peer_id})
        go = _wait_json(work / "go.json", args.start_timeout)
        rounds = []
        for r in range(args.rounds):
            entry = _round(averager, base, r, go, args)
            rounds.append(entry)
            print(json.dumps(entry), flush=True)
            _write_json(work / f"result{me}.json", rounds)
        # stay until the parent has every result: a peer that leaves at once cuts the streams of the parts
        # it reduced for slower peers (they then miss the last part of the round)
        _wait_json(work / "done.json", args.averaging_timeout + 60)
        return 0
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def _round(averager, base: list, r: int, go: dict, args: argparse.Namespace) -> dict:
    """Round `r` at its agreed start: its times, and whether every peer's average came out right."""
    me, n = args.worker, args.peers
    inputs = [b + (me + r) for b in base]  # made before the start, so its time is not counted
    start = go["start"] + r * go["period"]
    late = time.time() - start
    if late < 0:
        time.sleep(-late)
    began = time.time()
    result = averager.average(inputs, samples=1, epoch=r, expected=go["peers"])
    finished = time.time()
    entry = {"round": r, "seconds": finished - start, "own_seconds": finished - began, "late": max(0, late)}
    if result is None:
        entry.update(ok=False, error="no group or the round failed")
        return entry
    mean = (n - 1) / 2 + r
    err = max(float((a - b - mean).abs().max()) for a, b in zip(result.gradients, base, strict=True))
    tol = TOLERANCE[args.compression] * (0.6 + n - 1 + r)  # 0.6 bounds |base| (0.1 * randn, 12M draws)
    entry.update(group=result.group_size, max_err=err, tolerance=tol)
    entry["ok"] = result.group_size == n and err <= tol
    if not entry["ok"]:
        entry["error"] = f"group of {result.group_size}, max error {err:.3g} (tolerance {tol:.3g})"
    return entry


# --- parent: builds the lab, starts the workers, reports ---


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


def run_rounds(args: argparse.Namespace, work: Path, out: dict) -> None:
    """Build the lab, run the workers' rounds; `out` gets the bound and each round's interface counters as they come
    (the workers write their rounds' results to result<i>.json)."""
    from benchmarks.lab import Lab

    n, size = args.peers, sum(4 * _numel(s) for s in template_shapes(args.size_mb))
    butterfly = 2 * (n - 1) / n * size  # bytes each peer sends, and receives, in one round
    bound = butterfly * 8 / (args.rate * 1e6)
    period = args.period or max(10.0, 2 * bound + 10)
    out.update(bound=bound, butterfly=butterfly, counters=[])
    print(
        f"{n} peers at {args.rate:g} Mbit/s, {size / 1e6:.1f} MB of float32 in {len(template_shapes(args.size_mb))} "
        f"tensors, codec {args.compression}: butterfly bound {bound:.2f} s, a round every {period:.1f} s; "
        f"logs in {work}",
        flush=True,
    )
    with Lab() as lab:
        hosts = [lab.add_host(f"avg{i}", args.rate) for i in range(n)]
        procs: list[subprocess.Popen] = []
        common = [
            *("--workdir", str(work), "--peers", str(n), "--size-mb", str(args.size_mb)),
            *("--rounds", str(args.rounds), "--compression", args.compression),
            *("--averaging-timeout", str(args.averaging_timeout), "--start-timeout", str(args.start_timeout)),
            *(["--verbose"] if args.verbose else []),
        ]
        for i, host in enumerate(hosts):
            home = work / f"w{i}"
            (home / "tmp").mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(home / "tmp"))  # own p2p daemon sockets
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(i), "--ip", host.ip, *common]
            with open(home / "worker.log", "wb") as log:
                procs.append(host.popen(argv, cwd=home, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + args.start_timeout
        while not all((work / f"ready{i}.json").exists() for i in range(n)):
            _check_alive(procs, work)
            if time.monotonic() > deadline:
                raise Failed(f"the workers were not ready within {args.start_timeout:.0f} s; logs in {work}")
            time.sleep(0.2)
        start = time.time() + 2.0
        peers = [_wait_json(work / f"ready{i}.json", args.start_timeout)["peer"] for i in range(n)]
        _write_json(work / "go.json", {"start": start, "period": period, "peers": peers})
        for r in range(args.rounds):
            _sleep_until(start + r * period - 0.5, procs, work)
            out["counters"].append([h.counters() for h in hosts])
        deadline = time.monotonic() + max(0.0, start + args.rounds * period - time.time()) + args.averaging_timeout + 30
        while not all(len(rounds) == args.rounds for rounds in _results(work, n)):
            _check_alive(procs, work, allow_done=True)
            if time.monotonic() > deadline:
                raise Failed(f"the rounds did not finish in time; logs in {work}")
            time.sleep(0.2)
        out["counters"].append([h.counters() for h in hosts])
        _write_json(work / "done.json", {})
        _let_leave(procs)


def _results(work: Path, n: int) -> list[list[dict]]:
    """Each worker's rounds so far."""
    results: list[list[dict]] = [[] for _ in range(n)]
    for i in range(n):
        with contextlib.suppress(OSError, ValueError):
            results[i] = json.loads((work / f"result{i}.json").read_text())
    return results


def _let_leave(procs: list[subprocess.Popen]) -> None:
    """Give the workers EXIT_WAIT s to leave on their own; kill those still there (the lab's close is next)."""
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


def report(args: argparse.Namespace, work: Path, out: dict, figures: Figures) -> None:
    """Print the rounds that every worker finished, and their bytes were counted (all but when one failed)."""
    n, counters = args.peers, out.get("counters", [])
    results = _results(work, n)
    done = min(*map(len, results), len(counters) - 1)
    if done < 1:
        return
    bound, butterfly = out["bound"], out["butterfly"]
    times, oks, byte_ratios = [], 0, []
    print(
        f"{'round':>5} {'time s':>7} {'ratio':>6} {'ok':>5}  per host tx/rx MB (butterfly {butterfly / 1e6:.1f} each way)"
    )
    for r in range(done):
        entries = [results[i][r] for i in range(n)]
        seconds = max(e["seconds"] for e in entries)
        ok = sum(bool(e["ok"]) for e in entries)
        oks += ok == n
        times.append(seconds)
        traffic = []
        for i in range(n):
            tx, rx = (b - a for a, b in zip(counters[r][i], counters[r + 1][i], strict=True))
            byte_ratios.append(max(tx, rx) / butterfly)
            traffic.append(f"{tx / 1e6:.1f}/{rx / 1e6:.1f}")
        late = max(e["late"] for e in entries)
        notes = [e["error"] for e in entries if e.get("error")] + ([f"started {late:.1f} s late"] if late > 0.5 else [])
        print(f"{r:>5} {seconds:7.2f} {seconds / bound:6.3f} {ok:>3}/{n}  {' '.join(traffic)}  {'; '.join(notes)}")
    median = statistics.median(times)
    figures.update(ratio=f"{median / bound:.3f}", rounds_ok=f"{oks}/{args.rounds}", bound_s=f"{bound:.2f}")
    figures.update(median_s=f"{median:.2f}", mean_s=f"{statistics.mean(times):.2f}", max_s=f"{max(times):.2f}")
    figures["bytes_per_peer_over_bound"] = f"{statistics.mean(byte_ratios):.3f}"
    print(
        f"median round {median:.2f} s over the bound {bound:.2f} s = {median / bound:.3f} (goal <= 1.3); "
        f"{oks}/{args.rounds} rounds ok; each peer moved {statistics.mean(byte_ratios):.3f}x the butterfly's bytes"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="averaging.py",
        description="Time averaging rounds of n peers, each in a WAN-lab namespace behind a bandwidth cap, against "
        "the butterfly all-reduce bound 2(n-1)/n * size / bandwidth. Needs root; removes everything it creates.",
    )
    parser.add_argument("--rate", type=float, default=100.0, help="each peer's cap in Mbit/s, both ways (default 100)")
    parser.add_argument("--peers", type=int, default=4, help="peers averaging together (default 4)")
    parser.add_argument(
        "--size-mb", type=float, default=48.0, help="MB (1e6 bytes) of float32 averaged (default 48; quick 4)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="averaging rounds (default 5; quick 2)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none", help="averaging codec (default none)")
    parser.add_argument(
        "--period", type=float, default=0.0, help="s between round starts (default: max(10, 2 x bound + 10); quick 4)"
    )
    parser.add_argument(
        "--averaging-timeout", type=float, default=120.0, help="s a round may take (default 120; quick 30)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=120.0, help="s for the workers to be ready (default 120; quick 60)"
    )
    parser.add_argument("--verbose", action="store_true", help="workers log hivemind's all-reduce at debug level")
    add_workdir(parser, "the workers' logs")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: run worker i
    parser.add_argument("--ip", default="", help=argparse.SUPPRESS)
    add_quick(parser, "2 rounds of 4 MB, one every 4 s")
    return parser


def body(args: argparse.Namespace, figures: Figures) -> None:
    if args.peers < 2 or args.rounds < 1 or args.size_mb <= 0 or args.rate <= 0:
        print("averaging.py: need --peers >= 2, --rounds >= 1, --size-mb > 0 and --rate > 0", file=sys.stderr)
        raise SystemExit(2)
    from benchmarks.lab import LabError, open_benchmark

    open_benchmark("averaging.py", figures)
    with workdir(args.workdir, "swarmtrain-avg-") as work:
        for stale in work.glob("*.json"):  # a reused workdir: old ready/result files would be read as new
            stale.unlink()
        out: dict = {}
        try:
            run_rounds(args, work, out)
        except (Failed, LabError, OSError) as e:  # a worker that failed, a wait that timed out: one line
            raise SystemExit(f"averaging.py: {e}") from None
        finally:
            report(args, work, out, figures)  # the rounds done, also when a later one failed or on Ctrl+C


def main() -> None:
    parser = build_parser()
    args = parser.parse_known_args()[0]
    if args.worker is not None:  # a worker in a lab host: its output is its log, not a report
        sys.exit(worker(parser.parse_args()))
    if args.quick:  # the quick defaults; flags given still win
        parser.set_defaults(**QUICK)
    run(parser, body)


if __name__ == "__main__":
    main()

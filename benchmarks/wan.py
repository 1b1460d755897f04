"""Throughput of a swarm behind 100 Mbit/s links, against what its compute and its links allow.

Each configuration (activation codec none/fp16/int8, at two model widths) runs a real swarm in
the WAN lab (benchmarks/lab.py, needs root): a coordinator, one server for each of two stages and
a trainer, each in its own network namespace. On each swarm:

1. validation (first width only): before anything else trains it, a validator trainer does a fixed
   number of micro-batches with one in flight (uncapped) and validates. With one server per stage
   and one micro-batch at a time the swarm is plain sequential training, so the codecs compare on
   validation loss after equal samples with nothing else differing (same seeds, same data order).
   Its schedule is the throughput runs' (warmup, then an almost flat learning rate), so one swarm
   serves both and each codec costs one swarm start less.
2. uncapped windows: a throughput trainer (several micro-batches in flight) runs; its samples/s with
   no bandwidth cap, over whole micro-batches (see `rate`), in a window before the capped one and
   another after it (their mean: a swarm that speeds up or slows down meanwhile is not read as the
   caps' doing). On this machine every peer shares the same CPU cores, so this is the swarm's
   compute bound (what it does when links cost nothing).
3. capped window: every host capped at `--rate` Mbit/s both ways (`tc tbf`). Bytes per sample are
   measured on each host's interface (IP/TCP headers, DHT traffic and all) over the three windows
   together (see `bytes_per_sample`); the bandwidth bound is min over hosts and directions of
   cap / bytes per sample.
4. ratio = capped samples/s / min(compute bound, bandwidth bound). Goal >= 0.9.

Each window also reads the CPU time all of the swarm's processes took per sample (/proc): a capped
link delivers a message a segment at a time, and on this machine the cost of that falls on the
same cores as the compute (`cpu_<codec>_<width>` = capped over uncapped).

    sudo .venv/bin/python benchmarks/wan.py [--rate 100] [--window 6] [--widths 192,512] [--quick]

Last line: key=value pairs, each as its swarm ends: val_<codec>, ratio_<codec>_<width> and cpu_<codec>_<width>, then
val_int8_over_none and bytes_int8_over_none (the validator's interface bytes per sample over its
whole run), and status (benchmarks/report.py). The defaults (6 s windows, three a swarm; 48 validation micro-batches)
keep the 6 swarms within about 4-5 minutes on 2 cores. `--quick`: codecs none and int8 at width 192
only, 5 s windows, 24 validation micro-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cputime import cpu_seconds  # noqa: E402
from benchmarks.lab import Lab, LabError, open_benchmark  # noqa: E402
from benchmarks.rehearsal import Tail, join_args, start_peer, wait_for  # noqa: E402
from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402

CODECS = ("none", "fp16", "int8")
QUICK = {"widths": "192", "codecs": "none,int8", "window": 5.0, "warmup": 2, "micro_batches": 24, "timeout": 120.0}
SETTLE = 2.0  # s after the caps change before the next window
STOP_GRACE = 1.0  # s a measured swarm's peers have to leave before the lab kills them: nothing is measured then


def make_spec(width: int, codec: str, name: str) -> RunSpec:
    heads = max(2, width // 64)
    spec = RunSpec.from_dict(
        {
            "name": name,
            "seed": 0,
            "model": {
                "hidden_size": width,
                "num_layers": 4,
                "num_heads": heads,
                "intermediate_size": (width * 8 // 3 + 63) // 64 * 64,
                "max_seq_len": 128,
            },
            "stages": {"num_stages": 2},
            "admission": {"mode": "open"},  # its own peers, started without invite codes
            "training": {
                "micro_batch_size": 16,
                "seq_len": 128,
                "target_batch_size": 48,
                "total_steps": 100000,  # never reached: a flat learning rate after the warmup
                "lr": 0.008,
                "warmup_steps": 10,
            },
            "compression": {"activations": codec},
            "data": {"validation_bytes": 16384},  # the final validation: 8 micro-batches
        }
    )
    return spec


class Swarm:
    """One swarm in the lab: coordinator, a server per stage, and a host for each of `trainers`."""

    def __init__(self, lab: Lab, work: Path, spec: RunSpec, trainers: tuple[str, ...]):
        self.lab, self.work = lab, work
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.toml").write_text(spec_to_toml(spec))
        self.hosts = {name: lab.add_host(name) for name in ("coordinator", "server0", "server1", *trainers)}
        self.procs: dict[str, subprocess.Popen] = {}
        coord = self.hosts["coordinator"]
        info = work / "coordinator.json"
        argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
        self.procs["coordinator"] = start_peer(coord, work, [*argv, "--info-file", str(info)])
        wait_for("the coordinator", info.exists, self.procs, work, self.hosts, 120)
        self.maddr = json.loads(info.read_text())["join"].split()[-1]
        for stage in range(2):
            host = self.hosts[f"server{stage}"]
            self.procs[host.name] = start_peer(host, work, [*join_args(self.maddr, host), "--stage", str(stage)])
        servers_up = lambda: all(SERVING.search(self.log(f"server{s}")) for s in range(2))  # noqa: E731
        wait_for("the stage servers", servers_up, self.procs, work, self.hosts, 180)

    def train(self, name: str, micro_batches: int, inflight: int) -> Tail:
        """Start a trainer on host `name`; its log's entries."""
        host = self.hosts[name]
        args = [
            *join_args(self.maddr, host),
            *("--role", "trainer", "--seed", "0", "--log-file", "trainer.jsonl"),
            *("--max-inflight", str(inflight), "--max-micro-batches", str(micro_batches), "--eval-every", "100000"),
        ]
        self.procs[name] = start_peer(host, self.work, args)
        return Tail(self.work / name / "trainer.jsonl")

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.work / name / "peer.log").read_text(errors="replace")
        return ""

    def counters(self) -> dict[str, tuple[int, int]]:
        return {name: host.counters() for name, host in self.hosts.items()}

    def drops(self) -> int:
        """Packets the caps dropped (both ends of every host's link): each is a TCP loss to recover from."""
        total = 0
        for host in self.hosts.values():
            for argv in (
                ["tc", "-n", host.netns, "-s", "qdisc", "show", "dev", "eth0"],
                ["tc", "-n", self.lab.hub, "-s", "qdisc", "show", "dev", host.hub_dev],
            ):
                out = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout
                total += sum(int(m) for m in re.findall(r"dropped (\d+)", out))
        return total

    def set_rate(self, mbit: float | None) -> None:
        for host in self.hosts.values():
            self.lab.set_rate(host, mbit)

    def cpu_seconds(self) -> float:
        """CPU seconds so far of every process of the swarm, with their children (DHT, averager, p2pd)."""
        return cpu_seconds([proc.pid for proc in self.procs.values()]) or 0.0

    def window(self, tail: Tail, seconds: float) -> dict:
        """samples/s of the trainer behind `tail`, per-host (tx, rx) bytes per sample, and the swarm's CPU seconds
        per sample, over `seconds`."""
        s0, c0, t0, cpu0 = samples(tail), self.counters(), time.time(), self.cpu_seconds()
        time.sleep(seconds)
        s1, c1, t1, cpu1 = samples(tail), self.counters(), time.time(), self.cpu_seconds()
        if self.procs["trainer"].poll() is not None:
            raise LabError(f"the trainer ended during a window:\n{self.log('trainer')[-2000:]}")
        count = max(1, s1 - s0)
        moved = {n: (c1[n][0] - c0[n][0], c1[n][1] - c0[n][1]) for n in c1}
        return {"rate": rate(tail, t0, t1), "samples": count, "bytes": moved, "cpu": (cpu1 - cpu0) / count}

    def wait_trainer(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise LabError(f"{name} did not finish within {timeout:.0f} s") from None


def samples(tail: Tail) -> int:
    return sum(e["samples"] for e in tail.read() if e.get("type") == "micro_batch")


def rate(tail: Tail, t0: float, t1: float) -> float:
    """samples/s over the micro-batches done between t0 and t1, timed from the last done before t0 to the last
    done by t1: whole micro-batches, so a short window (a slow swarm does few in it) is not off by one at its ends."""
    done = [(e["time"], e["samples"]) for e in tail.read() if e.get("type") == "micro_batch"]
    inside = [(t, n) for t, n in done if t0 < t <= t1]
    start = max((t for t, _ in done if t <= t0), default=t0)
    return sum(n for _, n in inside) / (inside[-1][0] - start) if inside else 0.0


def bytes_per_sample(windows) -> dict[str, tuple[float, float]]:
    """Per host, (tx, rx) bytes per sample over all `windows` together. A window's bytes include the parts of the
    micro-batches in flight at its ends, and with 8 in flight (128 samples) against the 300 or so a capped window
    completes, one window alone is off by up to 10 %; the model's bytes per sample do not depend on the caps."""
    count = sum(w["samples"] for w in windows)
    hosts = windows[0]["bytes"]
    return {n: tuple(sum(w["bytes"][n][d] for w in windows) / count for d in (0, 1)) for n in hosts}


def bandwidth_bound(per_sample: dict[str, tuple[float, float]], mbit: float) -> tuple[float, str]:
    """Samples/s the busiest link direction allows at `mbit`, and which one it is."""
    cap = mbit * 1e6 / 8
    bounds = {
        f"{name} {'up' if d == 0 else 'down'}": cap / b[d] for name, b in per_sample.items() for d in (0, 1) if b[d] > 0
    }
    link = min(bounds, key=bounds.get)
    return bounds[link], link


def throughput(swarm: Swarm, args) -> dict:
    """Samples/s uncapped (the compute bound) and capped, with bytes per sample, of a throughput trainer."""
    tail = swarm.train("trainer", 1_000_000, args.inflight)
    deadline = time.monotonic() + 300
    while samples(tail) < args.warmup * 16:
        if time.monotonic() > deadline or swarm.procs["trainer"].poll() is not None:
            raise LabError(f"the trainer did not get going:\n{swarm.log('trainer')[-2000:]}")
        time.sleep(0.5)
    before = swarm.window(tail, args.window)
    swarm.set_rate(args.rate)
    time.sleep(SETTLE)
    dropped = swarm.drops()
    capped = swarm.window(tail, args.window)
    dropped = swarm.drops() - dropped
    swarm.set_rate(None)
    time.sleep(SETTLE)
    after = swarm.window(tail, args.window)
    compute = (before["rate"] + after["rate"]) / 2
    per_sample = bytes_per_sample((before, capped, after))
    bound, link = bandwidth_bound(per_sample, args.rate)
    return {
        "compute": compute,
        "compute_windows": (before["rate"], after["rate"]),
        "capped": capped["rate"],
        "bandwidth_bound": bound,
        "link": link,
        "ratio": capped["rate"] / min(compute, bound),
        "trainer_bytes_per_sample": sum(per_sample["trainer"]),
        "drops": dropped,
        "cpu": (capped["cpu"], (before["cpu"] + after["cpu"]) / 2),
    }


def validation(swarm: Swarm, args) -> tuple[float, float]:
    """Validation loss after `--micro-batches` micro-batches, one in flight, on the untrained swarm; and the
    validator's bytes per sample (its whole run: its DHT join and the final validation included)."""
    tail = swarm.train("validator", args.micro_batches, 1)
    code = swarm.wait_trainer("validator", args.timeout)
    if code != 0:
        raise LabError(f"the validator failed ({code}):\n{swarm.log('validator')[-2000:]}")
    evals = [e for e in tail.read() if e.get("type") == "eval"]
    if not evals:
        raise LabError(f"the validator logged no validation:\n{swarm.log('validator')[-2000:]}")
    return evals[-1]["loss"], sum(swarm.hosts["validator"].counters()) / samples(tail)


def measure(codec: str, width: int, validate: bool, args, work: Path, figures: Figures, vals: dict) -> None:
    """One swarm: its validation (when `validate`), then its throughput windows (unless `--window 0`)."""
    spec = make_spec(width, codec, f"wan-{codec}-{width}")
    trainers = tuple(name for name, wanted in (("validator", validate), ("trainer", args.window > 0)) if wanted)
    with Lab() as lab:
        swarm = Swarm(lab, work / f"{codec}-{width}", spec, trainers)
        try:
            if validate:
                vals[codec] = validation(swarm, args)
                figures[f"val_{codec}"] = f"{vals[codec][0]:.4f}"
                print(
                    f"width {width:4d} {codec:>5}: validation loss {vals[codec][0]:.4f} after "
                    f"{args.micro_batches * 16} samples; validator {vals[codec][1] / 1e3:.1f} kB/sample over its run",
                    flush=True,
                )
            if args.window:
                r = throughput(swarm, args)
                figures[f"ratio_{codec}_{width}"] = f"{r['ratio']:.3f}"
                figures[f"cpu_{codec}_{width}"] = f"{r['cpu'][0] / r['cpu'][1]:.3f}"
                print(
                    f"width {width:4d} {codec:>5}: compute {r['compute']:6.1f} samples/s "
                    f"({r['compute_windows'][0]:.1f} before the caps, {r['compute_windows'][1]:.1f} after), "
                    f"bandwidth bound {r['bandwidth_bound']:7.1f} ({r['link']}), capped {r['capped']:6.1f} "
                    f"-> ratio {r['ratio']:.3f}; trainer {r['trainer_bytes_per_sample'] / 1e3:.1f} kB/sample; "
                    f"{r['drops']} packets dropped at the caps; swarm CPU {r['cpu'][0] * 1e3:.1f} ms/sample capped, "
                    f"{r['cpu'][1] * 1e3:.1f} uncapped",
                    flush=True,
                )
        finally:
            lab.close(grace=STOP_GRACE)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="cap per host, Mbit/s each way")
    parser.add_argument(
        "--window", type=float, default=6.0, help="s per measurement window; 0: skip throughput (default 6; quick 5)"
    )
    parser.add_argument("--warmup", type=int, default=4, help="micro-batches before the first window (4; quick 2)")
    parser.add_argument("--widths", default="192,512", help="model widths; the first also compares validation loss")
    parser.add_argument("--codecs", default=",".join(CODECS), help="activation codecs (quick: none,int8)")
    parser.add_argument("--inflight", type=int, default=8, help="trainer: micro-batches in flight")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=48,
        help="validation (first width): micro-batches; 0: skip it (default 48; quick 24)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="s for a validation to finish (300; quick 120)")
    add_workdir(parser)
    add_quick(parser, "codecs none and int8 at width 192, 5 s windows, 24 validation micro-batches")
    return parser


def body(args: argparse.Namespace, figures: Figures) -> None:
    widths, codecs = [int(w) for w in args.widths.split(",")], args.codecs.split(",")
    open_benchmark("wan.py", figures)
    vals: dict[str, tuple[float, float]] = {}
    with workdir(args.workdir, "swarmtrain-wan-") as work:
        print(f"logs in {work}", flush=True)
        for width in widths:
            for codec in codecs:
                validate = width == widths[0] and args.micro_batches > 0
                if not (validate or args.window):
                    continue
                try:
                    measure(codec, width, validate, args, work, figures, vals)
                except LabError as e:  # a peer that failed or a wait that timed out: what was measured stays
                    raise SystemExit(f"wan.py: {codec} at width {width}: {e}") from None
    if "none" in vals and "int8" in vals:
        figures["val_int8_over_none"] = f"{vals['int8'][0] / vals['none'][0]:.4f}"
        figures["bytes_int8_over_none"] = f"{vals['int8'][1] / vals['none'][1]:.3f}"


def main() -> None:
    parser = build_parser()
    if parser.parse_known_args()[0].quick:  # the quick defaults; flags given still win
        parser.set_defaults(**QUICK)
    run(parser, body)


if __name__ == "__main__":
    main()

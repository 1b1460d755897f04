"""How fast the swarm recovers from a killed or a hung replica, and what churn costs, in one run.

A coordinator, 2 stages x 2 replicas and a trainer run on loopback. Phases, one after another:
a baseline without faults; SIGKILL of one replica of stage 0 (a fresh one joins afterwards); SIGSTOP
of one replica of stage 0 (SIGCONT afterwards); then churn, a random server SIGKILLed and a fresh
one started every 10 s. The recovery time of a fault is the time from the signal until the
trainer's throughput over a 2 s window is back to 90% of what the survivors give once settled
(measured 12-22 s after the signal). The last line is

    kill_recovery_s=... stop_recovery_s=... churn_ratio=... dead_call_fraction=... join_s=...

where dead_call_fraction is the share of the trainer's calls after the kill that went to the
killed peer, churn_ratio the throughput under churn over the baseline, and join_s the seconds from
`peer join` of a fresh replica (mid-run) until it serves with the stage's current state.

    python benchmarks/recovery.py [--churn 40] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, Processes, loopback_join, read_log, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402


@dataclass(frozen=True)
class Timing:
    window: float = 2.0  # s of throughput window
    settled: tuple[float, float] = (12.0, 22.0)  # s after a fault over which the survivors' throughput is measured
    warmup: float = 10.0  # s of training before the baseline
    pause: float = 10.0  # s between phases
    churn_every: float = 10.0  # s between a kill and a join under churn


QUICK = Timing(window=1.0, settled=(8.0, 12.0), warmup=2.0, pause=3.0, churn_every=5.0)


def spec() -> RunSpec:
    s = RunSpec()
    s.name = "recovery"
    s.model.hidden_size, s.model.num_layers, s.model.num_heads, s.model.intermediate_size = 128, 4, 4, 256
    s.model.max_seq_len = s.training.seq_len = 64
    s.training.micro_batch_size, s.training.target_batch_size, s.training.total_steps = 8, 32, 100_000
    s.averaging.request_timeout, s.averaging.averaging_timeout = 2.0, 8.0
    s.admission.mode = "open"  # its own peers, started without invite codes
    return s


class Bench:
    def __init__(self, workdir: Path):
        self.workdir, self.procs, self.joined = workdir, Processes(workdir), 0
        self.servers: dict[str, int] = {}  # name -> stage

    def start_swarm(self, s: RunSpec) -> None:
        (self.workdir / "run.toml").write_text(spec_to_toml(s))
        info = self.workdir / "coordinator.json"
        self.procs.start(
            "coordinator",
            ["coordinator", "run.toml", "--identity", "c.pem", "--host", "127.0.0.1", "--info-file", str(info)],
        )
        Processes.wait_until(lambda: info.exists(), 60, "the coordinator")
        self.maddr = json.loads(info.read_text())["join"].split()[-1]
        for stage in range(2):
            for i in range(2):
                self.server(f"s{stage}{i}", stage)
        args = ["--role", "trainer", "--seed", "0", "--max-inflight", "3", "--log-file", "t.jsonl"]
        self.procs.start("t", loopback_join(self.maddr, "t", *args, "--set", "trainer.log_calls=true"))

    def server(self, name: str, stage: int | None) -> float:
        """Start a server; returns the seconds from `peer join` until it serves with the stage's state."""
        extra = ["--stage", str(stage)] if stage is not None else []
        started = time.monotonic()
        self.procs.start(name, loopback_join(self.maddr, name, *extra))
        Processes.wait_until(lambda: SERVING.search(self.procs.log(name)), 120, name)
        self.servers[name] = int(SERVING.findall(self.procs.log(name))[-1][0])
        return time.monotonic() - started

    def endpoint(self, name: str) -> str:
        return SERVING.findall(self.procs.log(name))[-1][1]

    def signal(self, name: str, sig: int) -> float:
        os.kill(self.procs.procs[name][0].pid, sig)
        return time.time()

    def entries(self, kind: str) -> list[dict]:
        return [e for e in read_log(self.workdir / "t.jsonl") if e["type"] == kind]

    def rate(self, start: float, end: float) -> float:
        samples = sum(e["samples"] for e in self.entries("micro_batch") if start <= e["time"] < end)
        return samples / max(end - start, 1e-9)

    def recovery(self, fault: float, timing: Timing) -> tuple[float, float]:
        """(seconds until the throughput is back to 90% of the settled one, the settled throughput)."""
        settled = self.rate(fault + timing.settled[0], fault + timing.settled[1])
        t = fault
        while t < fault + timing.settled[1]:
            if self.rate(t, t + timing.window) >= 0.9 * settled:
                return t - fault, settled
            t += 0.1
        return float("inf"), settled


def phases(bench: Bench, args: argparse.Namespace, timing: Timing, figures: Figures) -> None:
    """Baseline, a killed replica, a joiner, a hung replica, then churn; figures as they come."""
    rng = random.Random(0)
    Processes.wait_until(lambda: len(bench.entries("micro_batch")) > 20, 120, "training")
    time.sleep(timing.warmup)
    start = time.time()
    time.sleep(args.baseline)
    figures["baseline_sps"] = baseline = bench.rate(start, time.time())
    print(f"baseline: {baseline:.1f} samples/s", flush=True)

    victim = bench.endpoint("s00")
    killed = bench.signal("s00", signal.SIGKILL)
    bench.servers.pop("s00")
    time.sleep(timing.settled[1] + timing.window)
    kill_s, kill_ref = bench.recovery(killed, timing)
    after = [e for e in bench.entries("call") if e["time"] >= killed]
    dead_fraction = sum(1 for e in after if e["endpoint"] == victim) / max(len(after), 1)
    figures.update(kill_recovery_s=kill_s, dead_call_fraction=dead_fraction, kill_settled_sps=kill_ref)
    print(
        f"SIGKILL: back to 90% of {kill_ref:.1f} samples/s after {kill_s:.2f} s; "
        f"{dead_fraction:.4f} of {len(after)} calls went to the dead peer",
        flush=True,
    )

    figures["join_s"] = join_s = bench.server("j0", 0)  # a fresh replica for stage 0, joining while training runs
    print(f"join: serving with the stage's current state {join_s:.1f} s after peer join", flush=True)
    time.sleep(timing.pause)
    stopped = bench.signal("s01", signal.SIGSTOP)
    time.sleep(timing.settled[1] + timing.window)
    bench.signal("s01", signal.SIGCONT)
    stop_s, stop_ref = bench.recovery(stopped, timing)
    figures.update(stop_recovery_s=stop_s, stop_settled_sps=stop_ref)
    print(f"SIGSTOP: back to 90% of {stop_ref:.1f} samples/s after {stop_s:.2f} s", flush=True)

    time.sleep(timing.pause)
    start = time.time()
    while time.time() - start < args.churn:
        time.sleep(timing.churn_every)
        churn_once(bench, rng)
    churn = bench.rate(start, time.time())
    figures.update(churn_ratio=churn / baseline, churn_sps=churn)
    print(f"churn: {churn:.1f} samples/s", flush=True)


def churn_once(bench: Bench, rng: random.Random) -> None:
    """SIGKILL a random server of a stage that keeps another, and start a fresh one (it picks its stage)."""
    stages = list(bench.servers.values())
    candidates = [n for n, s in bench.servers.items() if stages.count(s) >= 2]
    name = rng.choice(sorted(candidates))
    bench.signal(name, signal.SIGKILL)
    bench.servers.pop(name)
    bench.joined += 1
    joiner = f"c{bench.joined}"
    bench.procs.start(joiner, loopback_join(bench.maddr, joiner))
    bench.servers[joiner] = -1  # its stage is known once it serves
    Processes.wait_until(lambda: SERVING.search(bench.procs.log(joiner)), 120, "a joiner")
    bench.servers[joiner] = int(SERVING.findall(bench.procs.log(joiner))[-1][0])


def body(args: argparse.Namespace, figures: Figures) -> None:
    timing = QUICK if args.quick else Timing()
    args.churn = args.churn if args.churn is not None else (5.0 if args.quick else 40.0)
    args.baseline = args.baseline if args.baseline is not None else (5.0 if args.quick else 20.0)
    with workdir(args.workdir, "swarmtrain-recovery-") as tmp:
        bench = Bench(tmp)
        try:
            bench.start_swarm(spec())
            phases(bench, args, timing, figures)
        finally:
            bench.procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--churn", type=float, help="seconds of churn (a kill and a join every 10 s; default 40)")
    parser.add_argument("--baseline", type=float, help="seconds of the fault-free baseline (default 20)")
    add_quick(parser, "every phase once and short: 1 s windows, throughput settled 8-12 s after a fault, one churn")
    add_workdir(parser)
    run(parser, body)


if __name__ == "__main__":
    main()

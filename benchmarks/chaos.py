"""Chaos for minutes, then the books: every sample counted once, every replica of a stage equal.

A coordinator (a checkpoint every 4 steps), 2 stages x 2 replicas and 2 trainers on loopback. Faults
come one after another, each kind in turn in a random (seeded) order, a few seconds apart, until the
time is up:

- server: a server SIGKILLed and restarted with the same key (its stage keeps its other replica);
- trainer: a trainer stopped (SIGTERM) and restarted with the same key and the same data order;
- trainer_kill: a trainer SIGKILLed and restarted with the same key (its journal: what it left unsettled);
- empty: both servers of stage 1 told to leave at once (the last hands its state to the coordinator's
  checkpoint) and started again, the stage empty meanwhile;
- donor: a server SIGKILLed and restarted, and its stage's only other replica, its state donor,
  SIGSTOPped as the newcomer asks it for the stage's state, until the newcomer says it tries again;
- coordinator: the coordinator SIGKILLed as soon as it starts a checkpoint, and restarted with the
  same key and port and `--resume` from its checkpoints.

Then the trainers stop (SIGTERM: they drain) and, for each stage, the samples the trainers completed
(their logs, every start) must equal what its replicas stepped plus what waits in their accumulators
(Info), its replicas must sit at one step with equal fingerprints, and `peer status` must say that the
coordinator's books balance. The last line:

    seconds=... faults=... server=... trainer=... trainer_kill=... empty=... handed_over=... donor=...
    donor_waits=... coordinator=... mid_checkpoint=... samples=... lost=... twice=... apart=...
    books=exact status=ok

A run that ends with the books off, or replicas apart, fails (exit 1, status=failed).

    python benchmarks/chaos.py [--seconds 180] [--seed 0] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, Processes, loopback_join, read_log, spec_to_toml  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.coordinator import checkpoint  # noqa: E402
from peer.model.fingerprint import first_difference  # noqa: E402

KINDS = ("server", "trainer", "trainer_kill", "empty", "donor", "coordinator")


def spec() -> RunSpec:
    s = RunSpec()
    s.name = "chaos"
    s.model.hidden_size, s.model.num_layers, s.model.num_heads, s.model.intermediate_size = 64, 2, 4, 128
    s.model.max_seq_len = s.training.seq_len = 32
    s.training.micro_batch_size, s.training.target_batch_size, s.training.total_steps = 4, 32, 1_000_000
    s.training.lr, s.training.warmup_steps = 0.003, 2
    s.averaging.request_timeout, s.averaging.averaging_timeout = 2.0, 8.0
    s.admission.mode = "off"  # this process reads every server's Info over plain gRPC
    return s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kept(Processes):
    """Processes whose earlier logs are kept: a name started again logs anew, the old log is NAME.K.log."""

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        if log.exists():
            earlier = len(list(self.workdir.glob(f"{name}.*.log")))
            log.rename(self.workdir / f"{name}.{earlier + 1}.log")
        return super().start(name, args)


class Swarm:
    """The chaos swarm: its processes by name, and the faults done to them."""

    def __init__(self, root: Path):
        self.root, self.procs = root, Kept(root)
        self.port = free_port()
        self.maddr = ""
        self.figures = dict.fromkeys(KINDS, 0) | {"handed_over": 0, "donor_waits": 0, "mid_checkpoint": 0}

    # ---- processes --------------------------------------------------------------------------
    def coordinator(self, resume: bool = False) -> None:
        info = self.root / "coordinator.json"
        info.unlink(missing_ok=True)
        args = ["coordinator", "run.toml", "--identity", "c.pem", "--host", "127.0.0.1", "--dht-port", str(self.port)]
        args += ["--info-file", str(info), "--checkpoints", "ckpt", *(["--resume", "ckpt"] if resume else [])]
        for setting in ("checkpoint_every_steps=4", "checkpoint_every_minutes=0", "report_period=1"):
            args += ["--set", f"coordinator.{setting}"]
        self.procs.start("coordinator", args)
        Processes.wait_until(info.exists, 60, "the coordinator's start")
        self.maddr = json.loads(info.read_text())["join"].split()[-1]

    def server(self, name: str, *extra: str) -> None:
        self.procs.start(name, loopback_join(self.maddr, name, "--stage", name[1], *extra))

    def trainer(self, name: str) -> None:
        """Start trainer `name` and wait until it trains (a signal before that would find no handler)."""
        args = ["--role", "trainer", "--seed", name[1], "--log-file", f"{name}.jsonl"]
        started = time.time()
        self.procs.start(name, loopback_join(self.maddr, name, *args))
        trained = lambda: any(e.get("time", 0) > started for e in read_log(self.root / f"{name}.jsonl"))  # noqa: E731
        Processes.wait_until(trained, 120, f"{name} training")

    def serving(self, name: str, timeout: float = 120) -> str:
        """Wait until server `name` serves; its endpoint."""
        Processes.wait_until(lambda: SERVING.search(self.procs.log(name)), timeout, f"{name} serving")
        return SERVING.search(self.procs.log(name)).group(2)

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs.procs[name][0].pid, sig)

    def ended(self, name: str, timeout: float) -> int:
        """Wait for process `name` to end (SystemExit after `timeout`); its exit code."""
        try:
            return self.procs.procs[name][0].wait(timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{name} did not end within {timeout:.0f} s") from None

    def micro_batches(self) -> int:
        return sum(1 for t in ("t0", "t1") for e in read_log(self.root / f"{t}.jsonl") if e["type"] == "micro_batch")

    def start(self) -> None:
        (self.root / "run.toml").write_text(spec_to_toml(spec()))
        self.coordinator()
        for name in ("s0a", "s0b", "s1a", "s1b"):
            self.server(name)
        for name in ("s0a", "s0b", "s1a", "s1b"):
            self.serving(name)
        for name in ("t0", "t1"):
            self.trainer(name)
        Processes.wait_until(lambda: self.micro_batches() >= 20, 120, "training")

    # ---- faults -------------------------------------------------------------------------------
    def fault(self, kind: str, rng: random.Random) -> None:
        print(f"{time.strftime('%H:%M:%S')} fault: {kind}", flush=True)
        getattr(self, f"_{kind}")(rng)
        self.figures[kind] += 1

    def _server(self, rng: random.Random) -> None:
        name = rng.choice(["s0a", "s0b", "s1a", "s1b"])
        self.signal(name, signal.SIGKILL)
        self.ended(name, 30)
        self.server(name)  # the same key: the same peer id, a new incarnation
        self.serving(name)

    def _trainer(self, rng: random.Random) -> None:
        name = rng.choice(["t0", "t1"])
        self.stop_cleanly([name])
        self.trainer(name)  # the same key and seed: the same data, in the same order

    def _trainer_kill(self, rng: random.Random) -> None:
        name = rng.choice(["t0", "t1"])
        self.signal(name, signal.SIGKILL)
        self.ended(name, 30)
        self.trainer(name)  # the same key: its journal gives it what the killed start left unsettled

    def _empty(self, rng: random.Random) -> None:
        self.stop_cleanly(["s1a", "s1b"])  # together: the last to go hands the stage's state over
        self.figures["handed_over"] += any("is held; leaving" in self.procs.log(n) for n in ("s1a", "s1b"))
        for name in ("s1a", "s1b"):
            self.server(name)
        for name in ("s1a", "s1b"):
            self.serving(name)

    def _donor(self, rng: random.Random) -> None:
        stage = rng.choice("01")
        joiner, donor = rng.sample([f"s{stage}a", f"s{stage}b"], 2)
        self.signal(joiner, signal.SIGKILL)
        self.ended(joiner, 30)
        # a state of this size comes in well under a second: 3 s means the donor hangs
        self.server(joiner, "--set", "server.state_load_timeout=3")
        self.signal(donor, signal.SIGSTOP)  # hung as the newcomer asks it for the stage's state
        try:
            waited = lambda: "ould not load the state" in self.procs.log(joiner)  # noqa: E731
            deadline = time.monotonic() + 15.0  # the newcomer starts (a few s), then asks, then waits 3 s
            while not waited() and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            self.signal(donor, signal.SIGCONT)
        self.serving(joiner)
        self.figures["donor_waits"] += waited()

    def _coordinator(self, rng: random.Random) -> None:
        log = lambda: self.procs.log("coordinator")  # noqa: E731
        begun = len(re.findall(r"checkpoint at step \d+: pulling", log()))
        deadline = time.monotonic() + 60
        while len(re.findall(r"checkpoint at step \d+: pulling", log())) == begun:
            if time.monotonic() > deadline:
                raise SystemExit("the coordinator began no checkpoint within 60 s")
            time.sleep(0.02)
        self.signal("coordinator", signal.SIGKILL)
        step = re.findall(r"checkpoint at step (\d+): pulling", log())[-1]
        self.figures["mid_checkpoint"] += not re.search(rf"Wrote checkpoint \S+ \(step {step},", log())
        self.ended("coordinator", 30)
        # --resume needs a whole checkpoint: the one it was writing is not (never taken for whole)
        self.coordinator(resume=checkpoint.latest(self.root / "ckpt") is not None)

    # ---- the books --------------------------------------------------------------------------
    def stop_cleanly(self, names: list[str]) -> None:
        """SIGTERM to each of `names` at once; each must end with exit code 0 (SystemExit otherwise)."""
        for name in names:
            self.signal(name, signal.SIGTERM)
        for name in names:
            code = self.ended(name, 120)
            if code != 0:
                raise SystemExit(f"{name} ended with exit code {code} when told to stop")

    def completed(self) -> int:
        logs = [read_log(self.root / f"{t}.jsonl") for t in ("t0", "t1")]
        if any(e["type"] == "failed" for log in logs for e in log):
            raise SystemExit("a trainer gave a micro-batch up")
        # by uid: a trainer killed between its log line and its journal's says a micro-batch twice
        return sum({e["uid"]: e["samples"] for log in logs for e in log if e["type"] == "micro_batch"}.values())


def info(endpoint: str):
    import grpc

    from protocols import stage_pb2, stage_pb2_grpc

    with grpc.insecure_channel(endpoint) as channel:
        return stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10)


def settled(endpoints: list[str], timeout: float = 60) -> list:
    """Info of a stage's replicas once they sit at one step with nothing in a round."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [info(e) for e in endpoints]
        same = len({(i.epoch, i.samples_stepped) for i in infos}) == 1
        if same and not any(i.samples_averaging for i in infos):
            return infos
        if time.monotonic() > deadline:
            return infos  # the books below say how they differ
        time.sleep(0.3)


def check(swarm: Swarm, figures: Figures) -> None:
    """The books of each stage from the trainers' logs and the replicas' Info, and the coordinator's."""
    samples = swarm.completed()
    lost = twice = apart = 0
    for stage in "01":
        infos = settled([swarm.serving(f"s{stage}{r}") for r in "ab"])
        accounted = infos[0].samples_stepped + sum(i.samples_accumulated + i.samples_averaging for i in infos)
        lost, twice = lost + max(0, samples - accounted), twice + max(0, accounted - samples)
        prints = [next((list(f.values) for f in i.history if f.epoch == i.epoch), []) for i in infos]
        apart += len({i.epoch for i in infos}) > 1 or first_difference(*prints) is not None
        print(f"stage {stage}: {samples} completed, {accounted} accounted, steps {[i.epoch for i in infos]}")
    figures.update(samples=samples, lost=lost, twice=twice, apart=apart)
    status = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "they balance" not in status:
        status = subprocess.run(
            [sys.executable, "-m", "peer.cli.main", "status", swarm.maddr], capture_output=True, text=True, timeout=60
        ).stdout
        time.sleep(1.0)
    print(status[status.find("Books") :], flush=True)
    exact = lost == twice == apart == 0 and "they balance" in status
    figures["books"] = "exact" if exact else "off"
    if not exact:
        raise SystemExit("the books are off, or replicas of a stage hold different parameters")


def body(args: argparse.Namespace, figures: Figures) -> None:
    seconds = args.seconds if args.seconds is not None else 180.0
    rng = random.Random(args.seed)
    with workdir(args.workdir, "swarmtrain-chaos-") as root:
        swarm = Swarm(root)
        try:
            swarm.start()
            started, kinds, rounds = time.monotonic(), [], 0
            # every kind once in a random order, again and again until the time is up (quick: once, whole)
            while (kinds or not rounds) if args.quick else time.monotonic() - started < seconds:
                if not kinds:
                    kinds, rounds = rng.sample(KINDS, len(KINDS)), rounds + 1
                time.sleep(rng.uniform(2.0, 5.0))
                swarm.fault(kinds.pop(), rng)
                figures.update(swarm.figures)
            figures["seconds"] = round(time.monotonic() - started)
            figures["faults"] = sum(swarm.figures[k] for k in KINDS)
            figures.update(swarm.figures)
            swarm.stop_cleanly(["t0", "t1"])
            check(swarm, figures)
        finally:
            swarm.procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="how long faults come (default 180)")
    parser.add_argument("--seed", type=int, default=0, help="the faults' order and victims")
    add_quick(parser, "each kind of fault once")
    add_workdir(parser)
    run(parser, body)


if __name__ == "__main__":
    main()

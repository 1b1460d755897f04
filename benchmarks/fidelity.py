"""Does the swarm learn as well as one machine? Swarm against the plain loop, validation loss at equal samples.

One run, the demo's spec (model, batch, learning rate and schedule), the same data orders and seeds:

(a) 1 trainer, 1 server a stage;
(b) 2 trainers, 2 servers a stage (the demo's swarm);
(c) (b) with int8 activations between stages (compression.activations = "int8");
(d) (b) in local-update (DiLoCo) mode: each replica steps on its own gradients, the replicas average
    pseudo-gradients every `--inner-steps` steps.

Each swarm runs as separate processes on loopback (a coordinator, the servers, the trainers, each
trainer with its own seed and one micro-batch in flight) until its replicas reach `--steps` steps;
the coordinator then checkpoints it, and the checkpoint's weights are validated here. The plain loop
(peer.trainer.local) trains the same model in one process on the same micro-batches (the trainers'
seeds taken in turn) and validates after every step. Both validate on the same held-out sequences
(the run's validation set, `data.validation_bytes` of it), and the swarm's figure is set against the
plain loop's at the number of samples the swarm's trainers trained (interpolated between two steps).
The curves: trainer 0 validates through the swarm every few steps; each such point is printed beside
the plain loop's loss at the samples trained by then.

    python benchmarks/fidelity.py [--steps 16] [--configs abcd] [--quick] [--workdir DIR]
    python benchmarks/fidelity.py --wall [--steps N] [--workdir DIR]

Last line: per configuration `val_X` (swarm, nats/byte), `plain_X` (plain loop at equal samples),
`samples_X`, `ratio_X` (swarm / plain); then `ratio` (the worst of (a)-(c); goal <= 1.02) and
`diloco_ratio` ((d); goal <= 1.03). `--quick`: 8 steps, validation on a quarter of the set. `--configs efg` runs the ablations (docs/architecture.md, "Fidelity").

`--wall` compares in wall time instead: `peer demo` runs as a user runs it (its own spec; `--steps` to
shorten it), timed from start to its summary, which ends with its checkpoint's validation on the whole
held-out set; then the plain loop (the demo's spec, the two trainers' seeds in turn, this process's
threads) gets the same wall time: its steps are what fits in it (its schedule set to them) less the
demo's final validation, which it does too. Last line: `wall_s`, `demo_samples`, `demo_val`,
`plain_steps`, `plain_samples`, `plain_s`, `plain_val`, `wall_ratio` (demo / plain; goal <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import (  # noqa: E402
    DEMO_SPEC,
    Processes,
    held_out_loss,
    last_per_step,
    loopback_coordinator,
    loopback_join,
    read_log,
    spec_to_toml,
)
from peer.cli.generate import load_model  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.coordinator import checkpoint  # noqa: E402
from peer.data.corpus import load_corpus  # noqa: E402
from peer.data.validation import from_bytes  # noqa: E402
from peer.model.llama import StageModel  # noqa: E402
from peer.process.lifetime import tied_to_me  # noqa: E402
from peer.trainer.local import evaluate, train_local  # noqa: E402

START_TIMEOUT = 120.0  # s for a swarm's peers to come up
DEMO_TIMEOUT = 900.0  # s for `peer demo` start to summary (--wall)
QUICK = {"steps": 8, "validation_bytes": 8192}


@dataclass
class Config:
    what: str
    replicas: int  # servers a stage
    trainers: int
    overrides: dict = field(default_factory=dict)  # run spec sections, merged over the demo's


def configs(args: argparse.Namespace) -> dict[str, Config]:
    local = {"mode": "local", "inner_steps": args.inner_steps}
    local.update(
        {k: v for k, v in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum)) if v is not None}
    )
    return {
        "a": Config("1 trainer, 1 server a stage", 1, 1),
        "b": Config("2 trainers, 2 servers a stage", 2, 2),
        "c": Config("(b), int8 activations", 2, 2, {"compression": {"activations": "int8"}}),
        "d": Config("(b), local updates (DiLoCo)", 2, 2, {"averaging": local}),
        # ablations, outside the goal's figures: where (b) loses, pipelining from two trainers or averaging
        "e": Config("2 trainers, 1 server a stage", 1, 2),
        "f": Config("1 trainer, 2 servers a stage", 2, 1),
        "g": Config("(b), forwards and backwards wait out each round", 2, 2, {"averaging": {"pause_limit": 30.0}}),
    }


def make_spec(args: argparse.Namespace, config: Config) -> RunSpec:
    data = RunSpec.from_toml(DEMO_SPEC).to_dict()
    data["training"]["total_steps"] = args.steps
    # the demo warms up over 10 of its 180 steps: a short run warms up over its first quarter at most
    data["training"]["warmup_steps"] = min(data["training"]["warmup_steps"], max(1, args.steps // 4))
    data["data"]["validation_bytes"] = args.validation_bytes
    for section, values in config.overrides.items():
        data.setdefault(section, {}).update(values)
    if data.get("averaging", {}).get("mode") == "local":
        # each replica steps on its own batches: as many steps as the plain loop's, shared among the replicas,
        # so the swarm trains the plain loop's samples on the same schedule
        for key in ("total_steps", "warmup_steps"):
            data["training"][key] //= config.replicas
    return RunSpec.from_dict(data)


@dataclass
class SwarmRun:
    samples: int  # trained by the trainers (micro-batches with a forward and a backward)
    step: int  # the step of the checkpoint validated
    val: float  # the checkpoint's validation loss
    curve: list[tuple[int, int, float]]  # trainer 0's validations: (step, samples trained by then, loss)
    seconds: float  # from the trainers' start to their end
    backwards: list[int]  # the servers' backwards: on their forward's graph, on stashed weights, recomputed
    step_sizes: dict[int, int]  # stage 0's steps by the samples they took


BACKWARDS_RE = re.compile(
    r"backwards: (\d+) on their forward's graph, (\d+) on the weights a step back.*?(\d+) recomputed"
)
STEP_RE = re.compile(r"stage 0 step \d+: (\d+) samples")


def server_story(work: Path) -> tuple[list[int], dict[int, int]]:
    """What the servers said as they stopped (their backwards, summed) and stage 0's step sizes."""
    backwards, sizes = [0, 0, 0], {}
    for log in sorted(work.glob("s*.log")):
        text = log.read_text(errors="replace")
        for match in BACKWARDS_RE.finditer(text):
            backwards = [a + int(b) for a, b in zip(backwards, match.groups(), strict=True)]
        if log.name.startswith("s0"):
            for size in STEP_RE.findall(text):
                sizes[int(size)] = sizes.get(int(size), 0) + 1
    return backwards, dict(sorted(sizes.items()))


def start_swarm(procs: Processes, work: Path, spec: RunSpec, config: Config) -> str:
    """Coordinator (a checkpoint at the last step) and servers, until all serve; the multiaddr to join."""
    (work / "run.toml").write_text(spec_to_toml(spec))
    info = work / "coordinator.json"
    every = f"coordinator.checkpoint_every_steps={last_step(spec)}"
    coordinator = loopback_coordinator(
        "run.toml", str(info), "--checkpoints", "checkpoints", "--set", "coordinator.report_period=1", "--set", every
    )
    procs.start("coordinator", [*coordinator, "--set", "coordinator.checkpoint_every_minutes=0"])
    procs.wait_until(info.exists, START_TIMEOUT, "fidelity: the coordinator's start")
    maddr = json.loads(info.read_text())["join"].split()[-1]
    servers = [f"s{stage}{r}" for stage in range(spec.stages.num_stages) for r in range(config.replicas)]
    for name in servers:
        procs.start(name, loopback_join(maddr, name, "--stage", name[1]))
    serving = [f"Serving stage {name[1]} at " for name in servers]
    procs.wait_until(
        lambda: all(s in procs.log(n) for n, s in zip(servers, serving, strict=True)),
        START_TIMEOUT,
        "fidelity: serving",
    )
    return maddr


def train_swarm(spec: RunSpec, config: Config, work: Path, eval_every: int) -> SwarmRun:
    procs = Processes(work)
    try:
        maddr = start_swarm(procs, work, spec, config)
        started = time.time()
        names = [f"trainer{i}" for i in range(config.trainers)]
        for i, name in enumerate(names):
            extra = ["--eval-every", str(eval_every)] if i == 0 else []
            args = ["--role", "trainer", "--seed", str(i), "--log-file", f"{name}.jsonl", "--max-inflight", "1"]
            procs.start(name, loopback_join(maddr, name, *args, *extra))
        for name in names:
            if procs.procs[name][0].wait(600) != 0:
                raise RuntimeError(f"fidelity: {name} failed:\n{procs.log(name)[-2000:]}")
        seconds = time.time() - started
        root = work / "checkpoints"
        procs.wait_until(lambda: _last_step(root) >= last_step(spec), 60, "fidelity: the last checkpoint")
    finally:
        procs.stop()
    entries = [e for name in names for e in read_log(work / f"{name}.jsonl")]
    batches = sorted((e["time"], e["samples"]) for e in entries if e["type"] == "micro_batch")
    evals = last_per_step([e for e in read_log(work / "trainer0.jsonl") if e["type"] == "eval"])
    curve = [(e["epoch"], sum(n for t, n in batches if t <= e["time"]), e["loss"]) for e in evals]
    step = _last_step(root)
    return SwarmRun(sum(n for _, n in batches), step, float("nan"), curve, seconds, *server_story(work))


def last_step(spec: RunSpec) -> int:
    """The run's step when its trainers stop: in local mode the run counts outer steps (averaging rounds)."""
    t = spec.training
    return t.total_steps // spec.averaging.inner_steps if spec.local_updates else t.total_steps


def _last_step(root: Path) -> int:
    latest = checkpoint.latest(root) if root.exists() else None
    return checkpoint.read_manifest(latest, verify=False)["step"] if latest is not None else -1


def validate_checkpoint(root: Path, val: list) -> float:
    model = load_model(checkpoint.latest(root))
    return evaluate(model, val)


class PlainRun:
    """The plain loop's trajectory on some trainers' data orders: its weights after every step, each
    validated once, when a comparison asks for it (a validation costs about two steps here)."""

    def __init__(self, spec: RunSpec, corpus, seeds: list[int], steps: int, val: list):
        t = spec.training
        self.spec, self.val, self.losses = spec, val, {}
        self.per_step = -(-t.target_batch_size // t.micro_batch_size) * t.micro_batch_size
        self.states = [StageModel(spec).state_dict()]  # the weights every replica starts from (the run's seed)

        def keep(step: int, loss: float, model: StageModel) -> None:
            self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

        torch.manual_seed(0)
        self.seconds = train_local(spec, corpus, steps, seeds=seeds, on_step=keep).seconds

    def loss(self, step: int) -> float:
        if step not in self.losses:
            model = StageModel(self.spec)
            model.load_state_dict(self.states[step])
            self.losses[step] = evaluate(model, self.val)
        return self.losses[step]

    def at(self, samples: float) -> float:
        """The validation loss at `samples`, linear between the steps around it (the last step past them)."""
        position = min(samples / self.per_step, len(self.states) - 1)
        low = int(position)
        if low == position:
            return self.loss(low)
        return self.loss(low) + (self.loss(low + 1) - self.loss(low)) * (position - low)


def compare(key: str, config: Config, spec: RunSpec, work: Path, plain: PlainRun, val: list, figures: Figures) -> float:
    print(f"({key}) {config.what}: {spec.training.total_steps} steps of {spec.training.target_batch_size}", flush=True)
    swarm = train_swarm(spec, config, work, max(1, spec.training.total_steps // 2))
    swarm.val = validate_checkpoint(work / "checkpoints", val)
    if swarm.samples > plain.per_step * (len(plain.states) - 1):
        print(f"    the swarm trained {swarm.samples} samples, past the plain loop's last step: compared with that")
    ratio = swarm.val / plain.at(swarm.samples)
    print(f"    {'step':>5} {'samples':>8} {'swarm':>7} {'plain':>7}   (trainer 0's validations through the swarm)")
    for step, samples, loss in swarm.curve:
        print(f"    {step:>5} {samples:>8} {loss:7.3f} {plain.at(samples):7.3f}")
    print(
        f"    stage 0's steps by their samples (all replicas' lines): {swarm.step_sizes}; the servers' backwards: "
        f"{swarm.backwards[0]} on their forward's graph, {swarm.backwards[1]} on stashed weights (a step late), "
        f"{swarm.backwards[2]} recomputed on the current weights (the last stage's, all of them)"
    )
    print(
        f"    checkpoint at step {swarm.step}: {swarm.samples} samples in {swarm.seconds:.0f} s, validation "
        f"{swarm.val:.3f}; plain loop at equal samples {plain.at(swarm.samples):.3f}: ratio {ratio:.3f}",
        flush=True,
    )
    figures.update({f"val_{key}": swarm.val, f"plain_{key}": plain.at(swarm.samples), f"samples_{key}": swarm.samples})
    figures[f"ratio_{key}"] = ratio
    return ratio


def body(args: argparse.Namespace, figures: Figures) -> None:
    for key, value in QUICK.items():
        if args.quick and getattr(args, key) is None:
            setattr(args, key, value)
    args.steps = args.steps or 16
    args.validation_bytes = args.validation_bytes or 32768
    args.inner_steps = args.inner_steps or max(1, args.steps // 4)  # (d): two averaging rounds, the last at the end
    corpus = load_corpus()
    ratios, plains = {}, {}
    with workdir(args.workdir, "swarmtrain-fidelity-") as work:
        for key in dict.fromkeys(args.configs):
            config = configs(args)[key]
            spec = make_spec(args, config)
            if last_step(spec) < 1:
                raise SystemExit(
                    f"fidelity: ({key}) would not average once: --inner-steps {args.inner_steps} is more than each "
                    f"replica's {spec.training.total_steps} steps"
                )
            t = spec.training
            val = from_bytes(
                corpus.validation, t.seq_len, t.micro_batch_size, args.validation_bytes, "held out"
            ).batches
            shutil.rmtree(work / key, ignore_errors=True)  # a kept workdir's earlier run of this configuration
            (work / key).mkdir()
            seeds = tuple(range(config.trainers))
            if seeds not in plains:  # (b)-(d) share theirs; a few steps past the swarm's, which overshoots a little
                # the plain loop's own spec: the demo's schedule in steps of target_batch_size (not local mode's)
                plain_spec = make_spec(args, Config(config.what, config.replicas, config.trainers))
                plains[seeds] = PlainRun(plain_spec, corpus, list(seeds), args.steps + 4, val)
            ratios[key] = compare(key, config, spec, work / key, plains[seeds], val, figures)
    worst = [r for k, r in ratios.items() if k in "abc"]
    if worst:
        figures["ratio"] = max(worst)
    if "d" in ratios:
        figures["diloco_ratio"] = ratios["d"]


def wall(args: argparse.Namespace, figures: Figures) -> None:
    """`peer demo` as a user runs it, start to summary, against the plain loop given the same wall time."""
    corpus = load_corpus()
    with workdir(args.workdir, "swarmtrain-fidelity-wall-") as work:
        seconds, demo = run_demo_process(work / "demo", args.steps)
        figures.update({"wall_s": round(seconds), "demo_samples": demo["samples"], "demo_val": demo["val"]})
        spec = RunSpec.from_toml(DEMO_SPEC)
        step_seconds = plain_step_seconds(spec, corpus)
        # the plain loop's own final validation (the same model size and set) comes out of the same wall time
        spec.training.total_steps = max(1, int((seconds - demo["val_seconds"]) / step_seconds))
        print(f"plain loop: {step_seconds:.3f} s a step here, so {spec.training.total_steps} steps", flush=True)
        model = StageModel(spec)
        result = train_local(spec, corpus, spec.training.total_steps, seeds=[0, 1], on_step=keep_last(model))
        t = spec.training
        plain = held_out_loss(model, corpus, spec)
        print(f"plain loop: {result.samples} samples in {result.seconds:.0f} s, validation {plain:.3f}", flush=True)
        figures.update(
            {"plain_steps": t.total_steps, "plain_samples": result.samples, "plain_s": round(result.seconds)}
        )
        figures["plain_val"] = plain
        figures["wall_ratio"] = demo["val"] / plain


def run_demo_process(work: Path, steps: int | None) -> tuple[float, dict]:
    """Run `peer demo`; its wall time and what its summary says (samples, final validation and its seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "peer.cli.main",
        "demo",
        "--workdir",
        str(work),
        *(["--steps", str(steps)] * bool(steps)),
    ]
    started = time.monotonic()
    with open(work / "demo.out", "w") as out:
        proc = subprocess.Popen(tied_to_me(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(DEMO_TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the demo stops its swarm
                proc.wait(30)
    seconds = time.monotonic() - started
    text = (work / "demo.out").read_text()
    print(text[-1500:], flush=True)
    final = re.search(r"Final validation on the whole held-out set .*?: ([0-9.]+) nats/byte \((\d+) s\)", text)
    samples = re.search(r"samples trained\s*│?\s*(\d+)", text)
    if code != 0 or final is None or samples is None:
        raise RuntimeError(f"peer demo exited {code} without its final validation; its output is in {work}")
    return seconds, {
        "val": float(final.group(1)),
        "val_seconds": float(final.group(2)),
        "samples": int(samples.group(1)),
    }


def plain_step_seconds(spec: RunSpec, corpus, steps: int = 4) -> float:
    """Seconds a plain-loop step of `spec` takes here (the first, warming up, left out)."""
    times = []
    train_local(spec, corpus, steps, on_step=lambda *_: times.append(time.perf_counter()))
    return (times[-1] - times[0]) / (len(times) - 1)


def keep_last(into: StageModel):
    """An on_step that copies the loop's weights into `into` (validated after the loop)."""

    def keep(step: int, loss: float, model: StageModel) -> None:
        into.load_state_dict(model.state_dict())

    return keep


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each swarm (default 16)")
    parser.add_argument("--configs", default="abcd", help="which configurations to run (default abcd)")
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=None,
        help="(d): each replica's steps between averaging rounds (default: a quarter of --steps, two rounds)",
    )
    parser.add_argument("--outer-lr", type=float, help="(d): averaging.outer_lr (default: the spec's, 0.7)")
    parser.add_argument("--outer-momentum", type=float, help="(d): averaging.outer_momentum (default: the spec's, 0.9)")
    parser.add_argument(
        "--validation-bytes", type=int, default=None, help="held-out bytes validated on (default 32768)"
    )
    parser.add_argument(
        "--wall",
        action="store_true",
        help="instead: `peer demo` start to summary against the plain loop in the same wall time, both validated on "
        "the whole held-out set (--steps: the demo's steps; default the demo's own)",
    )
    add_quick(parser, "8 steps a swarm, validation on 8 kB")
    add_workdir(parser)
    return parser


if __name__ == "__main__":
    run(build_parser(), lambda args, figures: (wall if args.wall else body)(args, figures))

"""`peer demo`: a whole swarm on this machine, as separate processes, training for a few minutes.

A coordinator, two servers for each of the two stages and two trainers start on loopback; the
demo shows live progress from the trainers' logs, prints a summary and stops everything it
started, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from peer.cli.generate import load_model, sample
from peer.config import RunSpec
from peer.coordinator import checkpoint
from peer.data.corpus import load_corpus, unigram_entropy
from peer.data.validation import from_bytes
from peer.process.lifetime import interrupt_on_signals, tied_to_me, user_tempdir
from peer.trainer.local import evaluate

DEMO_SPEC = Path(__file__).with_name("demo.toml")
STAGES, REPLICAS, TRAINERS = 2, 2, 2
TRAINER_INFLIGHT = 1  # micro-batches each trainer keeps in flight: few, so gradients are rarely a step stale
START_TIMEOUT = 120.0  # s for every peer to come up
RUN_TIMEOUT = 600.0  # s before the demo gives up on the trainers
# a server's line once it serves with the stage's state (group 1: its stage, 2: its endpoint); not "Joined run ...
# Serving stage 0 of 2", which it says first, before it has loaded the state
SERVING = re.compile(r"Serving stage (\d+) at (\S+) from step")
FINAL_EVAL_BATCH = 64  # sequences per batch of the final validation on the whole held-out set


def loopback_join(maddr: str, name: str, *extra: str) -> list[str]:
    """`peer join` arguments for a peer of a one-machine swarm: its own key, loopback, one torch thread."""
    return ["join", maddr, "--identity", f"{name}.pem", "--host", "127.0.0.1", "--threads", "1", *extra]


def loopback_coordinator(spec_file: str, info_file: str, *extra: str) -> list[str]:
    """`peer coordinator` arguments for a one-machine swarm: its own key, loopback, its join line in `info_file`."""
    return [
        "coordinator",
        spec_file,
        "--identity",
        "coordinator.pem",
        "--host",
        "127.0.0.1",
        "--info-file",
        info_file,
        *extra,
    ]


class Processes:
    """Peers started as `peer` subprocesses, each in its own process group (with its p2p daemons).

    Each dies with the process that started it (peer.process.lifetime.tied_to_me), and its own reaper
    then ends what it started: nothing outlives the command, however it ends.
    """

    def __init__(self, workdir: Path):
        self.workdir, self.procs = workdir, {}

    def start(self, name: str, args: list[str], command: list[str] | None = None) -> subprocess.Popen:
        """Start `peer ARGS` (or `COMMAND ARGS`: a benchmark's attacker script) as `name`, its output in NAME.log."""
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        # TMPDIR: the peer's temporary files (its runtime dir, removed with it) go in the run's dir
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(self.workdir))
        proc = subprocess.Popen(
            # it dies with us whatever happens, SIGKILL too
            tied_to_me([*(command or [sys.executable, "-m", "peer.cli.main"]), *args]),
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl+C reaches it through stop(), after the summary
            env=env,
        )
        self.procs[name] = (proc, log)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    @staticmethod
    def wait_until(condition, timeout: float, what: str) -> None:
        """Poll `condition` until it holds; SystemExit naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not happen within {timeout:.0f} s")
            time.sleep(0.3)

    def stop(self, names=None, grace: float = 5.0) -> None:
        names = list(self.procs) if names is None else names
        for name in names:
            proc, _ = self.procs[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in names:
            proc, log = self.procs[name]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the process group also holds its p2p daemons
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            log.close()


def read_log(path: Path) -> list[dict]:
    """The JSON lines of a trainer's log so far (a line being written is skipped)."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return entries


def _progress(workdir: Path, spec: RunSpec, started: float) -> dict:
    logs = [read_log(workdir / f"trainer{i}.jsonl") for i in range(TRAINERS)]
    batches = [e for log in logs for e in log if e["type"] == "micro_batch"]
    evals = [e for log in logs for e in log if e["type"] == "eval"]
    now = time.time()
    recent = [e for e in batches if now - e["time"] <= 15]
    window = min(15.0, now - min((e["time"] for e in recent), default=now)) or 1.0
    return {
        "step": max((e["epoch"] for e in batches), default=0),
        "samples": sum(e["samples"] for e in batches),
        "rate": sum(e["samples"] for e in recent) / window if len(recent) > 1 else 0.0,
        "train": sum(e["loss"] for e in batches[-16:]) / len(batches[-16:]) if batches else None,
        "val": sorted(evals, key=lambda e: e["time"])[-1]["loss"] if evals else None,
        "evals": evals,
        "elapsed": time.monotonic() - started,
        "total": spec.training.total_steps,
    }


def _line(p: dict) -> str:
    train = f"{p['train']:.3f}" if p["train"] is not None else "-"
    val = f"{p['val']:.3f}" if p["val"] is not None else "-"
    return (
        f"step {p['step']:>4}/{p['total']} | {p['rate']:6.1f} samples/s | train loss {train} | "
        f"val loss {val} | {p['samples']} samples | {p['elapsed']:.0f} s"
    )


def _bar(p: dict) -> Table:
    """The live view on a terminal: a bar of the run's steps, then the numbers."""
    grid = Table.grid(padding=(0, 1))
    grid.add_row(ProgressBar(total=p["total"], completed=min(p["step"], p["total"]), width=30), _line(p))
    return grid


def admit_own_peers(spec: RunSpec) -> None:
    """A swarm whose every peer this command starts itself (the demo on loopback, a rehearsal in its lab) admits
    them without invite codes: open admission, unless the spec turns admission off."""
    if spec.admission.mode != "off":
        spec.admission.mode = "open"


def run_demo(steps: int | None = None, workdir: str = "", spec_path: str = "") -> int:
    console = Console() if Console().is_terminal else Console(width=160)
    spec = RunSpec.from_toml(spec_path or DEMO_SPEC)
    admit_own_peers(spec)  # every peer is the demo's own, on loopback
    if steps:
        spec.training.total_steps = steps
    interrupt_on_signals()  # SIGTERM, SIGHUP: stop the swarm as Ctrl+C does
    own_dir = not workdir
    work = Path(workdir or tempfile.mkdtemp(prefix="swarmtrain-demo-", dir=user_tempdir())).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "run.toml"
    spec_file.write_text(spec_to_toml(spec))
    corpus = load_corpus()
    baseline = unigram_entropy(corpus.validation)
    console.print(
        f"[bold]Swarmtrain demo[/bold]: a coordinator, {STAGES} stages x {REPLICAS} servers and {TRAINERS} trainers, "
        f"each its own process on loopback. Logs in {work}"
    )
    console.print(
        f"Corpus: Python's standard library ({len(corpus.train) / 1e6:.1f} MB train, "
        f"{len(corpus.validation) / 1e6:.1f} MB held out, {corpus.num_files} files); unigram baseline {baseline:.3f} nats/byte."
    )
    procs = Processes(work)
    started = time.monotonic()
    code = 1
    try:
        maddr = _start_coordinator(console, procs, work, spec)
        _start_servers(console, procs, maddr, started)
        trainers = _start_trainers(procs, maddr, spec)
        code = _follow(console, procs, trainers, work, spec, started)
        progress = _progress(work, spec, started)
        model = _last_checkpoint(console, work / "checkpoints") if code == 0 else None
        procs.stop()  # the swarm's work is done: its cores go to the final validation
        final = _final_validation(console, model, corpus, spec) if model is not None else None
        _summary(console, progress, baseline, spec, final)
        if model is not None:
            _sample(console, model, corpus)
    except KeyboardInterrupt:
        console.print("Interrupted; stopping the swarm.")
        code = 130
    finally:
        procs.stop()
        if own_dir and code == 0:
            shutil.rmtree(work, ignore_errors=True)
    return code


def _start_coordinator(console: Console, procs: Processes, work: Path, spec: RunSpec) -> str:
    """The coordinator, which writes a checkpoint when the run ends (to sample from); its multiaddr."""
    info = work / "coordinator.json"
    procs.start(
        "coordinator",
        loopback_coordinator(
            str(work / "run.toml"),
            str(info),
            "--checkpoints",
            str(work / "checkpoints"),
            "--set",  # it looks at the swarm (reads and stores in the DHT) every 3 s, not 1 s: the DHT's traffic
            "coordinator.report_period=3",  # costs this machine's cores (docs/architecture.md, "Fidelity")
            "--set",
            "dashboard.period=3",
            "--set",
            f"coordinator.checkpoint_every_steps={spec.training.total_steps}",
            "--set",
            "coordinator.checkpoint_every_minutes=0",
            "--set",  # within the demo's 20-s wait for the last checkpoint, when a stage stops a step short
            "coordinator.end_checkpoint_wait=10",
        ),
    )
    _wait(lambda: info.exists(), procs, ["coordinator"], "the coordinator to start")
    maddr = json.loads(info.read_text())["join"].split()[-1]
    console.print(f"Coordinator up: {maddr}")
    with contextlib.suppress(SystemExit):
        _wait(lambda: "Dashboard at" in procs.log("coordinator"), procs, ["coordinator"], "the dashboard", 10.0)
        dashboard = procs.log("coordinator").split("Dashboard at ", 1)[1].split()[0]
        console.print(f"Watch the swarm in a browser: {dashboard}")
    return maddr


def _start_servers(console: Console, procs: Processes, maddr: str, started: float) -> None:
    """REPLICAS servers of each stage, each told its stage; returns once all serve."""
    servers = [f"server{s}{chr(97 + r)}" for s in range(STAGES) for r in range(REPLICAS)]
    for name in servers:
        procs.start(name, loopback_join(maddr, name, "--stage", name[6]))
    _wait(lambda: all(SERVING.search(procs.log(n)) for n in servers), procs, servers, "the stage servers")
    console.print(
        f"{len(servers)} stage servers serving after {time.monotonic() - started:.0f} s; starting {TRAINERS} trainers."
    )


def _start_trainers(procs: Processes, maddr: str, spec: RunSpec) -> list[str]:
    """TRAINERS trainers, each with its own data order; the first validates now and then."""
    trainers = [f"trainer{i}" for i in range(TRAINERS)]
    for i, name in enumerate(trainers):
        extra = ["--eval-every", str(max(1, spec.training.total_steps // 6))] if i == 0 else []
        trainer_args = ["--role", "trainer", "--seed", str(i), "--log-file", f"{name}.jsonl"]
        procs.start(name, loopback_join(maddr, name, *trainer_args, "--max-inflight", str(TRAINER_INFLIGHT), *extra))
    return trainers


def _last_checkpoint(console: Console, root: Path, wait: float = 20.0):
    """The whole model from the checkpoint the coordinator writes at the end (None, said, if none came)."""
    deadline = time.monotonic() + wait
    while checkpoint.latest(root) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if checkpoint.latest(root) is None:
        console.print("No checkpoint was written at the end: no final validation, no sample.")
        return None
    return load_model(root)


def held_out_loss(model, corpus, spec: RunSpec) -> float:
    """A model's loss on the whole held-out set, in batches of FINAL_EVAL_BATCH sequences of the spec's length."""
    whole = from_bytes(corpus.validation, spec.training.seq_len, FINAL_EVAL_BATCH, len(corpus.validation), "held out")
    return evaluate(model, whole.batches)


def _final_validation(console: Console, model, corpus, spec: RunSpec) -> float:
    """The trained model's loss on the whole held-out set (what `benchmarks/fidelity.py --wall` compares)."""
    started = time.monotonic()
    loss = held_out_loss(model, corpus, spec)
    console.print(
        f"Final validation on the whole held-out set ({len(corpus.validation) / 1e6:.2f} MB): {loss:.3f} nats/byte "
        f"({time.monotonic() - started:.0f} s)."
    )
    return loss


def _sample(console: Console, model, corpus) -> None:
    """What the swarm learned: the checkpoint written at the end continues a held-out snippet."""
    text = bytes(corpus.validation[:4096])
    start = text.find(b"\ndef ")
    prompt = text[start + 1 : start + 49] if start >= 0 else text[:48]
    # the demo's model reads bytes: its token ids are the prompt's bytes, and the continuation's
    continuation = bytes(sample(model, list(prompt), 120, temperature=0.7, top_k=20))
    console.print("A held-out snippet, continued by the trained model (peer generate):")
    console.print((prompt + b"[...]" + continuation).decode("utf-8", errors="replace"), markup=False, highlight=False)


def _wait(condition, procs: Processes, names: list[str], what: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for name in names:
            if procs.procs[name][0].poll() is not None:
                raise SystemExit(f"peer demo: {name} exited early:\n{procs.log(name)[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"peer demo: waited {timeout:.0f} s for {what}")
        time.sleep(0.3)


def _follow(console: Console, procs: Processes, trainers: list[str], work: Path, spec: RunSpec, started: float) -> int:
    deadline = time.monotonic() + RUN_TIMEOUT
    interactive = console.is_terminal
    last_print = 0.0
    with Live(console=console, refresh_per_second=2, transient=False) if interactive else _Null() as live:
        while any(procs.procs[t][0].poll() is None for t in trainers):
            progress = _progress(work, spec, started)
            if interactive:
                live.update(_bar(progress))
            elif time.monotonic() - last_print > 10:
                console.print(_line(progress))
                last_print = time.monotonic()
            if time.monotonic() > deadline:
                console.print("peer demo: the trainers did not finish in time")
                return 1
            time.sleep(0.5)
        if interactive:
            live.update(_bar(_progress(work, spec, started)))
    failed = [t for t in trainers if procs.procs[t][0].returncode != 0]
    for t in failed:
        console.print(f"[red]{t} failed[/red]:\n{procs.log(t)[-2000:]}")
    return 1 if failed else 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _summary(console: Console, p: dict, baseline: float, spec: RunSpec, final: float | None) -> None:
    table = Table(title="Demo summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("optimizer steps", f"{p['step']} (target batch {spec.training.target_batch_size} samples)")
    table.add_row("samples trained", str(p["samples"]))
    table.add_row("wall time", f"{p['elapsed']:.0f} s")
    table.add_row("swarm samples/s (whole run)", f"{p['samples'] / max(p['elapsed'], 1e-6):.1f}")
    for e in last_per_step(p["evals"]):
        table.add_row(f"validation loss at step {e['epoch']}", f"{e['loss']:.3f} nats/byte")
    if final is not None:
        table.add_row("final validation loss (whole held-out set)", f"{final:.3f} nats/byte")
    table.add_row("unigram baseline", f"{baseline:.3f} nats/byte")
    console.print(table)
    if final is not None:
        console.print(f"Final validation loss {final:.3f} nats/byte vs unigram {baseline:.3f}.")


def last_per_step(evals: list[dict]) -> list[dict]:
    """A trainer's validations by step, the last of each step (the one at the end may repeat the step of
    the one before it)."""
    last = {e["epoch"]: e for e in sorted(evals, key=lambda e: e["time"])}
    return [last[step] for step in sorted(last)]


def dict_to_toml(data: dict) -> str:
    """TOML text of a nested dict of plain values (one level of tables, deeper ones inline), as run specs use.

    TOML has no null: keys whose value is None are left out."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v if x is not None) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items() if x is not None) + "}"
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, values in data.items():
        if isinstance(values, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def spec_to_toml(spec: RunSpec) -> str:
    return dict_to_toml(spec.to_dict())

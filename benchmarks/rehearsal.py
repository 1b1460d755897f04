"""A whole swarm rehearsed in the WAN lab (`python benchmarks/lab.py rehearse`): a coordinator, servers and
trainers each on a capped host, the swarm's samples/s and each host's traffic as it goes, then a summary."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.lab import ROOT, Host, Lab
from benchmarks.netns import LabError
from peer.cli.demo import SERVING, admit_own_peers, spec_to_toml
from peer.config import RunSpec, apply_override


class Tail:
    """The JSON lines a peer writes to a growing file (a trainer's --log-file); `read()` gives all so far."""

    def __init__(self, path: Path):
        self.path, self.offset, self.entries = path, 0, []

    def read(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
            end = data.rfind(b"\n") + 1  # leave a line being written for next time
            self.offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.entries.append(json.loads(line))
        return self.entries


def start_peer(host: Host, work: Path, args: list[str], settings: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `python -m peer.cli.main args` on `host`, in its own directory with its own TMPDIR (p2p daemon sockets)."""
    home = work / host.name
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(home / "tmp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    with open(home / "peer.log", "wb") as log:
        return host.popen(
            [sys.executable, "-m", "peer.cli.main", *args, *(f"--set={item}" for item in settings)],
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def host_log(work: Path, host: Host) -> str:
    with contextlib.suppress(OSError):
        return (work / host.name / "peer.log").read_text(errors="replace")
    return ""


def join_args(maddr: str, host: Host) -> list[str]:
    """`peer join` arguments for a peer on `host`: its own key, the host's address, one torch thread."""
    return ["join", maddr, "--identity", f"{host.name}.pem", "--host", host.ip, "--threads", "1"]


def wait_for(what: str, ready, procs: dict[str, subprocess.Popen], work: Path, hosts: dict, timeout: float) -> None:
    """Poll `ready()`; LabError (with the log's tail) when one of `procs` exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise LabError(
                    f"{name} exited early (status {proc.returncode}):\n{host_log(work, hosts[name])[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise LabError(f"waited {timeout:.0f} s for {what}; logs in {work}")
        time.sleep(0.3)


def _lab_spec(spec_path: str, overrides: tuple[str, ...]) -> RunSpec:
    spec = RunSpec.from_toml(spec_path)
    for item in overrides:
        apply_override(spec, item)
    admit_own_peers(spec)  # every peer is the rehearsal's own, in its lab
    return spec


def rehearse(
    spec_path: str,
    servers: int,
    trainers: int,
    rate_mbit: float | None,
    duration: float | None = None,
    workdir: str = "",
    overrides: tuple[str, ...] = (),
    peer_settings: tuple[str, ...] = (),
    interval: float = 5.0,
    console=None,
    start_timeout: float = 180.0,
) -> dict:
    """Run a coordinator, `servers` stage servers and `trainers` trainers, each on its own capped lab host.

    `overrides` (FIELD=VALUE) change the run spec, `peer_settings` every peer's settings (their `--set`).
    Prints progress every `interval` s and a summary; returns the summary (samples, samples_per_s, per-host bytes).
    `duration` bounds the training time (from the trainers' start; None: until they finish).
    """
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    spec = _lab_spec(spec_path, overrides)
    work = Path(workdir or tempfile.mkdtemp(prefix="swarmtrain-lab-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.toml").write_text(spec_to_toml(spec))
    cap = f"{rate_mbit:g} Mbit/s" if rate_mbit else "no cap"
    stages, t0 = spec.stages.num_stages, time.time()
    summary: dict = {"workdir": str(work), "samples": 0, "samples_per_s": 0.0, "hosts": {}}
    with Lab() as lab:
        roles = _roles(servers, trainers, stages)
        hosts = {name: lab.add_host(name, rate_mbit) for name in roles}
        console.print(
            f"[bold]WAN lab {lab.tag}[/bold]: {len(hosts)} hosts on {lab.subnet}, each capped at {cap} "
            f"both ways; logs in {work}"
        )
        procs: dict[str, subprocess.Popen] = {}
        tails: dict[str, Tail] = {}  # the trainers' JSON lines
        base, started, stopped = {}, time.time(), set()
        try:
            maddr = _start_coordinator(console, hosts, procs, work, peer_settings, start_timeout)
            _start_servers(hosts, procs, work, maddr, servers, stages, peer_settings, start_timeout)
            base, started = {name: host.counters() for name, host in hosts.items()}, time.time()
            _start_trainers(hosts, procs, tails, work, maddr, trainers, peer_settings)
            console.print(f"{servers} server(s) serving after {time.time() - t0:.0f} s; {trainers} trainer(s) started")
            _follow(console, hosts, procs, tails, started, duration, interval)
        except KeyboardInterrupt:
            console.print("interrupted; stopping the swarm (Ctrl+C again to kill it)")
            summary["interrupted"] = True
        finally:
            stopped = _stop(procs)
            if tails:
                summary.update(_summary(console, hosts, roles, base, tails, started, work, cap))
            lab.close(grace=0.5)  # what did not leave in time is killed now
        failed = [n for n in tails if n not in stopped and procs[n].returncode != 0]
        for name in failed:
            console.print(f"[red]{name} failed[/red]:\n{host_log(work, hosts[name])[-2000:]}")
        summary["failed"] = failed
    console.print(f"lab {lab.tag} removed")
    return summary


def _roles(servers: int, trainers: int, stages: int) -> dict[str, str]:
    roles = {"coordinator": "coordinator"}
    roles |= {f"server{i}": f"server (stage {i % stages})" if servers >= stages else "server" for i in range(servers)}
    return roles | {f"trainer{i}": "trainer" for i in range(trainers)}


def _start_trainers(hosts, procs, tails: dict[str, Tail], work: Path, maddr: str, trainers: int, settings) -> None:
    """`trainers` trainers, one micro-batch in flight each; each one's JSON lines followed in `tails` as it starts."""
    for i in range(trainers):
        name = f"trainer{i}"
        trainer = ["--role", "trainer", "--seed", str(i), "--log-file", "trainer.jsonl", "--max-inflight", "1"]
        procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), *trainer], settings)
        tails[name] = Tail(work / name / "trainer.jsonl")


def _start_coordinator(console, hosts: dict, procs: dict, work: Path, settings, timeout: float) -> str:
    """The coordinator on its lab host; its multiaddr (on the lab's network)."""
    coord = hosts["coordinator"]
    info = work / "coordinator.json"
    argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
    procs["coordinator"] = start_peer(coord, work, [*argv, "--info-file", str(info)], settings)
    wait_for("the coordinator", info.exists, procs, work, hosts, timeout)
    maddr = json.loads(info.read_text())["join"].split()[-1]
    if f"/ip4/{coord.ip}/" not in maddr:
        raise LabError(f"the coordinator announces {maddr}, not its lab address {coord.ip}")
    console.print(f"coordinator up at {maddr}")
    return maddr


def _start_servers(hosts, procs, work, maddr: str, servers: int, stages: int, settings, timeout: float) -> None:
    """`servers` stage servers (pinned round-robin when there are enough); returns once all serve."""
    names = [f"server{i}" for i in range(servers)]
    for i, name in enumerate(names):
        stage = ["--stage", str(i % stages)] if servers >= stages else []
        procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), *stage], settings)
    servers_up = lambda: all(SERVING.search(host_log(work, hosts[n])) for n in names)  # noqa: E731
    wait_for("the stage servers", servers_up, procs, work, hosts, timeout)


def _stop(procs: dict) -> set[str]:
    """Every peer still running leaves at once (trainers told first: Ctrl+C should not take long); those told."""
    live = [n for n in sorted(procs, key=lambda n: not n.startswith("trainer")) if procs[n].poll() is None]
    for name in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[name].pid, signal.SIGTERM)
    deadline = time.monotonic() + 6.0
    for name in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[name].wait(max(0.01, deadline - time.monotonic()))
    return set(live)


def _follow(console, hosts, procs, tails, started, duration, interval) -> None:
    trainers = [p for n, p in procs.items() if n.startswith("trainer")]
    last, counts = time.time(), {name: host.counters() for name, host in hosts.items()}
    seen = dict.fromkeys(tails, 0)
    while any(p.poll() is None for p in trainers):
        if duration is not None and time.time() - started >= duration:
            console.print(f"{duration:g} s of training done")
            return
        time.sleep(min(interval, 0.5))
        now = time.time()
        if now - last < interval:
            continue
        samples = 0
        for name, tail in tails.items():
            new, seen[name] = tail.read()[seen[name] :], len(tail.entries)
            samples += sum(e["samples"] for e in new if e.get("type") == "micro_batch")
        fresh = {name: host.counters() for name, host in hosts.items()}
        traffic = " ".join(
            f"{name} {(fresh[name][0] - counts[name][0]) * 8e-6 / (now - last):.1f}/"
            f"{(fresh[name][1] - counts[name][1]) * 8e-6 / (now - last):.1f}"
            for name in hosts
        )
        console.print(f"{now - started:5.0f} s | {samples / (now - last):6.1f} samples/s | tx/rx Mbit/s: {traffic}")
        last, counts = now, fresh


def _summary(console, hosts, roles, base, tails, started, work, cap) -> dict:
    from rich.table import Table

    batches = [e for tail in tails.values() for e in tail.read() if e.get("type") == "micro_batch"]
    samples = sum(e["samples"] for e in batches)
    elapsed = max((e["time"] for e in batches), default=time.time()) - started
    table = Table(
        title=f"WAN lab rehearsal: {samples} samples in {elapsed:.0f} s of training, "
        f"{samples / max(elapsed, 1e-9):.1f} samples/s, every host capped at {cap}"
    )
    for col in ("host", "role", "address", "tx MB", "rx MB", "tx Mbit/s", "rx Mbit/s"):
        table.add_column(col, justify="left" if col in ("host", "role", "address") else "right")
    result = dict(workdir=str(work), samples=samples, seconds=elapsed, samples_per_s=samples / max(elapsed, 1e-9))
    result["hosts"] = {}
    for name, host in hosts.items():
        tx, rx = (now - then for now, then in zip(host.counters(), base[name], strict=True))
        result["hosts"][name] = {"ip": host.ip, "tx_bytes": tx, "rx_bytes": rx}
        rate = 8e-6 / max(elapsed, 1e-9)
        table.add_row(
            name, roles[name], host.ip, f"{tx / 1e6:.1f}", f"{rx / 1e6:.1f}", f"{tx * rate:.1f}", f"{rx * rate:.1f}"
        )
    console.print(table)
    return result

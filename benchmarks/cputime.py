"""CPU time of process trees and progress read from log files, for benchmarks that compare what runs cost, and
two swarms measured in one window while their trainers run at once (`train_together`).

Linux only (/proc): user + system seconds of a process and all its descendants, read at once for many trees.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIN_WINDOW_BATCHES = 5  # micro-batches each side must log in a window of train_together for it to count


def count_lines(path: Path, marker: bytes) -> int:
    """How many times `marker` occurs in the file at `path` (0 while it does not exist)."""
    try:
        return path.read_bytes().count(marker)
    except OSError:
        return 0


def cpu_seconds(roots: list[int]) -> float | None:
    """User + system CPU seconds of the processes `roots` and all their descendants (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    total, todo, seen = 0.0, list(roots), set()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in times:
            continue
        seen.add(pid)
        total += times[pid]
        todo += children.get(pid, [])
    return total if seen else None


def descendants_of(pid: int) -> list[int]:
    """The live descendants of `pid`, read from /proc/<pid>/task/*/children."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def process_times(root: int) -> dict[int, tuple[str, float]]:
    """{pid: (kind, CPU seconds)} of `root` and its descendants; kind: peer (the root), p2pd, reaper (the root's
    child that has none: peer.process.reaper, forked first), or dht (the rest: hivemind's DHT process, forked
    from the peer)."""
    out = {}
    for pid in [root, *descendants_of(root)]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, _, tail = f.read().rpartition(")")
        except OSError:
            continue  # gone meanwhile
        fields = tail.split()
        name, parent = head.partition("(")[2], int(fields[1])
        if pid == root:
            kind = "peer"
        elif name == "p2pd":
            kind = "p2pd"
        else:
            kind = "reaper" if parent == root and not descendants_of(pid) else "dht"
        out[pid] = (kind, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def kind_seconds(roots: dict[str, int]) -> dict[str, dict[str, float]]:
    """{name: {kind: CPU seconds}} of each named process tree (process_times, summed by kind)."""
    out: dict[str, dict[str, float]] = {}
    for name, root in roots.items():
        kinds = out.setdefault(name, {})
        for kind, seconds in process_times(root).values():
            kinds[kind] = kinds.get(kind, 0.0) + seconds
    return out


def train_together(swarms: dict, name: str, micro_batches: int, warmup: int, extra: list[str], timeout):
    """A trainer on each swarm at once, each for `micro_batches`: per swarm, (samples/s, CPU s per 1000 samples)
    over one window, from when every trainer is past its first `warmup` micro-batches to when one of them has
    done 90 % of its own (before any of them drains at its end). The CPU is all of the swarm's processes (coordinator,
    servers, trainer, with their children) read from /proc. Both sides share the window, so the machine's state
    (its fast and slow spells) is the same for both, and they compete for the same cores."""
    procs = {mode: swarm.start_trainer(name, micro_batches, extra) for mode, swarm in swarms.items()}
    logs = {mode: swarm.workdir / f"{name}.jsonl" for mode, swarm in swarms.items()}
    roots = {
        mode: [swarm.procs.procs[n][0].pid for n in ("coordinator", *swarm.servers, name)]
        for mode, swarm in swarms.items()
    }
    first = last = None  # (monotonic time, {mode: (micro-batches logged, CPU seconds)})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
        look = (
            time.monotonic(),
            {mode: (count_lines(logs[mode], b'"micro_batch"'), cpu_seconds(roots[mode])) for mode in swarms},
        )
        counts = [done for done, _ in look[1].values()]
        if first is None and min(counts) >= warmup:
            first = look
        elif first is not None:
            last = look
            if max(counts) >= 0.9 * micro_batches:
                break
        time.sleep(0.2)
    failed = [mode for mode, p in procs.items() if p.poll() not in (None, 0)]
    for mode in failed:  # one trainer failed: the others are stopped, and its log is said
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        swarms[mode]._rate(procs[mode], name, warmup)
    for mode, swarm in swarms.items():
        left = max(deadline - time.monotonic(), 1.0)
        swarm._wait(
            lambda p=procs[mode]: p.poll() is not None, ["coordinator", *swarm.servers], f"trainer {name}", left
        )
    if first is None or last is None:
        raise SystemExit(f"trainers {name} never ran together past their warm-up within {timeout:.0f} s")
    figures = {}
    for mode, swarm in swarms.items():
        per_batch = swarm._rate(procs[mode], name, warmup)[1]
        (done0, cpu0), (done1, cpu1) = first[1][mode], last[1][mode]
        samples = (done1 - done0) * per_batch
        if done1 - done0 < MIN_WINDOW_BATCHES or None in (cpu0, cpu1):
            figures[mode] = (math.nan, math.nan)  # too short a window to say anything
            continue
        figures[mode] = (samples / max(last[0] - first[0], 1e-9), 1000 * (cpu1 - cpu0) / samples)
    return figures


def paired(without: list[float], with_: list[float], cost: bool = False) -> float:
    """The median over rounds of each round's overhead in %: throughput lost (1 - with / without), or with `cost`
    the extra cost (with / without - 1). Rounds are paired: both sides ran in the same window."""
    ratios = [w / o for o, w in zip(without, with_, strict=True) if o == o and w == w and o > 0 and w > 0]
    if not ratios:
        return math.nan
    return (statistics.median(ratios) - 1.0) * 100.0 if cost else (1.0 - statistics.median(ratios)) * 100.0

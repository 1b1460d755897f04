"""CPU time of process trees and progress read from log files, for benchmarks that compare what runs cost.

Linux only (/proc): user + system seconds of a process and all its descendants, read at once for many trees.
"""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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

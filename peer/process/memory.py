"""This process's memory as the kernel counts it (Linux /proc; 0 where that is not available)."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

M_ARENA_MAX = -8  # glibc's mallopt parameter


def _status_kb(field: str) -> int:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0


def resident() -> int:
    """Bytes resident now (VmRSS)."""
    return _status_kb("VmRSS")


def peak() -> int:
    """The most bytes ever resident at once (VmHWM)."""
    return _status_kb("VmHWM")


def limit_arenas(arenas: int) -> bool:
    """Cap glibc malloc's arenas (call before threads start); False where there is no glibc or arenas is 0."""
    if arenas <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc
        return False

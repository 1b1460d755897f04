"""What runs and what is left: a process's descendants, whether one is alive, hivemind's p2p sockets and
the peers' runtime directories (peer.process.lifetime), for the checks that a test leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from peer.process.reaper import children, stat


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    return stat(pid) is not None


def hivemind_sockets() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("hivemind-*.sock")}


def reaper_logs(places: list[Path], sockets: set[str]) -> str:
    """What the reapers logged (peer.process.reaper, reaper-PID.log under `places`) of these sockets: why they stayed."""
    lines = []
    for place in places:
        for log in sorted(place.rglob("reaper-*.log")):
            text = log.read_text(errors="replace")
            if any(Path(s).name in text for s in sockets):
                lines.append(f"--- {log}\n{text}")
    return "\n".join(lines) or "no reaper log names them"


def remove_stale_sockets(before: set[str]) -> None:
    """Remove the unix sockets that killed p2p daemons left in /tmp since `before` (nobody listens there)."""
    from peer.process.reaper import stale_sockets

    for path in set(stale_sockets(0.0)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


# this test session's tag on the runtime dirs of every peer it starts (peer.process.lifetime.RUNTIME_TAG_ENV), so
# that its checks judge only what it started, not another session's peers on the same machine
SESSION_TAG = f"pytest{os.getpid()}"
os.environ.setdefault("SWARMTRAIN_RUNTIME_TAG", SESSION_TAG)


def runtime_dirs(*places: Path) -> set[Path]:
    """This session's peers' runtime directories (peer.process.lifetime) in these places: each reaper removes its own."""
    tag = os.environ["SWARMTRAIN_RUNTIME_TAG"]
    return {d for place in places for d in place.glob(f"swarmtrain-peer-{tag}-*")}


def _torch_helper(pid: int) -> bool:
    """torch's shared-memory manager, which the test process itself starts and keeps until it exits."""
    return os.path.basename(_command(pid).split(" ", 1)[0]) == "torch_shm_manager"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"

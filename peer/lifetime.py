"""A process's lifetime: nothing outlives the command that started it, and leaving has a deadline.

Four pieces, all Linux:

- `die_with_parent`, a `preexec_fn` for spawners (the demo, test fixtures, benchmarks): the child
  gets SIGKILL the moment the process that started it dies, however it dies (prctl's
  PR_SET_PDEATHSIG). It is kept across exec, so `ip netns exec ... peer join` is covered too.
- `start_reaper`, called once by every long-running `peer` command: it forks a small watcher that
  follows the peer's descendants (hivemind's DHT and averager processes, their p2p daemons,
  tensor-parallel ranks) and, once the peer has exited in any way (its own SIGKILL included), ends
  those still alive (SIGTERM, then SIGKILL after a grace), removes the unix sockets of the p2p
  daemons it saw and the peer's private runtime directory.
- the same call makes every process the peer forks from its main thread (hivemind's DHT and
  averagers) die with it, through PR_SET_PDEATHSIG in an at-fork hook.

- `exit_within`: once a peer is told to leave (a signal, a revocation, a move), it exits within a
  bound whatever is still running (a hung averaging round, a stuck DHT call).

Exec'ing a new image (a server moving to another stage) keeps the process and its reaper: the
environment variable `REAPER_ENV` tells the new image that one already watches it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
REAPER_ENV = "SWARMTRAIN_REAPER"  # "<reaper pid>:<runtime dir>" of the reaper that watches this process
USER_TMPDIR_ENV = "SWARMTRAIN_USER_TMPDIR"  # the temporary directory before the runtime dir replaced it
SOCKET_FLAG = "-listen=/unix"  # how hivemind names a p2p daemon's unix socket on its command line
SOCKET_DIR = "/tmp/hivemind-"  # where hivemind puts its unix sockets, whatever TMPDIR says
SOCKET_LOOKS = 4  # the reaper notes the sockets the peer's processes hold every this many looks
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: a preexec_fn must not load libraries


def _set_parent_death_signal(sig: int) -> None:
    if _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def die_with_parent(sig: int = signal.SIGKILL):
    """A `preexec_fn`: the child gets `sig` when the thread that spawned it (use the main thread) dies."""
    parent = os.getpid()

    def preexec() -> None:
        _set_parent_death_signal(sig)
        if os.getppid() != parent:  # the parent died before the line above: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


# ---- reading /proc ------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, process group, start time in clock ticks) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _processes() -> dict[int, tuple[int, int, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(int(entry))) is not None:
            table[int(entry)] = found
    return table


def _bound_sockets(pids: list[int], prefix: str = SOCKET_DIR) -> set[str]:
    """Paths under `prefix` of the unix sockets these processes hold (hivemind's clients make their own)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    if not inodes or not pids:
        return set()
    try:
        with open(f"/proc/{pids[0]}/net/unix") as f:  # the processes' own network namespace
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return set()
    return {row[7] for row in rows if len(row) >= 8 and row[6] in inodes and row[7].startswith(prefix)}


def _sockets_of(pid: int) -> list[str]:
    """The unix socket paths a hivemind p2p daemon was started with (its own and its client's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    found = []
    for arg in args:
        if arg.startswith(SOCKET_FLAG):
            path = arg[len(SOCKET_FLAG) :]
            found += [path, path.replace("hivemind-p2pd-", "hivemind-p2pclient-")]
    return found


@dataclass
class Watch:
    """What the reaper knows of one peer: its descendants so far and what to remove after it."""

    peer: int
    me: int
    group: int  # the peer's process group
    born: int  # the peer's start time (clock ticks)
    # where the kernel puts the peer's orphans: its ancestors (a subreaper among them) and init, but
    # not its parent, whose other children (`peer join | tee`) are not the peer's
    adopters: set[int]
    seen: dict[int, int] = field(default_factory=dict)  # descendant pid -> start time
    sockets: set[str] = field(default_factory=set)
    looks: int = 0

    def look(self) -> None:
        """Remember the peer's descendants as they are now."""
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.peer, *[p for p in self.seen if p in table and table[p][2] == self.seen[p]]]
        new = False
        while todo:
            for child in children.get(todo.pop(), []):
                if child == self.me or child in self.seen:
                    continue
                self.seen[child], new = table[child][2], True
                self.sockets.update(_sockets_of(child))
                todo.append(child)
        self.looks += 1
        if new or self.looks % SOCKET_LOOKS == 0:
            live = [self.peer, *(p for p in self.seen if p in table and table[p][2] == self.seen[p])]
            self.sockets.update(_bound_sockets(live))

    def leftovers(self) -> list[int]:
        """Live processes of the peer: those seen (same start time), their children, and orphans of its group."""
        self.look()  # children of those seen, born since the last look
        table = _processes()
        mine = [p for p, born in self.seen.items() if p in table and table[p][2] == born]
        # orphans of the peer's process group, born after it, whose parent died before we saw them
        mine += [
            p
            for p, (ppid, group, born) in table.items()
            if group == self.group and born >= self.born and ppid in self.adopters and p not in (self.me, self.peer)
        ]
        return sorted(set(mine))


def _end(pids: list[int], grace: float) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_stat(p) is not None for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _stat(pid) is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _follow(watch: Watch, period: float) -> None:
    """Look at the peer's descendants every `period` until the peer exits."""
    try:
        poller = select.poll()
        poller.register(os.pidfd_open(watch.peer), select.POLLIN)  # readable once the peer has exited
    except (OSError, AttributeError):  # a kernel before 5.3: we notice through our parent's change
        poller = None
    while os.getppid() == watch.peer:
        if poller is None:
            time.sleep(period)
        elif poller.poll(period * 1000):
            return
        watch.look()


def _reap(watch: Watch, runtime_dir: str, period: float, grace: float) -> None:
    """The reaper's life: follow the peer until it exits, then end and remove what it left."""
    _follow(watch, period)
    for _ in range(2):  # a process forked while we ended the others is caught the second time
        leftovers = watch.leftovers()
        if leftovers:
            _end(leftovers, grace)
    for path in watch.sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def _detach_streams() -> None:
    """The reaper holds no pipe or file of the peer's: readers of its output see EOF when the peer ends."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 65536)


def _watching_me() -> str | None:
    """The runtime dir of a reaper that already watches this process (we were exec'd), if any."""
    pid_text, _, runtime_dir = os.environ.get(REAPER_ENV, "").partition(":")
    if pid_text.isdigit() and (found := _stat(int(pid_text))) is not None and found[0] == os.getpid():
        return runtime_dir
    return None


MAX_RUNTIME_BASE = 48  # chars: unix sockets made in the runtime dir (torch's) must fit in 108 bytes


def _runtime_base() -> str:
    """Where the runtime dir goes: the temporary directory, unless its path is too long for sockets in it."""
    base = tempfile.gettempdir()
    return base if len(base) <= MAX_RUNTIME_BASE or not os.access("/tmp", os.W_OK) else "/tmp"


def _forked_child() -> None:
    if threading.current_thread() is threading.main_thread():
        _set_parent_death_signal(signal.SIGKILL)


def start_reaper(period: float = 0.5, grace: float = 1.5) -> Path:
    """Have everything this process starts end with it; returns the process's private runtime directory.

    Call it from the main thread, before any child process or thread is started. The runtime
    directory (also set as TMPDIR for this process and its children) is removed after the process.
    """
    existing = _watching_me()
    if existing is not None and os.path.isdir(existing):
        runtime_dir = existing
    else:
        runtime_dir = tempfile.mkdtemp(prefix="swarmtrain-peer-", dir=_runtime_base())
        peer = os.getpid()
        pid = os.fork()
        if pid == 0:  # the reaper
            try:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                    signal.signal(sig, signal.SIG_IGN)  # a terminal's Ctrl+C is for the peer; we clean up after
                _detach_streams()
                watch = _watch(peer)
                if watch is not None:
                    _reap(watch, runtime_dir, period, grace)
            finally:
                os._exit(0)
        os.environ[REAPER_ENV] = f"{pid}:{runtime_dir}"
    # after the reaper's fork: the reaper itself must outlive us
    os.register_at_fork(after_in_child=_forked_child)
    os.environ.setdefault(USER_TMPDIR_ENV, tempfile.gettempdir())
    os.environ["TMPDIR"] = runtime_dir
    tempfile.tempdir = None  # read TMPDIR again
    return Path(runtime_dir)


def _watch(peer: int) -> Watch | None:
    """In the reaper: what it must know of the peer (its parent); None if the peer is already gone."""
    found = _stat(peer)
    if found is None or os.getppid() != peer:
        return None
    parent, group, born = found
    adopters, pid = {1}, parent
    while pid > 1 and (up := _stat(pid)) is not None:
        adopters.add(pid)
        pid = up[0]
    adopters.discard(parent)
    return Watch(peer, os.getpid(), group, born, adopters)


def exit_within(seconds: float, reason: str, code: int = 1) -> threading.Timer:
    """Exit the process (with `code`, saying `reason`) `seconds` from now unless it has by then.

    The timer is a daemon: a process that finishes in time exits normally. Past the bound, forked
    helpers get SIGTERM, then the process ends at once (the reaper ends whatever else is left).
    """
    timer = threading.Timer(seconds, exit_now, (reason, code))
    timer.daemon = True
    timer.start()
    return timer


def exit_now(reason: str, code: int = 1) -> None:
    """End the process now; its forked helpers (hivemind's DHT and averagers) get SIGTERM first."""
    import multiprocessing
    import sys

    print(f"peer: {reason}; exiting now.", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=1.0)
    os._exit(code)


def interrupt_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Make `signals` raise KeyboardInterrupt in the main thread, as Ctrl+C does.

    A command that starts peers (the demo, a benchmark) then stops them in its `finally` blocks
    when it is terminated or its terminal goes away, instead of dying with them still running.
    """

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    for sig in signals:
        signal.signal(sig, interrupt)


def user_tempdir() -> str:
    """Where files that must outlive this process go (the runtime dir is removed with it)."""
    return os.environ.get(USER_TMPDIR_ENV) or tempfile.gettempdir()

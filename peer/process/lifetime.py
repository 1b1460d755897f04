"""A process's lifetime: nothing outlives the command that started it, and leaving has a deadline.

All Linux:

- `tied_to_me`, for spawners (the demo, tensor-parallel ranks, test fixtures, benchmarks): the
  command line it returns gets SIGKILL the moment the process that started it dies, however it
  dies (prctl's PR_SET_PDEATHSIG, set by a tiny launcher that then execs the command). It is kept
  across exec, so `ip netns exec ... peer join` is covered too. No `preexec_fn`: Python code
  between fork and exec in a process with gRPC threads can abort the child (gRPC's fork handlers
  start pollers whose descriptors `close_fds` then closes: "epoll_wait error: Bad file descriptor").
- `die_with_parent`, the same for a child forked by multiprocessing (called first thing in it).
- `start_reaper`, called once by every long-running `peer` command: it forks the reaper
  (peer.process.reaper), which ends the peer's descendants (hivemind's DHT process, its
  p2p daemon, tensor-parallel ranks) once the peer has exited in any way, its own SIGKILL
  included, and removes their sockets and the peer's private runtime directory. The same call
  makes every process the peer forks from its main thread (hivemind's DHT) die with
  it, through PR_SET_PDEATHSIG in an at-fork hook. The runtime directory names its owner (the peer's
  and the reaper's pids with their start times); a start first sweeps the runtime directories whose
  peer and reaper are both gone (a supervisor that SIGKILLs a whole unit kills the reaper too).
- `exit_within`: once a peer is told to leave (a signal, a revocation), it exits within a bound
  whatever is still running (a hung averaging round, a stuck DHT call).
- `interrupt_on_signals`: SIGTERM and SIGHUP stop a command as Ctrl+C does.

Exec'ing a new image (a server moving to another stage) keeps the process and its reaper: the
environment variable `REAPER_ENV` tells the new image that one already watches it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from peer.process import reaper

PR_SET_PDEATHSIG = 1
REAPER_ENV = reaper.REAPER_ENV  # "<reaper pid>:<runtime dir>" of the reaper that watches this process
USER_TMPDIR_ENV = "SWARMTRAIN_USER_TMPDIR"  # the temporary directory before the runtime dir replaced it
RUNTIME_PREFIX = "swarmtrain-peer-"  # a peer's runtime dir: RUNTIME_PREFIX + tag + random, in _runtime_base()
MAX_TAG = 16  # chars of RUNTIME_TAG_ENV kept in the runtime dir's name
# chars: a unix socket's path fits in 107 (108 bytes with its NUL); the longest one made in the runtime dir is torch's
# shared-memory manager's, "/torch-shm-dir-XXXXXX/manager.sock", and the dir adds "/" PREFIX TAG "-" and 8 random chars
MAX_RUNTIME_BASE = 107 - len("/torch-shm-dir-XXXXXX/manager.sock") - (1 + len(RUNTIME_PREFIX) + MAX_TAG + 1 + 8)
# a tag for the runtime dirs of every peer started below a process that sets it (a test session names its own)
RUNTIME_TAG_ENV = "SWARMTRAIN_RUNTIME_TAG"
OWNER_FILE = "owner"  # in a runtime dir: "<peer pid> <its start> <reaper pid> <its start>" (start: clock ticks)
OWNERLESS_GRACE = 600.0  # s: a runtime dir with no owner file (being made, or an older version's) kept this long
EXIT_JOIN = 1.0  # s, all together, that forked helpers get to end after SIGTERM when a process must exit now
# looked up now: a preexec_fn or at-fork hook runs in a fresh child, where loading a library is unsafe
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
_forking_from_main = threading.local()  # set in the parent just before a fork


def _set_parent_death_signal(sig: int) -> None:
    if _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


# the launcher of tied_to_me: argv is [signal, parent pid, niceness, command...]; stdlib only, no site
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "sig, parent, niceness = map(int, sys.argv[1:4])\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0) != 0: sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != parent: os.kill(os.getpid(), sig)\n"
    "if niceness: os.nice(niceness)\n"
    "os.execvp(sys.argv[4], sys.argv[4:])\n"
)


def tied_to_me(argv: list[str], sig: int = signal.SIGKILL, niceness: int = 0) -> list[str]:
    """`argv` as a command line that gets `sig` when the thread spawning it (use the main thread) dies.

    Spawn it without a `preexec_fn` (see the module's notes); `niceness` is added to the child's.
    """
    return [sys.executable, "-S", "-c", _LAUNCHER, str(int(sig)), str(os.getpid()), str(niceness), *map(str, argv)]


def die_with_parent(sig: int = signal.SIGKILL):
    """For a child forked by multiprocessing: call the returned function first thing in the child;
    it then gets `sig` when the thread that forked it dies. (A spawned program: `tied_to_me`.)"""
    parent = os.getpid()

    def preexec() -> None:
        _set_parent_death_signal(sig)
        if os.getppid() != parent:  # the parent died before the line above: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


# ---- the reaper -------------------------------------------------------------------------------
def _watching_me() -> str | None:
    """The runtime dir of a reaper that already watches this process (we were exec'd), if any."""
    pid_text, _, runtime_dir = os.environ.get(REAPER_ENV, "").partition(":")
    if pid_text.isdigit() and (found := reaper.stat(int(pid_text))) is not None and found[0] == os.getpid():
        return runtime_dir
    return None


def _runtime_base() -> str:
    """Where the runtime dir goes: the temporary directory, unless its path is too long for sockets in it."""
    base = tempfile.gettempdir()
    return base if len(base) <= MAX_RUNTIME_BASE or not os.access("/tmp", os.W_OK) else "/tmp"


def _before_fork() -> None:
    # after the fork, the child's only thread is its "main" thread whichever thread forked: ask now
    _forking_from_main.value = threading.current_thread() is threading.main_thread()


def _forked_child(runtime_dir: str) -> None:
    """A process forked from the peer's main thread (hivemind's DHT, an averager) dies with the peer.

    Not one forked from another thread: PR_SET_PDEATHSIG fires when the forking thread ends. Every forked
    process names itself in the runtime dir (reaper.register): the reaper then ends its children
    (hivemind's p2p daemon) even when the peer exits before a look saw the fork.
    """
    if getattr(_forking_from_main, "value", False):
        _set_parent_death_signal(signal.SIGKILL)
    reaper.register(runtime_dir)


def start_reaper(period: float = 0.5, grace: float = 1.5) -> Path:
    """Have everything this process starts end with it; returns the process's private runtime directory.

    Call it from the main thread, before any child process or thread is started. The runtime
    directory (also set as TMPDIR for this process and its children) is removed after the process.
    """
    existing = _watching_me()
    if existing is not None and os.path.isdir(existing):
        runtime_dir = existing
    else:
        sweep_dead_runtime_dirs(_runtime_base())
        runtime_dir = _owned_runtime_dir()
        peer = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                reaper.run(peer, runtime_dir, period, grace)
                # the runtime dirs of the peer's children that died before their own reapers could remove them
                # (killed as they started, or their reapers ended with them): each names its dead owner
                sweep_dead_runtime_dirs(_runtime_base())
            finally:
                os._exit(0)
        os.environ[REAPER_ENV] = f"{pid}:{runtime_dir}"
        _write_owner(Path(runtime_dir), peer, pid)
    # after the reaper's fork: the reaper itself must outlive us
    os.register_at_fork(before=_before_fork, after_in_child=functools.partial(_forked_child, runtime_dir))
    os.environ.setdefault(USER_TMPDIR_ENV, tempfile.gettempdir())
    os.environ["TMPDIR"] = runtime_dir
    tempfile.tempdir = None  # read TMPDIR again
    return Path(runtime_dir)


def _owned_runtime_dir() -> str:
    """A new runtime dir that names this process as its owner from the moment it has its name: made hidden,
    owned, then renamed (a peer killed between making it and forking its reaper left an ownerless dir, kept for
    OWNERLESS_GRACE; a hidden one it may still leave is swept like the rest)."""
    tag = "".join(c for c in os.environ.get(RUNTIME_TAG_ENV, "") if c.isalnum())[:MAX_TAG]
    hidden = Path(
        tempfile.mkdtemp(prefix=f".{RUNTIME_PREFIX}{tag}-" if tag else f".{RUNTIME_PREFIX}", dir=_runtime_base())
    )
    _write_owner(hidden, os.getpid(), 0)
    runtime_dir = hidden.with_name(hidden.name[1:])
    hidden.rename(runtime_dir)
    return str(runtime_dir)


def _write_owner(runtime_dir: Path, peer: int, reaper_pid: int) -> None:
    """Say in the runtime dir whose it is: the peer and its reaper, each with its start time (a reused pid is
    never taken for them), so that a later peer can tell a dead peer's dir from a live one's."""
    ticks = [(found[2] if (found := reaper.stat(pid)) is not None else 0) for pid in (peer, reaper_pid)]
    tmp = runtime_dir / f".{OWNER_FILE}"
    tmp.write_text(f"{peer} {ticks[0]} {reaper_pid} {ticks[1]}\n")
    tmp.rename(runtime_dir / OWNER_FILE)


def _owner_alive(runtime_dir: Path) -> bool | None:
    """Whether the peer or the reaper that owns `runtime_dir` still runs; None if the dir names no owner."""
    try:
        fields = [int(f) for f in (runtime_dir / OWNER_FILE).read_text().split()]
    except (OSError, ValueError):
        return None
    if len(fields) != 4:
        return None
    pairs = [(fields[0], fields[1]), (fields[2], fields[3])]
    return any((found := reaper.stat(pid)) is not None and found[2] == born for pid, born in pairs)


def sweep_dead_runtime_dirs(base: str) -> list[Path]:
    """Remove the runtime dirs under `base` (ours: same user) whose peer and reaper are both gone; which went.

    A reaper removes its peer's dir; when the reaper is killed too (a supervisor's SIGKILL to every process of
    a unit or container) the dir stays, with a copy of the peer's key in it: the next peer's start removes it.
    A dir that names no owner is removed once older than OWNERLESS_GRACE (one being made has none yet)."""
    removed = []
    for path in [*Path(base).glob(RUNTIME_PREFIX + "*"), *Path(base).glob(f".{RUNTIME_PREFIX}*")]:
        try:
            info = path.lstat()
        except OSError:
            continue
        if info.st_uid != os.getuid() or not path.is_dir() or path.is_symlink():
            continue
        alive = _owner_alive(path)
        if alive or (alive is None and time.time() - info.st_mtime < OWNERLESS_GRACE):
            continue
        reaper.remove_dir(str(path))
        if not path.exists():
            removed.append(path)
    return removed


def user_tempdir() -> str:
    """Where files that must outlive this process go (the runtime dir is removed with it)."""
    return os.environ.get(USER_TMPDIR_ENV) or tempfile.gettempdir()


# ---- ending -----------------------------------------------------------------------------------
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
    """End the process now: one line on stderr (never blocking), forked helpers get SIGTERM, then exit."""
    with contextlib.suppress(OSError):
        flags = fcntl.fcntl(2, fcntl.F_GETFL)
        fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)  # a stalled reader of stderr must not hold us
        os.write(2, f"peer: {reason}; exiting now.\n".encode())
    with contextlib.suppress(Exception):
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        deadline = time.monotonic() + EXIT_JOIN
        for child in children:
            child.join(timeout=max(0.0, deadline - time.monotonic()))
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

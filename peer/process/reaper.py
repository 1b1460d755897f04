"""The reaper: a small process that ends what a peer started once the peer is gone (peer.process.lifetime).

It follows the peer's descendants while the peer lives: their pids with their start times (so a
reused pid is never taken for one of them) and the unix sockets they bind under /tmp (hivemind
puts its p2p daemons' and clients' sockets there). When the peer exits, however it exits, the
reaper sends SIGTERM to those still alive, SIGKILL after a grace, through pidfds (a pid that was
reused meanwhile gets no signal), removes the sockets (those it saw, and those made during the
peer's life that nobody listens on any more: a helper that died with the peer before a look saw
it bind one) and the peer's runtime directory, and exits. Each process forked in the peer's tree
names itself in the runtime dir (register), so that a fork no look saw (the peer exited first)
is still followed to its children: hivemind's DHT process, dying with the peer, to its p2p daemon.

It runs in a session of its own: a signal to the peer's process group (a terminal's Ctrl+C, a
supervisor's `kill -9 -PGID`) does not end it before its work.
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field

SOCKET_FLAG = "-listen=/unix"  # how hivemind names a p2p daemon's unix socket on its command line
SOCKET_DIR = "/tmp/hivemind-"  # where hivemind puts its unix sockets, whatever TMPDIR says
# torch's shared-memory files (file_system sharing, which hivemind uses): torch_<creator pid>_<random>_<n>;
# torch_shm_manager unlinks them when their users exit, but it dies with the peer's process group
SHM_DIR = "/dev/shm"
SOCKET_LOOKS = 4  # the sockets the peer's processes hold are noted every this many looks
# looks that find no new descendant double the period between looks up to this many times the first (16 s); a
# descendant no look saw is still ended: every fork names itself in the runtime dir (register) and is followed
# to its children after the peer, forks from the peer's main thread die with it (parent-death signal), and
# hivemind's daemons of its process group are found by a scan after it (ORPHANS)
REST_LOOK_FACTOR = 32
LOG_DIR_ENV = "SWARMTRAIN_REAPER_LOG_DIR"  # when set, each reaper writes what it did to reaper-<peer pid>.log there
ORPHANS = ("p2pd",)  # what the peer's group may hold as an orphan we did not see yet: hivemind's daemons
# set by the peer (peer.process.lifetime) to "<reaper pid>:<runtime dir>": every program its tree execs after that
# carries it in its environment (hivemind's p2p daemon gets a copy of its DHT process's), and so names its reaper
REAPER_ENV = "SWARMTRAIN_REAPER"
ENVIRON_READ = 1 << 16  # bytes of a process's environment read when looking for the mark
SOCKET_SETTLE = 1.0  # s: a socket file younger than this may be bound but not listening yet
SOCKET_PROBE = 0.2  # s a probe's connect may take
BOUND_RECHECK = 0.2  # s: a young socket still bound as the reaper ends is looked at again after this
FORKS_FILE = "forks"  # in the runtime dir: "<pid> <start time>" of each process the peer's tree forked (register)
FORKS_READ = 1 << 20  # bytes: the reaper reads this much of its end (the newest forks; 50,000 lines)
RMTREE_TRIES = 20  # times the runtime dir is removed again while something still writes in it
RMTREE_PAUSE = 0.1  # s between those tries


# ---- reading /proc ------------------------------------------------------------------------------
def stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, process group, start time in clock ticks) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def children(pid: int) -> list[int]:
    """The children of `pid`, read from its threads' `children` lists (no scan of all processes)."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _carries(pid: int, mark: bytes) -> bool:
    """Whether the environment `pid` was exec'd with holds the line `mark` (not a forked child's later changes)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read(ENVIRON_READ).split(b"\0")
    except OSError:
        return False


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
    if not inodes:
        return set()
    table = _unix_sockets(str(pids[0]))  # the processes' own network namespace
    return {path for inode, path in table.items() if inode in inodes and path.startswith(prefix)}


def _unix_sockets(proc: str = "self") -> dict[str, str]:
    """inode -> path of the unix sockets bound to a path in the network namespace of /proc/`proc`."""
    try:
        with open(f"/proc/{proc}/net/unix") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return {}
    return {row[6]: row[7] for row in rows if len(row) >= 8}


def _listening(path: str) -> bool:
    """Whether some process listens on the unix socket at `path` (in any network namespace)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(SOCKET_PROBE)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a full backlog, a slow listener: someone is there
    finally:
        probe.close()
    return True


def stale_sockets(since: float, prefix: str = SOCKET_DIR) -> list[str]:
    """hivemind's unix sockets made since `since` (wall clock) that nobody listens on any more.

    A process that died with the peer before the reaper saw it bind (a DHT node started in the
    last look's period) leaves a socket file no list names. Bound sockets of this network namespace
    are skipped unprobed; others (a peer in another namespace, a file without a listener) get a
    connect, once the file is old enough that its maker has surely called listen().
    """
    candidates = {}
    for path in glob.glob(prefix + "*.sock"):
        with contextlib.suppress(OSError):
            made = os.lstat(path).st_ctime
            if made >= since:
                candidates[path] = made
    bound = set(_unix_sockets().values())
    if bound & set(candidates):  # a process still exiting (past the point where /proc names it) may bind one yet
        time.sleep(BOUND_RECHECK)
        bound = set(_unix_sockets().values())
    candidates = {p: made for p, made in candidates.items() if p not in bound}
    if candidates:
        time.sleep(max(0.0, max(candidates.values()) + SOCKET_SETTLE - time.time()))
    return [p for p in candidates if not _listening(p)]


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


# ---- following one peer -------------------------------------------------------------------------
@dataclass
class Watch:
    """What the reaper knows of one peer: its descendants so far and what to remove after it."""

    peer: int
    me: int
    group: int  # the peer's process group
    born: int  # the peer's start time (clock ticks)
    started: float  # wall clock when the reaper began to watch (before the peer started anything)
    # where the kernel puts the peer's orphans: its ancestors (a subreaper among them) and init, but
    # not its parent, whose other children (`peer join | tee`) are not the peer's
    adopters: set[int]
    seen: dict[int, int] = field(default_factory=dict)  # descendant pid -> start time
    # REAPER_ENV=<reaper>:<runtime dir>: a program our peer's tree exec'd carries it, wherever it was orphaned to
    mark: bytes = b""
    sockets: set[str] = field(default_factory=set)
    looks: int = 0

    def live(self) -> list[int]:
        """The descendants seen that still live (the same start time: not a reused pid)."""
        return [p for p, born in self.seen.items() if (found := stat(p)) is not None and found[2] == born]

    def look(self, peer_alive: bool = True) -> None:
        """Remember the peer's descendants as they are now (from the peer too while it lives)."""
        todo = [*([self.peer] if peer_alive else []), *self.live()]
        new = False
        while todo:
            for child in children(todo.pop()):
                if child == self.me or child in self.seen or (found := stat(child)) is None:
                    continue
                self.seen[child], new = found[2], True
                self.sockets.update(_sockets_of(child))
                todo.append(child)
        self.looks += 1
        if new or self.looks % SOCKET_LOOKS == 0:
            self.sockets.update(_bound_sockets([*([self.peer] if peer_alive else []), *self.live()]))

    def registered(self, runtime_dir: str) -> None:
        """Take as seen the forks that named themselves in the runtime dir (register), those still alive."""
        try:
            with open(os.path.join(runtime_dir, FORKS_FILE), "rb") as f:
                skip = max(0, os.fstat(f.fileno()).st_size - FORKS_READ)  # the newest forks: the live ones
                f.seek(skip, os.SEEK_SET)
                lines = f.read().decode(errors="replace").splitlines()[1 if skip else 0 :]  # not a cut line
                rows = [line.split() for line in lines]
        except OSError:
            return
        for row in rows:
            if len(row) == 2 and row[0].isdigit() and row[1].isdigit():
                pid, born = int(row[0]), int(row[1])
                if pid != self.me and (found := stat(pid)) is not None and found[2] == born:
                    self.seen.setdefault(pid, born)

    def leftovers(self, runtime_dir: str | None = None) -> list[int]:
        """After the peer: its descendants still alive, and hivemind daemons of its group orphaned unseen."""
        if runtime_dir is not None:  # forks made since the last look (one that dies with the peer: its children)
            self.registered(runtime_dir)
        self.look(peer_alive=False)  # children of those seen, born since the last look
        mine = set(self.live())
        for pid in self._orphans():
            self.sockets.update(_sockets_of(pid))
            mine.add(pid)
        mine.discard(self.me)
        return sorted(mine)

    def _orphans(self) -> list[int]:
        """Programs of the peer's tree no look saw: hivemind's daemons of its group adopted by an ancestor or
        init, and whatever carries our mark in its environment, whoever adopted it (a daemon whose DHT process
        was still exiting when we looked, one in a session of its own)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or (info := stat(int(entry))) is None or int(entry) in (self.me, self.peer):
                continue
            ppid, group, born = info
            pid = int(entry)
            if born < self.born:
                continue
            ours = group == self.group and ppid in self.adopters and _comm(pid) in ORPHANS
            if ours or (self.mark and _carries(pid, self.mark)):
                self.seen[pid] = born
                found.append(pid)
        return found


def _handles(pids: list[int], watch: Watch) -> dict[int, int]:
    """pidfds of the processes, opened while their start time is checked: a reused pid gets none."""
    handles = {}
    for pid in pids:
        try:
            handle = os.pidfd_open(pid)
        except OSError:
            continue
        if (found := stat(pid)) is not None and found[2] == watch.seen.get(pid):
            handles[pid] = handle
        else:
            os.close(handle)
    return handles


def _end(handles: dict[int, int], grace: float) -> None:
    for handle in handles.values():
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(handle, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(stat(p) is not None for p in handles):
        time.sleep(0.05)
    for handle in handles.values():
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        os.close(handle)


def _follow(watch: Watch, period: float) -> None:
    """Look at the peer's descendants every `period` (less often while none is born) until the peer exits."""
    try:
        pidfd = os.pidfd_open(watch.peer)
    except ProcessLookupError:
        return  # it exited, and was reaped, since we first looked
    try:
        if (found := stat(watch.peer)) is not None and found[2] != watch.born:
            return  # that pid is another process's now: the peer has exited
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the peer has exited
        wait = period
        while not poller.poll(wait * 1000):
            known = len(watch.seen)
            watch.look()
            # nothing new: the looks grow apart up to REST_LOOK_FACTOR x period (a look reads every thread's
            # children list: 0.003 of a core at 0.5 s, 0.0006 at 2 s); a new descendant makes them `period` apart again
            wait = period if len(watch.seen) != known else min(2 * wait, REST_LOOK_FACTOR * period)
    finally:
        os.close(pidfd)


def _quiet(line: str) -> None:
    """The logger of a reaper that logs nothing."""


def reap(watch: Watch, runtime_dir: str, period: float, grace: float, log=_quiet) -> None:
    """The reaper's life: follow the peer until it exits, then end and remove what it left.

    The sockets it knows go even if ending the processes fails; `log` hears each step (diagnostics)."""
    _follow(watch, period)
    log(f"peer {watch.peer} exited; seen {sorted(watch.seen)}, sockets {sorted(watch.sockets)}")
    stale: list[str] = []
    try:
        for _ in range(2):  # a process forked while we ended the others is caught the second time
            leftovers = watch.leftovers(runtime_dir)
            log(f"leftovers {leftovers}")
            if leftovers:
                _end(_handles(leftovers, watch), grace)
        stale = stale_sockets(watch.started)
        if log is not _quiet:  # finding the bound ones reads /proc/net/unix: only when someone listens
            log(f"stale sockets {sorted(stale)}; still bound {sorted(_bound_elsewhere(watch.started))}")
    finally:
        for path in watch.sockets | set(stale):
            with contextlib.suppress(OSError):
                os.unlink(path)
        remove_dir(runtime_dir, log)
        log(f"shared memory files removed: {remove_shared_memory([watch.peer, *watch.seen])}")
    log("done")


def register(runtime_dir: str) -> None:
    """In a process just forked in a peer's tree: name it (pid, start time) in the runtime dir's FORKS_FILE.

    One short append (atomic); a failure is ignored: the reaper's looks and its scan for orphans remain."""
    found = stat(os.getpid())
    if found is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(runtime_dir, FORKS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {found[2]}\n".encode())
        finally:
            os.close(fd)


def remove_dir(path: str, log=_quiet) -> None:
    """Remove the runtime dir, again while something (a helper still exiting) puts files in it; `log` hears what stays."""
    failed: list[str] = []
    for _ in range(RMTREE_TRIES):
        failed.clear()
        shutil.rmtree(path, onerror=lambda _f, where, e: failed.append(f"{where}: {e[1]}"))
        if not os.path.lexists(path):
            return
        log(f"runtime dir not removed yet: {failed[:5]}")
        time.sleep(RMTREE_PAUSE)


def remove_shared_memory(pids, directory: str = SHM_DIR) -> int:
    """Remove the torch shared-memory files that processes `pids` (all gone) created; how many."""
    removed = 0
    for pid in pids:
        for path in glob.glob(os.path.join(directory, f"torch_{pid}_*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    return removed


def _bound_elsewhere(since: float, prefix: str = SOCKET_DIR) -> list[str]:
    """hivemind's sockets made since `since` that a live process still binds (diagnostics: not removed)."""
    bound = set(_unix_sockets().values())
    made = []
    for path in glob.glob(prefix + "*.sock"):
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ctime >= since and path in bound:
                made.append(path)
    return made


def _log_to(peer: int):
    """A line logger for the reaper of `peer`: to reaper-<peer>.log under LOG_DIR_ENV, or nowhere."""
    where = os.environ.get(LOG_DIR_ENV)
    if not where:
        return _quiet

    def log(line: str) -> None:
        with contextlib.suppress(OSError), open(os.path.join(where, f"reaper-{peer}.log"), "a") as f:
            f.write(f"{time.time():.3f} {line}\n")

    return log


def watch_parent(peer: int, runtime_dir: str = "") -> Watch | None:
    """In the reaper: what it must know of the peer (its parent); None if the peer is already gone."""
    found = stat(peer)
    if found is None or os.getppid() != peer:
        return None
    parent, group, born = found
    adopters, pid = {1}, parent
    while pid > 1 and (up := stat(pid)) is not None:
        adopters.add(pid)
        pid = up[0]
    adopters.discard(parent)
    watch = Watch(peer, os.getpid(), group, born, time.time() - 1.0, adopters)
    watch.mark = f"{REAPER_ENV}={watch.me}:{runtime_dir}".encode()
    return watch


def run(peer: int, runtime_dir: str, period: float, grace: float) -> None:
    """The reaper process, just forked from `peer`: detach, then follow and clean up after it."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's Ctrl+C is for the peer; we clean up after
    os.setsid()  # and a signal to the peer's whole group does not end us before our work
    devnull = os.open(os.devnull, os.O_RDWR)  # we hold none of the peer's pipes: its readers see EOF
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    log = _log_to(peer)
    try:
        watch = watch_parent(peer, runtime_dir)  # None: the peer died before we looked (SIGKILLed as it started)
        log(f"watching {peer}" if watch is not None else f"peer {peer} gone before the first look")
        if watch is not None:
            reap(watch, runtime_dir, period, grace, log)
    except BaseException as e:  # said in the log (the reaper has no output), then the runtime dir still goes
        log(f"failed: {type(e).__name__}: {e}")
        raise
    finally:  # whatever happened, the peer's runtime dir goes
        remove_dir(runtime_dir, log)

"""Nothing outlives the command that started it: real processes, real SIGKILL and SIGTERM.

`peer demo` and a benchmark start whole swarms (coordinator, servers, trainers, each with its
hivemind DHT process, averagers and libp2p daemon). Whatever ends them, everything they started
must be gone within seconds: no p2pd, no forked helper, no temporary directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.processes import alive, descendants, runtime_dirs
from helpers.swarm import ROOT, write_spec

from peer.cli.demo import loopback_coordinator
from peer.process.forkserver import Forkserver
from peer.process.lifetime import tied_to_me
from peer.process.reaper import LOG_DIR_ENV

GONE_WITHIN = 10.0  # s


def _start(argv: list[str], workdir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir))
    with open(log, "wb") as out:
        return subprocess.Popen(
            tied_to_me(argv),
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _follow_until(proc: subprocess.Popen, log: Path, pattern: str, timeout: float) -> set[int]:
    """Every process `proc` started so far, polled until `pattern` appears in its log."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.update(descendants(proc.pid))
        if re.search(pattern, log.read_text(errors="replace")):
            seen.update(descendants(proc.pid))
            return seen
        assert proc.poll() is None, f"exited early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-3000:]}")


def _tails(log: Path, workdir: Path, chars: int = 1500) -> str:
    """The end of a run's own log and of each peer log in its work directory: why a swarm did not come up."""
    logs = [log, *sorted(workdir.rglob("*.log"))] if workdir.exists() else [log]
    return "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-chars:]}" for p in logs if p.exists())


def _names(pids) -> list[str]:
    out = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            command = b" ".join(argv).decode(errors="replace")
            # the program's own name first: a deep checkout's path would push it past the shortened command
            out.append(f"{pid} {os.path.basename(argv[0].decode(errors='replace'))} {command[:100]}")
        except OSError:
            out.append(str(pid))
    return out


def _all_gone(pids: set[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _kill_everything(proc: subprocess.Popen, pids: set[int]) -> None:
    """Cleanup if the test failed: nothing may stay behind whatever the outcome."""
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(10)


def test_a_killed_demo_leaves_nothing_behind(tmp_path):
    workdir = tmp_path / "demo"
    log = tmp_path / "demo.log"
    before = {p.name for p in Path("/tmp").glob("hivemind-*.sock")}
    dirs = runtime_dirs(Path("/tmp"), tmp_path)
    proc = _start(
        [sys.executable, "-m", "peer.cli.main", "demo", "--workdir", str(workdir), "--steps", "100000"], tmp_path, log
    )
    pids: set[int] = set()
    try:
        # 30 s in, or once both trainers are up (then every kind of process has started), whichever is first
        try:
            pids = _follow_until(proc, log, r"starting 2 trainers", 30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                pids.update(descendants(proc.pid))
                if all((workdir / f"trainer{i}.log").exists() for i in range(2)) and any(
                    "p2pd" in n for n in _names(pids)
                ):
                    break
                time.sleep(0.2)
        except AssertionError:
            pids.update(descendants(proc.pid))  # 30 s without trainers on a slow machine: kill it anyway
        names = _names(pids)
        assert sum("p2pd" in n for n in names) >= 3, f"{names}\n{_tails(log, workdir)}"  # the swarm really was up
        pids.update(descendants(proc.pid))
        assert _shared_memory(pids), "the swarm's averagers made no torch shared-memory files to clean up"
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        left = _all_gone(pids, GONE_WITHIN)
        assert not left, f"alive {GONE_WITHIN:.0f} s after the demo's SIGKILL: {_names(left)}"
        print(f"everything the demo started ({len(pids)} processes) was gone {time.monotonic() - killed:.1f} s after")
        leftovers = {p.name for p in Path("/tmp").glob("hivemind-*.sock")} - before
        assert not leftovers, f"p2p sockets left: {leftovers}"
        deadline = time.monotonic() + GONE_WITHIN  # (the reapers remove them last)
        while runtime_dirs(Path("/tmp"), workdir) - dirs and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not runtime_dirs(Path("/tmp"), workdir) - dirs, "runtime directories (with key copies) left"
        deadline = time.monotonic() + GONE_WITHIN
        while _shared_memory(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _shared_memory(pids), f"torch shared-memory files left in /dev/shm: {_shared_memory(pids)[:5]}"
    finally:
        _kill_everything(proc, pids)


def _shared_memory(pids) -> list[str]:
    """The torch shared-memory files (file_system sharing) that processes `pids` created."""
    return [path for pid in pids for path in glob.glob(f"/dev/shm/torch_{pid}_*")]


def test_a_terminated_benchmark_stops_its_swarm(tmp_path):
    log = tmp_path / "bench.log"
    argv = [sys.executable, str(ROOT / "benchmarks" / "swarm_vs_local.py"), "--quick", "--workdir", str(tmp_path / "w")]
    proc = _start(argv, tmp_path, log)
    pids: set[int] = set()
    try:
        pids = _follow_until(proc, log, r"serving|Serving", 120)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("p2pd" in n for n in _names(pids)) < 2:
            pids.update(descendants(proc.pid))
            time.sleep(0.2)
        assert sum("p2pd" in n for n in _names(pids)) >= 2, f"{_names(pids)}\n{_tails(log, tmp_path / 'w')}"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(GONE_WITHIN) == 130  # interrupted, and said so in its last line
        assert log.read_text().strip().splitlines()[-1].endswith("status=interrupted")
        left = _all_gone(pids, GONE_WITHIN)
        assert not left, f"alive {GONE_WITHIN:.0f} s after the benchmark's SIGTERM: {_names(left)}"
    finally:
        _kill_everything(proc, pids)


def test_the_reaper_finds_sockets_nobody_listens_on_any_more(tmp_path):
    """A helper that died with its peer before the reaper saw it bind leaves a socket file: it is
    found by age and by a refused connect; a socket still listened on, or older than the peer, is not."""
    import socket

    from peer.process.reaper import stale_sockets

    prefix = str(tmp_path / "hivemind-")
    old = socket.socket(socket.AF_UNIX)
    old.bind(prefix + "old.sock")
    old.close()
    time.sleep(0.1)  # not a wait for anything: file times lag the clock by up to a tick; keep them apart
    since = time.time()
    time.sleep(0.1)
    dead, live = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    dead.bind(prefix + "dead.sock")
    dead.close()
    live.bind(prefix + "live.sock")
    live.listen()
    try:
        assert stale_sockets(since, prefix) == [prefix + "dead.sock"]
    finally:
        live.close()


def test_a_peer_killed_as_it_starts_leaves_no_runtime_dir(tmp_path):
    """The peer dies as its reaper starts (a peer SIGKILLed as it starts, as when its demo dies): before
    the reaper looks at it, or between its first look and following it. The reaper still removes the
    peer's runtime directory."""
    program = (
        "import os, signal, sys\n"
        "from peer.process.lifetime import start_reaper\n"
        "print(start_reaper(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == -signal.SIGKILL, out.stderr
        runtime_dir = Path(out.stdout.strip())
        assert runtime_dir.name.startswith("swarmtrain-peer-"), out.stdout
        deadline = time.monotonic() + GONE_WITHIN
        while runtime_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not runtime_dir.exists(), f"{runtime_dir} left behind"


def test_torch_s_shared_memory_works_in_the_runtime_dir_of_any_temporary_directory():
    """torch's shared-memory manager binds a unix socket in the runtime dir (hivemind shares tensors through it):
    with a temporary directory of 32-48 chars and the longest tag, its path once passed the 107 chars a socket's
    path may have (bind: EINVAL, every peer of a test with a short name failed to start). Each length of
    temporary directory gives a runtime dir where it fits."""
    program = (
        "import torch, torch.multiprocessing as mp\n"
        "from peer.process.lifetime import start_reaper\n"
        "print(start_reaper(), flush=True)\n"
        "mp.set_sharing_strategy('file_system')\n"
        "torch.empty(8, dtype=torch.uint8).share_memory_()\n"
    )
    for length in (20, 31, 32, 48, 60):
        base = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
        tmpdir = base / ("d" * (length - len(str(base)) - 1))
        tmpdir.mkdir()
        env = dict(os.environ, TMPDIR=str(tmpdir), SWARMTRAIN_RUNTIME_TAG="t" * 20)
        try:
            out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)
            assert out.returncode == 0, (length, out.stderr[-2000:])
        finally:
            shutil.rmtree(base, ignore_errors=True)


def test_a_peer_killed_before_its_reaper_exists_leaves_a_dir_that_names_it_and_its_parent_s_reaper_sweeps(tmp_path):
    """A runtime dir names its owner from the moment it has its name (it is made hidden, owned, then renamed): a
    peer killed before it forked its reaper (the demo's peers as the demo dies) left an ownerless one, kept for 10
    minutes. Now the reaper of the process that started it sweeps it as it ends: here a child killed between the
    two, and its parent's exit."""
    program = (
        "import os, signal, subprocess, sys\n"
        "from peer.process import lifetime\n"
        "lifetime.start_reaper()\n"
        "child = subprocess.run([sys.executable, '-c', 'import os, signal\\n'\n"
        "    'from peer.process import lifetime\\n'\n"
        "    'print(lifetime._owned_runtime_dir(), flush=True)\\n'\n"
        "    'os.kill(os.getpid(), signal.SIGKILL)'], capture_output=True, text=True,\n"
        "    env=dict(os.environ, TMPDIR=os.environ[lifetime.USER_TMPDIR_ENV]))\n"
        "print(child.stdout.strip(), flush=True)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    left = Path(out.stdout.strip().splitlines()[-1])
    # beside the parent's runtime dir (as a demo's peers' are), not in it (which goes with the parent anyway)
    assert left.name.startswith("swarmtrain-peer-") and not left.parent.name.startswith("swarmtrain-peer-"), out
    deadline = time.monotonic() + GONE_WITHIN
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left.exists(), f"{left} left behind"
    assert not list(left.parent.glob(f".{left.name}")), "its hidden name left behind"


def test_a_fork_no_look_saw_is_still_ended_with_what_it_started(tmp_path):
    """The peer forks a helper and exits before its reaper's first look (hivemind's DHT process of a peer
    stopped a second after it started, whose p2p daemon outlived it once on a clean clone). The helper named
    itself in the runtime dir as it was forked: the reaper ends it and what it started all the same."""
    program = (
        "import ctypes, os, subprocess, sys, time\n"
        "from peer.process.lifetime import start_reaper\n"
        "start_reaper(period=60.0)\n"  # no look before the peer exits
        "child = os.fork()\n"
        "if child == 0:\n"
        "    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"  # outlives the peer: no parent-death signal
        "    sleeper = subprocess.Popen(['sleep', '120'])\n"
        "    print(os.getpid(), sleeper.pid, flush=True)\n"
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "sys.stdin.readline()\n"  # the test has read both pids: exit
        "os._exit(0)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path), **{LOG_DIR_ENV: str(tmp_path)})
    peer = subprocess.Popen(
        [sys.executable, "-c", program],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    pids = set()
    try:
        pids = {int(p) for p in peer.stdout.readline().split()}
        assert len(pids) == 2 and all(alive(p) for p in pids)
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert peer.wait(30) == 0
        left = _all_gone(pids, GONE_WITHIN)
        assert not left, f"left behind: {_names(left)}\n" + "\n".join(
            f.read_text() for f in tmp_path.glob("reaper-*.log")
        )
    finally:
        _kill_everything(peer, pids)


def test_a_daemon_whose_forking_parent_died_first_is_ended_by_the_mark_in_its_environment(tmp_path):
    """A fork of the peer starts a daemon named p2pd in a session of its own and dies before the peer: the daemon
    is adopted by init, no look saw it, its forking parent is gone (its name in the runtime dir leads nowhere), and
    its process group is not the peer's (a fresh-clone CI run left a p2p daemon whose DHT process was exiting as
    the reaper looked). It carries the reaper's mark in the environment it was exec'd with: the reaper ends it."""
    daemon = tmp_path / "p2pd"
    daemon.symlink_to("/bin/sleep")
    program = (
        "import os, subprocess, sys\n"
        "from peer.process.lifetime import start_reaper\n"
        "start_reaper(period=60.0)\n"  # no look before the peer exits
        "child = os.fork()\n"
        "if child == 0:\n"
        f"    d = subprocess.Popen([{str(daemon)!r}, '120'], start_new_session=True)\n"
        "    print(d.pid, flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "sys.stdin.readline()\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path), **{LOG_DIR_ENV: str(tmp_path)})
    peer = subprocess.Popen(
        [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    pids = set()
    try:
        pids = {int(peer.stdout.readline())}
        assert all(alive(p) for p in pids)
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert peer.wait(30) == 0
        left = _all_gone(pids, GONE_WITHIN)
        assert not left, f"left behind: {_names(left)}\n" + "\n".join(
            f.read_text() for f in tmp_path.glob("reaper-*.log")
        )
    finally:
        _kill_everything(peer, pids)


def test_a_forked_peer_is_its_own_process_and_dies_with_its_template(tmp_path):
    """peer.process.forkserver, which the fixtures start their peers with: each child runs its own command line,
    directory, environment and output, with its own exit code; when the template ends, a running
    child and all it started (its reaper's work) end with it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path), **{LOG_DIR_ENV: str(tmp_path)})
    others = runtime_dirs(Path("/tmp"), tmp_path)  # other peers' (earlier runs' too): not this test's to judge
    with Forkserver(env=env) as server:
        log = tmp_path / "version.log"
        with open(log, "wb") as out:
            assert server.start(["--version"], str(tmp_path), env, out.fileno()).wait(30) == 0
        assert log.read_text().startswith("peer (swarmtrain) ")
        with open(tmp_path / "keygen.log", "wb") as out:  # its environment: the key goes to XDG_CONFIG_HOME
            own = dict(env, XDG_CONFIG_HOME=str(tmp_path / "config"))
            assert server.start(["keygen"], str(tmp_path), own, out.fileno()).wait(30) == 0
        assert (tmp_path / "config" / "swarmtrain" / "identity.pem").exists()
        with open(tmp_path / "bad.log", "wb") as out:
            bad = server.start(["generate", "no-such-checkpoint"], str(tmp_path), env, out.fileno())
            assert bad.wait(30) == 2
        assert "peer generate: no-such-checkpoint: no complete checkpoint" in (tmp_path / "bad.log").read_text()
        with open(tmp_path / "nowhere.log", "wb") as out:  # a child that cannot start says why; the template serves on
            assert server.start(["--version"], str(tmp_path / "gone"), env, out.fileno()).wait(30) == 1
        assert "FileNotFoundError" in (tmp_path / "nowhere.log").read_text()

        spec = write_spec(tmp_path / "run.toml", {"name": "forked", "stages": {"num_stages": 1}})
        info = tmp_path / "coordinator.json"
        with open(tmp_path / "coordinator.log", "wb") as out:
            argv = loopback_coordinator(str(spec), str(info))
            coordinator = server.start(argv, str(tmp_path), env, out.fileno())
        pids = _follow_coordinator(coordinator, info, tmp_path / "coordinator.log")
        assert os.getsid(coordinator.pid) == coordinator.pid  # a session (and process group) of its own
        assert any("p2pd" in _cmdline(pid) for pid in pids), "the coordinator's DHT daemon was not seen"
        assert os.getcwd() != str(tmp_path) and os.readlink(f"/proc/{coordinator.pid}/cwd") == str(tmp_path)
    # hivemind makes multiprocessing locks at import: a template that held them would share them among all its
    # children, and one SIGKILLed holding one would hang the others (failed one clean-clone run)
    with pytest.raises(RuntimeError, match="must not import"):
        Forkserver(preload=("hivemind",), env=env)
    deadline = time.monotonic() + GONE_WITHIN
    while [p for p in pids if alive(p)] or runtime_dirs(Path("/tmp"), tmp_path) - others:
        assert time.monotonic() < deadline, (
            f"left after the template ended: {[(p, _cmdline(p)) for p in pids if alive(p)]}, "
            f"{runtime_dirs(Path('/tmp'), tmp_path) - others}\n"
            + "\n".join(f.read_text() for f in tmp_path.glob("reaper-*.log"))
        )
        time.sleep(0.1)
    assert coordinator.poll() == -signal.SIGKILL


def _follow_coordinator(coordinator, info: Path, log: Path) -> set[int]:
    """The coordinator's process and its descendants, once it has written its join line."""
    deadline = time.monotonic() + 60
    while not info.exists():
        assert coordinator.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    pids = {coordinator.pid, *descendants(coordinator.pid)}
    while not any("p2pd" in _cmdline(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
        pids.update(descendants(coordinator.pid))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_HOLDER = (
    "import os, sys, time\n"
    "from peer.process.lifetime import start_reaper\n"
    "print(start_reaper(), os.environ['SWARMTRAIN_REAPER'].split(':')[0], flush=True)\n"
    "time.sleep(120)\n"
)


def _holder(env: dict) -> tuple[subprocess.Popen, Path, int]:
    """A process that starts its reaper and waits (in a process group of its own): it, its dir, its reaper."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    runtime_dir, reaper_pid = proc.stdout.readline().split()
    return proc, Path(runtime_dir), int(reaper_pid)


def test_the_next_peer_sweeps_what_a_killed_peer_and_reaper_left(tmp_path):
    """A supervisor that SIGKILLs every process of a unit (systemd, a container runtime, `timeout -s KILL` of a
    tree) kills the reaper with its peer: nobody removes the peer's runtime dir, with its key copy. The next
    peer's start removes it (its owner and reaper gone), and keeps the dir of a peer that lives."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("SWARMTRAIN_REAPER", None)
    living, living_dir, _ = _holder(env)
    dead, dead_dir, dead_reaper = _holder(env)
    try:
        (dead_dir / "libp2p.key").write_bytes(b"secret")
        os.killpg(dead.pid, signal.SIGKILL)  # the peer's whole process group...
        os.kill(dead_reaper, signal.SIGKILL)  # ...and its reaper, in a session of its own
        dead.wait(30)
        deadline = time.monotonic() + GONE_WITHIN
        while alive(dead_reaper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(dead_reaper)
        assert dead_dir.exists(), "nobody was left to remove it: the scenario did not happen"
        out = subprocess.run(
            [sys.executable, "-c", "from peer.process.lifetime import start_reaper; print(start_reaper())"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert not dead_dir.exists(), f"{dead_dir} of a dead peer was not swept"
        assert living_dir.is_dir(), "the runtime dir of a live peer was swept"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(living.pid, signal.SIGKILL)
        living.wait(30)
    deadline = time.monotonic() + GONE_WITHIN
    while living_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not living_dir.exists(), "the live peer's reaper did not remove its dir"

"""Fixtures that start real peers (coordinator, stage servers, trainers) as OS processes on loopback.

Peers are forked from one template process that has done the imports (peer.forkserver): each is
still a process of its own, in its own process group, running `peer.cli.main` with its own command
line. It dies with the template, which dies with the test process (PR_SET_PDEATHSIG). When
the test ends, pass or fail, the fixture SIGKILLs each peer; the peer's reaper (peer.lifetime)
ends what it started (the DHT and averager processes, the p2p daemons), and the fixture checks
that none of them is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from peer.demo import dict_to_toml, loopback_coordinator, loopback_join
from peer.forkserver import Forkserver
from peer.lifetime import tied_to_me

# endpoint -> (test workdir, identity file of the peer serving it): what a test's own TLS client pins
_SERVERS: dict[str, tuple[Path, Path]] = {}

ROOT = Path(__file__).resolve().parent.parent
PEER = [sys.executable, "-m", "peer.cli"]
REAPED = [sys.executable, str(ROOT / "tests" / "helpers" / "reaped.py")]  # a helper program, under a reaper


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(dict_to_toml(spec))
    return path


class Peer:
    def __init__(
        self,
        name: str,
        args: list[str],
        workdir: Path,
        niceness: int = 0,
        tty: bool = False,
        python: bool = False,
        forkserver: Forkserver | None = None,
    ):
        """Start `peer ARGS` (with `python`: `python ARGS` under a reaper, tests/helpers/reaped.py); with `tty` its
        output is a pseudo-terminal. With a `forkserver`, a peer is forked from its template (peer.forkserver):
        the same process, without the seconds of imports."""
        self.name, self.python = name, python
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        # TMPDIR: temporary files of the peer (torch, multiprocessing) go to the test's dir. hivemind's
        # p2p daemons put their unix sockets in /tmp whatever TMPDIR says: see remove_stale_sockets
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir))
        out, self._copier = self._log, None
        if tty:
            master, out = pty.openpty()
            env.update(COLUMNS="120", LINES="40", TERM="xterm-256color")
        try:
            if forkserver is not None and not python:
                output = out if isinstance(out, int) else out.fileno()
                self.proc = forkserver.start(args, str(workdir), env, output, niceness)
            else:
                self.proc = subprocess.Popen(
                    # with its niceness, and dying with this test process (SIGKILL included)
                    tied_to_me([*REAPED, *args] if python else [*PEER, *args], niceness=niceness),
                    cwd=workdir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
        except BaseException:
            if tty:
                os.close(master)
                os.close(out)
            raise
        if tty:
            os.close(out)
            self._copier = threading.Thread(target=self._copy, args=(master,), daemon=True)
            self._copier.start()
        self.known_pids: set[int] = {self.proc.pid}

    def _copy(self, master: int) -> None:
        """The terminal's output into the log, until the peer closes it."""
        try:
            while chunk := os.read(master, 65536):
                self._log.write(chunk)
                self._log.flush()
        except (OSError, ValueError):
            pass  # EIO: every process holding the terminal has exited (ValueError: the log was closed)
        finally:
            os.close(master)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.known_pids.update(descendants(self.proc.pid))
            match = re.search(pattern, self.output())
            if match:
                return match
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.proc.returncode}) before {pattern!r}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: no {pattern!r} within {timeout} s:\n{self.output()[-3000:]}")

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.known_pids.update(descendants(self.proc.pid))
            if self.proc.poll() is not None:
                return self.proc.returncode
            time.sleep(0.2)
        raise AssertionError(f"{self.name} still running after {timeout} s:\n{self.output()[-3000:]}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.known_pids.update(descendants(self.proc.pid))
            os.kill(self.proc.pid, sig)

    def terminate(self) -> None:
        """Ask the peer (its process group) to leave: SIGTERM."""
        if self.proc.poll() is None:
            self.known_pids.update(descendants(self.proc.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def end(self) -> None:
        """SIGKILL a peer's own process (its reaper ends the rest); another program (a helper script,
        hivemind's own DHT node) gets SIGTERM to its group and a few seconds to clean up first.
        Then close what the fixture holds of it."""
        if self.proc.poll() is None:
            self.known_pids.update(descendants(self.proc.pid))
            if self.python:
                self.kill(grace=5.0)
                return
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._copier is not None:
            self._copier.join(5)
        self._log.close()

    def kill(self, grace: float = 8.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace`. A peer's reaper, in a session of its own,
        is spared: it ends what the peer started and removes its files (stop_all checks that it did)."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._copier is not None:
            self._copier.join(5)
        self._log.close()


class Swarm:
    """Starts the peers of one test run in `workdir` and remembers them for cleanup."""

    def __init__(self, workdir: Path, forkserver: Forkserver | None = None):
        self.workdir, self.forkserver = workdir, forkserver
        self.peers: list[Peer] = []
        self.maddr = ""

    def start(self, name: str, args: list[str], niceness: int = 0, tty: bool = False, python: bool = False) -> Peer:
        peer = Peer(name, args, self.workdir, niceness, tty, python, self.forkserver)
        self.peers.append(peer)
        return peer

    def coordinator(self, spec: dict, timeout: float = 60, extra: list[str] = ()) -> str:
        path = write_spec(self.workdir / "run.toml", spec)
        info = self.workdir / "coordinator.json"
        peer = self.start(
            "coordinator",
            loopback_coordinator(str(path), str(info), *extra),
        )
        deadline = time.monotonic() + timeout
        while not info.exists():
            if peer.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"coordinator did not start:\n{peer.output()}")
            time.sleep(0.2)
        self.maddr = json.loads(info.read_text())["join"].split()[-1]
        return self.maddr

    def server(self, name: str, stage: int | None = None, extra: list[str] = (), niceness: int = 0) -> Peer:
        stage_args = ["--stage", str(stage)] if stage is not None else []
        return self.start(name, loopback_join(self.maddr, name, *extra, *stage_args), niceness)

    def trainer(self, name: str, extra: list[str] = (), niceness: int = 0, tty: bool = False) -> Peer:
        return self.start(
            name,
            loopback_join(self.maddr, name, "--role", "trainer", "--log-file", f"{name}.jsonl", *extra),
            niceness,
            tty,
        )

    def endpoint(self, server: Peer, timeout: float = 120) -> str:
        endpoint = server.wait_for(r"Serving stage \d+ at (\S+) from step", timeout).group(1)
        self.known(endpoint, server.name)
        return endpoint

    def known(self, endpoint: str, name: str) -> str:
        """Remember that peer `name` serves `endpoint`, so this test's TLS clients can pin its key."""
        _SERVERS[endpoint] = (self.workdir, self.workdir / f"{name}.pem")
        return endpoint

    def log(self, name: str) -> list[dict]:
        path = self.workdir / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def stop_all(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every peer (a test that checks leaving makes its peers leave itself); each peer's reaper
        (peer.lifetime) then ends what the peer started. Returns what is still alive after `timeout`."""
        for peer in self.peers:
            peer.end()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [pid for peer in self.peers for pid in peer.known_pids if alive(pid)]
            if not left:
                return []
            time.sleep(0.1)
        for pid in left:  # reported as a failure; killed so that nothing outlives the test all the same
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return left


def hivemind_sockets() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("hivemind-*.sock")}


def remove_stale_sockets(before: set[str]) -> None:
    """Remove the unix sockets that killed p2p daemons left in /tmp since `before` (nobody listens there)."""
    from peer.reaper import stale_sockets

    for path in set(stale_sockets(0.0)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


def runtime_dirs(*places: Path) -> set[Path]:
    """The peers' runtime directories (peer.lifetime) in these places: each reaper removes its own."""
    return {d for place in places for d in place.glob("swarmtrain-peer-*")}


@pytest.fixture(scope="session", autouse=True)
def forkserver(tmp_path_factory):
    """The template the fixtures fork their peers from (peer.forkserver): started before any module, so
    that each module's check below counts it as already there. Its own output goes to template.log."""
    log = tmp_path_factory.mktemp("forkserver") / "template.log"
    with Forkserver(env=dict(os.environ, PYTHONUNBUFFERED="1"), log=str(log)) as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    """Whatever a test module started has ended with it (its peers' reapers done): no process of ours,
    no peer's runtime directory, no p2p socket. Polled for a few seconds: a reaper ends its peer's
    helpers first."""
    dirs, before, sockets = runtime_dirs(Path("/tmp")), set(descendants(os.getpid())), hivemind_sockets()
    yield
    deadline = time.monotonic() + 10
    while True:
        procs = [p for p in descendants(os.getpid()) if p not in before and alive(p) and not _torch_helper(p)]
        left = runtime_dirs(Path("/tmp")) - dirs
        stale = hivemind_sockets() - sockets
        if not (procs or left or stale) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    commands = {p: _command(p) for p in procs}
    for pid in procs:  # reported below; ended so that nothing outlives the test run all the same
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    assert not commands, f"processes left behind by this module: {commands}"
    assert not left, f"runtime directories left behind by this module: {sorted(map(str, left))}"
    assert not stale, f"p2p sockets left behind by this module: {sorted(stale)}"


def _torch_helper(pid: int) -> bool:
    """torch's shared-memory manager, which the test process itself starts and keeps until it exits."""
    return os.path.basename(_command(pid).split(" ", 1)[0]) == "torch_shm_manager"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


@pytest.fixture
def swarm(tmp_path, forkserver):
    s = Swarm(tmp_path, forkserver)
    sockets, dirs = hivemind_sockets(), runtime_dirs(Path("/tmp"), tmp_path)
    try:
        yield s
    finally:
        leftovers = s.stop_all()
        stale = hivemind_sockets() - sockets
        remove_stale_sockets(sockets)  # a helper script's (hivemind-dht, rogue.py): no reaper of ours there
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not runtime_dirs(Path("/tmp"), tmp_path) - dirs, "a peer's runtime directory was left behind"
    if not any(p.python for p in s.peers):
        assert not stale, f"p2p sockets left behind: {stale}"


class TestCredential:
    """A credential for the test process itself, signed with the run's coordinator key (the test owns
    the run): what peer.client needs of a peer.security.Security."""

    def __init__(self, workdir: Path, roles: tuple[str, ...] = ("trainer", "server")):
        import grpc
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        from dht.credential import RunAuthority, ownership_proof
        from dht.identity import Identity

        spec = tomllib.loads((workdir / "run.toml").read_text())
        authority = RunAuthority(Identity.load(workdir / "coordinator.pem"), spec.get("name", "swarmtrain"))
        self.identity, key = Identity.generate(), ec.generate_private_key(ec.SECP256R1())
        nonce = os.urandom(16)
        proof = ownership_proof(self.identity, key.public_key(), nonce)
        cert = authority.issue(self.identity.peer_id, key.public_key(), roles, nonce, proof, 3600)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.generation = 1
        self.credentials = grpc.ssl_channel_credentials(
            authority.pem(), key_pem, cert.public_bytes(serialization.Encoding.PEM)
        )

    def channel_credentials(self):
        return self.credentials

    def target_name(self, endpoint: str, peer_id: str | None = None) -> str:
        from dht.credential import dns_name_of
        from dht.identity import Identity

        return dns_name_of(peer_id or Identity.load(_SERVERS[endpoint][1]).peer_id)


def test_credential(endpoint: str) -> TestCredential | None:
    """A credential good for the run `endpoint` belongs to (None when that run has admission off)."""
    workdir = _SERVERS[endpoint][0]
    spec = tomllib.loads((workdir / "run.toml").read_text())
    if spec.get("admission", {}).get("mode", "open") == "off":
        return None
    return TestCredential(workdir)


test_credential.__test__ = False  # a helper, not a test
TestCredential.__test__ = False


def channel(endpoint: str):
    """A gRPC channel of this test process to `endpoint` (a server started by the swarm fixture)."""
    import grpc

    credential = test_credential(endpoint)
    if credential is None:
        return grpc.insecure_channel(endpoint)
    options = [("grpc.ssl_target_name_override", credential.target_name(endpoint))]
    return grpc.secure_channel(endpoint, credential.channel_credentials(), options=options)


def client(endpoint: str, *args, **kwargs):
    """A peer.client.StageClient of this test process, admitted to the run `endpoint` belongs to."""
    from peer.client import StageClient

    return StageClient(*args, security=test_credential(endpoint), **kwargs)


def settled_infos(endpoints: list[str], timeout: float = 30.0) -> list:
    """Info of each live replica of a stage, once they all sit at the same step with nothing in flight."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [info(e) for e in endpoints]
        agree = len({i.epoch for i in infos}) == 1 and len({i.samples_stepped for i in infos}) == 1
        if agree and not any(i.samples_averaging for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas never agreed: {[(i.epoch, i.samples_stepped) for i in infos]}")
        time.sleep(0.25)


def check_books(infos: list, samples: int, stage: int) -> None:
    stepped = infos[0].samples_stepped
    pending = sum(i.samples_accumulated + i.samples_averaging for i in infos)
    assert stepped + pending == samples, f"stage {stage}: {stepped} stepped + {pending} pending != {samples} completed"


def info(endpoint: str, timeout: float = 10.0):
    """The Info of a stage server, over a short-lived gRPC channel."""
    from protocols import stage_pb2, stage_pb2_grpc

    with channel(endpoint) as ch:
        return stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=timeout)

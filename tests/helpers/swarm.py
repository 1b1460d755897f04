"""A swarm of real peers for one test: each a process of its own, in its own process group, forked from
the session's template (peer.process.forkserver) and running `peer.cli.main.main` with its own command
line. It dies with the template, which dies with the test process (PR_SET_PDEATHSIG). When the test
ends, pass or fail, `Swarm.stop_all` SIGKILLs each peer; the peer's reaper (peer.process.lifetime)
ends what it started (the DHT and averager processes, the p2p daemons)."""

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
from pathlib import Path

from helpers.processes import alive, descendants
from peer.cli.demo import dict_to_toml, loopback_coordinator, loopback_join
from peer.process.forkserver import Forkserver
from peer.process.lifetime import tied_to_me
from peer.process.reaper import LOG_DIR_ENV as REAPER_LOG_DIR

# endpoint -> (test workdir, identity file of the peer serving it): what a test's own TLS client pins
_SERVERS: dict[str, tuple[Path, Path]] = {}


ROOT = Path(__file__).resolve().parents[2]  # the repository


PEER = [sys.executable, "-m", "peer.cli.main"]


REAPED = [sys.executable, str(ROOT / "tests" / "helpers" / "reaped.py")]  # a helper program, under a reaper


def admitting_its_peers(spec: dict) -> dict:
    """The run spec a test swarm's coordinator runs: its peers join without invite codes, so open admission unless
    the test's spec has an admission table (then what it says, with the run spec's defaults for the rest)."""
    return spec if "admission" in spec else {**spec, "admission": {"mode": "open"}}


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
        env: dict[str, str] | None = None,
    ):
        """Start `peer ARGS` (with `python`: `python ARGS` under a reaper, tests/helpers/reaped.py); with `tty` its
        output is a pseudo-terminal. With a `forkserver`, a peer is forked from its template (peer.process.forkserver):
        the same process, without the seconds of imports."""
        self.name, self.python = name, python
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        # TMPDIR: temporary files of the peer (torch, multiprocessing) go to the test's dir. hivemind's
        # p2p daemons put their unix sockets in /tmp whatever TMPDIR says: see remove_stale_sockets
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir), **(env or {}))
        env[REAPER_LOG_DIR] = str(workdir)  # each peer's reaper says what it removed (reaper-PID.log)
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

    def start(
        self,
        name: str,
        args: list[str],
        niceness: int = 0,
        tty: bool = False,
        python: bool = False,
        env: dict[str, str] | None = None,
    ) -> Peer:
        """Start peer `name`; `env`: variables it has besides this process's (SWARMTRAIN_FAILPOINTS, say)."""
        peer = Peer(name, args, self.workdir, niceness, tty, python, self.forkserver, env)
        self.peers.append(peer)
        return peer

    def coordinator(self, spec: dict, timeout: float = 60, extra: list[str] = ()) -> str:
        path = write_spec(self.workdir / "run.toml", admitting_its_peers(spec))
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

    def server(
        self, name: str, stage: int | None = None, extra: list[str] = (), niceness: int = 0, env: dict | None = None
    ) -> Peer:
        stage_args = ["--stage", str(stage)] if stage is not None else []
        return self.start(name, loopback_join(self.maddr, name, *extra, *stage_args), niceness, env=env)

    def trainer(
        self, name: str, extra: list[str] = (), niceness: int = 0, tty: bool = False, env: dict | None = None
    ) -> Peer:
        return self.start(
            name,
            loopback_join(self.maddr, name, "--role", "trainer", "--log-file", f"{name}.jsonl", *extra),
            niceness,
            tty,
            env=env,
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
        (peer.process.lifetime) then ends what the peer started. Returns what is still alive after `timeout`."""
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

"""The fixtures: real peers (coordinator, stage servers, expert hosts, trainers) as OS processes on loopback.

The layer itself is tests/helpers: helpers.swarm starts and stops the peers, helpers.calls talks to
them over gRPC, helpers.processes finds what is left. Here: the fork server every peer is started
from (one per test session), the `swarm` fixture, which always stops what its test started, and a
check after every module that nothing it started is left (process, runtime directory, p2p socket)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from helpers.processes import (
    _command,
    _torch_helper,
    alive,
    descendants,
    hivemind_sockets,
    reaper_logs,
    remove_stale_sockets,
    runtime_dirs,
)
from helpers.swarm import Swarm

from peer.process.forkserver import Forkserver


@pytest.fixture(scope="session", autouse=True)
def forkserver(tmp_path_factory):
    """The template the fixtures fork their peers from (peer.process.forkserver): started before any module, so
    that each module's check below counts it as already there. Its own output goes to template.log."""
    log = tmp_path_factory.mktemp("forkserver") / "template.log"
    with Forkserver(env=dict(os.environ, PYTHONUNBUFFERED="1"), log=str(log)) as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(tmp_path_factory):
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
    assert not stale, (
        f"p2p sockets left behind by this module: {sorted(stale)}\n{reaper_logs([tmp_path_factory.getbasetemp()], stale)}"
    )


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
        assert not stale, f"p2p sockets left behind: {stale}\n{reaper_logs([tmp_path], stale)}"

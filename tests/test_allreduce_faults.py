"""A round outlives a member: 4 all-reduce members as processes of their own (tests/helpers/allreduce_member.py,
the real peer.server.allreduce over gRPC on loopback); one SIGKILLs or SIGSTOPs itself mid-round, after its
first pieces went out. The other three finish the round without it, soon after they detect it (a killed
member's reset streams at once, a stopped one's silence after averaging.read_timeout), and step exactly the
average of their own three contributions, counting exactly their samples."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.allreduce_member import member_identities

from peer.process.lifetime import tied_to_me

MEMBER = Path(__file__).resolve().parent / "helpers" / "allreduce_member.py"
MEMBERS, MB, READ_TIMEOUT = 4, 16.0, 1.0
AFTER_DETECTION = 2.0  # s the survivors may take to finish once they could have seen the loss (the goal)


@pytest.fixture
def members(tmp_path):
    """Start the 4 members (the last one with `fault`); always killed afterwards, stopped ones too."""
    procs: list[subprocess.Popen] = []

    def start(fault: list[str]) -> list[subprocess.Popen]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for i in range(MEMBERS):
            argv = [sys.executable, str(MEMBER), str(tmp_path), str(i), str(MEMBERS), str(MB), str(READ_TIMEOUT)]
            argv += fault if i == MEMBERS - 1 else []
            with open(tmp_path / f"member{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        tied_to_me(argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
        return procs

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _lines(tmp_path: Path, i: int, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    log = tmp_path / f"member{i}.log"
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        if found := re.search(pattern, text):
            return found
        assert time.monotonic() < deadline, f"member {i} never printed {pattern!r}:\n{text[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_a_round_outlives_a_member_killed_or_stopped_mid_round(members, tmp_path, fault):
    members([fault, "3"])
    died = float(_lines(tmp_path, MEMBERS - 1, r"DYING t=([\d.]+)", 120)[1])
    detection = 0.0 if fault == "KILL" else READ_TIMEOUT
    survivors = [identity.peer_id for identity in member_identities(MEMBERS)[: MEMBERS - 1]]
    weights = list(range(1, MEMBERS))  # member i holds i + 1 everywhere, from i + 1 samples
    mean = sum(w * w for w in weights) / sum(weights)
    for i in range(MEMBERS - 1):
        found = _lines(
            tmp_path, i, r"RESULT members=(\S+) (?:samples=(\d+) value=([\d.]+) exact=(\w+) )?t=([\d.]+)", 60
        )
        log = (tmp_path / f"member{i}.log").read_text()
        assert found[1] == ",".join(survivors), log[-3000:]
        assert int(found[2]) == sum(weights), log[-3000:]  # exactly the survivors' samples
        assert abs(float(found[3]) - mean) < 1e-5 and found[4] == "True", log[-3000:]
        took = float(found[5]) - died
        print(f"member {i} finished {took:.2f} s after its partner's {fault} (detection bound {detection:.1f} s)")
        assert took <= detection + AFTER_DETECTION, f"member {i} finished {took:.2f} s after the {fault}\n{log[-3000:]}"
    assert "RESULT" not in (tmp_path / f"member{MEMBERS - 1}.log").read_text()

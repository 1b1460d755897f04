"""gRPC's process-wide experiments (peer.process.grpc_env): set before grpc is imported, the user's own kept.

Each check runs in a fresh interpreter: the environment and the imported modules are process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from peer.process.grpc_env import GRPC_EXPERIMENTS

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


TUNE = "import os; from peer.process.grpc_env import tune_grpc; print(tune_grpc(), os.environ['GRPC_EXPERIMENTS'])"


def test_experiments_are_set_before_grpc_is_imported():
    assert _python(TUNE) == f"True {GRPC_EXPERIMENTS}"


def test_the_users_own_experiments_are_kept():
    assert _python(TUNE, GRPC_EXPERIMENTS="-tcp_rcv_lowat") == "True -tcp_rcv_lowat"


def test_too_late_once_grpc_is_imported():
    assert _python("import grpc; " + TUNE) == f"False {GRPC_EXPERIMENTS}"


def test_the_entry_points_import_no_grpc_before_they_tune_it():
    # peer.cli.main and the fork server's template call tune_grpc first: nothing they import may load grpc
    code = "import sys, peer.cli.main, peer.process.forkserver; print('grpc' in sys.modules)"
    assert _python(code) == "False"

"""Run a Python program under a reaper (peer.process.lifetime), as every `peer` command runs.

    python tests/helpers/reaped.py -m MODULE ARGS...    (or: SCRIPT ARGS...)

The test fixtures start their helper programs (hivemind's own DHT node, the rogue peer) this way:
whatever such a program starts (hivemind's DHT process, its p2p daemon, their sockets) ends with
it, even when the test process that started it is SIGKILLed.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root, for peer.process.lifetime

from peer.process.lifetime import start_reaper  # noqa: E402


def main() -> None:
    start_reaper()  # first: before the program starts any process
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

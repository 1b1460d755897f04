"""`python -m peer.model.rank`: one of ranks 1.. of a peer's tensor-parallel group (started by rank 0, peer.model.tp_runtime).

The first line of stdin says what to hold (run spec, stage, rank, device, the group's port);
every later line is a command from rank 0. The process ends when its input ends, and on its own
when rank 0 is gone (its parent changes), so it never outlives the peer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

from peer.config import RunSpec
from peer.model.tp import TPGroup
from peer.model.tp_runtime import ShardedStageRuntime


def _watch_parent(parent: int, period: float) -> None:
    while os.getppid() == parent:
        time.sleep(period)
    os._exit(1)  # rank 0 is gone: nobody will send another command


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    init = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_watch_parent, args=(os.getppid(), init["watch_period"]), daemon=True).start()
    if init["threads"] > 0:
        torch.set_num_threads(init["threads"])
    spec = RunSpec.from_dict(init["spec"])
    # build the shard first (every rank draws the whole tensors from the seed), then join the group:
    # rank 0's first collective then waits for nothing but the group
    tp = TPGroup(init["rank"], init["world"], torch.device(init["device"]))
    runtime = ShardedStageRuntime(
        spec,
        init["stage"],
        tp,
        activation_cache_size=init["activation_cache_size"],
        fingerprint_history=init["fingerprint_history"],
        dedup_history=init["dedup_history"],
        compute_dtype=init["compute_dtype"],
    )
    tp.connect(init["port"], init["timeout"])
    try:
        runtime.serve(sys.stdin.buffer)
    finally:
        tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

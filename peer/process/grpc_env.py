"""gRPC core's process-wide settings, which it reads from the environment once, when `grpc` is first imported.

`tune_grpc()` must run before that import: the `peer` command calls it first thing, and so does the fork
server's template (peer.process.forkserver) before its preloads, so every peer process has them. A value the
user set (`GRPC_EXPERIMENTS` in the environment) is kept.

The experiments turned on, both in gRPC's own tree since 2022 and off by default there:
- `tcp_frame_size_tuning`: the HTTP/2 layer tells TCP how many bytes the message being read still needs, and
  a read completes only once they are there;
- `tcp_rcv_lowat`: with that size, the socket's SO_RCVLOWAT is set so the kernel wakes the reader once, not for
  every segment.

On a link slower than the CPU (any WAN) a message arrives a segment at a time, and without them each segment
wakes gRPC's poller and its reader: in benchmarks/wan.py's lab, capped at 100 Mbit/s, float32 activations
cost the swarm 41.8 ms of CPU per sample with them off and 29.9 ms with them on (24.5 ms uncapped either way).
"""

from __future__ import annotations

import os
import sys

GRPC_EXPERIMENTS = "tcp_frame_size_tuning,tcp_rcv_lowat"


def tune_grpc() -> bool:
    """Set gRPC's experiments unless the user set their own; whether they hold (False: `grpc` was imported)."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    return "grpc" not in sys.modules

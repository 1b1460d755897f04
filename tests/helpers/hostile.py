"""A stage server that claims to be ahead of its stage (tests/test_security.py runs it).

`python hostile.py JUMP NOISE peer-arguments...` runs `peer ARGS` with one change: once it serves, before
each announcement, it sets its step to exactly JUMP past the least advanced of its partners, and (once) adds Gaussian
noise of std NOISE to its weights. Its records, its answers (Info, Round, Forward, Backward) and the state
it gives (GetState) then all say that step: what a peer that wants to take a stage over, or to end the
run for every trainer, would send. It prints `HOSTILE at STEP` whenever its claim changes.
"""

from __future__ import annotations

import sys

import torch

from peer.cli.main import main
from peer.server.replica import Replica


def claiming(jump: int, noise: float):
    publish, poisoned = Replica.publish, set()

    async def claim(self, *args, **kwargs):
        if self.state == "serving" and self.peers:
            if id(self) not in poisoned and noise:
                poisoned.add(id(self))
                with torch.no_grad():
                    for p in self.runtime.params:
                        p.add_(torch.randn_like(p) * noise)
            step = min(r.epoch for r in self.peers.values()) + jump
            if step != self.runtime.epoch:
                self.runtime.epoch = step
                print(f"HOSTILE at {step}", flush=True)
        return await publish(self, *args, **kwargs)

    return claim


if __name__ == "__main__":
    Replica.publish = claiming(int(sys.argv[1]), float(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))

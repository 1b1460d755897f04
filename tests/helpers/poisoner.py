"""A stage server that poisons its averaging rounds (tests/test_attacks.py runs it).

`python poisoner.py VALUE peer-arguments...` runs `peer ARGS` with two changes: the gradients it sends to
every averaging round are VALUE everywhere (its weight, its sample count, stays as it was), and it takes
whatever mean comes back; it states a reference of 1e30 for rounds with one member bringing samples (the
lower median of the members' statements is what counts). An admitted replica that does this is what averaging must withstand. It prints
`POISONER sent step N with S samples` for each round it poisoned (with no samples its values weigh nothing).

`python poisoner.py --ratchet FACTOR peer-arguments...` sends its honest gradients instead, times FACTOR more
with each round it brings samples to (FACTOR^k at its k-th), and says their true norm: a mean that grows
round by round, to raise the norm bound's reference with it. It prints `POISONER sent step N with S samples
at scale X`.
"""

from __future__ import annotations

import sys

import torch

from peer.cli.main import main
from peer.server.averaging import GradientAverager, _norm


def poisoning(value: float):
    send = GradientAverager._round

    def poisoned(self, gradients, me, epoch, group):
        print(f"POISONER sent step {epoch} with {me.samples} samples", flush=True)
        me.reference = 1e30  # and says a round it alone brings samples to may be held to anything
        return send(self, [torch.full_like(g, value) for g in gradients], me, epoch, group)

    return poisoned


def ratcheting(factor: float):
    send, scale = GradientAverager._round, [1.0]

    def ratcheted(self, gradients, me, epoch, group):
        if me.samples > 0:
            scale[0] *= factor
        gradients = [g * scale[0] for g in gradients]
        me.norm = _norm(gradients)  # its true norm: the claim of an honest member
        print(f"POISONER sent step {epoch} with {me.samples} samples at scale {scale[0]:g}", flush=True)
        return send(self, gradients, me, epoch, group)

    return ratcheted


if __name__ == "__main__":
    if sys.argv[1] == "--ratchet":
        GradientAverager._round, sys.argv[1:3] = ratcheting(float(sys.argv[2])), ["0"]
    else:
        GradientAverager._round = poisoning(float(sys.argv[1]))
    GradientAverager._plausible = lambda self, *args: True
    sys.exit(main(sys.argv[2:]))

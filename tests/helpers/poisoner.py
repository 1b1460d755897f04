"""A stage server that poisons its averaging rounds (tests/test_attacks.py runs it).

`python poisoner.py VALUE peer-arguments...` runs `peer ARGS` with two changes: the gradients it sends to
every averaging round are VALUE everywhere (its weight, its sample count, stays as it was), and it takes
whatever mean comes back. An admitted replica that does this is what averaging must withstand. It prints
`POISONER sent step N with S samples` for each round it poisoned (with no samples its values weigh nothing).
"""

from __future__ import annotations

import sys

import torch

from peer.cli.main import main
from peer.server.averaging import GradientAverager


def poisoning(value: float):
    send = GradientAverager._round

    def poisoned(self, gradients, me, epoch, group):
        print(f"POISONER sent step {epoch} with {me.samples} samples", flush=True)
        return send(self, [torch.full_like(g, value) for g in gradients], me, epoch, group)

    return poisoned


if __name__ == "__main__":
    GradientAverager._round = poisoning(float(sys.argv[1]))
    GradientAverager._plausible = lambda self, *args: True
    sys.exit(main(sys.argv[2:]))

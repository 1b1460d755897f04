"""A stage server whose state is one no honest replica holds (tests/test_attacks.py runs it).

`python rotten.py peer-arguments...` runs `peer ARGS` with one change: every state it gives (GetState) has its
Adam second moments negated (negative, where an AdamW step only ever leaves means of squares) and its optimizer
step counts at 0. A replica that loaded it would divide by a step of zero and take square roots of negative
numbers at its next step: NaN weights for good. Its parameters, fingerprint and records are honest.
"""

from __future__ import annotations

import sys

from peer.cli.main import main
from peer.model.part_state import PartState


def rotting():
    snapshot = PartState.snapshot

    def rotten(self, *args, **kwargs):
        metadata, tensors = snapshot(self, *args, **kwargs)
        for name, t in list(tensors.items()):
            if name.endswith("/exp_avg_sq"):
                tensors[name] = -(t + 1e-3)
            elif name.endswith("/step"):
                tensors[name] = t * 0
        return metadata, tensors

    return rotten


if __name__ == "__main__":
    PartState.snapshot = rotting()
    sys.exit(main(sys.argv[1:]))

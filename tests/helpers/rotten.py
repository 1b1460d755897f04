"""A stage server whose state is one no honest replica holds (tests/test_attacks.py runs it).

`python rotten.py [--weights] peer-arguments...` runs `peer ARGS` with one change: every state it gives
(GetState) has its Adam second moments negated (negative, where an AdamW step only ever leaves means of squares)
and its optimizer step counts at 0. A replica that loaded it would divide by a step of zero and take square roots
of negative numbers at its next step: NaN weights for good. Its parameters, fingerprint and records are honest.

With `--weights`, the state it gives is sound but of other weights: every parameter moved by 1e-2, and the
fingerprint it gives with them recomputed to match (a state that checks out on its own). Its records, its
answers and the state it trains with stay honest: only a second replica's word at the same step tells.

With `--moments`, the state it gives holds its honest weights with second moments 1e6 times its own (finite, sound
on their own: a replica that loaded them would hardly move for thousands of steps), the fingerprint it gives with
them recomputed to match.

With `--metadata`, the state it gives holds its honest tensors and fingerprint, and says it stepped -1 samples (a
checkpoint that kept that metadata would fail every resume from it).

With `--missing`, every part of its state it gives lacks its first tensor (a co-donor that spoils every transfer it
takes part in, while its fingerprint and answers are honest).
"""

from __future__ import annotations

import sys

from peer.cli.main import main
from peer.model.part_state import PartState, state_fingerprint


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


def refingerprinted(change):
    """Snapshots with `change(name, tensor)` applied to each tensor, and, for a whole state (one shard), the
    fingerprint recomputed to match."""
    snapshot = PartState.snapshot

    def changed(self, *args, **kwargs):
        metadata, tensors = snapshot(self, *args, **kwargs)
        tensors = {name: change(name, t) for name, t in tensors.items()}
        if all(f"param/{name}" in tensors for name in self.param_names):
            metadata["fingerprint"] = state_fingerprint(tensors, self.param_names, self.local)
        return metadata, tensors

    return changed


def other_weights():
    return refingerprinted(lambda name, t: t + 1e-2 if name.startswith("param/") else t)


def stalling_moments():
    return refingerprinted(lambda name, t: t * 1e6 if name.endswith("/exp_avg_sq") else t)


def lying_metadata():
    snapshot = PartState.snapshot

    def lying(self, *args, **kwargs):
        metadata, tensors = snapshot(self, *args, **kwargs)
        metadata["samples_stepped"] = -1
        return metadata, tensors

    return lying


def missing():
    snapshot = PartState.snapshot

    def lacking(self, *args, **kwargs):
        metadata, tensors = snapshot(self, *args, **kwargs)
        tensors.pop(next(iter(tensors)), None)
        return metadata, tensors

    return lacking


if __name__ == "__main__":
    modes = {
        "--weights": other_weights,
        "--moments": stalling_moments,
        "--missing": missing,
        "--metadata": lying_metadata,
    }
    mode = sys.argv[1] if sys.argv[1] in modes else ""
    PartState.snapshot = modes.get(mode, rotting)()
    sys.exit(main(sys.argv[2 if mode else 1 :]))

"""A run that starts from a model directory's pretrained weights: only the coordinator reads the files.

At start the coordinator checks every tensor against the model the spec builds and pins the
weight files' sha256 in the spec (`model.weights`), which it signs and publishes. It then serves
each stage's (and each expert's) initial weights the way it serves a resumed checkpoint
(peer.coordinator.archive, an `archive` record at step 0): a server that joins a stage (an expert
host, an expert) with no serving replica loads its own part's tensors from there, never the whole
model; later joiners load from the serving replicas.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dht.node import SwarmDHT
from peer.config import PeerConfig, RunSpec
from peer.coordinator.archive import Archive
from peer.coordinator.checkpoint import CheckpointError
from peer.model.moe import expert_uid
from peer.model.pretrained import WeightFiles, check, expert_state, has_weights, stage_state
from peer.process.status_lines import say


def pin_weights(spec: RunSpec) -> RunSpec:
    """The spec with `model.weights` set to the fingerprint of its directory's weights, after checking them."""
    if not spec.model.path or not has_weights(Path(spec.model.path)):
        return spec
    weights = WeightFiles(Path(spec.model.path))
    check(spec, weights)
    pinned = dataclasses.replace(spec, model=dataclasses.replace(spec.model, weights=weights.fingerprint()))
    pinned.validate()
    return pinned


def _metadata(spec: RunSpec, name: str, tensor_count: int) -> dict:
    """A donor's state metadata for a part nobody has stepped yet."""
    return {"part": name, "epoch": 0, "samples_stepped": 0, "spec": spec.fingerprint(), "tensor_count": tensor_count}


def open_pretrained(spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT) -> Archive:
    """The pretrained weights, served to joining servers by stage; CheckpointError naming what is wrong."""
    directory = Path(spec.model.path)
    weights = WeightFiles(directory)
    names = [f"stage {s}" for s in range(spec.stages.num_stages)]
    names += [f"expert {expert_uid(layer, e)}" for layer in spec.moe_layers() for e in range(spec.moe.num_experts)]
    manifest = {"step": 0, "parts": {n: {"epoch": 0, "metadata": _metadata(spec, n, 0)} for n in names}}

    def load(name: str) -> tuple[dict, dict]:
        kind, _, ident = name.partition(" ")
        if kind == "expert":
            layer, _, index = ident.partition(".")
            state = expert_state(spec, weights, int(layer), int(index))
        else:
            state = stage_state(spec, weights, int(ident))
        return _metadata(spec, name, len(state)), state

    archive = Archive(directory, spec, cfg, dht, manifest=manifest, load=load)
    try:
        archive.start()
    except OSError as e:
        raise CheckpointError(f"model.path: cannot serve {directory}'s weights: {e}") from None
    archive.announce()
    say(f"Serving the pretrained weights of {directory} ({weights.dtype()}) to joining servers at {archive.endpoint}.")
    return archive

"""Checkpoints of a run: one directory per checkpoint, safetensors for tensors, a JSON manifest.

Layout of `ROOT/step-00000123/`:

- `stage-0.safetensors`, `expert-1.5.safetensors`, ...: each part's state as a donor sends it
  (`param/...`, `optim/...`, `outer/...` tensors; peer.model.part.PartRuntime.state_tensors);
- `manifest.json`: format, the run spec and its fingerprint, the step, and per part its file,
  the peer that gave it, its epoch, the state's metadata and the file's SHA-256.

Writing is atomic: everything goes into a hidden `.tmp-...` directory beside the others, each
file is flushed to disk, the manifest is written last, and the directory is renamed into place.
A reader takes only `step-*` directories whose manifest parses and whose files match their
checksums, so a checkpoint cut off mid-write (or damaged later) is never taken for a whole one.
Nothing here unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dht.errors import UserError
from protocols.version import software_version

FORMAT = 2  # 2: parameters named as transformers names them (model.layers.L.self_attn.q_proj.weight, ...)
MANIFEST = "manifest.json"
PREFIX = "step-"


class CheckpointError(UserError, ValueError):
    """A checkpoint that is incomplete, damaged, or not of this run."""


@dataclass
class Part:
    """One part's state as it goes into a checkpoint."""

    name: str  # "stage 0" or "expert 1.5" (PartRuntime.name)
    metadata: dict  # the state's metadata (PartRuntime.state_metadata)
    tensors: dict[str, torch.Tensor]
    peer: str = ""  # the peer id of the replica that gave it
    # a checkpoint whose copy of this part goes on unchanged (no server held a newer one): its directory
    carried_from: Path | None = None
    entry: dict | None = None  # with carried_from: that checkpoint's manifest entry for the part


def part_file(name: str) -> str:
    kind, _, ident = name.partition(" ")
    return f"{kind}-{ident}.safetensors"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: str | Path, spec: dict, fingerprint: str, step: int, parts: list[Part], keep: int = 3) -> Path:
    """Write a checkpoint of `parts` at `step` under `root` atomically; keep the newest `keep`. Its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PREFIX}{step:08d}-", dir=root))
    try:
        entries = {}
        for part in parts:
            entries[part.name] = _carry(part, tmp) if part.carried_from is not None else _save(part, tmp)
        manifest = {
            "format": FORMAT,
            "software": software_version(),  # the release that wrote it
            "run": spec.get("name", ""),
            "spec": spec,
            "spec_fingerprint": fingerprint,
            "step": step,
            "created": time.time(),
            "parts": entries,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        replaced = None
        if final.exists():  # the same step again: the new one replaces it, and a whole one is there at every moment
            replaced = Path(tempfile.mkdtemp(prefix=f".old-{PREFIX}{step:08d}-", dir=root))
            os.rename(final, replaced / final.name)
        os.rename(tmp, final)
        _fsync_dir(root)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException:  # removes the partial checkpoint, then re-raises whatever it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def _save(part: Part, into: Path) -> dict:
    """Write a pulled part's tensors; its manifest entry."""
    path = into / part_file(part.name)
    tensors = {k: t.detach().cpu().contiguous() for k, t in part.tensors.items()}
    save_file(tensors, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {
        "file": path.name,
        "peer": part.peer,
        "epoch": int(part.metadata.get("epoch", 0)),
        "metadata": part.metadata,
        "sha256": _sha256(path),
        "tensors": len(tensors),
    }


def _carry(part: Part, into: Path) -> dict:
    """Take a part's file from an earlier checkpoint (a hard link where the filesystem allows); its entry."""
    source, path = part.carried_from / part.entry["file"], into / part_file(part.name)
    try:
        os.link(source, path)
    except OSError:
        shutil.copy2(source, path)
    return {**part.entry, "file": path.name, "carried_from": part.carried_from.name}


def read_manifest(path: str | Path, verify: bool = True) -> dict:
    """The manifest of a complete checkpoint; CheckpointError if it is incomplete or damaged."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({e})") from None
    if isinstance(manifest, dict) and manifest.get("format") == 1:
        raise CheckpointError(
            f"{path}: a format-1 checkpoint, written by an earlier Swarmtrain whose parameter names this one "
            "does not read (blocks.L.attn.wq.weight, ...); resume it with the release that wrote it"
        )
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("parts"), dict)
    ):
        raise CheckpointError(f"{path}: {MANIFEST} is not a format-{FORMAT} checkpoint manifest")
    for name, entry in manifest["parts"].items():
        file = path / str(entry.get("file", ""))
        if not file.is_file() or file.parent != path:
            raise CheckpointError(f"{path}: {name}'s file {entry.get('file')!r} is missing")
        if verify and _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"{path}: {file.name} does not match its checksum")
    return manifest


def complete(root: str | Path, verify: bool = True) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (half-written and damaged ones left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.glob(f"{PREFIX}*")):
        try:
            read_manifest(path, verify)
        except CheckpointError:
            continue
        found.append(path)
    return found


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (a checkpoint directory itself is its own latest)."""
    root = Path(root)
    if (root / MANIFEST).exists():
        read_manifest(root)
        return root
    found = complete(root)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints, and temporary directories of dead writers.

    The newest holds the newest copy of every part (a part no server held newer is carried into it)."""
    for path in complete(root, verify=False)[: -max(keep, 1)]:
        shutil.rmtree(path, ignore_errors=True)
    for tmp in [*root.glob(f".tmp-{PREFIX}*"), *root.glob(f".old-{PREFIX}*")]:
        if time.time() - tmp.stat().st_mtime > 3600:  # a writer that died an hour ago
            shutil.rmtree(tmp, ignore_errors=True)


def load_part(path: str | Path, manifest: dict, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of part `name` of the checkpoint at `path`, as a donor would send them."""
    entry = manifest["parts"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: the checkpoint holds no {name}")
    return dict(entry["metadata"]), load_file(str(Path(path) / entry["file"]))


def model_weights(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(run spec, weights named as in the whole model, peer.model.llama.StageModel(spec)) of the newest
    complete checkpoint at `path`.

    Stages give their parameters under their own names; an expert `L.E` of a mixture-of-experts
    layer gives `model.layers.L.block_sparse_moe.experts.E.*` (Mixtral's names).
    """
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"{path}: no complete checkpoint there (a directory `peer coordinator --checkpoints` wrote)"
        )
    path = found
    manifest = read_manifest(path)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(manifest["parts"]):
        _, tensors = load_part(path, manifest, name)
        kind, _, ident = name.partition(" ")
        prefix = ""
        if kind == "expert":
            layer, _, index = ident.partition(".")
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{index}."
        for key, t in tensors.items():
            if key.startswith("param/"):
                weights[prefix + key[len("param/") :]] = t
    return manifest["spec"], weights

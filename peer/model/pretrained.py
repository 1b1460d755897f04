"""Pretrained weights in a Hugging Face model directory, read by tensor name and checked against the model.

The weights are safetensors: `model.safetensors`, or shards named by `model.safetensors.index.json`.
Files are memory-mapped and only the tensors asked for are read, so serving one stage never
loads the whole model. `check` compares every tensor's name and shape with the model the run spec
builds (peer.model.llama.StageModel, on the meta device: no memory) before anything is served.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from peer.config import ConfigError, RunSpec
from peer.model.llama import StageModel

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# tensors some checkpoints carry that are not parameters (older Llama exports keep the rotary table)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def has_weights(directory: Path) -> bool:
    return (directory / INDEX).exists() or (directory / SINGLE).exists()


class WeightFiles:
    """Where each tensor of a directory lives, and its shape and dtype, from the safetensors headers alone."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, Path] = {}  # tensor name -> file
        index = directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: directory / file for name, file in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{index}: not a safetensors index ({e})") from None
        else:
            self.files = dict.fromkeys(self._names(directory / SINGLE), directory / SINGLE)
        self.headers = {}  # tensor name -> (shape, safetensors dtype)
        for file in sorted(set(self.files.values())):
            for name, header in self._header(file).items():
                if self.files.get(name) == file:
                    self.headers[name] = header
        missing = sorted(set(self.files) - set(self.headers))
        if missing:
            raise ConfigError(f"{index}: names {missing[0]} in {self.files[missing[0]].name}, which does not hold it")

    @staticmethod
    def _names(file: Path) -> list[str]:
        return list(WeightFiles._header(file))

    @staticmethod
    def _header(file: Path) -> dict[str, tuple[list[int], str]]:
        try:
            with safe_open(str(file), "pt") as f:
                return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
        except FileNotFoundError:
            raise ConfigError(f"{file}: missing") from None
        except Exception as e:  # safetensors' own error type: damaged or not safetensors
            raise ConfigError(f"{file}: not a readable safetensors file ({e})") from None

    def dtype(self) -> str:
        """The dtype most of the weights are stored in ("BF16", "F32", ...)."""
        kinds = [h[1] for h in self.headers.values()]
        return max(set(kinds), key=kinds.count) if kinds else "F32"

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors as float32, reading only them (each file memory-mapped)."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        for file, wanted in by_file.items():
            with safe_open(str(file), "pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name).to(torch.float32)
        return out

    def fingerprint(self) -> str:
        """sha256 over the weight files' bytes, in name order (what the run spec pins)."""
        digest = hashlib.sha256()
        for file in sorted(set(self.files.values())):
            digest.update(file.name.encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
        return digest.hexdigest()[:32]


def expected_shapes(spec: RunSpec, stage: int | None = None) -> dict[str, list[int]]:
    """Parameter name -> shape of the whole model, or of one stage (its experts live on expert hosts, not
    in it), built on the meta device (no memory)."""
    with torch.device("meta"):
        model = StageModel(spec, stage)
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    if stage is not None:
        shapes = {name: shape for name, shape in shapes.items() if ".experts." not in name}
    return shapes


def state_shards_needed(spec: RunSpec, stage: int, expert: str, max_message_bytes: int) -> int:
    """Shards a part's state must come in so that none exceeds half of `max_message_bytes` (a state is at
    most 5 float32 copies of the parameters: weights, 2 Adam moments, the outer anchor and momentum)."""
    if expert:
        params = 3 * spec.model.hidden_size * (spec.moe.expert_size or spec.model.intermediate_size)
    else:
        params = sum(math.prod(shape) for shape in expected_shapes(spec, stage).values())
    return max(1, -(-5 * 4 * params // max(max_message_bytes // 2, 1)))


def check(spec: RunSpec, weights: WeightFiles) -> None:
    """ConfigError naming the first tensor that is missing, misshapen, of an unknown dtype, or unexpected."""
    where = weights.directory
    expected = expected_shapes(spec)
    present = {n: h for n, h in weights.headers.items() if not n.endswith(IGNORED_SUFFIXES)}
    if spec.model.tie_embeddings:
        present.pop("lm_head.weight", None)
    for name, shape in expected.items():
        if name not in present:
            raise ConfigError(f"{where}: the weights lack {name} (config.json's model has it, shape {shape})")
        if present[name][0] != shape:
            raise ConfigError(f"{where}: {name} has shape {present[name][0]}, config.json's model needs {shape}")
        if present[name][1] not in DTYPES:
            raise ConfigError(f"{where}: {name} is stored as {present[name][1]}; only F32, F16 and BF16 are read")
    unexpected = sorted(set(present) - set(expected))
    if unexpected:
        raise ConfigError(f"{where}: the weights hold {unexpected[0]}, which config.json's model has no place for")


def stage_state(spec: RunSpec, weights: WeightFiles, stage: int) -> dict[str, torch.Tensor]:
    """A stage's initial state from the weights, named as a donor sends it (`param/NAME`; in local mode also
    the outer anchor, equal to them, and a zero outer momentum)."""
    return _state(spec, weights.read(list(expected_shapes(spec, stage))))


def expert_state(spec: RunSpec, weights: WeightFiles, layer: int, index: int) -> dict[str, torch.Tensor]:
    """Expert `layer.index`'s initial state from the weights (`param/w1.weight`, ...), as its donors send it."""
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{index}."
    names = [n for n in weights.headers if n.startswith(prefix)]
    return _state(spec, {n[len(prefix) :]: t for n, t in weights.read(names).items()})


def _state(spec: RunSpec, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {f"param/{n}": t for n, t in params.items()}
    if spec.local_updates:
        state.update({f"outer/anchor/{n}": t for n, t in params.items()})
        state.update({f"outer/momentum/{n}": torch.zeros_like(t) for n, t in params.items()})
    return state

"""What the coordinator checks before a replica's state of a part goes into a checkpoint.

A checkpoint is what every later run starts from: a state taken at its donor's word would carry a
hostile replica's weights into every resume. So the coordinator checks what it pulled against what
the donor does not control: the part's credible step (peer.swarm.consensus), the model's own
shapes, values an optimizer step can leave (finite, second moments never negative, step counts of at
least one), and the parameters' fingerprint, computed here, which must match the one the donor gave
and be held at the same step by a second replica (`seconds`, from its recent steps, asked by Info).
A part with two or more replicas is taken only from a seconded one; a part with a single replica has
nobody to compare with (its one server computes it anyway).
"""

from __future__ import annotations

import torch

from peer.config import RunSpec
from peer.model.fingerprint import first_difference, held_at
from peer.model.moe import make_expert, parse_expert_uid
from peer.model.numerics import all_finite
from peer.model.part_state import (
    OPTIMIZER_SLOTS,
    Poisoned,
    StateError,
    check_moments,
    check_optimizer_slot,
    inherited_steps,
    state_fingerprint,
)
from peer.model.pretrained import expected_shapes


def seconds(history, epoch: int, values: list[float], tolerance: float) -> str:
    """Why a replica's recent steps (an Info answer's `history`) do not hold `epoch` with these parameters ("" if
    they do)."""
    held = held_at(history, epoch, values, tolerance)
    if held is None:
        return f"its recent steps {[f.epoch for f in history][-4:]} do not include step {epoch}"
    return "" if held else f"its parameters at step {epoch} differ"


def part_shapes(spec: RunSpec, stage: int, expert: str) -> dict[str, list[int]]:
    """Parameter name -> shape of a part, in the order its fingerprint lists them (built on the meta device)."""
    if not expert:
        return expected_shapes(spec, stage)
    layer, index = parse_expert_uid(expert)
    with torch.device("meta"):
        module = make_expert(spec.model, spec.moe, spec.seed, layer, index)
    return {name: list(p.shape) for name, p in module.named_parameters()}


def vet(spec: RunSpec, stage: int, expert: str, metadata: dict, tensors: dict, limit: int, tolerance: float) -> list:
    """The fingerprint of a replica's state of a part (its parameters' and moments' sums and sums of squares); StateError
    (Poisoned for values no honest step leaves) unless it is a sound state of the part at a step no further than
    `limit`, whose parameters match the fingerprint its donor gave with it."""
    epoch = metadata.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise Poisoned(f"its state's epoch is {epoch!r}, not a step")
    if epoch > limit:
        raise StateError(f"it gave the state of step {epoch}, past the part's credible step {limit}")
    if metadata.get("spec") != spec.fingerprint():
        raise StateError(f"its state is of run spec {metadata.get('spec')!r}, not this run's")
    shapes = part_shapes(spec, stage, expert)
    unknown = sorted(set(tensors) - _known_names(shapes, spec.local_updates))
    if unknown:
        raise StateError(f"its state holds {unknown[0]!r}, which the part has no place for")
    _check_metadata(metadata, tensors, f"expert {expert}" if expert else f"stage {stage}")
    for name, shape in shapes.items():
        _check_parameter(tensors, name, shape, spec.local_updates)
        if (m := tensors.get(f"optim/{name}/exp_avg")) is not None and (
            v := tensors.get(f"optim/{name}/exp_avg_sq")
        ) is not None:
            check_moments(f"optim/{name}", m, v, spec.training.betas)
    values = state_fingerprint(tensors, list(shapes), spec.local_updates)
    given = [float(x) for x in metadata.get("fingerprint") or []]
    if given and first_difference(given, values, tolerance) is not None:
        raise StateError(f"its parameters do not match the fingerprint it gave for step {epoch}")
    return values


def _check_metadata(metadata: dict, tensors: dict, part: str) -> None:
    """What a checkpoint keeps of a state's metadata, and what a resume or a joiner reads of it, is sound: the part,
    counts that are counts, the tensors it says, step records that parse (else a resume would fail on them)."""
    if metadata.get("part") != part:
        raise StateError(f"its state is of {metadata.get('part')!r}, not {part}")
    for field in ("samples_stepped", "last_step_samples", "tensor_count"):
        value = metadata.get(field, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Poisoned(f"its state's {field} is {value!r}, not a count")
    if metadata.get("tensor_count", len(tensors)) != len(tensors):
        raise StateError(f"its state says {metadata['tensor_count']} tensors and holds {len(tensors)}")
    try:
        inherited_steps(metadata)
        [float(x) for x in metadata.get("fingerprint") or []]
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise Poisoned(f"its state's step records are malformed ({type(e).__name__}: {e})") from None


def _check_parameter(tensors: dict, name: str, shape: list[int], local: bool) -> None:
    for kind in ("param", "outer/anchor", "outer/momentum") if local else ("param",):
        t = tensors.get(f"{kind}/{name}")
        if t is None or list(t.shape) != shape:
            raise StateError(f"its state lacks {kind}/{name} of shape {shape}")
        if not all_finite(t):
            raise Poisoned(f"{kind}/{name} in its state is not finite")
    for slot in OPTIMIZER_SLOTS:
        if (t := tensors.get(f"optim/{name}/{slot}")) is not None:
            if (t.numel() != 1) if slot == "step" else list(t.shape) != shape:
                raise StateError(f"optim/{name}/{slot} in its state has the wrong shape {list(t.shape)}")
            check_optimizer_slot(f"optim/{name}/{slot}", slot, t)


def _known_names(shapes: dict[str, list[int]], local: bool) -> set[str]:
    kinds = ("param", "outer/anchor", "outer/momentum") if local else ("param",)
    names = {f"{kind}/{name}" for name in shapes for kind in kinds}
    return names | {f"optim/{name}/{slot}" for name in shapes for slot in OPTIMIZER_SLOTS}

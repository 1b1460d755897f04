"""The plain single-process training loop: the reference the swarm must match and the baseline it is timed against."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from peer.config import RunSpec
from peer.data.corpus import Corpus, Sampler, validation_batches
from peer.model.llama import StageModel, stage_of_parameter
from peer.model.numerics import squared_norm
from peer.model.optim import build_optimizer, set_lr


@dataclass
class LocalResult:
    micro_batch_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    samples: int = 0
    seconds: float = 0.0
    clipped_steps: int = 0  # stage steps whose gradient training.max_grad_norm clipped


def parameters_by_stage(spec: RunSpec, model: StageModel) -> list[list[torch.nn.Parameter]]:
    """The whole model's parameters, grouped by the stage of the swarm that holds each."""
    groups = [[] for _ in range(spec.stages.num_stages)]
    for name, param in model.named_parameters():
        groups[stage_of_parameter(spec, name)].append(param)
    return groups


def clip_per_stage(stages: list[list[torch.nn.Parameter]], limit: float) -> int:
    """Clip each stage's gradient to norm `limit` as its servers do (peer.model.part); how many were clipped."""
    clipped = 0
    for params in stages:
        grads = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(squared_norm(grads))
        if norm > limit:
            for g in grads:
                g.mul_(limit / norm)
            clipped += 1
    return clipped


@torch.no_grad()
def evaluate(model: StageModel, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean per-sequence loss over `batches` (a last, smaller batch weighs by its sequences)."""
    model.eval()
    with torch.no_grad():
        losses = [(model(x, y).item(), x.shape[0]) for x, y in batches]
    model.train()
    return sum(loss * n for loss, n in losses) / sum(n for _, n in losses)


def train_local(
    spec: RunSpec,
    corpus: Corpus,
    steps: int,
    seed: int = 0,
    eval_every: int = 0,
    eval_batches: int = 4,
    on_step: Callable[[int, float, StageModel], None] | None = None,
    seeds: Sequence[int] = (),
) -> LocalResult:
    """Train the whole model for `steps` optimizer steps of target_batch_size samples, as the swarm would.

    Micro-batches come from Sampler(seed) in the same order a trainer with that seed sends them; with
    `seeds`, one sampler each, taken in turn (as that many trainers with those seeds feed one run).
    `on_step(step, last micro-batch loss, model)` is called after each step.
    """
    t = spec.training
    model = StageModel(spec)
    optimizer = build_optimizer(model.parameters(), t)
    samplers = [Sampler(corpus.train, t.seq_len, t.micro_batch_size, s) for s in (seeds or [seed])]
    per_step = -(-t.target_batch_size // t.micro_batch_size)  # micro-batches per optimizer step
    val = validation_batches(corpus, t.seq_len, t.micro_batch_size, eval_batches) if eval_every else []
    stages = parameters_by_stage(spec, model)
    result = LocalResult()
    started = time.perf_counter()
    for step in range(steps):
        set_lr(optimizer, step, t)
        for _ in range(per_step):
            inputs, targets = samplers[len(result.micro_batch_losses) % len(samplers)].next()
            loss = model(inputs, targets)
            aux = model.aux_loss()  # MoE load balancing, part of the objective but not of the reported loss
            objective = loss if aux is None else loss + aux
            (objective * inputs.shape[0] / (per_step * t.micro_batch_size)).backward()
            result.micro_batch_losses.append(loss.item())
            result.samples += inputs.shape[0]
        if t.max_grad_norm > 0:
            result.clipped_steps += clip_per_stage(stages, t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, result.micro_batch_losses[-1], model)
        if eval_every and (step + 1) % eval_every == 0:
            result.val_losses.append((step + 1, evaluate(model, val)))
    result.seconds = time.perf_counter() - started
    return result

"""The optimizer and learning-rate schedule every replica of every stage (and the local loop) uses."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from peer.config import TrainingConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainingConfig) -> torch.optim.AdamW:
    # foreach=False keeps the update order fixed, so replicas and the local loop agree bit for bit
    return torch.optim.AdamW(
        list(params),
        lr=lr_at(0, cfg),
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )


def lr_at(step: float, cfg: TrainingConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at total_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, step: float, cfg: TrainingConfig, scale: float = 1.0) -> None:
    """The schedule's lr at `step` (a fraction: where a swarm's samples put it), times `scale`."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg) * scale


def schedule_of(samples_before: int, step_samples: int, epoch: int, cfg: TrainingConfig) -> tuple[float, float]:
    """(schedule position, lr scale) of a step of `step_samples` after `samples_before` samples stepped in
    `epoch` steps.

    A swarm's steps vary in size (each stage steps when it counts about target_batch_size samples, from
    announcements a progress period old), and its stages step at different samples. The schedule follows
    the samples, not the step count, so every stage gives each sample the lr the plain loop gives it, and a
    step smaller than the plain loop's moves the weights less (linear scaling). The plain loop's step is
    target_batch_size rounded up to whole micro-batches: a step of exactly that after k of them is its step
    k, bit for bit. Bounds, since the counts are the group members' claims: the scale is at most 1 (a
    larger step, as after a failed round, takes the peak lr, no more) and the position at most
    2 x epoch + 1 (a member claiming a huge count cannot end the schedule)."""
    plain_step = -(-cfg.target_batch_size // cfg.micro_batch_size) * cfg.micro_batch_size
    position = min(max(samples_before, 0) / plain_step, 2.0 * epoch + 1.0)
    return position, min(max(step_samples, 0) / plain_step, 1.0)

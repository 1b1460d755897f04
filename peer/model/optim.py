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


def schedule_of(samples_before: int, step_samples: int, target: int) -> tuple[float, float]:
    """(schedule position, lr scale) of a step of `step_samples` after `samples_before` samples stepped.

    A swarm's steps vary in size (each stage steps when it counts about target_batch_size samples, from
    announcements a progress period old), and its stages step at different samples. The schedule follows
    the samples, not the step count, so every stage gives each sample the lr the plain loop gives it, and
    the lr scales with the step's size (linear scaling): a step of half the target moves the weights about
    half as far. A step of exactly the target at `samples_before` = k * target is the plain loop's step k."""
    return samples_before / target, step_samples / target

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


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at total_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainingConfig) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)

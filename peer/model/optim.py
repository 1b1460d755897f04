"""The optimizer and learning-rate schedule every replica of every stage (and the local loop) uses."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from peer.config import TrainingConfig


class AdamW:
    """AdamW (decoupled weight decay) over one group of parameters: torch.optim.AdamW's update with foreach=False
    (one parameter at a time, in a fixed order, so replicas and the local loop agree bit for bit), the same
    operations in the same order (tests/test_numerics.py compares the two), without torch.optim.Optimizer's
    machinery, whose construction imports torch._dynamo: 1.5 s of CPU and 70 MB of memory in every server.

    Its state is torch's own layout (`state[p]`: `step`, a float32 scalar tensor, `exp_avg`, `exp_avg_sq`), so
    states and checkpoints pass between the two; `param_groups` holds the group's `lr` (set_lr)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        self.params = list(params)
        group = {"params": self.params, "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups = [group]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in self.params:
            if p.grad is not None:
                self._update(p, p.grad, lr, beta1, beta2, eps, decay)

    def _update(self, p, grad, lr: float, beta1: float, beta2: float, eps: float, decay: float) -> None:
        state = self.state.get(p)
        if not state:
            state = self.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step_t += 1
        if decay != 0:
            p.mul_(1 - lr * decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainingConfig) -> AdamW:
    return AdamW(params, lr=lr_at(0, cfg), betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_at(step: float, cfg: TrainingConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at total_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: AdamW, step: float, cfg: TrainingConfig, scale: float = 1.0) -> None:
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

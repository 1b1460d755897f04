"""What every trainable part a peer holds (a stage, an expert) shares: accumulator, optimizer step, state.

A part's parameters receive sum-of-sample gradients from backwards into an accumulator; an
optimizer step divides by the samples it accounts (over the whole averaging group). Additions
are numbered within an incarnation for trainers' receipts. A part's state (parameters, optimizer
state, metadata) is what a joining replica downloads, in shards from several donors.

In local mode (DiLoCo, `averaging.mode = "local"`) a replica takes inner optimizer steps on its
own gradients; a round then averages the pseudo-gradients (the anchor, i.e. the parameters after
the last outer step, minus the parameters now) and the outer step is Nesterov momentum SGD on the
anchor: m = mu*m + delta; anchor -= lr*(delta + mu*m). The parameters become the new anchor,
plus whatever inner steps were taken while the round ran. `epoch` counts outer steps there.

Every method runs on the owner's torch thread, one at a time, so nothing here takes a lock.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.model import allocation
from peer.model.numerics import squared_norm
from peer.model.optim import build_optimizer, schedule_of, set_lr
from peer.model.part_state import Fingerprint, PartState

logger = logging.getLogger(__name__)


def next_incarnation(previous: int) -> int:
    """An incarnation number larger than `previous` and than any this peer id had before (nanoseconds)."""
    return max(previous + 1, time.time_ns())


class BadGradient(ValueError):
    """A backward whose parameter gradients are not finite: refused, nothing added."""


@dataclass
class Restored:
    """Gradients a failed round took and put back: the additions after the previous piece, up to `seq`."""

    epoch: int  # the step the round was for
    seq: int  # the last accumulator addition in this piece
    sums: list[torch.Tensor]  # the piece's gradients summed over its samples (CPU copies)
    samples: int


# pieces kept from failed rounds at one step (each a gradient-sized copy, in host memory); more are merged,
# oldest first, and a partner's step then covers a merged piece only whole (else it stays: counted twice)
MAX_RESTORED = 4


class PartRuntime(PartState):
    """The step and state side of one part; subclasses add its forward and backward."""

    keeps_stash = True  # keep the previous step's weights, for backwards of forwards that ran on them

    def __init__(
        self,
        spec: RunSpec,
        name: str,
        module: torch.nn.Module,
        fingerprint_history: int = 64,
        dedup_history: int = 1024,
        initialized: bool = True,
    ):
        self.spec, self.name, self.model = spec, name, module
        # False: the parameters are zero pages not yet in memory, until load_state or init_from_seed
        self.initialized = initialized
        self.tp_degree = 1  # ranks this part is split over (peer.model.tp); 1: unsplit
        self.devices: list[str] = []  # the torch devices it runs on, one per rank
        self.params = [p for _, p in module.named_parameters()]
        self.param_names = [n for n, _ in module.named_parameters()]
        self.optimizer = build_optimizer(self.params, spec.training)
        self.accumulator = [allocation.zeros_like(p) for p in self.params]  # in memory once backwards come
        self.epoch = 0  # optimizer steps taken (local mode: outer steps)
        self.version = 0  # changes whenever the parameters do: cached forwards on other weights are stale
        self.samples_accumulated = 0  # samples in the accumulator
        self.samples_stepped = 0  # samples accounted by finished steps (whole averaging group)
        self.history: deque[Fingerprint] = deque(maxlen=fingerprint_history)
        self._checked_values: list[float] | None = None  # a loading state's fingerprint, checked (part_state)
        self.throughput = 0.0  # samples/s of forward+backward, exponential moving average
        self.fixed_throughput = False  # announced as configured, not measured
        self._stash: tuple[int, list[torch.Tensor]] | None = None  # (version, weights) before the last step
        # what failed rounds of this epoch took and put back, in pieces by the additions they end at: a
        # partner's step may have counted some of them (its round succeeded there, not here)
        self.restored: list[Restored] = []
        # receipts: the accumulator's additions are numbered; stepped_seq says how many are in finished steps
        # a new, larger number whenever the accumulator is dropped: the newest incarnation is the largest
        self.incarnation = next_incarnation(0)
        self.seq = 0  # backwards added to the accumulator in this incarnation
        self.stepped_seq = 0  # additions up to this one are in a finished optimizer step
        self.taken_seq = 0  # additions up to this one were taken out by take_gradients
        # uid -> seq of the backwards added in this incarnation: a caller's retry of one (its answer came
        # too late) is answered again but not added twice
        self.counted: OrderedDict[str, int] = OrderedDict()
        self._dedup_history = dedup_history
        # local mode (DiLoCo): the anchor (parameters after the last outer step), the outer momentum,
        # and the inner steps and samples since the last outer step
        self.local = spec.local_updates
        self.inner_steps = self.inner_samples = 0
        anchor = (lambda p: p.detach().clone()) if initialized else allocation.zeros_like  # noqa: E731
        self.anchor = [anchor(p) for p in self.params] if self.local else []
        self.momentum = [allocation.zeros_like(p) for p in self.params] if self.local else []
        self._taken: tuple[list[torch.Tensor], int, int] | None = None  # (params, inner steps, samples) at a take
        self.configure_clipping(10.0, 64)
        self.clipped = self.refused_gradients = 0  # backwards clipped, and refused as not finite

    def configure_clipping(self, factor: float, window: int) -> None:
        """Clip a backward's per-sample gradient norm to `factor` x the median of the last `window`."""
        self.clip_factor = factor
        self.grad_norms: deque[float] = deque(maxlen=max(window, 1))

    def guard_gradients(self, grads, samples: int) -> list:
        """One backward's parameter gradients, checked before they are added to the accumulator.

        Not finite: BadGradient (the caller gets INVALID_ARGUMENT). Far above the running median of
        per-sample norms: scaled down to `clip_factor` x that median, and logged. A hostile trainer
        can thus move a step by at most that much per micro-batch (docs/security.md). The norm is the
        whole part's (a split part's ranks sum their shards'), and a split part's ranks all take rank
        0's decision, so they clip alike.
        """
        if all(g is None for g in grads):
            return list(grads)
        norm = math.sqrt(self._squared_norm(grads, exact=False))  # a check of this server's own: no agreement needed
        if not math.isfinite(norm):
            self.refused_gradients += 1
            raise BadGradient("the gradients this backward produced are not finite; nothing was added")
        per_sample = norm / max(samples, 1)
        scale = 1.0
        if len(self.grad_norms) >= 8 and self.clip_factor > 0:
            limit = self.clip_factor * statistics.median(self.grad_norms)
            if per_sample > limit > 0:
                scale = limit / per_sample
        scale = self._shared_scale(scale)
        if scale < 1.0:
            grads = [None if g is None else g * scale for g in grads]
            self.clipped += 1
            logger.warning(
                "%s: clipped a backward's gradient norm %.3g per sample to %.3g (%.0fx the running median)",
                self.name,
                per_sample,
                per_sample * scale,
                self.clip_factor,
            )
        self.grad_norms.append(per_sample * scale)
        return list(grads)

    def _squared_norm(self, grads, exact: bool = True) -> float:
        """The squared norm of `grads` over the whole part (a split part sums its ranks'; see numerics.squared_norm
        for `exact`)."""
        return squared_norm([g for g in grads if g is not None], exact)

    def _shared_scale(self, scale: float) -> float:
        """The clip scale every rank of the part takes (a split part: rank 0's)."""
        return scale

    @property
    def progress(self) -> int:
        """Training steps: optimizer steps (gradient mode), or inner steps of the outer steps so far (local)."""
        return self.epoch * self.spec.averaging.inner_steps + self.inner_steps if self.local else self.epoch

    def _accumulate(self, grads, samples: int, uid: str = "") -> int:
        for acc, g in zip(self.accumulator, grads, strict=True):
            if g is not None:
                acc.add_(g)
        self.samples_accumulated += samples
        self.seq += 1
        if uid:
            self.counted[uid] = self.seq
            while len(self.counted) > self._dedup_history:
                self.counted.popitem(last=False)
        return self.seq

    def _measure(self, batch: int, seconds: float, weight: float) -> None:
        if self.fixed_throughput:
            return
        # a forward is ~1/3 and a backward ~2/3 of the work of one sample
        sample_rate = batch / max(seconds / weight, 1e-6)
        self.throughput = sample_rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * sample_rate

    @torch.no_grad()
    def init_from_seed(self) -> None:
        """The run's initial weights into a part built without them (`initialized` False); else nothing."""
        if self.initialized:
            return
        self._keep_pinned()
        self.model.init_from_seed()
        for a, p in zip(self.anchor, self.params, strict=False):
            a.copy_(p)
        self.initialized = True

    def _restash(self) -> None:
        """Before a step: keep the weights it replaces if a forward that ran on them may still see its backward
        (weight stashing), else keep none (the last step's copy goes too: a copy of the weights is not held for
        nothing)."""
        self._stash = None  # first: the old copy is freed before a new one is made
        if self.keeps_stash and self._awaits_backward():
            self._stash = (self.version, [p.detach().clone() for p in self.params])

    def _awaits_backward(self) -> bool:
        """Hook: whether a forward on the current weights may still see its backward (a stage's cached forwards)."""
        return True

    def _after_step(self) -> None:
        """Hook: the parameters just changed in place."""

    def _after_load(self) -> None:
        """Hook: the parameters were replaced by a donor's."""

    # ---- optimizer step -------------------------------------------------------------------
    def take_gradients(self) -> tuple[list[torch.Tensor], int]:
        """Hand over the accumulated per-sample mean gradients and their sample count, and reset.

        The accumulator itself is handed over, divided in place, and a new one takes its place: zero pages
        that take no memory until backwards write them (peer.model.allocation), not a copy of the part."""
        samples = self.samples_accumulated
        grads = self.accumulator
        for g in grads:
            g.div_(max(samples, 1))
        self.accumulator = [allocation.zeros_like(p) for p in self.params]
        self.samples_accumulated = 0
        self.taken_seq = self.seq
        return grads, samples

    def drop_accumulator(self) -> int:
        """Forget the accumulated gradients and start a new incarnation; returns the samples dropped.

        Called when trainers may have taken this server for gone (its DHT record expired while it
        was frozen): they replay their unstepped backwards elsewhere, so keeping them would count twice.
        """
        dropped = self.samples_accumulated
        for acc in self.accumulator:
            acc.zero_()
        self.samples_accumulated = 0
        self.restored = []
        # the uids of stepped additions stay known, as stepped (seq 0 is in every finished step): a trainer
        # started again after a kill that sends one of them again is answered, not counted twice
        stepped = OrderedDict((uid, 0) for uid, seq in self.counted.items() if seq <= self.stepped_seq)
        self.incarnation = next_incarnation(self.incarnation)
        self.seq = self.stepped_seq = self.taken_seq = 0
        self.counted = stepped
        return dropped

    def restore_gradients(self, grads: list[torch.Tensor], samples: int, seq: int) -> None:
        """Put gradients taken (up to addition `seq`) for a round that failed back, for the next round.

        What earlier failed rounds of this epoch put back was taken again with the rest: the new
        piece is only what this take added to them.
        """
        for acc, g in zip(self.accumulator, grads, strict=True):
            acc.add_(g, alpha=samples)
        self.samples_accumulated += samples
        self.restored = [r for r in self.restored if r.epoch == self.epoch]
        earlier = sum(r.samples for r in self.restored)
        if samples > earlier:
            sums = [(g * samples).cpu() for g in grads]
            for r in self.restored:
                sums = [s - p for s, p in zip(sums, r.sums, strict=True)]
            self.restored.append(Restored(self.epoch, seq, sums, samples - earlier))
        while len(self.restored) > MAX_RESTORED:
            first, second = self.restored[0], self.restored.pop(1)
            first.sums = [a + b for a, b in zip(first.sums, second.sums, strict=True)]
            first.seq, first.samples = second.seq, first.samples + second.samples

    def drop_covered(self, incarnation: int, seq: int) -> int:
        """A partner's step counted our additions up to `seq` (a round that failed here succeeded there):
        take the pieces it covered out of the accumulator again; returns the samples dropped."""
        if incarnation != self.incarnation:
            return 0
        dropped = [r for r in self.restored if r.seq <= seq]
        for r in dropped:
            for acc, g in zip(self.accumulator, r.sums, strict=True):
                acc.sub_(g.to(acc.device))
            self.samples_accumulated -= r.samples
        self.restored = [r for r in self.restored if r.seq > seq]
        # a donor's word on what its step counted of ours: no further than what we added (a claim of 2^63 would
        # have our receipts confirmed for backwards no step holds)
        self.stepped_seq = max(self.stepped_seq, min(seq, self.seq))
        return sum(r.samples for r in dropped)

    def apply_step(
        self,
        grads: list[torch.Tensor],
        group_samples: int,
        seq: int,
        members: list[str] | None = None,
        coverage: dict[str, tuple[int, int]] | None = None,
    ) -> Fingerprint:
        """One optimizer step with `grads` (already averaged over the group), covering additions up to `seq`."""
        self.restored = []  # taken with the rest of the accumulator into this step
        position, scale = schedule_of(self.samples_stepped, group_samples, self.epoch, self.spec.training)
        self._optimizer_step(grads, position, scale)
        self.epoch += 1
        self.samples_stepped += group_samples
        self.stepped_seq = max(self.stepped_seq, seq)
        self._after_step()
        fingerprint = Fingerprint(
            self.epoch, group_samples, self.fingerprint_values(), list(members or []), dict(coverage or {})
        )
        self.history.append(fingerprint)
        return fingerprint

    # ---- local mode (DiLoCo) ---------------------------------------------------------------
    def apply_inner_step(self, grads: list[torch.Tensor], samples: int, seq: int) -> None:
        """Local mode: an optimizer step of this replica alone, covering additions up to `seq`."""
        self._optimizer_step(grads, self.progress)
        self.inner_steps += 1
        self.inner_samples += samples
        self.stepped_seq = max(self.stepped_seq, seq)
        self._after_step()

    def full_parameters(self) -> list[torch.Tensor]:
        """The parameters as CPU copies (a split part gathers them from its ranks)."""
        return [p.detach().cpu().clone() for p in self.params]

    def inner_step(self) -> None:
        """Local mode: an inner step with what the accumulator holds (nothing if it is empty)."""
        if self.samples_accumulated:
            grads, samples = self.take_gradients()
            self.apply_inner_step(grads, samples, self.taken_seq)

    def _optimizer_step(self, grads: list[torch.Tensor], schedule_step: float, scale: float = 1.0) -> None:
        """Stash the weights, then one AdamW step with `grads` at the lr of `schedule_step` times `scale`; a new
        version."""
        self._keep_pinned()  # shards of this step a joiner has still to get
        self._restash()
        limit = self.spec.training.max_grad_norm
        if limit > 0:  # every rank of a split part takes the same norm (a sum over the ranks), so they clip alike
            norm = math.sqrt(self._squared_norm(grads))
            if norm > limit:
                grads = [g * (limit / norm) for g in grads]
        for p, g in zip(self.params, grads, strict=True):
            # the caller's tensors themselves (none of them is used after the step: AdamW reads its gradients
            # without writing them), not a copy of the whole part
            p.grad = g.to(device=p.device, dtype=p.dtype)
        set_lr(self.optimizer, schedule_step, self.spec.training, scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    @torch.no_grad()
    def take_delta(self) -> tuple[list[torch.Tensor], int]:
        """Local mode: the pseudo-gradient (anchor - parameters, float32 CPU) and the samples it covers."""
        current = [p.detach().clone() for p in self.params]
        self._taken = (current, self.inner_steps, self.inner_samples)
        delta = [(a - c).float().cpu() for a, c in zip(self.anchor, current, strict=True)]
        return delta, self.inner_samples

    @torch.no_grad()
    def apply_outer_step(
        self,
        delta: list[torch.Tensor],
        group_samples: int,
        members: list[str] | None = None,
        coverage: dict[str, tuple[int, int]] | None = None,
    ) -> Fingerprint:
        """Local mode: the outer Nesterov step with the group's averaged pseudo-gradient `delta`.

        Inner steps taken since `take_delta` are kept on top of the new anchor.
        """
        taken, steps, samples = self._taken
        self._taken = None
        mu, lr = self.spec.averaging.outer_momentum, self.spec.averaging.outer_lr
        self._keep_pinned()
        self._restash()
        for p, a, m, d, t in zip(self.params, self.anchor, self.momentum, delta, taken, strict=True):
            d = d.to(device=a.device, dtype=a.dtype)
            m.mul_(mu).add_(d)
            a.sub_(d + mu * m, alpha=lr)
            p.add_(a - t)  # = anchor + (inner progress since the take)
        self.epoch += 1
        self.inner_steps -= steps
        self.inner_samples -= samples
        self.samples_stepped += group_samples
        self.version += 1
        self._after_step()
        fingerprint = Fingerprint(
            self.epoch, group_samples, self.fingerprint_values(), list(members or []), dict(coverage or {})
        )
        self.history.append(fingerprint)
        return fingerprint

    def forget_delta(self) -> None:
        """Local mode: a round failed; the next one takes the pseudo-gradient anew."""
        self._taken = None

    # ---- a round, in either mode ----------------------------------------------------------
    def take_for_round(self) -> tuple[list[torch.Tensor], int]:
        """What this replica averages: its mean gradients, or in local mode its pseudo-gradient."""
        return self.take_delta() if self.local else self.take_gradients()

    def apply_round(
        self,
        averaged: list[torch.Tensor],
        group_samples: int,
        seq: int,
        members: list[str],
        coverage: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        if self.local:
            self.apply_outer_step(averaged, group_samples, members, coverage)
        else:
            self.apply_step(averaged, group_samples, seq, members, coverage)

    def restore_round(self, taken: list[torch.Tensor], samples: int, seq: int) -> None:
        """The round failed: gradients go back into the accumulator (local mode: nothing to put back)."""
        if self.local:
            self.forget_delta()
        else:
            self.restore_gradients(taken, samples, seq)

    def has_work(self) -> bool:
        """Whether a step alone would change anything: gradients accumulated, or inner steps to fold in."""
        return bool(self.inner_samples) if self.local else bool(self.samples_accumulated)

    def awaiting_backward(self) -> frozenset:
        """The training forwards run on the current weights whose backward has not come yet (keys of their
        cached graphs): a step now would leave their gradients to count one step late. Safe from any thread."""
        return frozenset()

    def samples_awaiting_backward(self) -> int:
        """Samples of the forwards `awaiting_backward` names (a step that drains counts them in). Any thread."""
        return 0

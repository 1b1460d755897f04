"""The torch side of a stage server: forward, stateless backward, gradient accumulation, optimizer step.

Every method runs on the server's single torch thread (never on the event loop), one at a time,
so the accumulator and the optimizer need no locks.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from peer.config import RunSpec
from peer.model import StageModel
from peer.optim import build_optimizer, set_lr


class InputError(ValueError):
    """A request whose tensors do not fit this stage; the message says which and why."""


class StateError(ValueError):
    """A downloaded state that does not fit this stage."""


class Late(RuntimeError):
    """A request's deadline passed before its work was done: its gradients were not kept."""


@dataclass
class Fingerprint:
    epoch: int  # the optimizer step this fingerprint follows (epoch after the step)
    samples: int  # samples the step accounted over the whole averaging group
    values: list[float]  # per parameter: sum, then sum of squares
    members: list[str] = field(default_factory=list)  # peer ids of the averaging group; empty: unknown


@dataclass
class _CachedForward:
    epoch: int
    inputs: torch.Tensor
    outputs: torch.Tensor


STEP_MEMBERS = 32  # recent steps whose group members travel with a state
LATE_MARGIN = 0.25  # s: gradients finished closer than this to the deadline are not kept (the answer could come late)


class StageRuntime:
    def __init__(self, spec: RunSpec, stage: int, activation_cache_size: int = 32, fingerprint_history: int = 64):
        self.spec, self.stage = spec, stage
        self.model = StageModel(spec, stage)
        self.model.train()
        self.params = [p for _, p in self.model.named_parameters()]
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self.optimizer = build_optimizer(self.params, spec.training)
        self.accumulator = [torch.zeros_like(p) for p in self.params]
        self.epoch = 0  # optimizer steps taken
        self.samples_accumulated = 0  # samples in the accumulator
        self.samples_stepped = 0  # samples accounted by finished steps (whole averaging group)
        self.history: deque[Fingerprint] = deque(maxlen=fingerprint_history)
        self._cache: OrderedDict[str, _CachedForward] = OrderedDict()
        self._cache_size = activation_cache_size
        self.throughput = 0.0  # samples/s of forward+backward, exponential moving average
        self.fixed_throughput = False  # announced as configured, not measured
        self.cache_hits = self.cache_misses = self.cache_stashed = 0
        self._stash: tuple[int, list[torch.Tensor]] | None = None  # (epoch, weights) of the previous step
        # (epoch, grads, samples, seq) of a failed round, back in the accumulator
        self.restored: tuple[int, list[torch.Tensor], int, int] | None = None
        # receipts: the accumulator's additions are numbered; stepped_seq says how many are in finished steps
        self.incarnation = random.getrandbits(63) or 1  # a new number whenever the accumulator is dropped
        self.seq = 0  # backwards added to the accumulator in this incarnation
        self.stepped_seq = 0  # additions up to this one are in a finished optimizer step
        self.taken_seq = 0  # additions up to this one were taken out by take_gradients

    # ---- input checks ---------------------------------------------------------------------
    def check_inputs(self, inputs: torch.Tensor) -> None:
        cfg = self.spec.model
        if self.model.is_first:
            if inputs.dtype not in (torch.int64, torch.int32, torch.uint8) or inputs.dim() != 2:
                raise InputError(
                    f"stage 0 takes token ids of shape [batch, seq] and an integer dtype, got {inputs.dtype} {list(inputs.shape)}"
                )
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= cfg.vocab_size):
                raise InputError(f"token ids must lie in [0, {cfg.vocab_size})")
        else:
            if inputs.dtype != torch.float32 or inputs.dim() != 3 or inputs.shape[-1] != cfg.hidden_size:
                raise InputError(
                    f"stage {self.stage} takes float32 hidden states of shape [batch, seq, {cfg.hidden_size}], "
                    f"got {inputs.dtype} {list(inputs.shape)}"
                )
            if not torch.isfinite(inputs).all():
                raise InputError("inputs contain NaN or Inf")
        if inputs.shape[0] < 1 or inputs.shape[1] < 1:
            raise InputError(f"inputs must hold at least one sequence of one token, got shape {list(inputs.shape)}")
        if inputs.shape[1] > cfg.max_seq_len:
            raise InputError(f"sequence length {inputs.shape[1]} exceeds the model's max_seq_len {cfg.max_seq_len}")

    def check_targets(self, inputs: torch.Tensor, targets: torch.Tensor | None, required: bool) -> None:
        if targets is None:
            if required:
                raise InputError(f"stage {self.stage} is the last stage: the backward needs targets")
            return
        if not self.model.is_last:
            raise InputError(f"targets go to the last stage, not stage {self.stage}")
        if targets.dtype not in (torch.int64, torch.int32, torch.uint8) or list(targets.shape) != list(
            inputs.shape[:2]
        ):
            raise InputError(
                f"targets must be integer ids of shape {list(inputs.shape[:2])}, got {targets.dtype} {list(targets.shape)}"
            )
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.spec.model.vocab_size):
            raise InputError(f"target ids must lie in [0, {self.spec.model.vocab_size})")

    # ---- forward / backward ---------------------------------------------------------------
    def _graph(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = inputs if self.model.is_first else inputs.detach().requires_grad_(True)
        with torch.enable_grad():
            return x, self.model(x, targets)

    def forward(self, uid: str, inputs: torch.Tensor, targets: torch.Tensor | None, train: bool) -> torch.Tensor:
        """Hidden states, or the loss on the last stage when targets are given."""
        self.check_inputs(inputs)
        self.check_targets(inputs, targets, required=False)
        started = time.perf_counter()
        if train and uid and targets is None:
            x, out = self._graph(inputs, None)
            self._cache[uid] = _CachedForward(self.epoch, x, out)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            result = out.detach()
        else:
            with torch.no_grad():
                result = self.model(inputs, targets)
        self._measure(inputs.shape[0], time.perf_counter() - started, weight=1 / 3)
        return result

    def backward(
        self,
        uid: str,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        deadline: float | None = None,
    ) -> tuple[torch.Tensor | None, float | None, int]:
        """Accumulate this micro-batch's parameter gradients; return (grad of inputs, loss on the last stage, seq).

        The objective is the micro-batch's summed per-sample loss, so the accumulator holds
        sum-of-sample gradients and the step divides by the samples it accounts. With a `deadline`
        (time.monotonic()), gradients computed after it are dropped (Late): the caller has given up
        and sent the micro-batch to another replica, which must be the only one to count it.
        """
        self.check_inputs(inputs)
        self.check_targets(inputs, targets, required=self.model.is_last)
        batch = inputs.shape[0]
        if not self.model.is_last:
            if grad_outputs is None:
                raise InputError(f"stage {self.stage} needs grad_outputs for its backward")
            expected = [*inputs.shape[:2], self.spec.model.hidden_size]
            if grad_outputs.dtype != torch.float32 or list(grad_outputs.shape) != expected:
                raise InputError(
                    f"grad_outputs must be float32 of shape {expected}, got {grad_outputs.dtype} {list(grad_outputs.shape)}"
                )
            if not torch.isfinite(grad_outputs).all():
                raise InputError("grad_outputs contain NaN or Inf")
        elif grad_outputs is not None:
            raise InputError("the last stage computes its own loss: send targets, not grad_outputs")
        if deadline is not None and time.monotonic() > deadline:
            raise Late("the request's deadline passed while it waited")
        started = time.perf_counter()
        cached = self._cache.pop(uid, None) if uid else None
        same_inputs = (
            cached is not None and cached.inputs.shape == inputs.shape and torch.equal(cached.inputs.detach(), inputs)
        )
        params = self.params
        if same_inputs and cached.epoch == self.epoch:
            x, out = cached.inputs, cached.outputs
            self.cache_hits += 1
        elif same_inputs and self._stash is not None and cached.epoch == self._stash[0]:
            # the forward ran on the weights of the previous step: recompute with those (weight stashing),
            # so these gradients match the activations the later stages saw; they apply one step late
            params = [p.detach().requires_grad_(True) for p in self._stash[1]]
            x = inputs if self.model.is_first else inputs.detach().requires_grad_(True)
            named = dict(zip(self.param_names, params, strict=True))
            with torch.enable_grad():
                out = torch.func.functional_call(self.model, named, (x, targets))
            self.cache_stashed += 1
        else:
            x, out = self._graph(inputs, targets)
            self.cache_misses += 1
        wrt = params if self.model.is_first else [x, *params]
        with torch.enable_grad():
            if self.model.is_last:
                loss = out.detach().item()
                grads = torch.autograd.grad(out * batch, wrt, allow_unused=True)
            else:
                loss = None
                grads = torch.autograd.grad(out, wrt, grad_outputs, allow_unused=True)
        grad_inputs = None if self.model.is_first else grads[0]
        param_grads = grads if self.model.is_first else grads[1:]
        if deadline is not None and time.monotonic() > deadline - LATE_MARGIN:
            raise Late("the request's deadline passed during its backward")
        for acc, g in zip(self.accumulator, param_grads, strict=True):
            if g is not None:
                acc.add_(g)
        self.samples_accumulated += batch
        self.seq += 1
        self._measure(batch, time.perf_counter() - started, weight=2 / 3)
        return grad_inputs, loss, self.seq

    def _measure(self, batch: int, seconds: float, weight: float) -> None:
        if self.fixed_throughput:
            return
        # a forward is ~1/3 and a backward ~2/3 of the work of one sample
        sample_rate = batch / max(seconds / weight, 1e-6)
        self.throughput = sample_rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * sample_rate

    def benchmark(self, batch: int, seq_len: int, repeats: int = 2) -> float:
        """Measure samples/s of forward+backward on made-up data, without touching the accumulator."""
        cfg = self.spec.model
        gen = torch.Generator().manual_seed(0)
        if self.model.is_first:
            inputs = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
        else:
            inputs = torch.randn(batch, seq_len, cfg.hidden_size, generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen) if self.model.is_last else None
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            x, out = self._graph(inputs, targets)
            objective = out if self.model.is_last else (out * out).mean()
            torch.autograd.grad(objective, self.params, allow_unused=True)
            best = min(best, time.perf_counter() - started)
        self.throughput = batch / best
        return self.throughput

    # ---- optimizer step -------------------------------------------------------------------
    def take_gradients(self) -> tuple[list[torch.Tensor], int]:
        """Hand over the accumulated per-sample mean gradients and their sample count, and reset."""
        samples = self.samples_accumulated
        grads = [acc / max(samples, 1) for acc in self.accumulator]
        for acc in self.accumulator:
            acc.zero_()
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
        self.restored = None
        self.incarnation = random.getrandbits(63) or 1
        self.seq = self.stepped_seq = self.taken_seq = 0
        return dropped

    def restore_gradients(self, grads: list[torch.Tensor], samples: int, seq: int) -> None:
        """Put gradients taken (up to addition `seq`) for a round that failed back, for the next round."""
        for acc, g in zip(self.accumulator, grads, strict=True):
            acc.add_(g, alpha=samples)
        self.samples_accumulated += samples
        self.restored = (self.epoch, grads, samples, seq)

    def _drop_restored(self) -> None:
        """A partner's round for our failed epoch succeeded with our contribution: take it out again."""
        _, grads, samples, seq = self.restored
        for acc, g in zip(self.accumulator, grads, strict=True):
            acc.sub_(g, alpha=samples)
        self.samples_accumulated -= samples
        self.stepped_seq = max(self.stepped_seq, seq)
        self.restored = None

    def apply_step(
        self, grads: list[torch.Tensor], group_samples: int, seq: int, members: list[str] | None = None
    ) -> Fingerprint:
        """One optimizer step with `grads` (already averaged over the group), covering additions up to `seq`."""
        self._stash = (self.epoch, [p.detach().clone() for p in self.params])
        self.restored = None  # taken with the rest of the accumulator into this step
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(p.dtype).clone()
        set_lr(self.optimizer, self.epoch, self.spec.training)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.epoch += 1
        self.samples_stepped += group_samples
        self.stepped_seq = max(self.stepped_seq, seq)
        # cached graphs hold the old weights, which the step changed in place: keep only their inputs,
        # for a recompute with the stashed weights
        self._cache = OrderedDict(
            (uid, _CachedForward(c.epoch, c.inputs.detach(), c.outputs.detach())) for uid, c in self._cache.items()
        )
        fingerprint = Fingerprint(self.epoch, group_samples, self.fingerprint_values(), list(members or []))
        self.history.append(fingerprint)
        return fingerprint

    @torch.no_grad()
    def fingerprint_values(self) -> list[float]:
        values = []
        for p in self.params:
            d = p.double()
            values += [d.sum().item(), d.pow(2).sum().item()]
        return values

    # ---- state transfer -------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, shard: int = 0, num_shards: int = 1) -> tuple[dict, dict[str, torch.Tensor]]:
        """Parameters and optimizer state (copies) with metadata: what a joining replica loads.

        With `num_shards` > 1, only part `shard` of the tensors (see `state_shards`), so that
        several donors can each send a part.
        """
        everything = {f"param/{n}": p for n, p in zip(self.param_names, self.params, strict=True)}
        for name, p in zip(self.param_names, self.params, strict=True):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    everything[f"optim/{name}/{key}"] = value
        part = state_shards(everything, max(num_shards, 1))[shard] if num_shards > 1 else set(everything)
        tensors = {n: t.detach().clone().reshape(t.shape) for n, t in everything.items() if n in part}
        metadata = {
            "stage": self.stage,
            "epoch": self.epoch,
            "samples_stepped": self.samples_stepped,
            "last_step_samples": self.history[-1].samples if self.history else 0,
            "spec": self.spec.fingerprint(),
            "tensor_count": len(everything),
            # who made the recent steps: a replica that resyncs keeps gradients no step of the donor counted
            "step_members": {str(f.epoch): f.members for f in list(self.history)[-STEP_MEMBERS:]},
        }
        return metadata, tensors

    @torch.no_grad()
    def load_state(self, metadata: dict, tensors: dict[str, torch.Tensor], me: str = "") -> None:
        """Take a donor's state (keeping the accumulator); `me` is this replica's peer id."""
        if metadata.get("stage") != self.stage or metadata.get("spec") != self.spec.fingerprint():
            raise StateError(f"state is for stage {metadata.get('stage')} of spec {metadata.get('spec')}, not ours")
        for name, p in zip(self.param_names, self.params, strict=True):
            t = tensors.get(f"param/{name}")
            if t is None or t.shape != p.shape:
                raise StateError(f"state lacks parameter {name} of shape {list(p.shape)}")
            if not torch.isfinite(t).all():
                raise StateError(f"parameter {name} in the state is not finite")
        for name, p in zip(self.param_names, self.params, strict=True):
            p.copy_(tensors[f"param/{name}"])
            state = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                t = tensors.get(f"optim/{name}/{key}")
                if t is not None:
                    state[key] = t.clone()
            if state:
                self.optimizer.state[p] = state
        members = (metadata.get("step_members") or {}).get(str(self.restored[0] + 1)) if self.restored else None
        if self.restored is not None and self.restored[0] < int(metadata["epoch"]) and me in (members or []):
            # the donor's step after the round that failed here had us in its group: the round succeeded
            # on its side with our samples gathered into it, so they were already accounted and applied
            self._drop_restored()
        self.epoch = int(metadata["epoch"])
        self.samples_stepped = int(metadata.get("samples_stepped", 0))
        if self.epoch > 0:  # the parameters after this step are now the donor's
            self.history.append(
                Fingerprint(self.epoch, int(metadata.get("last_step_samples", 0)), self.fingerprint_values())
            )
        self._cache.clear()
        self._stash = None


def state_shards(tensors: dict[str, torch.Tensor], num_shards: int) -> list[set[str]]:
    """Split tensor names into `num_shards` parts of similar bytes; every replica computes the same split."""
    parts: list[set[str]] = [set() for _ in range(num_shards)]
    sizes = [0] * num_shards
    for name, t in sorted(tensors.items(), key=lambda item: (-item[1].numel() * item[1].element_size(), item[0])):
        lightest = min(range(num_shards), key=lambda i: (sizes[i], i))
        parts[lightest].add(name)
        sizes[lightest] += t.numel() * t.element_size()
    return parts

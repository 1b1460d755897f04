"""The torch side of a stage server: forward, stateless backward, gradient accumulation, optimizer step.

Every method runs on the server's single torch thread (never on the event loop), one at a time,
so the accumulator and the optimizer need no locks.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.model.llama import StageModel
from peer.model.numerics import all_finite
from peer.model.part import BadGradient, PartRuntime
from peer.model.part_state import Fingerprint, StateError, state_shards

__all__ = ["Fingerprint", "InputError", "Late", "RankDied", "StageRuntime", "StateError", "state_shards"]


class InputError(ValueError):
    """A request whose tensors do not fit this stage; the message says which and why."""


class RankDied(RuntimeError):
    """A rank of this peer's tensor-parallel group is gone (peer.model.tp_runtime): the stage cannot be served here."""


class Late(RuntimeError):
    """A request's deadline passed before its work was done: its gradients were not kept."""


@dataclass
class _CachedForward:
    version: int  # the parameters it ran on (PartRuntime.version)
    inputs: torch.Tensor
    outputs: torch.Tensor
    aux: torch.Tensor | None = None  # the weighted MoE load-balancing loss of this forward


# the dtype of a stage's matmuls (torch.autocast); weights, optimizer state and the wire stay float32
COMPUTE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
LATE_MARGIN = 0.25  # s: gradients finished closer than this to the deadline are not kept (the answer could come late)


def _forget_grad(p: torch.Tensor) -> None:
    p.grad = None


class StageRuntime(PartRuntime):
    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        activation_cache_size: int = 32,
        fingerprint_history: int = 64,
        experts=None,
        dedup_history: int = 1024,
        device: str = "cpu",
        tp=None,
        compute_dtype: str = "",
        init: bool = True,
    ):
        """`init` False: a server about to load a donor's state; its weights take no memory until that
        load, or init_from_seed when no donor has one (on CPU, unsplit; elsewhere they start initialised)."""
        self.stage = stage
        self.device = torch.device(device)
        compute_dtype = compute_dtype or spec.training.dtype  # "": the run's
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"server.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype]
        # experts: the remote backend of its MoE layers, if any; tp: this rank's place (peer.model.tp) when split
        init = init or tp is not None or self.device.type != "cpu"
        if init:
            model = StageModel(spec, stage, experts, tp).to(self.device)
        else:  # its weights come from a donor, or from init_from_seed: none in memory before
            model = StageModel.unallocated(spec, stage, experts)
        model.train()
        super().__init__(spec, f"stage {stage}", model, fingerprint_history, dedup_history, initialized=init)
        self.devices = [str(self.device)]
        self._cache: OrderedDict[str, _CachedForward] = OrderedDict()
        self._cache_size = activation_cache_size
        self.cache_hits = self.cache_misses = self.cache_stashed = 0
        self.duplicates = 0  # retried backwards answered without being added again
        self.perturb_outputs = 0.0  # server.perturb_outputs (drills and tests): noise added to forward outputs

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
            if not all_finite(inputs):
                raise InputError("inputs contain NaN or Inf")
        if inputs.shape[0] < 1 or inputs.shape[1] < 1:
            raise InputError(f"inputs must hold at least one sequence of one token, got shape {list(inputs.shape)}")
        if inputs.shape[1] > cfg.max_seq_len:
            raise InputError(f"sequence length {inputs.shape[1]} exceeds the model's max_seq_len {cfg.max_seq_len}")
        limit = self.spec.training.request_tokens()
        if inputs.shape[0] * inputs.shape[1] > limit:
            raise InputError(
                f"{inputs.shape[0] * inputs.shape[1]} tokens in one request; this run takes at most {limit} "
                "(training.max_request_tokens)"
            )

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

    def check_grad_outputs(self, inputs: torch.Tensor, grad_outputs: torch.Tensor | None) -> None:
        if not self.model.is_last:
            if grad_outputs is None:
                raise InputError(f"stage {self.stage} needs grad_outputs for its backward")
            expected = [*inputs.shape[:2], self.spec.model.hidden_size]
            if grad_outputs.dtype != torch.float32 or list(grad_outputs.shape) != expected:
                raise InputError(
                    f"grad_outputs must be float32 of shape {expected}, got {grad_outputs.dtype} {list(grad_outputs.shape)}"
                )
            if not all_finite(grad_outputs):
                raise InputError("grad_outputs contain NaN or Inf")
        elif grad_outputs is not None:
            raise InputError("the last stage computes its own loss: send targets, not grad_outputs")

    # ---- forward / backward ---------------------------------------------------------------
    def _agree(self, flag: bool) -> bool:
        """A decision every rank of a split stage must share (rank 0's); unsplit, the flag itself."""
        return flag

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _on_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device)

    def _graph(self, inputs: torch.Tensor, targets: torch.Tensor | None):
        """(inputs that need grad, outputs, weighted MoE aux loss or None), with the autograd graph."""
        x = inputs if self.model.is_first else inputs.detach().requires_grad_(True)
        with torch.enable_grad():
            with self._autocast():
                out = self.model(x, targets)
            return x, out, self.model.aux_loss()

    def forward(self, uid: str, inputs: torch.Tensor, targets: torch.Tensor | None, train: bool) -> torch.Tensor:
        """Hidden states, or the loss on the last stage when targets are given."""
        self.check_inputs(inputs)
        self.check_targets(inputs, targets, required=False)
        started = time.perf_counter()
        inputs, targets = self._on_device(inputs), self._on_device(targets)
        if train and uid and targets is None and not self.model.is_last:  # the last stage's backward needs the loss
            x, out, aux = self._graph(inputs, None)
            self._cache[uid] = _CachedForward(self.version, x, out, aux)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            result = out.detach().float()
        else:
            with torch.no_grad(), self._autocast():
                result = self.model(inputs, targets).float()
        self._measure(inputs.shape[0], time.perf_counter() - started, weight=1 / 3)
        if self.perturb_outputs and targets is None:  # server.perturb_outputs: a drill of a wrong server
            result = result + self.perturb_outputs * torch.randn_like(result)
        return result.cpu()

    def backward(
        self,
        uid: str,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        deadline: float | None = None,
        count: bool = True,
    ) -> tuple[torch.Tensor | None, float | None, int]:
        """Accumulate this micro-batch's parameter gradients; return (grad of inputs, loss on the last stage, seq).

        `count` False (a dry backward): the gradients are computed and nothing is added; seq 0.

        The objective is the micro-batch's summed per-sample loss, so the accumulator holds
        sum-of-sample gradients and the step divides by the samples it accounts. With a `deadline`
        (time.monotonic()), gradients computed after it are dropped (Late): the caller has given up
        and sent the micro-batch to another replica, which must be the only one to count it.
        """
        self.check_inputs(inputs)
        self.check_targets(inputs, targets, required=self.model.is_last)
        batch = inputs.shape[0]
        self.check_grad_outputs(inputs, grad_outputs)
        if self._agree(deadline is not None and time.monotonic() > deadline):
            raise Late("the request's deadline passed while it waited")
        started = time.perf_counter()
        inputs, targets, grad_outputs = self._on_device(inputs), self._on_device(targets), self._on_device(grad_outputs)
        x, out, aux, params = self._recall(uid, inputs, targets)
        grad_inputs, param_grads, loss = self._gradients(x, out, aux, params, grad_outputs, batch)
        if self._agree(deadline is not None and time.monotonic() > deadline - LATE_MARGIN):
            raise Late("the request's deadline passed during its backward")
        if not count:  # the caller knows this stage stepped this micro-batch: its input gradients only
            return None if grad_inputs is None else grad_inputs.cpu(), loss, 0
        if uid and uid in self.counted:
            # a retry of a backward already added (its answer reached the caller too late): answer it
            # again with the first addition's number, and do not count it twice
            self.duplicates += 1
            return grad_inputs, loss, self.counted[uid]
        refused = False
        try:
            param_grads = self.guard_gradients(param_grads, batch)
        except BadGradient:
            refused = True
        if self._agree(refused):  # every rank of a split stage refuses together (rank 0 decides)
            raise BadGradient("the gradients this backward produced are not finite; nothing was added")
        seq = self._accumulate(param_grads, batch, uid)
        self._measure(batch, time.perf_counter() - started, weight=2 / 3)
        return None if grad_inputs is None else grad_inputs.cpu(), loss, seq

    def _awaits_backward(self) -> bool:
        """Whether a forward on the current weights is cached for a backward to come (then a step stashes them)."""
        return any(c.version == self.version for c in list(self._cache.values()))

    def _recall(self, uid: str, inputs: torch.Tensor, targets: torch.Tensor | None):
        """The forward's graph for a backward: cached, recomputed on the stashed weights it ran on, or anew;
        (inputs, outputs, aux loss, the parameters to differentiate)."""
        cached = self._cache.pop(uid, None) if uid else None
        same_inputs = (
            cached is not None and cached.inputs.shape == inputs.shape and torch.equal(cached.inputs.detach(), inputs)
        )
        if same_inputs and cached.version == self.version:
            self.cache_hits += 1
            return cached.inputs, cached.outputs, cached.aux, self.params
        if same_inputs and self._stash is not None and cached.version == self._stash[0]:
            stash = self._stash
            if not any(c.version == stash[0] for c in self._cache.values()):
                self._stash = None  # the last forward that ran on those weights: they go after this backward
            # the forward ran on the weights of the previous step: recompute with those (weight stashing),
            # so these gradients match the activations the later stages saw; they apply one step late
            params = [p.detach().requires_grad_(True) for p in stash[1]]
            x = inputs if self.model.is_first else inputs.detach().requires_grad_(True)
            named = dict(zip(self.param_names, params, strict=True))
            with torch.enable_grad():
                with self._autocast():
                    out = torch.func.functional_call(self.model, named, (x, targets))
                aux = self.model.aux_loss()
            self.cache_stashed += 1
            return x, out, aux, params
        x, out, aux = self._graph(inputs, targets)
        self.cache_misses += 1
        return x, out, aux, self.params

    def _gradients(self, x, out, aux, params, grad_outputs, batch: int):
        """(grad of the inputs, the parameters' gradients, the loss on the last stage) of a micro-batch's
        summed per-sample objective."""
        wrt = params if self.model.is_first else [x, *params]
        with torch.enable_grad():
            if self.model.is_last:
                loss = out.detach().item()
                objective = out if aux is None else out + aux
                grads = torch.autograd.grad(objective * batch, wrt, allow_unused=True)
            else:
                loss = None
                outputs, grads_out = [out], [grad_outputs]
                if aux is not None:  # the MoE layers' load-balancing loss, per sample as the main objective
                    outputs.append(aux * batch)
                    grads_out.append(torch.ones_like(aux))
                grads = torch.autograd.grad(outputs, wrt, grads_out, allow_unused=True)
        grad_inputs = None if self.model.is_first else grads[0]
        return grad_inputs, grads if self.model.is_first else grads[1:], loss

    def benchmark(self, batch: int, seq_len: int, repeats: int = 2) -> float:
        """Measure samples/s of forward+backward on made-up data, without touching the accumulator."""
        cfg = self.spec.model
        gen = torch.Generator().manual_seed(0)
        if self.model.is_first:
            inputs = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
        else:
            inputs = torch.randn(batch, seq_len, cfg.hidden_size, generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen) if self.model.is_last else None
        inputs, targets = self._on_device(inputs), self._on_device(targets)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            x, out, _ = self._graph(inputs, targets)
            objective = out if self.model.is_last else (out * out).mean()
            # each parameter's gradient is dropped as soon as it is made: no second copy of the weights at once
            hooks = [p.register_post_accumulate_grad_hook(_forget_grad) for p in self.params if p.requires_grad]
            try:
                objective.backward()
            finally:
                for hook in hooks:
                    hook.remove()
            best = min(best, time.perf_counter() - started)
        self.throughput = batch / best
        return self.throughput

    def _after_step(self) -> None:
        # cached graphs hold the old weights, which the step changed in place: keep only their inputs,
        # for a recompute with the stashed weights
        self._cache = OrderedDict(
            (uid, _CachedForward(c.version, c.inputs.detach(), c.outputs.detach())) for uid, c in self._cache.items()
        )

    def _after_load(self) -> None:
        self._cache.clear()

    def awaiting_backward(self) -> frozenset:
        # a list of the items in one C call: the torch thread may change the cache meanwhile
        return frozenset(uid for uid, c in list(self._cache.items()) if c.version == self.version)

    def samples_awaiting_backward(self) -> int:
        return sum(c.inputs.shape[0] for c in list(self._cache.values()) if c.version == self.version)

"""The torch side of one hosted expert: batched forward, stateless batched backward, accumulation, steps.

Requests for the expert arrive merged into batches (peer.server.batcher). A training forward keeps its
batch's graph, keyed by the uids it merged; a backward batch made of exactly those uids reuses it,
any other backward recomputes the forward from the inputs it carries (so any replica can serve
it). The accumulator holds sum-of-sample gradients, as a stage's does, and a step divides by the
samples of the callers' micro-batches that reached this expert.

Every method runs on the host's torch thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.model.moe import make_expert, parse_expert_uid
from peer.model.numerics import all_finite
from peer.model.part import PartRuntime


class ExpertInputError(ValueError):
    """A request whose tensors do not fit the expert; the message says which and why."""


class MissingInputs(LookupError):
    """A backward without inputs whose forward this host no longer holds: the caller resends them."""


@dataclass
class _Batch:
    version: int  # the parameters it ran on (PartRuntime.version)
    uids: tuple[str, ...]
    inputs: torch.Tensor  # the merged inputs (on the device), requiring grad
    outputs: torch.Tensor  # with the graph
    sizes: list[int]  # rows of each request
    originals: list[torch.Tensor]  # each request's inputs as received (CPU)


class ExpertRuntime(PartRuntime):
    keeps_stash = False  # a backward after a step recomputes with the new weights

    def __init__(
        self, spec: RunSpec, uid: str, device: str = "cpu", cache_size: int = 64, fingerprint_history: int = 64
    ):
        layer, index = parse_expert_uid(uid)
        self.uid, self.layer, self.index, self.device = uid, layer, index, torch.device(device)
        module = make_expert(spec.model, spec.moe, spec.seed, layer, index).to(self.device)
        module.train()
        super().__init__(spec, f"expert {uid}", module, fingerprint_history)
        self.hidden = spec.model.hidden_size
        self._cache: OrderedDict[tuple[str, ...], _Batch] = OrderedDict()
        self._cache_size = cache_size
        self.cache_hits = self.cache_misses = 0

    def check(self, inputs: torch.Tensor, name: str = "inputs") -> None:
        if inputs.dtype != torch.float32 or inputs.dim() != 2 or inputs.shape[1] != self.hidden:
            raise ExpertInputError(
                f"{name}: expert {self.uid} takes float32 tokens of shape [tokens, {self.hidden}], "
                f"got {inputs.dtype} {list(inputs.shape)}"
            )
        if inputs.shape[0] < 1:
            raise ExpertInputError(f"{name}: no tokens")
        if not all_finite(inputs):
            raise ExpertInputError(f"{name}: contains NaN or Inf")

    def forward(self, uids: list[str], inputs: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
        """One batch of requests: each request's outputs (CPU)."""
        started = time.perf_counter()
        sizes = [t.shape[0] for t in inputs]
        x = torch.cat(inputs).to(self.device)
        if train and all(uids):
            x.requires_grad_(True)
            with torch.enable_grad():
                out = self.model(x)
            key = tuple(uids)
            self._cache[key] = _Batch(self.version, key, x, out, sizes, list(inputs))
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            with torch.no_grad():
                out = self.model(x)
        self._measure(x.shape[0], time.perf_counter() - started, weight=1 / 3)
        return [o.cpu() for o in out.detach().split(sizes)]

    def awaiting_backward(self) -> frozenset:
        # a list of the items in one C call: the torch thread may change the cache meanwhile
        return frozenset(key for key, batch in list(self._cache.items()) if batch.version == self.version)

    def cached_inputs(self, uid: str) -> torch.Tensor | None:
        """The inputs a cached forward of `uid` received (a backward may then leave them out)."""
        for batch in self._cache.values():
            if uid in batch.uids:
                return batch.originals[batch.uids.index(uid)]
        return None

    def _cached(self, uids: list[str], inputs: list[torch.Tensor]) -> tuple[_Batch, list[int]] | None:
        """The cached forward batch of exactly these requests (same inputs, same weights), with their order in it."""
        for key, batch in self._cache.items():
            if set(key) == set(uids) and len(key) == len(uids):
                del self._cache[key]
                order = [key.index(u) for u in uids]
                same = batch.version == self.version and all(
                    batch.originals[o].shape == t.shape and torch.equal(batch.originals[o], t)
                    for o, t in zip(order, inputs, strict=True)
                )
                return (batch, order) if same else None
        return None

    def backward(
        self, uids: list[str], inputs: list[torch.Tensor], grads: list[torch.Tensor], samples: int
    ) -> tuple[list[torch.Tensor], int]:
        """One batch of backwards: each request's input gradients (CPU), and the accumulator addition's seq."""
        started = time.perf_counter()
        hit = self._cached(uids, inputs) if all(uids) else None
        if hit is not None:
            batch, order = hit
            by_position = [None] * len(order)
            for i, o in enumerate(order):
                by_position[o] = grads[i]
            x, out, sizes = batch.inputs, batch.outputs, batch.sizes
            grad_out = torch.cat(by_position).to(self.device)
            self.cache_hits += 1
        else:
            # batches holding any of these uids can never be reused now: free their graphs
            for key in [k for k in self._cache if any(u in k for u in uids if u)]:
                del self._cache[key]
            order = list(range(len(uids)))
            sizes = [t.shape[0] for t in inputs]
            x = torch.cat(inputs).to(self.device).requires_grad_(True)
            with torch.enable_grad():
                out = self.model(x)
            grad_out = torch.cat(grads).to(self.device)
            self.cache_misses += 1
        with torch.enable_grad():
            computed = torch.autograd.grad(out, [x, *self.params], grad_out)
        seq = self._accumulate(self.guard_gradients(computed[1:], samples), samples)
        parts = computed[0].detach().split(sizes)
        self._measure(x.shape[0], time.perf_counter() - started, weight=2 / 3)
        return [parts[o].cpu() for o in order], seq

    def benchmark(self, tokens: int = 1024, repeats: int = 2) -> float:
        """Measure tokens/s of forward+backward on made-up data, without touching the accumulator."""
        x = torch.randn(tokens, self.hidden, generator=torch.Generator().manual_seed(0)).to(self.device)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            x.requires_grad_(True)
            with torch.enable_grad():
                out = self.model(x)
                torch.autograd.grad((out * out).mean(), [x, *self.params])
            best = min(best, time.perf_counter() - started)
        self.throughput = tokens / best
        return self.throughput

    def _after_step(self) -> None:
        self._cache.clear()  # graphs of the old weights: a backward now recomputes with the new ones

    def _after_load(self) -> None:
        self._cache.clear()

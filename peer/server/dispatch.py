"""The remote experts of a stage's MoE layers: calls to expert hosts over gRPC, from the torch thread.

A MoE layer's forward sends each expert the tokens routed to it, all experts in parallel. A call
goes to one live host of the expert (chosen by throughput, load and measured latency), with a
deadline from what such calls cost there; a host that fails or is late is banned for a while and
the call goes to another replica, up to `experts.max_tries`; an expert no replica answers is
skipped and the gate renormalises over the others (peer.model.moe). The backward goes to the host that
did the forward, or, if it is gone, any replica: the request carries the expert's inputs.

The torch thread blocks on these calls while the event loop runs them (the stage's own requests
queue meanwhile); `bind` gives the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from dht.node import SwarmDHT
from peer.config import PeerConfig, RunSpec
from peer.model.moe import expert_uid
from peer.model.numerics import all_finite
from peer.net.client import StageClient, gone_after
from peer.swarm.router import NoServer, Router
from protocols import codec, expert_pb2, framing
from protocols.failures import Reason, reason_of

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    expert: str
    rows: torch.Tensor  # token indices sent
    slots: torch.Tensor  # top-k slot of each row
    call_uid: str
    peer: str  # who answered the forward


class RemoteExperts:
    """The expert backend of one stage server's MoE layers (see peer.model.moe.ExpertBackend)."""

    def __init__(self, spec: RunSpec, stage: int, cfg: PeerConfig, dht: SwarmDHT):
        self.spec, self.cfg, self.ecfg = spec, cfg, cfg.experts
        blocks = spec.stage_blocks(stage)
        self.layers = [layer for layer in spec.moe_layers() if layer in blocks]
        self.uids = [expert_uid(layer, e) for layer in self.layers for e in range(spec.moe.num_experts)]
        self.slot = {uid: i for i, uid in enumerate(self.uids)}
        self.router = Router(dht, spec.name, 0, cfg.experts, cfg.network, experts=self.uids)
        self.client = StageClient.for_server(cfg.server, dht.security)
        self.codec = codec.codec_from_name(spec.compression.activations)
        self.block_size = spec.compression.block_size
        self.loop: asyncio.AbstractEventLoop | None = None
        self.offline = False  # True while the stage times its own work: experts answer zeros, no call is made
        self._refresher: asyncio.Task | None = None
        self._refreshing: asyncio.Future | None = None  # the read of the expert records under way
        self.calls = self.retried = self.skipped = 0  # counters for status and logs

    # ---- the event loop side --------------------------------------------------------------
    async def bind(self) -> None:
        """Start serving calls from the torch thread on the running loop, and keep the expert list fresh."""
        self.loop = asyncio.get_running_loop()
        await self._refresh()
        self._refresher = asyncio.create_task(self._refresh_loop())

    async def _refresh(self) -> None:
        """Re-read the expert records; calls that ask at once share one read."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._read_records())
        await asyncio.shield(self._refreshing)

    async def _read_records(self) -> None:
        try:
            await self.router.refresh()
        except Exception as e:  # the DHT may be busy: the expert list is refreshed again next period
            logger.warning("expert list refresh failed: %s", e)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ecfg.refresh_period)
            await self._refresh()

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.client.close()

    async def _call(
        self, expert: str, method: str, request, payloads: dict, tokens: int, prefer: str | None, only: bool = False
    ):
        """One expert call on some replica; (response, payloads, peer) or None when no replica answered.

        With `only`, just one try on `prefer` (a backward without its inputs, which only that host kept).
        """
        slot, tried = self.slot[expert], set()
        if only:
            tried = {pid for pid in self.router.servers[slot] if pid != prefer}
        kind = f"expert/{method}"
        for attempt in range(1 if only else max(1, self.ecfg.max_tries)):
            try:
                pid, record = self.router.choose(slot, tried, prefer, kind)
            except NoServer:
                if attempt == 0 and not only:
                    await self._refresh()  # a newcomer may have announced since the last look
                    continue
                return None
            nbytes = request.ByteSize() + sum(len(p) for p in payloads.values()) * 2  # the answer: as many rows
            timeout = self.router.deadline(pid, record, kind, tokens, 1 / 3 if method == "forward" else 1.0, nbytes)
            started = time.monotonic()
            try:
                call = self.client.expert_forward if method == "forward" else self.client.expert_backward
                response, returned = await call(record.endpoint, request, payloads, timeout=timeout, peer=pid)
                self.router.report_success(pid, kind, time.monotonic() - started)
                return response, returned, pid
            except grpc.aio.AioRpcError as e:
                why = reason_of(e)
                if why == Reason.MISSING_INPUTS:
                    return None  # alive, but it no longer holds the forward: the caller resends with inputs
                if why == Reason.LEAVING:
                    self.router.report_leaving(pid)
                elif why is None and await gone_after(e, record.endpoint, self.cfg.network.probe_timeout):
                    self.router.report_dead(pid)
                reason = f"{e.code().name}: {e.details()}"
            except (codec.TensorDecodeError, framing.FramingError) as e:
                reason = str(e)
            ban = self.router.report_failure(pid, escalate_while_banned=False)
            tried.add(pid)
            self.retried += 1
            logger.warning(
                "expert %s %s on %s failed after %.1f s (%s); banned %.0f s",
                expert,
                method,
                record.endpoint,
                time.monotonic() - started,
                reason,
                ban,
            )
        return None

    def _decoded(self, response, field: str, returned: dict, shape) -> torch.Tensor | None:
        try:
            tensor = codec.decode(getattr(response, field), self.cfg.server.max_tensor_elements, returned.get(field))
        except codec.TensorDecodeError:
            return None
        if list(tensor.shape) != list(shape) or not all_finite(tensor):
            return None
        return tensor.float()

    async def _forward_all(self, layer: int, tokens: torch.Tensor, top_index: torch.Tensor, train: bool):
        sends = []
        for e in range(self.spec.moe.num_experts):
            rows, slots = (top_index == e).nonzero(as_tuple=True)
            if rows.numel():
                sends.append(_Sent(expert_uid(layer, e), rows, slots, uuid.uuid4().hex[:16], ""))

        async def one(sent: _Sent):
            x = tokens[sent.rows]
            request = expert_pb2.ExpertForwardRequest(
                run_id=self.spec.name, expert=sent.expert, uid=sent.call_uid, output_codec=self.codec, train=train
            )
            header, payload = codec.encode_payload(x, self.codec, self.block_size)
            request.inputs.CopyFrom(header)
            result = await self._call(sent.expert, "forward", request, {"inputs": payload}, x.shape[0], None)
            if result is None:
                return None
            response, returned, pid = result
            sent.peer = pid
            return self._decoded(response, "outputs", returned, x.shape)

        return sends, await asyncio.gather(*(one(s) for s in sends))

    async def _backward_all(self, sends: list[_Sent], tokens: torch.Tensor, grads: torch.Tensor, samples: int):
        async def one(sent: _Sent):
            x, g = tokens[sent.rows], grads[sent.rows, sent.slots].contiguous()
            request = expert_pb2.ExpertBackwardRequest(
                run_id=self.spec.name, expert=sent.expert, uid=sent.call_uid, samples=samples, output_codec=self.codec
            )
            header, grad_payload = codec.encode_payload(g, self.codec, self.block_size)
            request.grad_outputs.CopyFrom(header)
            result = None
            if sent.peer in self.router.servers[self.slot[sent.expert]]:
                # the host that did the forward kept its inputs: leave them out (a cheaper request)
                payloads = {"grad_outputs": grad_payload}
                result = await self._call(sent.expert, "backward", request, payloads, x.shape[0], sent.peer, only=True)
            if result is None:  # another replica, or the same one that lost the forward: send the inputs too
                header, inputs_payload = codec.encode_payload(x, self.codec, self.block_size)
                request.inputs.CopyFrom(header)
                payloads = {"grad_outputs": grad_payload, "inputs": inputs_payload}
                result = await self._call(sent.expert, "backward", request, payloads, x.shape[0], sent.peer)
            if result is None:
                return None
            response, returned, _ = result
            return self._decoded(response, "grad_inputs", returned, x.shape)

        return await asyncio.gather(*(one(s) for s in sends))

    # ---- the torch thread side ------------------------------------------------------------
    def _run(self, coro):
        if self.loop is None:
            coro.close()
            raise RuntimeError("remote experts are not bound to an event loop yet")
        # every try at its longest deadline (a backward has one more, without inputs), and a refresh
        tries = max(1, self.ecfg.max_tries) + 1
        limit = self.ecfg.request_timeout * tries + self.cfg.network.dht_request_timeout * 2 + 5.0
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=limit)
        except TimeoutError:
            future.cancel()  # no call of it may add gradients after the stage gave up
            raise

    def __call__(self, layer: int, tokens: torch.Tensor, top_index: torch.Tensor, samples: int = 1):
        if self.offline:
            zeros = tokens.new_zeros(*top_index.shape, tokens.shape[-1]) + 0 * tokens.sum()
            return zeros, torch.ones(top_index.shape, dtype=torch.bool)
        train = torch.is_grad_enabled() and tokens.requires_grad
        return _RemoteCall.apply(tokens, top_index, self, layer, samples, train)


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, top_index, backend: RemoteExperts, layer: int, samples: int, train: bool):
        x = tokens.detach().float().contiguous()
        sends, results = backend._run(backend._forward_all(layer, x, top_index, train))
        outputs = x.new_zeros(*top_index.shape, x.shape[-1])
        answered = torch.zeros(top_index.shape, dtype=torch.bool)
        kept = []
        for sent, out in zip(sends, results, strict=True):
            backend.calls += 1
            if out is None:
                backend.skipped += 1
                continue
            outputs[sent.rows, sent.slots] = out
            answered[sent.rows, sent.slots] = True
            kept.append(sent)
        ctx.backend, ctx.sends, ctx.samples = backend, kept, samples
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(answered)
        return outputs.to(tokens.dtype), answered

    @staticmethod
    def backward(ctx, grad_outputs, _grad_answered):
        (x,) = ctx.saved_tensors
        backend: RemoteExperts = ctx.backend
        grads = grad_outputs.float().contiguous()
        results = backend._run(backend._backward_all(ctx.sends, x, grads, ctx.samples))
        grad_tokens = torch.zeros_like(x)
        for sent, g in zip(ctx.sends, results, strict=True):
            if g is None:
                backend.skipped += 1
                logger.warning("expert %s: no replica took the backward; its gradient is left out", sent.expert)
                continue
            grad_tokens.index_add_(0, sent.rows, g)
        return grad_tokens, None, None, None, None, None

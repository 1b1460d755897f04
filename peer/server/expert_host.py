"""An expert host: serves some experts of the run's mixture-of-experts layers over gRPC.

Each hosted expert is a replica (peer.server.replica) with its own DHT record, optimizer and averaging
group, so replicas of an expert on different hosts step together exactly as stage replicas do.
The experts share one torch thread; concurrent calls for one expert are merged into batches
(peer.server.batcher) before they reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health_pb2

from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.model.expert import ExpertInputError, ExpertRuntime, MissingInputs
from peer.model.moe import expert_uid, parse_expert_uid
from peer.net.client import StageClient
from peer.net.relay import offered_relay
from peer.net.uplink import Uplink
from peer.server.averaging import GradientAverager
from peer.server.batcher import Batcher
from peer.server.expert_service import ExpertServicer
from peer.server.replica import Part, Replica
from peer.server.stage import open_grpc_server

logger = logging.getLogger(__name__)


def best_device(requested: str = "") -> str:
    if requested:
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def all_experts(spec: RunSpec) -> list[str]:
    return [expert_uid(layer, e) for layer in spec.moe_layers() for e in range(spec.moe.num_experts)]


def parse_expert_choice(spec: RunSpec, text: str) -> int | list[str]:
    """`--experts N` (how many) or `--experts 1.0,1.5` (which); ValueError naming the problem."""
    if text.strip().isdigit():
        n = int(text)
        if n < 1:
            raise ValueError("--experts: host at least one expert")
        return n
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    known = set(all_experts(spec))
    for uid in chosen:
        parse_expert_uid(uid)
        if uid not in known:
            layers = spec.moe_layers()
            raise ValueError(
                f"--experts: {uid} is not an expert of run '{spec.name}' "
                f"(MoE layers {layers}, experts 0..{spec.moe.num_experts - 1})"
            )
    return chosen


def choose_experts(counts: dict[str, int], n: int) -> list[str]:
    """The `n` least-replicated experts (fewest live hosts first, then in order)."""
    order = {uid: i for i, uid in enumerate(counts)}
    return sorted(counts, key=lambda uid: (counts[uid], order[uid]))[:n]


class ExpertHost:
    def __init__(
        self,
        spec: RunSpec,
        cfg: PeerConfig,
        dht: SwarmDHT,
        runtimes: dict[str, ExpertRuntime],
        averagers: dict[str, GradientAverager],
    ):
        self.spec, self.run_id, self.cfg, self.dht = spec, spec.name, cfg, dht
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.client = StageClient.for_server(cfg.server, dht.security)
        self.inflight = 0
        self.inflight_bytes = 0  # decoded request tensors held by the requests running (server.max_inflight_bytes)
        self.leaving = False
        self.endpoint = ""
        self.uplink = None  # peer.net.uplink.Uplink: reachability, and the relay it is served through if any
        self.grpc_server: grpc.aio.Server | None = None
        self.replicas: dict[str, Replica] = {}
        self.forward_batchers: dict[str, Batcher] = {}
        self.backward_batchers: dict[str, Batcher] = {}
        ex = cfg.experts
        pause_window = [0.0]  # the experts' rounds together hold the torch thread at most averaging.pause_limit
        for uid, runtime in runtimes.items():
            layer, _ = parse_expert_uid(uid)
            part = Part(spec.stage_of_block(layer), uid)
            replica = Replica(
                spec, part, cfg, dht, runtime, averagers.get(uid), self.executor, self.client, pause_window
            )
            replica.load = lambda: float(self.inflight)
            self.replicas[uid] = replica
            self.forward_batchers[uid] = Batcher(self._forward_batch(replica), ex.max_batch_tokens, ex.max_wait)
            self.backward_batchers[uid] = Batcher(self._backward_batch(replica), ex.max_batch_tokens, ex.max_wait)

    def stir(self) -> None:
        """A request came: every expert's replica reads its partners' records at the fast period again."""
        for replica in self.replicas.values():
            replica.stir()

    # ---- calls ----------------------------------------------------------------------------
    def _forward_batch(self, replica: Replica):
        runtime: ExpertRuntime = replica.runtime

        async def run(requests):
            now = time.monotonic()
            live = [r for r in requests if r[3] is None or r[3] > now]  # (uid, inputs, train, deadline)
            epoch = runtime.progress
            if not live:
                return [(None, epoch)] * len(requests)
            outputs = await replica.run_torch(
                runtime.forward, [r[0] for r in live], [r[1] for r in live], all(r[2] for r in live)
            )
            by_request = {id(r): o for r, o in zip(live, outputs, strict=True)}
            return [(by_request.get(id(r)), epoch) for r in requests]

        return run

    def _backward_batch(self, replica: Replica):
        runtime: ExpertRuntime = replica.runtime

        def job(requests):
            replica._drop_if_expired()
            epoch = runtime.progress
            results: list = [None] * len(requests)
            ready = []  # (position, uid, inputs, grads, samples)
            for i, (uid, inputs, grads, samples) in enumerate(requests):
                if inputs is None:  # left out by the caller: the forward's, if this host still has it
                    inputs = runtime.cached_inputs(uid) if uid else None
                if inputs is None:
                    results[i] = MissingInputs(f"inputs: no forward of uid {uid!r} is cached here; send the inputs")
                elif grads.shape != inputs.shape:
                    results[i] = ExpertInputError(
                        f"grad_outputs: shape {list(grads.shape)} differs from the inputs' {list(inputs.shape)}"
                    )
                else:
                    ready.append((i, uid, inputs, grads, samples))
            if ready:
                grads, seq = runtime.backward(
                    [r[1] for r in ready], [r[2] for r in ready], [r[3] for r in ready], sum(r[4] for r in ready)
                )
                for (i, *_), g in zip(ready, grads, strict=True):
                    results[i] = (g, epoch, seq, runtime.incarnation, runtime.stepped_seq)
            return results

        async def run(requests):
            results = await replica.run_torch(job, requests)
            replica._maybe_step()  # queued on the torch thread before these answers leave
            return results

        return run

    async def forward(self, uid: str, call_uid: str, inputs: torch.Tensor, train: bool, deadline: float | None):
        """(outputs, epoch); outputs None when the deadline passed before the batch ran."""
        if train:
            await self.replicas[uid].forward_gate(deadline)  # while the expert drains (peer.server.replica_round)
        return await self.forward_batchers[uid].submit(inputs.shape[0], (call_uid, inputs, train, deadline))

    async def backward(self, uid: str, call_uid: str, inputs, grad_outputs, samples: int):
        """(grad_inputs, epoch, seq, incarnation, stepped_seq), or the error of this request alone."""
        return await self.backward_batchers[uid].submit(
            grad_outputs.shape[0], (call_uid, inputs, grad_outputs, samples)
        )

    # ---- lifecycle ------------------------------------------------------------------------
    async def _moved(self, endpoint: str) -> None:
        """Its relay changed (peer.net.uplink): every expert announces where it is dialled now."""
        self.endpoint = endpoint
        for replica in self.replicas.values():
            replica.endpoint = endpoint
        await asyncio.gather(*(r.publish(force=True) for r in self.replicas.values()))

    async def start(self) -> None:
        relay = offered_relay(self.cfg, self.spec.name, self.dht.security, "experts")
        self.grpc_server, self.health, endpoint = await open_grpc_server(
            self.cfg, ExpertServicer(self), self.dht.security, relay
        )
        self.uplink = Uplink(self.cfg, self.spec.name, self.dht, endpoint, self._moved)
        self.endpoint = await self.uplink.start()
        self.uplink.offer(relay)
        for replica in self.replicas.values():
            replica.endpoint, replica.uplink = self.endpoint, self.uplink
        await asyncio.gather(*(r.publish(force=True) for r in self.replicas.values()))  # 'joining'
        loaded = await asyncio.gather(*(r.load_state_from_peers() for r in self.replicas.values()))
        self.loaded = [uid for uid, ok in zip(self.replicas, loaded, strict=True) if ok]
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        for replica in self.replicas.values():
            replica.start_progress()
        await asyncio.gather(*(r.publish(force=True) for r in self.replicas.values()))

    async def stop(self) -> None:
        """Leave cleanly: every expert announces 'leaving', finishes its work and round, then 'left'."""
        self.leaving = True
        if self.uplink is not None:
            self.uplink.closing = True  # its relay going away now is no reason to look for another
        for replica in self.replicas.values():
            replica.leaving = True
        if self.grpc_server is not None:
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        with contextlib.suppress(Exception):  # 'leaving' first: stage servers stop calling here
            await asyncio.wait_for(
                asyncio.gather(*(r.publish(force=True) for r in self.replicas.values())),
                self.cfg.network.dht_request_timeout,
            )
        deadline = time.monotonic() + self.cfg.server.shutdown_grace
        while self.inflight and time.monotonic() < deadline:  # finish the calls under way
            await asyncio.sleep(0.05)
        await asyncio.gather(*(r.finish(announced=True) for r in self.replicas.values()), return_exceptions=True)
        if self.grpc_server is not None:
            await self.grpc_server.stop(0.5)
        if self.uplink is not None:
            await self.uplink.close()
        for batcher in [*self.forward_batchers.values(), *self.backward_batchers.values()]:
            batcher.close()
        with contextlib.suppress(Exception):
            await self.client.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def expert_counts(records: dict[str, dict[str, ServerRecord]]) -> dict[str, int]:
    """Per expert uid: hosts joining or serving it, from the records of each expert's key."""
    return {uid: sum(1 for r in found.values() if r.state in ("joining", "serving")) for uid, found in records.items()}

"""A resumed run's checkpoint (the coordinator's `--resume DIR`), or a model directory's pretrained
weights (peer.coordinator.pretrained), served to joiners.

The coordinator opens a gRPC server that answers `Info` and `GetState` for every part of the
checkpoint (stages on the Stage service, experts on the Expert service), exactly as a serving
replica would, and announces each part in the DHT with state `archive`. Trainers never route to
an archive (they take `serving` records only); a server that joins a part with no serving
replica loads the archive's state instead of starting from the seed (peer.server.replica), so the run
goes on from the checkpoint's step. Forward and backward are not served.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.coordinator import checkpoint
from peer.model.part_state import shard_request_error, state_shards
from peer.net.background import LoopThread
from peer.net.refusal import refuse
from peer.net.serving import announce_host, grpc_server, listen
from peer.server.servicer import parsed
from protocols import codec, framing, stage_pb2
from protocols.failures import Reason

SERVICES = ("swarmtrain.Stage", "swarmtrain.Expert")


class Archive:
    """The parts of one checkpoint, served over gRPC from a thread of their own.

    `manifest` and `load` (name -> (metadata, tensors)) serve another source of parts than a
    checkpoint directory: a manifest of the same shape (`step`, `parts` with `epoch` and `metadata`)."""

    def __init__(self, path: Path, spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT, manifest=None, load=None):
        self.path, self.spec, self.cfg, self.dht = path, spec, cfg, dht
        if manifest is None:
            manifest = checkpoint.read_manifest(path)
            if manifest.get("spec_fingerprint") != spec.fingerprint():
                raise checkpoint.CheckpointError(
                    f"{path} is a checkpoint of another run spec (fingerprint {manifest.get('spec_fingerprint')}, "
                    f"this spec's is {spec.fingerprint()})"
                )
            load = lambda name: checkpoint.load_part(path, manifest, name)  # noqa: E731
        self.manifest, self._load = manifest, load
        # the part read last: a joiner asks for a big part's state in several shards at once, read once
        self._last: tuple[str, dict, dict] | None = None
        self._reading: asyncio.Lock | None = None  # made on the archive's own event loop
        self.endpoint = ""
        self.started = time.time()
        # announced: the coordinator checkpoints a part whose last server leaves (false once it stops)
        self.takes_handover = bool(cfg.coordinator.checkpoint_dir)
        self._thread = LoopThread("archive")
        self._server: grpc.aio.Server | None = None

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def switch(self, path: Path) -> None:
        """Serve the checkpoint at `path` from now on (the coordinator's newest: the state of last resort of
        every part), at the same endpoint; a request under way finishes with what it read."""
        manifest = checkpoint.read_manifest(path, verify=False)
        self._thread.call(self._switch(path, manifest))

    async def _switch(self, path: Path, manifest: dict) -> None:
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:
            load = lambda name: checkpoint.load_part(path, manifest, name)  # noqa: E731
            self.path, self.manifest, self._load, self._last = path, manifest, load, None

    # ---- the calls ------------------------------------------------------------------------
    async def _info(self, request: stage_pb2.InfoRequest, context):
        name = f"expert {request.expert}" if request.expert else None
        entries = [e for n, e in self.manifest["parts"].items() if n == name] if name else []
        if name and not entries:
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"the archive holds no {name}")
        epoch = entries[0]["epoch"] if entries else self.step
        return stage_pb2.InfoResponse(
            run_id=self.spec.name, peer_id=self.dht.peer_id, epoch=int(epoch), state="archive"
        )

    async def _get_state(self, request_bytes: bytes, context):
        try:
            request = stage_pb2.StateRequest.FromString(request_bytes)
        except DecodeError as e:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"not a StateRequest: {e}")
        if request.run_id != self.spec.name:
            await refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this archive is of run '{self.spec.name}'",
                Reason.WRONG_RUN,
            )
        name = f"expert {request.expert}" if request.expert else f"stage {request.stage}"
        entry = self.manifest["parts"].get(name)
        if entry is None:
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"the archive holds no {name}")
        if request.HasField("epoch") and int(entry["epoch"]) != request.epoch:
            await refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the archive holds {name} at step {entry['epoch']}",
                Reason.STALE_EPOCH,
            )
        wrong = shard_request_error(request.shard, request.num_shards, self.cfg.server.max_state_shards)
        if wrong:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, wrong, Reason.BAD_INPUT)
        metadata, tensors = await self._part(name)
        num_shards = max(request.num_shards, 1)
        if num_shards > 1:
            wanted = state_shards(tensors, num_shards)[request.shard]
            tensors = {k: t for k, t in tensors.items() if k in wanted}
        response, payloads = stage_pb2.StateResponse(metadata_json=json.dumps(metadata, sort_keys=True)), {}
        for i, (key, tensor) in enumerate(sorted(tensors.items())):
            header, payloads[f"tensors.{i}.tensor"] = codec.encode_payload(tensor)
            response.tensors.add(name=key, tensor=header)
        for frame in framing.frames(response, payloads, self.cfg.server.chunk_bytes):
            yield frame

    async def _part(self, name: str) -> tuple[dict, dict]:
        """(metadata, tensors) of part `name`, read once for the shards asked for together (one part kept)."""
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:
            if self._last is None or self._last[0] != name:
                self._last = None  # the previous part's tensors go before the next is read
                metadata, tensors = await asyncio.to_thread(self._load, name)
                self._last = (name, metadata, tensors)
            return self._last[1], self._last[2]

    # ---- lifecycle ------------------------------------------------------------------------
    async def _serve(self) -> None:
        net = self.cfg.network
        server = grpc_server(self.cfg, self.dht.security)
        for service in SERVICES:
            handlers = {
                "Info": grpc.unary_unary_rpc_method_handler(
                    parsed(self._info, stage_pb2.InfoRequest),
                    response_serializer=stage_pb2.InfoResponse.SerializeToString,
                ),
                "GetState": grpc.unary_stream_rpc_method_handler(self._get_state),
            }
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        port = listen(server, f"{net.host}:{net.port}", self.dht.security)
        await server.start()
        self.endpoint = f"{announce_host(net.host, net.announce_host)}:{port}"
        self._server = server

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start(self._serve, timeout)

    def records(self) -> list[tuple[str, ServerRecord]]:
        """(DHT key, record) announcing each part of the archive."""
        out = []
        for name, entry in self.manifest["parts"].items():
            kind, _, ident = name.partition(" ")
            expert = ident if kind == "expert" else ""
            stage = self.spec.stage_of_block(int(ident.partition(".")[0])) if expert else int(ident)
            key = keys.expert_key(self.spec.name, expert) if expert else keys.servers_key(self.spec.name, stage)
            record = ServerRecord(
                stage=stage,
                expert=expert,
                endpoint=self.endpoint,
                throughput=0.0,
                epoch=int(entry["epoch"]),
                step=int(entry["epoch"]),
                samples_stepped=int(entry["metadata"].get("samples_stepped", 0)),
                state="archive",
                takes_handover=self.takes_handover,
                started=self.started,
                updated=time.time(),
            )
            out.append((key, record))
        return out

    def announce(self) -> None:
        for key, record in self.records():
            self.dht.store(key, record, self.cfg.coordinator.refreshed_ttl(self.cfg.network))

    def stop(self) -> None:
        if self._server is not None:
            self._thread.call(self._server.stop(0.5))
        self._thread.stop()

"""The coordinator's checkpoints: pull each part's state from one of its servers, write it (peer.coordinator.checkpoint).

Every `coordinator.checkpoint_every_steps` steps of the run (the highest step announced by a
stage) or `coordinator.checkpoint_every_minutes`, the coordinator reads the DHT, picks for each
stage and each expert the serving replica furthest ahead, and downloads its state over the same
`GetState` call joiners use, each with a deadline. What it gets is checked before it is kept
(peer.coordinator.vetting: sound, at a credible step, its parameters held by a second replica at that
step); a refused donor's part is asked of the next. A checkpoint is written only when every part
answered; the parts may be a step or so apart (each stage steps on its own), which the manifest
records per part. Training never waits for any of this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import PeerConfig, RunSpec
from peer.coordinator import checkpoint, vetting
from peer.model.fingerprint import tolerance
from peer.model.moe import expert_uid
from peer.model.part_state import StateError
from peer.model.pretrained import state_shards_needed
from peer.net.client import StageClient
from peer.swarm.consensus import credible_limit

logger = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, spec: RunSpec, cfg: PeerConfig, dht: SwarmDHT):
        self.spec, self.cfg, self.dht = spec, cfg, dht
        self.ccfg = cfg.coordinator
        self.root = Path(self.ccfg.checkpoint_dir)
        self.last_step = -1  # the run's step at the last checkpoint written
        self.last_time = time.monotonic()
        self.end_seen = 0.0  # when a stage was first seen at training.total_steps (monotonic s; 0: not yet)
        self.written: list[Path] = []
        # the checkpoint this run goes on from (the last it wrote, or the one it resumed; not an older run's
        # in the same directory): a part whose servers all hold an older step (or none serves it) keeps its copy
        self.previous: Path | None = None

    def due(self, step: int, lowest: int | None = None) -> bool:
        """Whether a checkpoint is due at the run's `step` (the highest step a stage announced; `lowest`: the lowest).

        The run's end (training.total_steps) is one checkpoint, taken once every stage has got there (its parts then
        all hold the last step, not a stage a step behind at the one before), or coordinator.end_checkpoint_wait
        after the first did."""
        if not self.ccfg.checkpoint_dir or step <= self.last_step:
            return False
        end = self.spec.training.total_steps
        if step >= end:
            if self.last_step >= end:
                return False  # the run's last is written
            self.end_seen = self.end_seen or time.monotonic()
            waited = time.monotonic() - self.end_seen >= self.ccfg.end_checkpoint_wait
            return waited or (lowest is not None and lowest >= end)
        every, minutes = self.ccfg.checkpoint_every_steps, self.ccfg.checkpoint_every_minutes
        if every > 0 and step // every > max(self.last_step, 0) // every:
            return True
        return minutes > 0 and time.monotonic() - self.last_time >= minutes * 60

    def parts(self) -> list[tuple[str, int, str]]:
        """(part name, stage, expert uid) of every part of the model that lives on servers."""
        found = [(f"stage {s}", s, "") for s in range(self.spec.stages.num_stages)]
        for layer in self.spec.moe_layers():
            for e in range(self.spec.moe.num_experts):
                uid = expert_uid(layer, e)
                found.append((f"expert {uid}", self.spec.stage_of_block(layer), uid))
        return found

    async def _pull(self, client: StageClient, stage: int, expert: str) -> checkpoint.Part | None:
        key = keys.expert_key(self.spec.name, expert) if expert else keys.servers_key(self.spec.name, stage)
        records = await self.dht.aget(key, ServerRecord)
        # a leaving server still gives its state (the last one of a part waits for this: peer.server.replica_handover)
        holders = [(pid, r) for pid, r in records.items() if r.state in ("serving", "leaving") and r.expert == expert]
        # never the state of a replica that claims a step most of them do not back (peer.swarm.consensus)
        limit = credible_limit((r.epoch for _, r in holders), self.cfg.server.max_resync_jump)
        holders = [(pid, r) for pid, r in holders if r.epoch <= limit]
        ranked = sorted(holders, key=lambda item: (-item[1].epoch, item[1].state != "serving", -item[1].throughput))
        for pid, record in ranked:
            try:
                metadata, tensors = await self._whole_state(client, record.endpoint, stage, expert, pid)
            except Exception as e:  # a replica that went away: the next one
                logger.warning("checkpoint: %s did not give its state: %s", record.endpoint, e)
                continue
            name = f"expert {expert}" if expert else f"stage {stage}"
            others = [(p, r) for p, r in holders if p != pid]
            why = await self._unsound(client, stage, expert, metadata, tensors, limit, others)
            if not why and metadata["epoch"] < record.epoch:  # an older step that others still remember: a revert
                why = f"it gave the state of step {metadata['epoch']}, behind its record's {record.epoch}"
            if why:
                logger.warning(
                    "checkpoint: the state of %s from %s (%s) is not taken: %s", name, record.endpoint, pid, why
                )
                continue
            return checkpoint.Part(name, metadata, tensors, peer=pid)
        return None

    async def _unsound(self, client, stage: int, expert: str, metadata, tensors, limit: int, others) -> str:
        """Why a replica's state of a part must not go into a checkpoint ("" if it may): it is not a sound state
        at a credible step (peer.coordinator.vetting), or, the part having other replicas, none of them held
        the same parameters at that step."""
        tol = tolerance(self.spec.compression.averaging)
        try:
            values = await asyncio.to_thread(vetting.vet, self.spec, stage, expert, metadata, tensors, limit, tol)
        except StateError as e:
            return str(e)
        if not others:
            return ""  # the part's one replica: nobody to compare with
        epoch, said = int(metadata["epoch"]), []
        for pid, record in others:
            try:
                info = await client.info(record.endpoint, self.ccfg.checkpoint_timeout, expert=expert, peer=pid)
            except Exception as e:  # gone, or busy: another may second it
                said.append(f"{pid[-8:]}: no answer ({type(e).__name__})")
                continue
            why = vetting.seconds(info.history, epoch, values, tol)
            if not why:
                return ""
            said.append(f"{pid[-8:]}: {why}")
        return f"no other replica held the same parameters at step {epoch} ({'; '.join(said)})"

    async def _whole_state(
        self, client: StageClient, endpoint: str, stage: int, expert: str, peer: str
    ) -> tuple[dict, dict]:
        """One replica's whole state of a part, in shards of one step when it is big (see state_shards_needed)."""
        timeout, run = self.ccfg.checkpoint_timeout, self.spec.name
        n = state_shards_needed(self.spec, stage, expert, self.cfg.server.max_message_bytes)
        metadata, tensors = await client.get_state(endpoint, run, stage, timeout, 0, n, expert=expert, peer=peer)
        rest = await asyncio.gather(
            *(
                client.get_state(endpoint, run, stage, timeout, i, n, metadata["epoch"], expert=expert, peer=peer)
                for i in range(1, n)
            )
        )
        for _, part in rest:
            tensors.update(part)
        return metadata, tensors

    async def take(self, step: int) -> Path | None:
        """Pull every part and write a checkpoint at `step`; None (and a warning) if a part had no server."""
        logger.info("checkpoint at step %d: pulling %d parts", step, len(self.parts()))
        client = StageClient.for_server(self.cfg.server, self.dht.security)
        before = self._previous_parts()
        try:
            pulled = []
            for name, stage, expert in self.parts():
                part = self._newest(name, await self._pull(client, stage, expert), before)
                if part is None:
                    logger.warning("checkpoint at step %d skipped: no serving replica of %s gave its state", step, name)
                    return None
                pulled.append(part)
        finally:
            await client.close()
        path = await asyncio.to_thread(
            checkpoint.write,
            self.root,
            self.spec.to_dict(),
            self.spec.fingerprint(),
            step,
            pulled,
            self.ccfg.checkpoint_keep,
        )
        self.last_step, self.last_time = step, time.monotonic()
        self.written.append(path)
        self.previous = path
        return path

    def _previous_parts(self) -> dict[str, dict]:
        """The previous checkpoint's manifest entries by part name (none when there is none, or it is gone)."""
        if self.previous is None:
            return {}
        try:
            return checkpoint.read_manifest(self.previous, verify=False)["parts"]
        except checkpoint.CheckpointError as e:
            logger.warning(
                "checkpoint: the previous one, %s, cannot be read (%s): no part carried from it", self.previous, e
            )
            return {}

    def _newest(self, name: str, pulled: checkpoint.Part | None, before: dict[str, dict]) -> checkpoint.Part | None:
        """What goes into the checkpoint for part `name`: what its server gave, unless the previous checkpoint
        holds a later step of it (its servers restarted from an older state, or none serves it): then that
        copy, carried on. A part's step never goes down from one checkpoint to the next."""
        entry = before.get(name)
        if entry is None:
            return pulled
        epoch = int(pulled.metadata.get("epoch", 0)) if pulled is not None else -1
        if epoch >= int(entry["epoch"]):
            return pulled
        why = "no server holds it" if pulled is None else f"its servers are at step {epoch}"
        logger.warning(
            "checkpoint: %s keeps its copy at step %s from %s (%s)", name, entry["epoch"], self.previous, why
        )
        return checkpoint.Part(name, entry["metadata"], {}, entry.get("peer", ""), self.previous, entry)

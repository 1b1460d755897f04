"""State transfer of a replica (peer.server.replica): a joiner loads the part's state in shards from
several donors, and a replica that fell behind (missed a round) resyncs from those ahead.

StateTransfer is a piece of Replica, on the replica's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from dht.records import ServerRecord
from peer.process.status_lines import say

logger = logging.getLogger(__name__)


class StateTransfer:
    """Loading a Replica's state from its peers (Replica inherits it)."""

    # ---- state ----------------------------------------------------------------------------
    async def _fetch_state(self, donors: list[ServerRecord]) -> tuple[dict, dict]:
        """The state of the part at one step, in parts from up to `state_donors` donors at once."""
        timeout = self.cfg.server.state_load_timeout
        lead = max(donors, key=lambda r: r.epoch)
        if (
            lead.state == "archive"
        ):  # a resumed run's checkpoint (peer.coordinator.archive): one copy, at its record's step
            epoch = lead.epoch
        else:
            info = await self.client.info(
                lead.endpoint, timeout=self.cfg.network.dht_request_timeout, expert=self.part.expert
            )
            epoch = info.epoch
        same = [lead, *[r for r in donors if r is not lead and r.epoch == epoch]][: self.cfg.server.state_donors]
        n = max(len(same), self._state_shards())

        at_once = asyncio.Semaphore(len(same))  # a shard per donor at a time: few shards in memory half-read

        async def part(donor: ServerRecord, shard: int):
            async with at_once:
                return await self.client.get_state(
                    donor.endpoint, self.run_id, self.stage, timeout, shard, n, epoch, expert=self.part.expert
                )

        # each donor sends every len(same)-th shard; a shard stays well under the largest message accepted
        results = await asyncio.gather(*(part(same[i % len(same)], i) for i in range(n)), return_exceptions=True)
        for i, result in enumerate(results):
            for other in same:  # a part whose donor failed comes from another donor
                if not isinstance(result, BaseException):
                    break
                with contextlib.suppress(Exception):
                    result = await part(other, i)
            if isinstance(result, BaseException):
                raise result
            results[i] = result
        metadata, tensors = dict(results[0][0]), {}
        for _, part in results:
            tensors.update(part)
        if len(tensors) != int(metadata.get("tensor_count", len(tensors))):
            raise ValueError(f"the donors sent {len(tensors)} of {metadata.get('tensor_count')} tensors")
        return metadata, tensors

    def _state_shards(self) -> int:
        """Shards the part's state must come in so that none exceeds half of server.max_message_bytes (the
        state is at most 5 copies of the parameters: weights, 2 Adam moments, the outer anchor and momentum)."""
        state = 5 * sum(p.numel() * p.element_size() for p in self.runtime.params)
        return max(1, -(-state // max(self.cfg.server.max_message_bytes // 2, 1)))

    async def _load_from(self, donors: list[ServerRecord], attempts: int = 4) -> bool:
        for attempt in range(attempts):
            started = time.perf_counter()
            try:
                metadata, tensors = await self._fetch_state(donors)
                await self.run_torch(self.runtime.load_state, metadata, tensors, self.dht.peer_id)
                n = min(len(donors), self.cfg.server.state_donors)
                say(
                    f"Loaded the state of {self.label} (step {self.runtime.epoch}) from {n} peer{'s' * (n > 1)} "
                    f"in {time.perf_counter() - started:.1f} s."
                )
                return True
            except Exception as e:  # a donor may fail in any way: tried again, or another donor
                logger.warning("%s: could not load the state (try %d): %s", self.label, attempt + 1, e)
                await asyncio.sleep(0.2 * (attempt + 1))
                await self.refresh_peers()
                fresh = self._donors()
                donors = [r for r in fresh if r.epoch >= min(d.epoch for d in donors)] or fresh
                if not donors:
                    return False
        return False

    def _donors(self) -> list[ServerRecord]:
        """Serving replicas; when there is none, the resumed run's checkpoint (an `archive` record)."""
        serving = [r for r in self.peers.values() if r.state == "serving"]
        return serving or [r for r in self.peers.values() if r.state == "archive"]

    async def load_state_from_peers(self) -> bool:
        """Load parameters and optimizer state from serving replicas (or the run's archive); False if none answered."""
        await self.refresh_peers()
        donors = self._donors()
        return bool(donors) and await self._load_from(donors)

    async def _resync(self, ahead: list[ServerRecord]) -> None:
        """This replica fell behind (missed a round): take the state of those ahead of it, keeping its accumulator."""
        leader = max(ahead, key=lambda r: r.epoch)
        logger.warning(
            "%s: at step %d while %s is at %d; loading its state",
            self.label,
            self.runtime.epoch,
            leader.endpoint,
            leader.epoch,
        )
        self.stepping = True
        try:
            await self._load_from([r for r in ahead if r.epoch == leader.epoch], attempts=1)
        finally:
            self.stepping = False

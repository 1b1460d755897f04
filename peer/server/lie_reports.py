"""What a replica tells the coordinator of partners its averaging rounds proved to lie (peer.server.slice_word).

Each proof holds what the liar signed twice, two different digests of one slice of one round; the coordinator
checks both signatures itself before it revokes (peer.coordinator.authority), so one replica's report is enough
and no replica's word is taken for it. The replica stores its last proofs (at most 16: dht.records.LieProofs) under
its own subkey when a new one comes, and again while they live, for a coordinator that was away."""

from __future__ import annotations

import logging
import time

from dht import keys
from dht.records import LieProofs

logger = logging.getLogger(__name__)


class LieReports:
    """The proofs of one replica's all-reduce (AllReduce.proofs), stored in the DHT for the coordinator."""

    def __init__(self, replica):
        self.replica = replica
        self._stored: tuple = ()  # what was stored last: (count, newest proof's time)
        self._stored_at = 0.0  # monotonic

    async def report(self) -> None:
        r = self.replica
        proofs = list(r.averager.allreduce.proofs) if r.averager is not None else []
        if not proofs:
            return
        ttl = 3 * r.cfg.network.record_ttl
        seen = (len(proofs), proofs[-1].caught)
        if seen == self._stored and time.monotonic() - self._stored_at < ttl / 3:
            return
        try:
            stored = await r.dht.astore(keys.proofs_key(r.run_id), LieProofs(proofs=proofs, updated=time.time()), ttl)
        except Exception as e:  # the DHT may be busy: stored again next look
            logger.warning("could not report partners proven to lie: %s", e)
            return
        if stored:
            self._stored, self._stored_at = seen, time.monotonic()

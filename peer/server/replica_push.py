"""Progress on the channel replicas already share: a replica pushes its record to its partners as it changes.

The replicas of a part step together on their summed sample counts, so each must learn the others' counts,
steps and rounds as they move. Reading them from the DHT every progress period cost every node of a small
swarm a record store and a `latest` read per replica twice a second. Instead a replica sends its newest
record, the very envelope it would store in the DHT (signed, with its credential), to each partner with a
`Progress` call whenever it changes (`push_progress`), one call at a time per partner, the newest record
each time; the partner answers with its own. A receiver checks a pushed record exactly as a DHT record
(`SwarmDHT.opened`: signature, expiry, credential and the roles that may publish it, its fields), takes it
only when newer than what it holds of that peer (`updated`), and from then on believes it no more than a
record read from the DHT: the same bounds on claimed steps (peer.swarm.consensus) apply to both.

The DHT keeps the records for everyone else (trainers, the coordinator, joiners): a replica stores its
record at once only when its step, round, state or incarnation changes, else once an announce period
(peer.net.cadence), and reads its partners' records once an announce period (at rest less often) to find
new ones and as the fallback: while a push to some partner fails, it reads them every progress period as
before. Pushing is a piece of Replica (peer.server.replica) and runs on its event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc

from dht.records import ServerRecord
from peer.net.refusal import Refused
from protocols import stage_pb2
from protocols.failures import Reason

logger = logging.getLogger(__name__)


class Pushing:
    """A replica's pushes of its record to its partners, and its take of theirs (Replica inherits it)."""

    def _init_push(self) -> None:
        self._pushes: dict[str, asyncio.Task] = {}  # partner -> its push under way (one at a time per partner)
        self._pushed_to: dict[str, tuple] = {}  # partner -> the record signature it was last sent
        self._sealed: tuple[tuple, stage_pb2.SignedRecord] | None = None  # (signature, our newest record sealed)
        self._push_failing: set[str] = set()  # partners whose last push failed: the DHT is read as before
        self.pushes: collections.Counter[str] = collections.Counter()  # sent, failed, taken, stale, refused

    # ---- sending --------------------------------------------------------------------------------
    def _push_targets(self) -> list[str]:
        """The partners our record goes to: those serving or joining, the most recently heard of first."""
        live = [(r.updated, pid) for pid, r in self.peers.items() if r.state in ("serving", "joining")]
        return [pid for _, pid in sorted(live, reverse=True)[: self.cfg.network.max_partners]]

    def push_progress(self, record: ServerRecord, force: bool = False) -> None:
        """Send `record` (just made) to every partner not yet sent one like it; `force`: to every partner."""
        signature = self._signature(record)
        targets = self._push_targets()
        self._pushed_to = {pid: s for pid, s in self._pushed_to.items() if pid in self.peers}
        self._push_failing &= self.peers.keys()  # bounded by the partners known
        due = [pid for pid in targets if force or self._pushed_to.get(pid) != signature]
        if not due:
            return
        record.ttl = self.cfg.network.record_ttl
        expiration, envelope = self.dht.sealed(self.part.key(self.run_id), record, record.ttl)
        sealed = stage_pb2.SignedRecord(owner=self.dht.peer_id, expiration=expiration, envelope=envelope)
        self._sealed = (signature, sealed)
        for pid in due:
            self._pushed_to[pid] = signature
            if pid not in self._pushes:
                self._pushes[pid] = asyncio.create_task(self._push_to(pid))

    async def _push_to(self, pid: str) -> None:
        """Push our newest sealed record to `pid` until it holds the newest (a newer one made during a call goes next)."""
        net = self.cfg.network
        try:
            while True:
                partner, (signature, sealed) = self.peers.get(pid), self._sealed
                if partner is None:
                    return
                request = stage_pb2.ProgressRequest(
                    run_id=self.run_id, stage=self.stage, expert=self.part.expert, record=sealed
                )
                response = await self.client.progress(partner.endpoint, request, net.push_timeout, peer=pid)
                self.pushes["sent"] += 1
                self._push_failing.discard(pid)
                if response.HasField("record") and response.record.owner == pid:
                    self._take_signed(response.record)
                if self._sealed is None or self._sealed[0] == signature:
                    return
        except Exception as e:  # refused, timed out, gone, our channel closed: the DHT carries it meanwhile
            self.pushes["failed"] += 1
            if self.dht.security is not None:
                self.dht.security.refused(e)  # refused as not admitted: is this peer revoked? (its list says)
            if pid not in self._push_failing:  # said once for a spell of failures
                code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
                logger.warning(
                    "%s: a push of our progress to %s failed (%s): replicas' records are read from the DHT every "
                    "progress period until one gets through",
                    self.label,
                    pid,
                    code,
                )
            self._push_failing.add(pid)
            self._pushed_to.pop(pid, None)  # sent again at the next change, or read from the DHT meanwhile
        finally:
            self._pushes.pop(pid, None)

    def _pushes_work(self) -> bool:
        """Whether every serving partner takes our pushes (else the DHT is read every progress period)."""
        return not any(pid in self._push_failing for pid, r in self.peers.items() if r.state == "serving")

    def sealed_record(self) -> stage_pb2.SignedRecord:
        """Our own newest record, sealed (a Progress call's answer): the last pushed, or one made now."""
        if self._sealed is not None and self._sealed[0] == self._signature(self.record()):
            return self._sealed[1]
        record = self.record()
        record.ttl = self.cfg.network.record_ttl
        expiration, envelope = self.dht.sealed(self.part.key(self.run_id), record, record.ttl)
        sealed = stage_pb2.SignedRecord(owner=self.dht.peer_id, expiration=expiration, envelope=envelope)
        self._sealed = (self._signature(record), sealed)
        return sealed

    def push_levels(self) -> dict[str, tuple[str, str, float]]:
        """Its pushes, for the peer's metrics (peer.net.metrics)."""
        return push_levels([self])

    # ---- receiving ------------------------------------------------------------------------------
    def take_pushed(self, signed: stage_pb2.SignedRecord, caller: str) -> stage_pb2.SignedRecord:
        """A partner's Progress call: its record, checked and taken; our own in return. Refused (with the reason)
        when it is not the caller's own, too large, or does not count as a DHT record of this part would not."""
        if caller and signed.owner != caller:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a replica pushes its own record only: the call comes from {caller}, the record names {signed.owner}",
            )
        limit = self.cfg.network.max_pushed_record_bytes
        if len(signed.envelope) > limit:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"record: {len(signed.envelope)} bytes, more than network.max_pushed_record_bytes ({limit})",
            )
        if signed.owner == self.dht.peer_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "record: this peer's own id")
        if signed.owner not in self.peers and len(self.peers) >= self.cfg.network.max_partners:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this replica knows {len(self.peers)} partners already (network.max_partners)",
                Reason.OVERLOADED,
            )
        if not self._take_signed(signed):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"record: not a valid record of {self.label} signed by {signed.owner} (signature, expiry, "
                "credential, role or fields)",
            )
        return self.sealed_record()

    def _take_signed(self, signed: stage_pb2.SignedRecord) -> bool:
        """Take a partner's sealed record if it counts (checked as a DHT record); False if it does not."""
        if len(signed.envelope) > self.cfg.network.max_pushed_record_bytes or signed.owner == self.dht.peer_id:
            return False
        record = self.dht.opened(
            self.part.key(self.run_id), signed.owner, signed.expiration, signed.envelope, ServerRecord
        )
        if record is None or not self.part.matches(record):
            self.pushes["refused"] += 1
            return False
        self._take_record(signed.owner, record)
        return True

    def _take_record(self, pid: str, record: ServerRecord) -> None:
        """A partner's record that counts: kept if newer than the one held (a DHT read may bring an older one)."""
        known = self.peers.get(pid)
        if known is not None and record.updated <= known.updated:
            self.pushes["stale"] += 1
            return
        self.pushes["taken"] += 1
        if record.state == "left":
            self.peers.pop(pid, None)
            return
        self.peers[pid] = record
        self._seen[pid] = time.time()
        self._first_seen.setdefault(pid, self.runtime.epoch)
        if not self.stepping and self.state == "serving":
            self._maybe_step()  # its samples may complete the target batch now


def push_levels(replicas) -> dict[str, tuple[str, str, float]]:
    """The pushes of these replicas (one peer's) together, for its metrics."""
    total: collections.Counter[str] = collections.Counter()
    for replica in replicas:
        total.update(replica.pushes)
    return {
        "progress_pushes": ("counter", "Records pushed to partner replicas and answered", total["sent"]),
        "progress_push_failures": ("counter", "Pushes to partner replicas that failed", total["failed"]),
        "progress_pushes_taken": ("counter", "Partners' records taken from pushes (newer than held)", total["taken"]),
        "progress_pushes_refused": (
            "counter",
            "Pushed records that did not count (checked as DHT records)",
            total["refused"],
        ),
    }

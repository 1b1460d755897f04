"""The trainer's view of the servers: who serves each stage, how fast they answer, who is banned or gone.

Deadlines come from what a call should cost: the latency this trainer measured for the same kind
of call to the same server (or, before any, the server's announced throughput and load), times a
margin, plus a floor. A hung server therefore costs about a second, not a fixed minute.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import ExpertsConfig, NetworkConfig, TrainerConfig
from peer.net.cadence import lifetime
from peer.swarm.consensus import agreed, backed

LIVE = ("joining", "serving", "leaving")  # the states of a replica that counts in what most of its part say
STEP_READS = 3  # refreshes in a row that must all say the run reached its last step before a trainer stops
SEEN_WINDOW = 10.0  # s a serving record read once still counts in what most replicas of its part say

LATENCY_DECAY = 0.8  # weight of the past in a server's latency average
UNMEASURED = 0.5  # s assumed for a kind of call a server has not answered yet, at the least


@dataclass
class _Health:
    failures: int = 0  # failures in a row
    banned_until: float = 0.0  # time.monotonic(); a good answer ends it
    avoided_until: float = 0.0  # time.monotonic(); a good answer does not end it (`Router.ban`)
    answered: float = 0.0  # time.time() of its last good answer
    said_leaving: float = 0.0  # time.time() of its last refusal as leaving

    def banned(self, now: float) -> bool:
        return max(self.banned_until, self.avoided_until) > now


class NoServer(RuntimeError):
    """No live, unbanned server for a stage."""


class Router:
    """Routes to the replicas of each slot: the stages (for a trainer) or, with `experts`, those experts (for a stage).

    `cfg` has the deadline and ban settings (TrainerConfig or ExpertsConfig).
    """

    def __init__(
        self,
        dht: SwarmDHT,
        run_id: str,
        num_stages: int,
        cfg: TrainerConfig | ExpertsConfig,
        net: NetworkConfig,
        experts: list[str] | None = None,
        inner_steps: int = 0,
    ):
        """`inner_steps`: local averaging mode's inner steps per outer step (0: gradient mode, where a record's
        training step is its epoch): what bounds the training step a record claims beside its epoch."""
        self.dht, self.run_id, self.cfg, self.net = dht, run_id, cfg, net
        self.inner_steps = inner_steps
        if experts is None:
            self.slots = [(keys.servers_key(run_id, s), s, "") for s in range(num_stages)]
        else:
            self.slots = [(keys.expert_key(run_id, uid), None, uid) for uid in experts]
        self.num_stages = len(self.slots)
        self.servers: list[dict[str, ServerRecord]] = [{} for _ in self.slots]  # routable now
        self.present: set[str] = set()  # peers whose record the last refresh found
        self.last: dict[tuple[str, int], ServerRecord] = {}  # newest record seen of each (peer, incarnation)
        self.latest: dict[str, ServerRecord] = {}  # newest record seen of each peer
        self.health: dict[str, _Health] = {}
        self.endpoints: dict[str, str] = {}  # peer -> endpoint its record named at the last refresh
        self.latency: dict[tuple[str, str], float] = {}  # (peer, kind of call) -> average seconds
        self.dead: set[str] = set()  # refused connections: the process is gone
        self.dead_since: dict[str, float] = {}  # when each was marked dead (time.time())
        self.leaving: set[str] = set()  # said so in an answer, before its record did
        self.distrusted: set[str] = set()  # caught answering wrong (peer.trainer.spotcheck): never routed to again
        self.incarnation: dict[str, int] = {}  # the incarnation a peer last answered with
        self.answered: dict[tuple[str, int], int] = {}  # (peer, incarnation) -> stepped_seq it last answered
        self.rng = random.Random()
        self.max_epoch = 0
        # the run's step (what most replicas say, the furthest part) at each of the last refreshes: one partial DHT
        # read that happened to hold only a hostile claim must not end a trainer's run
        self.recent_steps: collections.deque[int] = collections.deque(maxlen=STEP_READS)
        # per slot: peer -> (when read, its step) of serving records read in the last SEEN_WINDOW s: what most
        # replicas say is counted over these, so a read that missed some honest records changes nothing
        self.seen: list[dict[str, tuple[float, int]]] = [{} for _ in self.slots]

    # ---- the server list ------------------------------------------------------------------
    async def refresh(self) -> None:
        present, endpoints, step = set(), {}, 0
        found = await asyncio.gather(*(self.dht.aget(key, ServerRecord) for key, _, _ in self.slots))
        for slot, ((_, stage, expert), records) in enumerate(zip(self.slots, found, strict=True)):
            records = {
                pid: r for pid, r in records.items() if r.expert == expert and (stage is None or r.stage == stage)
            }
            for pid, r in records.items():
                endpoints[pid] = r.endpoint
                if self.endpoints.get(pid, r.endpoint) != r.endpoint and pid in self.health:
                    # it moved (to another relay): a ban of its old address does not hold; an avoidance of it does
                    self.health[pid] = _Health(avoided_until=self.health[pid].avoided_until)
                if not expert:  # receipts and incarnations are the trainer's, for stages
                    self.note(pid, r)
                elif (pid in self.dead or pid in self.leaving) and r.started > self.dead_since.get(pid, 0.0):
                    self.dead.discard(pid)  # the host restarted (same key, a new process) after it was marked
                    self.leaving.discard(pid)
                present.add(pid)
            self.servers[slot] = self._routable(records, self._counted(slot, records))
            # the run's progress is what more than half of a part's replicas say (all of them, not only those routed
            # to: of two, the one claiming 10^9 would be the only routable one; and those joining or leaving at
            # their steps: of two, the one left serving while the other restarts is not a majority): one record
            # cannot end every trainer, even of two replicas
            live = [r for pid, r in records.items() if r.state in LIVE and pid not in self.distrusted]
            step = max(step, backed(self._training_step(r) for r in live))
        self.max_epoch = max(self.max_epoch, step)
        self.recent_steps.append(step)
        self.present, self.endpoints = present, endpoints
        self._forget_old()

    def _training_step(self, r: ServerRecord) -> int:
        """The training step a record claims, no further than its epoch allows: the epoch itself in gradient mode,
        in local mode at most the inner steps of one more outer step."""
        return min(max(r.step, r.epoch), (r.epoch + 1) * self.inner_steps) if self.inner_steps else r.epoch

    def reached(self, step: int) -> bool:
        """Whether the run is at `step` by the last STEP_READS refreshes in a row (peer.swarm.consensus)."""
        return len(self.recent_steps) == STEP_READS and min(self.recent_steps) >= step

    def _counted(self, slot: int, records: dict[str, ServerRecord]) -> list[int]:
        """The steps of a part's serving replicas read in the last SEEN_WINDOW s (this read's included)."""
        now, seen = time.monotonic(), self.seen[slot]
        for pid, r in records.items():
            if r.state == "serving" and pid not in self.distrusted and pid not in self.dead and pid not in self.leaving:
                seen[pid] = (now, r.epoch)
            else:
                seen.pop(pid, None)  # a replica gone (its stale step must not hold the live ones back)
        self.seen[slot] = seen = {pid: v for pid, v in seen.items() if now - v[0] < SEEN_WINDOW}
        return [epoch for _, epoch in seen.values()]

    def _routable(self, records: dict[str, ServerRecord], counted: list[int]) -> dict[str, ServerRecord]:
        """The serving records of a part to route to: not dead, leaving or distrusted, and not more than
        `max_step_lag` steps behind the part's newest (a replica catching up computes with old weights), where
        the newest is no further than that past the step most of its replicas are at (peer.swarm.consensus): a
        claim of a later step no majority backs draws no traffic."""
        serving = {
            pid: r
            for pid, r in records.items()
            if r.state == "serving" and pid not in self.dead and pid not in self.leaving and pid not in self.distrusted
        }
        lag = self.cfg.max_step_lag
        limit = agreed(counted) + lag
        newest = max((r.epoch for r in serving.values() if r.epoch <= limit), default=0)
        return {pid: r for pid, r in serving.items() if newest - lag <= r.epoch <= newest}

    def note(self, pid: str, record: ServerRecord) -> None:
        """Remember a record (from the DHT or an Info answer) if it is newer than what we have."""
        old = self.latest.get(pid)
        if old is not None and old.updated > record.updated:
            return
        if old is not None and old.incarnation != record.incarnation:
            self.dead.discard(pid)  # a new incarnation answers again
            self.leaving.discard(pid)
        self.latest[pid] = record
        self.last[(pid, record.incarnation)] = record

    def _forget_old(self, keep: float = 600.0) -> None:
        horizon = time.time() - keep
        for key in [k for k, r in self.last.items() if r.updated < horizon]:
            del self.last[key]
        for pid in [p for p, r in self.latest.items() if r.updated < horizon]:
            del self.latest[pid]

    def gone(self, pid: str, incarnation: int, since: float) -> bool:
        """Whether `pid`'s `incarnation` will never step again: it left, died, or dropped its accumulator.

        An absent record counts only once it must have expired (with a second to spare), both from
        its own time and from `since` (when the trainer last heard from that incarnation): a server
        drops its accumulator when its record expires, and a DHT read can miss a live record.
        """
        if pid in self.dead:
            return True
        current = self.current_incarnation(pid)
        if current is not None and current != incarnation:
            return True
        mine = self.last.get((pid, incarnation))
        if mine is not None and mine.state == "left":
            return True
        if pid in self.present:
            return False
        heard = max(since, mine.updated if mine is not None else 0.0)
        return time.time() > heard + lifetime(mine.ttl if mine is not None else 0.0, self.net) + 1.0

    # ---- choosing -------------------------------------------------------------------------
    def weight(self, peer_id: str, record: ServerRecord, kind: str) -> float:
        latency = self.latency.get((peer_id, kind), 0.0)
        latency_factor = 1.0 / (1.0 + latency * max(record.throughput, 1e-3))  # slow answers count against
        return max(record.throughput, 1e-3) / (1.0 + record.load) * latency_factor

    def choose(
        self, stage: int, exclude: set[str] = frozenset(), prefer: str | None = None, kind: str = ""
    ) -> tuple[str, ServerRecord]:
        """Pick a server of `stage` at random, weighted by throughput and measured latency; skip banned ones."""
        now = time.monotonic()
        candidates = [
            (pid, r)
            for pid, r in self.servers[stage].items()
            if pid not in exclude and not self.health.get(pid, _Health()).banned(now)
        ]
        if not candidates:
            raise NoServer(f"no live server for stage {stage}")
        for pid, r in candidates:
            if pid == prefer:
                return pid, r
        weights = [self.weight(pid, r, kind) for pid, r in candidates]
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    def only(self, stage: int, peer_id: str, mind_bans: bool = True) -> tuple[str, ServerRecord]:
        """Server `peer_id` of `stage`, if it can take a call now (routable, or leaving: it still answers a
        backward it holds; and not banned nor avoided unless `mind_bans` is False); else NoServer."""
        record, health = self.servers[stage].get(peer_id), self.health.get(peer_id, _Health())
        latest = self.latest.get(peer_id)
        said = peer_id in self.leaving or (latest is not None and latest.state == "leaving")  # in an answer, or record
        if record is None and said and latest is not None and latest.stage == stage and not self.vanished(peer_id):
            record = latest
        if record is None or (mind_bans and health.banned(time.monotonic())):
            raise NoServer(f"server {peer_id} of stage {stage} cannot take a call now")
        return peer_id, record

    def lost(self, peer_id: str) -> bool:
        """Whether `peer_id` died or left, or its record expired (or was never seen): what it held is gone.
        A peer caught lying counts as lost too: nothing it says it holds is taken on trust."""
        return peer_id in self.leaving or self.vanished(peer_id)

    def elsewhere(self, peer_id: str, stage: int) -> bool:
        """Whether `peer_id`'s latest record is of another stage (it moved: what it held of `stage` went with it)."""
        record = self.latest.get(peer_id)
        return record is not None and not record.expert and record.stage != stage

    def vanished(self, peer_id: str) -> bool:
        """`lost`, but for a server that is leaving and not yet gone: it still answers a backward it holds."""
        if peer_id in self.dead or peer_id in self.distrusted:
            return True
        record = self.latest.get(peer_id)
        if record is None or record.state == "left":
            return True
        return peer_id not in self.present and time.time() > record.updated + lifetime(record.ttl, self.net) + 1.0

    def deadline(
        self, peer_id: str, record: ServerRecord, kind: str, samples: int, work: float, nbytes: int = 0
    ) -> float:
        """Seconds to allow a call: its expected time (measured, else estimated) times a margin, plus a floor.

        `work` is the call's share of a forward+backward (a forward is about 1/3). Before a
        measurement, the estimate also allows the call's `nbytes` (both ways) to cross a link of
        `min_link_mbit`: on a thin home link, moving the tensors takes longer than computing them.
        """
        expected = self.latency.get((peer_id, kind))
        if expected is None:
            estimate = samples * work / max(record.throughput, 1e-3) * (1.0 + record.load)
            expected = max(estimate, UNMEASURED) + nbytes * 8 / (self.cfg.min_link_mbit * 1e6)
        return min(self.cfg.request_timeout, self.cfg.deadline_floor + self.cfg.deadline_margin * expected)

    # ---- outcomes -------------------------------------------------------------------------
    def report_success(self, peer_id: str, kind: str, seconds: float) -> None:
        key = (peer_id, kind)
        old = self.latency.get(key)
        self.latency[key] = seconds if old is None else LATENCY_DECAY * old + (1 - LATENCY_DECAY) * seconds
        health = self.health.setdefault(peer_id, _Health())
        health.failures = 0  # forgiven: it answers again
        health.banned_until, health.answered = 0.0, time.time()

    def answered_since(self, peer_id: str, since: float) -> bool:
        """Whether `peer_id` gave a good answer after `since` (time.time()), or a refusal as leaving: it lives, not
        frozen (a leaving server refreshes its record seldom)."""
        health = self.health.get(peer_id, _Health())
        return max(health.answered, health.said_leaving) > since

    def refreshed_since(self, peer_id: str, since: float) -> bool:
        """Whether `peer_id`'s newest record was refreshed after `since` (time.time()): it lives, not frozen."""
        record = self.latest.get(peer_id)
        return record is not None and record.updated > since

    def banned_endpoints(self, limit: int = 16) -> list[str]:
        """Endpoints of the servers banned right now (at most `limit`), for the trainer's announcement."""
        now = time.monotonic()
        banned = [pid for pid, h in self.health.items() if h.banned(now)]
        return sorted({self.latest[pid].endpoint for pid in banned if pid in self.latest})[:limit]

    def report_failure(self, peer_id: str, escalate_while_banned: bool = True) -> float:
        """Ban a failing server, for longer each time it fails in a row; returns the ban length.

        With `escalate_while_banned` False, failures of calls that ran at the same time as the
        one that banned it (an expert host's parallel calls) do not lengthen the ban.
        """
        health = self.health.setdefault(peer_id, _Health())
        if not escalate_while_banned and health.banned_until > time.monotonic():
            return health.banned_until - time.monotonic()
        health.failures += 1
        ban = min(self.cfg.ban_time * (2 ** min(health.failures - 1, 16)), self.cfg.max_ban)
        health.banned_until = time.monotonic() + ban
        return ban

    def ban(self, peer_id: str) -> None:
        """Avoid a server for max_ban s, whatever its record says or it answers meanwhile (peer.trainer.ledger.overdue,
        peer.trainer.insistence)."""
        health = self.health.setdefault(peer_id, _Health())
        health.avoided_until = max(health.avoided_until, time.monotonic() + self.cfg.max_ban)

    def stage_step(self, stage: int) -> int:
        """The step most of `stage`'s serving replicas were at over the last reads (peer.swarm.consensus.agreed);
        -1 while none was read."""
        slot = next((i for i, (_, s, expert) in enumerate(self.slots) if s == stage and not expert), None)
        seen = self.seen[slot] if slot is not None else {}
        return agreed(epoch for _, epoch in seen.values()) if seen else -1

    def current_incarnation(self, pid: str) -> int | None:
        """The newest incarnation its records and answers name: the largest (a server's grow, peer.model.part).

        A server that dropped its accumulator answers with its new incarnation at once, while its
        record in the DHT may still name the old one for a while (its announcements were stuck):
        going by either alone would take the live incarnation for gone, and replay forever.
        """
        record, answer = self.latest.get(pid), self.incarnation.get(pid)
        known = [i for i in (record.incarnation if record is not None else None, answer) if i]
        return max(known) if known else None

    def report_answer(self, peer_id: str, incarnation: int, stepped_seq: int) -> None:
        """A server answered with its incarnation and how many of its additions are stepped."""
        self.incarnation[peer_id] = max(incarnation, self.incarnation.get(peer_id, 0))
        key = (peer_id, incarnation)
        self.answered[key] = max(self.answered.get(key, 0), stepped_seq)
        self.dead.discard(peer_id)

    def report_dead(self, peer_id: str) -> None:
        """Its port refuses connections: the process is gone, with what it had accumulated.

        Not so for a peer served through a relay (its record names one): there the refusal says
        only that the relay is gone; the peer moves to another relay and announces it.
        """
        record = self.latest.get(peer_id) or next((s[peer_id] for s in self.servers if peer_id in s), None)
        if record is not None and record.relay:
            return
        self.dead.add(peer_id)
        self.dead_since[peer_id] = time.time()
        self._unroute(peer_id)

    def report_leaving(self, peer_id: str) -> None:
        """It refused a call as leaving: not routed to, and it lives (`answered_since`: it still answers a backward
        it holds, peer.trainer.insistence)."""
        self.leaving.add(peer_id)
        self.dead_since[peer_id] = time.time()
        self.health.setdefault(peer_id, _Health()).said_leaving = time.time()
        self._unroute(peer_id)

    def distrust(self, peer_id: str) -> None:
        """It answered wrong: never route to it again (in this process)."""
        self.distrusted.add(peer_id)
        self._unroute(peer_id)

    def _unroute(self, peer_id: str) -> None:
        for servers in self.servers:
            servers.pop(peer_id, None)

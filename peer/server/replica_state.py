"""State transfer of a replica (peer.server.replica): a joiner loads the part's state in shards from
several donors, and a replica that fell behind (missed a round) resyncs from those ahead.

StateTransfer is a piece of Replica, on the replica's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from dht.records import COORDINATOR_STATES, ServerRecord
from peer.model.fingerprint import first_difference, held_at, tolerance
from peer.model.part_state import OutOfReach, Poisoned, StateError
from peer.process.status_lines import say
from peer.server.replica_belief import forget_own_steps
from peer.server.shard_fetch import ShardFetch
from peer.server.transfer_lead import lead_first
from peer.swarm.consensus import backed

logger = logging.getLogger(__name__)


def why(e: BaseException) -> str:
    """A failure in one line: a gRPC status and its details, else the exception."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


def _of_step(result: tuple[dict, dict], donor: ServerRecord, epoch: int) -> tuple[dict, dict]:
    """A shard `donor` sent, if it is of the step asked for (Poisoned if not: its word on it is worth nothing),
    its metadata marked with where it came from (this copy only)."""
    if result[0].get("epoch") != epoch:
        raise Poisoned(f"{donor.endpoint} sent the state of step {result[0].get('epoch')!r}, not of {epoch}")
    result[0]["from"] = donor.endpoint
    return result


def _lead_order(r: ServerRecord) -> tuple[int, float]:
    """The donor that leads a state's transfer: the furthest step, then the fastest."""
    return r.epoch, r.throughput


class StateTransfer:
    """Loading a Replica's state from its peers (Replica inherits it)."""

    # ---- state ----------------------------------------------------------------------------
    async def _fetch_state(self, donors: list[ServerRecord]) -> tuple[dict, dict]:
        """The state of the part at one step, in parts from up to `state_donors` donors at once.

        Shards that came are kept until the whole state is in: a try after a failed one asks only for
        those still missing, when the donors are still at the same step (a big state over a slow link
        would otherwise never finish)."""
        lead = self._transfer_lead = max(donors, key=_lead_order)  # the one struck if its step fails
        epoch = await self._lead_step(lead, max(r.epoch for r in donors))
        same = await self._lead_first([lead, *[r for r in donors if r is not lead and r.epoch == epoch]], epoch)
        self._transfer_lead = same[0]
        n = min(max(len(same), self._state_shards()), self.cfg.server.max_state_shards)
        if self._partial_state is None or self._partial_state[:2] != (epoch, n):
            self._partial_state = (epoch, n, {})
        have: dict[int, tuple[dict, dict]] = self._partial_state[2]
        timeout = self._shard_timeout(n)

        async def part(donor: ServerRecord, shard: int):
            result = await self.client.get_state(
                donor.endpoint,
                self.run_id,
                self.stage,
                timeout,
                shard,
                n,
                epoch,
                expert=self.part.expert,
                peer=donor.owner,
            )
            return _of_step(result, donor, epoch)

        # a shard at a time from each donor, a shard stays well under the largest message accepted; one that hangs
        # is asked of another after server.state_patience s (peer.server.shard_fetch)
        fetch = ShardFetch(same, list(range(n)), part, have, self.cfg.server.state_patience, timeout / 2)
        try:
            await fetch.run()
        finally:
            self._transfer_senders = {same[k].owner for k in fetch.sent}
        # the lead of what came: the first donor (in lead order) that sent a shard and neither failed nor hung
        sound = [r for k, r in enumerate(same) if k in fetch.sent and k not in fetch.failed and k not in fetch.outrun]
        self._transfer_lead = (sound or [same[k] for k in sorted(fetch.sent)] or same)[0]
        await self._agree(have, self._transfer_lead, part)
        self._partial_state = None
        metadata, tensors = dict(have[0][0]), {}
        # this copy only: whose word the state is (the lead's: co-donors' shards that disagreed came from it again,
        # so a co-donor is asked for its own opinion like any other replica)
        metadata["donors"] = [self._transfer_lead.owner]
        for i in range(n):
            tensors.update(have[i][1])
        if len(tensors) != int(metadata.get("tensor_count", len(tensors))):
            raise ValueError(f"the donors sent {len(tensors)} of {metadata.get('tensor_count')} tensors")
        return metadata, tensors

    async def _lead_first(self, donors: list[ServerRecord], epoch: int) -> list[ServerRecord]:
        """Up to server.state_donors of `donors` (at step `epoch`) to send the state, the lead first: those holding
        the parameters most of them say they held then (peer.server.transfer_lead; each is asked, Info)."""
        timeout, bound = self.cfg.network.dht_request_timeout, self.cfg.server.state_donors
        asked = donors[: bound + self.cfg.server.second_opinions]

        async def ask(r: ServerRecord):
            try:
                return await self.client.info(r.endpoint, timeout=timeout, expert=self.part.expert, peer=r.owner)
            except Exception:  # gone or busy: no word
                return None

        if len(asked) == 1:
            return asked
        infos = await asyncio.gather(*(ask(r) for r in asked))
        return lead_first(asked, list(infos), epoch, tolerance(self.spec.compression.averaging))[:bound]

    async def _lead_step(self, lead: ServerRecord, followed: int) -> int:
        """The step a transfer is pinned to: the lead's own answer (Info), held to the part's credible step, to at
        most one past the step the donors were followed at (`followed`, their records': a lead that answered 16
        steps further each time it was loaded from would lead the part to its last step), and to no less than
        the step the lead claimed (no replica's step goes back); an archive's, its record's."""
        if lead.state == "archive":  # a resumed run's checkpoint (peer.coordinator.archive): one copy, at its step
            return lead.epoch
        timeout = self.cfg.network.dht_request_timeout
        try:
            info = await self.client.info(lead.endpoint, timeout=timeout, expert=self.part.expert, peer=lead.owner)
        except grpc.aio.AioRpcError as e:  # unloadable: tried from the lead alone once, then struck as a donor
            if self.dht.security is not None:
                self.dht.security.refused(e)  # refused as not admitted: is this peer revoked? (its list says)
            raise StateError(f"{lead.endpoint}, the transfer's lead, did not say its step ({why(e)})") from None
        epoch = info.epoch
        if epoch > self._step_limit():  # its answer, not its record: the record was what was held to the limit
            raise Poisoned(f"{lead.endpoint} says it is at step {epoch}, past the part's credible step")
        if epoch > followed + 1:  # one step on since its record was read: an honest donor that just stepped
            raise StateError(f"{lead.endpoint} says it is at step {epoch}, past the step {followed} it was followed at")
        if epoch < lead.epoch:
            raise StateError(f"{lead.endpoint} says it is at step {epoch}, behind the step {lead.epoch} it claimed")
        return epoch

    def _shard_timeout(self, shards: int) -> float:
        """The deadline of one shard's call: server.state_shard_floor s plus its bytes (at least the largest tensor's,
        with its optimizer state) at server.state_min_rate (a
        donor that sends nothing fails in seconds, not minutes, when the state is small), at most
        server.state_load_timeout."""
        server, sizes = self.cfg.server, [p.numel() * p.element_size() for p in self.runtime.params]
        shard = 5 * max(sum(sizes) / max(shards, 1), max(sizes, default=0))  # a shard holds whole tensors
        return min(server.state_load_timeout, server.state_shard_floor + shard / server.state_min_rate)

    async def _agree(self, have: dict[int, tuple[dict, dict]], lead: ServerRecord, part) -> None:
        """Shards whose donor's parameters differ from the lead's at the same step (by the fingerprints the
        donors sent) come again from the lead: a state is never mixed from replicas that went apart."""
        announced = {i: [float(x) for x in meta.get("fingerprint") or []] for i, (meta, _) in sorted(have.items())}
        leads = [fp for i, fp in announced.items() if fp and have[i][0].get("from") == lead.endpoint]
        reference = leads[0] if leads else next((fp for fp in announced.values() if fp), [])
        for i, fp in announced.items():
            index = first_difference(reference, fp, tolerance(self.spec.compression.averaging))
            if index is None:
                continue
            logger.warning(
                "%s: two donors of step %s hold different parameters (fingerprints differ at parameter %d); "
                "shard %d comes from %s instead",
                self.label,
                have[i][0].get("epoch"),
                index,
                i,
                lead.endpoint,
            )
            have[i] = await part(lead, i)

    def _state_shards(self) -> int:
        """Shards the part's state must come in so that none exceeds half of server.max_message_bytes (the
        state is at most 5 copies of the parameters: weights, 2 Adam moments, the outer anchor and momentum)."""
        state = 5 * sum(p.numel() * p.element_size() for p in self.runtime.params)
        return max(1, -(-state // max(self.cfg.server.max_message_bytes // 2, 1)))

    async def _load_from(self, donors: list[ServerRecord], attempts: int = 4, strike: bool = True) -> bool:
        """Load the state of `donors` (tried `attempts` times); True once loaded. A lone donor whose own state does
        not load is banned as a donor for a while (`_strike`), unless `strike` is False (a resync strikes its
        donor itself)."""
        for attempt in range(attempts):
            started, self._transfer_lead, self._transfer_senders = time.perf_counter(), None, set()
            try:
                metadata, tensors = await self._fetch_state(donors)
                self._check_steps(metadata)
                self._not_behind(metadata)
                await self._second_opinion(metadata, donors)
                reach = self.cfg.server.max_update_per_step
                await self.run_torch(self.runtime.check_reach, metadata, tensors, reach, self._apart(donors))
                lone = self._lone_since()
                await self.run_torch(self.runtime.load_state, metadata, tensors, self.dht.peer_id)
                if lone is not None:  # its own fingerprints since it stepped alone are of weights it no longer holds
                    await self.run_torch(forget_own_steps, self.runtime, lone)
                self.paused, self._rejoined = False, self.runtime.epoch  # whatever it stepped alone is gone
                self._held_since = None
                self._stepped.set()  # synchronous mode: micro-batches held for the steps it took go
                n = min(len(donors), self.cfg.server.state_donors)
                say(
                    f"Loaded the state of {self.label} (step {self.runtime.epoch}) from {n} peer{'s' * (n > 1)} "
                    f"in {time.perf_counter() - started:.1f} s."
                )
                return True
            except (OutOfReach, Poisoned) as e:  # a donor whose state no honest replica holds: never again
                self.last_load_error = why(e)
                lead = self._transfer_lead or max(donors, key=_lead_order)
                if len(donors) > 1:  # which donor's shards it was is not known: the lead alone, once more
                    return await self._load_from([lead], attempts=1, strike=strike)
                self._distrust([lead], str(e))
                return False
            except Exception as e:  # a donor may fail in any way: tried again, or another donor
                self.last_load_error = why(e)
                unloadable = isinstance(e, (ValueError, KeyError))  # StateError is a ValueError
                if unloadable and len(donors) > 1:
                    # what came does not load, and whose part it was we cannot tell: the lead alone, once (a
                    # co-donor's bad part must not fail every load, nor get the lead struck)
                    logger.warning("%s: the state did not load (%s); once more from its lead alone", self.label, why(e))
                    lead = self._transfer_lead or max(donors, key=_lead_order)
                    return await self._load_from([lead], attempts=1, strike=strike)
                if unloadable and strike:  # its own state did not load: not asked again for a while (a resync
                    self._strike(donors[0])  # strikes its donor itself)
                if self.dht.security is not None:
                    self.dht.security.refused(e)  # refused as not admitted: is this peer revoked? (its list says)
                logger.warning("%s: could not load the state (try %d): %s", self.label, attempt + 1, why(e))
                await asyncio.sleep(0.2 * (attempt + 1))
                await self.refresh_peers()
                fresh = self._donors()
                donors = [r for r in fresh if r.epoch >= min(d.epoch for d in donors)] or fresh
                if not donors:
                    return False
        return False

    def _not_behind(self, metadata: dict) -> None:
        """StateError if a state would take this replica back: a donor that claimed to be ahead and sends an older
        state (its record's step copied from an honest replica) is a failed resync, not a load."""
        epoch = metadata.get("epoch")
        if self.runtime.initialized and isinstance(epoch, int) and epoch < self.runtime.epoch:
            raise StateError(f"its state is of step {epoch}, behind this replica's {self.runtime.epoch}")

    async def _second_opinion(self, metadata: dict, donors: list[ServerRecord]) -> None:
        """StateError unless the parameters a state brings (the fingerprint given with it, which the load checks
        against them) are those the part's other replicas held at that step, by their recent steps (Info): refused
        when more of them held other parameters than held these, the donor counted with these (of two replicas,
        either one's word stands; of three, two outvote a liar). Replicas that have not reached that step, or
        cannot say (or answer a step below their own record's: a step never goes back), count for neither; but a
        step past every donor's record that none of them reached (each says a step behind it) is its lead's word
        alone, not loaded now: a lead that answered Info one step past its record was loaded unchecked, each load
        letting it lead the next one a step further. (A step some donor's record holds is not refused so: one
        hostile replica answering "behind" would veto an honest state, and get its honest donor struck.)"""
        epoch, owners = int(metadata["epoch"]), set(metadata.get("donors") or [r.owner for r in donors])
        if any(r.state == "archive" for r in donors):
            return  # the coordinator's checkpoint, vetted as it was written (peer.coordinator.vetting)
        others = [r for r in self._credible([r for r in self.peers.values() if r.state == "serving"])]
        others = sorted((r for r in others if r.owner not in owners), key=lambda r: -r.epoch)  # likeliest there first
        others = others[: self.cfg.server.second_opinions]
        if not others:
            return
        values, tol = [float(x) for x in metadata.get("fingerprint") or []], tolerance(self.spec.compression.averaging)

        async def held(r: ServerRecord) -> tuple[int | None, bool | None]:
            timeout = self.cfg.network.dht_request_timeout
            try:
                info = await self.client.info(r.endpoint, timeout=timeout, expert=self.part.expert, peer=r.owner)
            except Exception:  # gone or busy: no word
                return None, None
            if info.epoch < r.epoch:  # behind its own record: no word
                return None, None
            return info.epoch, held_at(info.history, epoch, values, tol)

        answers = await asyncio.gather(*(held(r) for r in others))
        said, reached = [w for _, w in answers], [e for e, _ in answers if e is not None]
        past = epoch > max((r.epoch for r in donors), default=-1)  # no donor's record holds it: the lead's answer
        if past and reached and max(reached) < epoch and True not in said:
            raise StateError(f"its step {epoch} is its donor's word alone: the part's others are at {max(reached)}")
        agree, differ = said.count(True) + 1, said.count(False)
        if differ > agree:  # two or more against the donor's word: not a replica that just went apart
            raise Poisoned(f"{differ} of the part's other replicas held other parameters at step {epoch}")

    def _donors(self) -> list[ServerRecord]:
        """Serving replicas at or below the step more than half of them are at (peer.swarm.consensus.backed: a step
        one replica alone claims ahead of the others is its own word, and a joiner has no state of its own to bound
        what it would load), less those banned as donors for now; when there is none, the resumed run's checkpoint
        (an `archive` record)."""
        serving = self._credible([r for r in self.peers.values() if r.state == "serving"])
        step, now = backed(r.epoch for r in serving), time.monotonic()
        # a donor whose own state did not load lately is not asked again before its ban ends (`_strike`)
        banned = {pid for pid, (_, until) in self._donor_strikes.items() if until > now}
        below = [r for r in serving if r.epoch <= step]
        donors = [r for r in below if r.owner not in banned] or below  # all banned: asked anyway, never the seed
        return donors or [r for r in self.peers.values() if r.state == "archive"]

    def _apart(self, donors: list[ServerRecord]) -> int:
        """This replica's steps since it last stepped in one group with any of `donors` (its history says), or, if
        it never did, since it first saw the first of them: how far honest replicas may have drifted apart. At
        least those since its first step alone after it last loaded a state: a step in a group after that did
        not bring its weights back to the group's (peer.server.replica_belief `_rejoin`)."""
        owners, epoch, lone = {r.owner for r in donors}, self.runtime.epoch, self._lone_since()
        alone = 0 if lone is None else epoch - lone + 1
        for step in reversed(self.runtime.history):
            if owners.intersection(step.members):
                return max(epoch - step.epoch, alone)
        return max(epoch - min((self._first_seen.get(o, epoch) for o in owners), default=epoch), alone)

    def _check_steps(self, metadata: dict) -> None:
        """OutOfReach if the donor's recent steps include one from a group whose mean this replica refused as
        poisoned (peer.server.averaging): every honest member of that group refused it alike."""
        refused = self.averager.refused_groups if self.averager is not None else {}
        for step, members in (metadata.get("step_members") or {}).items():
            if refused.get(int(step)) == sorted(members):  # not for good: another donor may hold a clean state
                raise StateError(f"its step {step} stepped the mean of a group this replica refused as poisoned")

    def _distrust(self, donors: list[ServerRecord], reason: str) -> None:
        """Never take state from, average with, or wait for these donors again (their claim was false)."""
        for r in donors:
            if len(self._distrusted) < 1024:
                self._distrusted.add(r.owner)
        names = ", ".join(r.owner or r.endpoint for r in donors)
        logger.error("%s: distrusts %s for good: %s", self.label, names, reason)
        say(f"{self.label.capitalize()} refused the state of {names}: {reason}.")

    async def load_state_from_peers(self) -> bool:
        """Load parameters and optimizer state from serving replicas (or the run's archive).

        False only when nobody holds the part. While somebody does, a failed download is tried again,
        with a pause that doubles up to `server.state_retry_max`, and said (why, and when the next try
        comes): a server never serves the seed's weights beside trained replicas. It gives up only
        when told to leave (`told_to_leave`)."""
        await self.refresh_peers()
        await self.refresh_peers()  # two reads (a peer read once is kept): one that missed records picks no donor
        donors = self._donors()
        pause = 1.0
        while donors:
            if await self._load_from(donors):
                return True
            if self.told_to_leave():
                return False
            say(
                f"Could not load the state of {self.label} from {len(donors)} peer(s) "
                f"({self.last_load_error}); trying again in {pause:.0f} s."
            )
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.cfg.server.state_retry_max)
            await self.refresh_peers()
            donors = self._donors()
        return False

    async def load_or_wait(self) -> bool | None:
        """Load the part's state; True once loaded. False: nobody holds it and the run never stepped it (or
        `server.seed_start`): it starts from the seed. A part the run has stepped but nobody holds now (all
        its servers left or died, and no checkpoint is offered) is waited for, never restarted from the
        seed. None: told to leave meanwhile."""
        said = 0.0
        while True:
            if await self.load_state_from_peers():
                return True
            if self.told_to_leave():
                return None
            trained = await self._trained_step()
            if trained <= 0 or self.cfg.server.seed_start:
                return False
            if time.monotonic() - said > 30.0:
                said = time.monotonic()
                say(
                    f"{self.label.capitalize()} was trained to step {trained}, but no server and no checkpoint holds "
                    "its state now: waiting for one (server.seed_start = true would start it from the seed anew)."
                )
            await asyncio.sleep(self.cfg.server.state_retry_max / 5)

    async def _trained_step(self) -> int:
        """The highest step the coordinator says this part reached: its `trained` or `archive` record (only the
        coordinator may publish those, dht.records). A server's own `left` or `leaving` record is its claim about
        itself and not believed here: one such record of step 10^9 made the first server of the part wait
        forever (0 when the DHT cannot say)."""
        try:
            records = await self.dht.aget(self.part.key(self.run_id), ServerRecord)
        except Exception:  # the DHT may be busy: asked again on the next look
            return 0
        past = [r.epoch for r in records.values() if self.part.matches(r) and r.state in COORDINATOR_STATES]
        return max(past, default=0)

    async def _resync(self, ahead: list[ServerRecord]) -> None:
        """This replica fell behind (missed a round): take the state of those ahead of it. Its accumulator goes
        only once a state loaded (more than a step behind, it holds gradients of old weights); a donor that
        failed is asked again only after its ban (`_strike`)."""
        now = time.monotonic()
        ahead = [
            r
            for r in self._backed_only(self._credible(ahead))
            if self._donor_strikes.get(r.owner, (0, 0.0))[1] <= now and not self._struck(r.owner)
        ]
        if not ahead:
            return
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
            before, donors = self.runtime.epoch, [r for r in ahead if r.epoch == leader.epoch]
            # a load counts only if it brought the step claimed: one that answers with an older state than its
            # record's (its own step copied from an honest replica) is a failure like a state that never came
            if await self._load_from(donors, attempts=1, strike=False) and self.runtime.epoch >= leader.epoch:
                for r in donors:  # one that sent nothing (it failed, or hung and was outrun) keeps its strikes
                    if r.owner in self._transfer_senders:
                        self._donor_strikes.pop(r.owner, None)
                if self.runtime.epoch - before > 1:
                    await self.run_torch(self._drop_stale, before)
            else:  # the donor that led the transfer (peer.server.transfer_lead), else the one at the top step
                self._strike(self._transfer_lead or leader)
        finally:
            self.stepping = False

    async def _announced_while(self, work) -> None:
        """Await `work` (a resync: a donor may take server.state_load_timeout to send its state, or never) while
        this replica's record keeps being announced: its record must not expire meanwhile (trainers would take it
        for gone and replay what it holds, and it would drop its accumulator at the next look)."""

        async def announce() -> None:
            while True:
                await asyncio.sleep(self.cfg.network.announce_period)
                await self.publish()

        keeper = asyncio.create_task(announce())
        try:
            await work
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    def _drop_stale(self, epoch: int) -> None:
        """Torch thread: this replica was more than a step behind, at `epoch` (its gradients are of weights the
        stage left steps ago): its accumulator goes, under a new incarnation, and trainers replay what it held."""
        dropped = self.runtime.drop_accumulator()
        logger.warning(
            "%s: was %d steps behind its stage; %d accumulated samples, of old weights, are dropped (trainers replay "
            "them)",
            self.label,
            self.runtime.epoch - epoch,
            dropped,
        )

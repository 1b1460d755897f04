"""The butterfly all-reduce of one part's replicas, over our own gRPC path, in the peer's own process.

A round's group (fixed by the replicas' own round protocol: peer.server.replica_round) is a sorted list of
peer ids; the part's tensors, taken as one flat float32 vector, are cut into one slice per member (whole
codec blocks each), and member i owns slice i. Each member opens one bidirectional `Average` call
(protocols/averaging.proto) to every other owner and streams its own values of that owner's slice, piece
by piece (averaging.piece_bytes); the owner reduces each piece as soon as every member's copy of it is in
(the sample-weighted mean, or a robust aggregate: peer.server.robust), encodes it once, takes its own copy
from those very bytes, and streams it back to every member on their calls, with a signed digest of them and,
once it has every slice, what it got of each (peer.server.slice_word). Reduce-scatter and all-gather overlap,
piece by piece, and every member that steps holds bit-equal averages: an owner that sent two is caught.

Faults. A member that dies (its connection refused or reset), stops (no bytes within averaging.read_timeout
once its pieces are due) or sends a piece of the wrong size or with values that are not finite is *lost*:
the owner that saw it ends its slice with a verdict naming it, a member that gives up on an attempt tells
every owner whom it lost, and the survivors run the round again at once (the next `attempt`) without them,
from their own tensors (nothing is changed before a round succeeds). A round steps only with a quorum
(more than half of the group it started with), and only when every owner's verdict reports the same
contributions: the step counts exactly the samples of the members in it, and trainers replay the rest.

Bounds. An owner allocates pieces by its own tensors' size (a header whose total differs is refused), reads at
most its slice's pieces from each member, and keeps at most `MAX_ROUNDS` rounds' state."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from peer.net.refusal import Refused
from peer.server import slice_word
from peer.server.owned_slice import Attempt, Failed, OwnedSlice, contribution_key, liars_among
from peer.server.piece_codec import PieceCodec, PieceError, decode_into
from peer.server.round_failures import RoundFailures
from peer.server.slicing import Flat, Limits, piece_bounds, slice_bounds
from protocols import averaging_pb2
from protocols.averaging_frames import message_frame, parse_frame, piece_frame
from protocols.failures import Reason
from protocols.framing import FramingError

WRONG_RUN, BAD = Reason.WRONG_RUN, Reason.BAD_INPUT

logger = logging.getLogger(__name__)
MAX_ROUNDS = 8  # (epoch, attempt) states an owner keeps: the newest rounds only


@dataclass
class Outcome:
    """A round that succeeded: the average (views of one flat buffer, shaped as the tensors) and what it counts."""

    averaged: list[torch.Tensor]
    gathered: list[averaging_pb2.Contribution]  # every member's, in group order
    attempts: int


class AllReduce:
    """Runs this replica's rounds and serves its partners' calls, on the replica's event loop."""

    def __init__(self, limits: Limits, codec: PieceCodec, block_size: int):
        self.limits, self.codec, self.block_size = limits, codec, block_size
        self.failures = RoundFailures(limits.max_failed_rounds, limits.failed_ban, limits.max_failed_ban)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="allreduce")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client = None
        self.peer_id = ""
        self.endpoint_of: Callable[[str], str | None] = lambda peer: None
        self.header_base = averaging_pb2.AverageHeader()
        self.epoch_now: Callable[[], int] = lambda: 0
        self.admitted: Callable[[str], bool] = lambda peer: True
        self.sign: Callable[[bytes], bytes] = lambda data: b""  # this peer's Ed25519 signature (dht.identity)
        self._slices: collections.OrderedDict[tuple[int, int], OwnedSlice] = collections.OrderedDict()
        self._started: dict[tuple[int, int], asyncio.Event] = {}
        # epoch -> the group that stepped it, for the last rounds
        self._stepped: collections.OrderedDict[int, list[str]] = collections.OrderedDict()
        self.proofs: collections.deque = collections.deque(maxlen=16)  # dht.records.AverageLie, newest last

    def bind(self, loop, client, identity, endpoint_of, header: averaging_pb2.AverageHeader, epoch_now, admitted):
        """Set once the replica serves: its loop, client (TLS pinning), identity (dht.identity.Identity: its peer id,
        and the key its slices' averages are signed with), partners' endpoints, part."""
        self.loop, self.client, self.peer_id, self.endpoint_of = loop, client, identity.peer_id, endpoint_of
        self.header_base, self.epoch_now, self.admitted, self.sign = header, epoch_now, admitted, identity.sign

    # ---- a round, as a member ------------------------------------------------------------------
    async def round(self, tensors: list[torch.Tensor], me: averaging_pb2.Contribution, epoch: int, group: list[str]):
        """Average `tensors` with `group` (peer ids, ours included) for `epoch`: an Outcome, or None if it failed."""
        flat = Flat(tensors)
        try:
            found = await self._attempts(flat, me, epoch, sorted(set(group)))
        finally:
            self._close(epoch)  # partners' calls for this round that come later are answered at once
        if found is None:
            return None
        gathered, attempts, out = found
        self.failures.stepped(c.peer_id for c in gathered)
        averaged, offset = [], 0
        for t in tensors:
            averaged.append(out[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return Outcome(averaged, gathered, attempts)

    async def _attempts(self, flat: Flat, me, epoch: int, group: list[str]):
        """Attempts until one succeeds, each without the members the last lost: (contributions, attempts, the
        averaged flat vector) or None. Each attempt fills an output of its own: what a failed one still writes (a
        piece reduced or decoded as it ended) never reaches the next."""
        quorum = len(group) // 2 + 1  # more than half of the group the round started with
        for attempt in range(self.limits.max_attempts):
            if self.peer_id not in group or len(group) < max(2, quorum):
                logger.warning("averaging for step %d: %d of the %d members left, no quorum", epoch, len(group), quorum)
                return None
            out = torch.empty(flat.numel, dtype=torch.float32)
            try:
                gathered = await self._attempt(Attempt(epoch, attempt, group, me, flat, out))
            except Failed as e:
                logger.warning("averaging for step %d, attempt %d, failed: %s", epoch, attempt, e.reason)
                if e.stepped:
                    self.failures.claimed_stepped(e.claimants, epoch)  # to be seen ahead next (replica_round)
                    return None
                group = sorted((set(group) - e.lost) & set(e.group or group))
                continue
            self._stepped[epoch] = group
            return gathered, attempt + 1, out
        return None

    def unstep(self, epoch: int) -> None:
        """The replica did not step the average of its round for `epoch` (implausible, no samples): partners' calls
        for its next round at that step are served again, not answered 'stepped'."""
        self._stepped.pop(epoch, None)

    async def _attempt(self, run: Attempt) -> list[averaging_pb2.Contribution]:
        bounds = slice_bounds(run.flat.numel, len(run.group), self.block_size)
        mine = run.group.index(self.peer_id)
        owned = OwnedSlice(run, bounds[mine], self.limits, self.codec, self.pool, self._signer(run))
        self._open(run.epoch, run.attempt, owned)
        reducer = asyncio.ensure_future(owned.reduce())
        loop = asyncio.get_running_loop()
        ours = loop.create_future()  # our confirm once every verdict is in and agrees; None if the attempt failed
        verdicts_in = {owner: loop.create_future() for owner in run.group if owner != self.peer_id}
        calls = {
            owner: asyncio.ensure_future(self._exchange(run, owner, bounds[i], verdicts_in[owner], ours))
            for i, owner in enumerate(run.group)
            if owner != self.peer_id
        }
        try:
            verdicts = await self._verdicts(run, verdicts_in, owned, reducer)
            gathered = self._agreed(run, verdicts)
            confirm = slice_word.confirm_of(run.group, verdicts)
            await owned.set_confirm(confirm)
            if owned.confirm is not confirm:  # a member already heard that we do not step: we do not
                raise Failed(set(), f"we confirmed no step: {owned.confirm.reason}", stepped=True)
            ours.set_result(confirm)
            confirms = dict(zip(calls, await asyncio.gather(*calls.values()), strict=True))
            self._confirmed(run, confirm, confirms, [c.nonce for c in gathered])
        finally:  # unless set: members we answer hear that we do not step
            await owned.set_confirm(averaging_pb2.Confirm(ok=False, reason="our side of the attempt failed"))
            if not ours.done():
                ours.set_result(None)
            for task in calls.values():
                task.cancel()
            await owned.fail(Failed(set(), "the attempt is over"))  # nothing, once reduced; else its callers hear
            reducer.cancel()
        return gathered

    def _signer(self, run: Attempt) -> Callable[[list[bytes], bytes], bytes]:
        return lambda nonces, digest: self.sign(self._prefix(run, nonces)(self.peer_id) + digest)

    def _confirmed(self, run: Attempt, ours: averaging_pb2.Confirm, confirms: dict, nonces: list[bytes]) -> None:
        """Every other member's confirm names our digests (or says it does not step), or Failed: we do not step (nor
        run another attempt: every verdict was ok). A proven liar is left out of our rounds, and an owner's two signed
        digests kept as a proof for the coordinator (`proofs`: peer.server.lie_reports). A confirm that never came is
        a word like a verdict that never came: checked at the next invitation (claimants)."""
        fault = slice_word.confirms_failure(run.group, ours, confirms, self._prefix(run, nonces))
        if fault is not None:
            if fault.proven:
                self.failures.caught(fault.whom, fault.why)
            if fault.theirs is not None:
                self.proofs.append(slice_word.lie_of(self.header_base, run, nonces, fault))
            raise Failed({fault.whom}, fault.why, stepped=True, claimants=set() if fault.proven else {fault.whom})

    def _prefix(self, run: Attempt, nonces: list[bytes]) -> Callable[[str], bytes]:
        return lambda owner: slice_word.statement(self.header_base, run.epoch, run.attempt, run.group, owner, nonces)

    async def _verdicts(self, run: Attempt, verdicts_in: dict, owned: OwnedSlice, reducer) -> dict[str, object]:
        """Every owner's verdict (ours too); on the first failure, tell the others whom this attempt lost."""
        verdicts: dict[str, object] = {}
        pending = {reducer: self.peer_id, **{future: owner for owner, future in verdicts_in.items()}}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                owner = pending.pop(task)
                verdicts[owner] = (owned.failure or owned.verdict()) if task is reducer else task.result()
            failure = next((v for v in verdicts.values() if isinstance(v, Failed)), None)
            failure = failure or next((self._owner_failure(o, v) for o, v in verdicts.items() if _failed(v)), None)
            if failure is not None:
                run.lost |= failure.lost
                if owned.done and owned.failure is None:
                    # our slice's average and ok verdict already went out: a member holding every owner's ok
                    # verdict may step this attempt, so running another (a second average at this step) must not be
                    # (whose word ended it is checked like a `stepped` word: a partner that stepped is ahead next; an
                    # owner whose call ended without its verdict, broke or went silent is checked alike, else one
                    # that did so after every slice of ours went out would end every round and never be left out)
                    raise Failed(
                        failure.lost,
                        f"{failure.reason}; our slice was already averaged",
                        stepped=True,
                        claimants=failure.claimants or failure.lost,
                    )
                await owned.fail(failure)
                raise failure
        return verdicts

    def _agreed(self, run: Attempt, verdicts: dict) -> list[averaging_pb2.Contribution]:
        """The contributions every owner reduced with: the same on all, or whoever told them apart is lost."""
        seen: dict[str, set[tuple]] = collections.defaultdict(set)
        for verdict in verdicts.values():
            for c in verdict.gathered:
                seen[c.peer_id].add(contribution_key(c))
        told_apart = {p for p in run.group if len(seen.get(p, ())) != 1}
        if told_apart:
            liars = liars_among(told_apart, verdicts, self.peer_id)
            raise Failed(liars, f"owners' verdicts differ on what {sorted(told_apart)} sent; lost: {sorted(liars)}")
        return list(verdicts[self.peer_id].gathered)

    def _owner_failure(self, owner: str, verdict: averaging_pb2.AverageVerdict) -> Failed:
        """An owner's failed verdict, as this member takes it. Members it names lost (others) are left out of the
        next attempt as it says (we cannot tell), and a group it names is kept to. A verdict that names us lost,
        names a group without us, or names nobody (its own step, a round it ended) is its word against what we
        know (we are here, in this group): the owner is left out instead, so that no one member's word alone
        ends a round for the rest."""
        named = set(verdict.lost) - {self.peer_id}
        against_us = self.peer_id in verdict.lost or (verdict.group and self.peer_id not in verdict.group)
        if not against_us and (named or verdict.group):
            return Failed(named, verdict.reason, list(verdict.group) or None, claimants={owner})
        return Failed({owner}, f"{owner}: {verdict.reason}", claimants={owner})

    async def _exchange(self, run: Attempt, owner: str, bounds: tuple[int, int], verdict_in, ours):
        """Our pieces of `owner`'s slice out, its averaged pieces in: its verdict (or Failed) into `verdict_in`;
        then, once `ours` (our confirm) is set, its confirm, returned (or Failed; None if ours is not to be)."""
        endpoint = self.endpoint_of(owner)
        if not endpoint:
            verdict_in.set_result(Failed({owner}, f"{owner}: no endpoint known"))
            return None
        call = self.client.average(endpoint, owner, self.limits.round_timeout)
        pieces = piece_bounds(*bounds, self.limits.piece_elements)
        writer = asyncio.ensure_future(self._send(call, run, pieces))
        try:
            result = await self._receive(call, run, owner, pieces)
            verdict_in.set_result(result)
            if isinstance(result, Failed):  # the owner did not answer as it should: it hears whom we lost, it too
                await self._give_up(call, run.lost | result.lost)
            elif result.ok and await ours is not None:
                wait = 4 * self.limits.read_timeout  # an owner waits 3 at most for its own side's verdicts
                confirm = await slice_word.read_confirm(call, owner, wait)
                return confirm if not isinstance(confirm, str) else Failed({owner}, confirm)
            return None
        except grpc.aio.AioRpcError as e:
            failed = Failed({owner}, f"{owner}: {e.code().name}: {e.details()}")
            if not verdict_in.done():
                verdict_in.set_result(failed)
            return failed
        except asyncio.CancelledError:
            # this attempt failed elsewhere: say whom it lost before the call goes, so the owner does not take us
            writer.cancel()
            if not verdict_in.done():
                await self._give_up(call, run.lost)
            raise
        finally:
            writer.cancel()
            call.cancel()  # over: its verdict and confirm are in, or not to be
            if not verdict_in.done():  # ended otherwise (a channel closed under it, say): the attempt must not wait
                verdict_in.set_result(Failed({owner}, f"{owner}: the call ended without its verdict"))

    @staticmethod
    async def _give_up(call, lost: set[str]) -> None:
        """Tell an owner we leave this attempt, and whom it lost; then end the call."""
        with contextlib.suppress(Exception):  # the call may be over already: nothing to tell then
            verdict = averaging_pb2.AverageVerdict(ok=False, lost=sorted(lost), reason="attempt given up")
            await asyncio.wait_for(call.write(_verdict(verdict)), 0.5)
        call.cancel()

    async def _send(self, call, run: Attempt, pieces) -> None:
        header = averaging_pb2.AverageHeader()
        header.CopyFrom(self.header_base)
        header.epoch, header.attempt, header.total_elements = run.epoch, run.attempt, run.flat.numel
        header.group.extend(run.group)
        header.sender.CopyFrom(run.me)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):  # the call ended (the owner answered, or it broke): the reader says
            await call.write(message_frame(averaging_pb2.AverageFrame(header=header)))
            for start, end in pieces:
                frame = await loop.run_in_executor(
                    self.pool, lambda s=start, e=end: piece_frame(self.codec.encode(run.flat.read(s, e)))
                )
                await call.write(frame)
            await call.done_writing()
            logger.debug("step %d attempt %d: all %d pieces sent", run.epoch, run.attempt, len(pieces))

    async def _receive(self, call, run: Attempt, owner: str, pieces):
        loop = asyncio.get_running_loop()
        received, first, digest = 0, True, slice_word.new_digest()
        while True:
            # an owner gets twice the read deadline: its next piece may wait for a stalled member, whom it must be
            # the first to blame (else we blame it, tell it so, and the members' groups come apart)
            wait = 2 * self.limits.read_timeout + (self.limits.group_timeout if first else 0.0)
            try:
                frame = await asyncio.wait_for(call.read(), wait)
            except TimeoutError:
                return Failed({owner}, f"{owner}: nothing in {wait:.1f} s")
            first = False
            if frame is grpc.aio.EOF:
                return Failed({owner}, f"{owner}: the call ended without a verdict")
            try:
                kind, body = parse_frame(frame)
            except FramingError as e:
                return Failed({owner}, f"{owner}: {e}")
            if kind == "verdict":
                if body.ok and received != len(pieces):
                    return Failed({owner}, f"{owner}: a verdict after {received} of {len(pieces)} pieces")
                if body.stepped:
                    return Failed(set(), f"{owner} already stepped this round", stepped=True, claimants={owner})
                logger.debug(
                    "step %d attempt %d: verdict of %s after %d pieces", run.epoch, run.attempt, owner, received
                )
                if body.total_elements and body.total_elements != run.flat.numel:
                    # sizes differ: whoever differs from us is the odd one, as far as we can tell
                    return Failed({owner}, f"{owner} holds {body.total_elements} elements, not ours")
                if body.ok and body.digest != digest.digest():
                    return Failed({owner}, f"{owner}: its verdict's digest is not that of the pieces it sent")
                if body.ok and not slice_word.in_group_order(body.gathered, run.group):
                    return Failed({owner}, f"{owner}: its verdict's contributions are not the group's, in its order")
                signed = self._prefix(run, [c.nonce for c in body.gathered])(owner)
                if body.ok and not slice_word.signed_by(owner, signed, body.digest, body.signature):
                    return Failed({owner}, f"{owner}: its verdict's signature is not its own")
                return body
            if kind != "piece" or received >= len(pieces):
                return Failed({owner}, f"{owner}: sent a frame it should not ({kind})")
            start, end = pieces[received]
            try:
                await loop.run_in_executor(self.pool, decode_into, self.codec, body, run.out, start, end, digest)
            except PieceError as e:
                return Failed({owner}, f"{owner}: {e}")
            received += 1

    # ---- the owner's side: partners' calls -------------------------------------------------------
    def _open(self, epoch: int, attempt: int, owned: OwnedSlice) -> None:
        key = (epoch, attempt)
        self._slices[key] = owned
        self._started.setdefault(key, asyncio.Event()).set()
        while len(self._slices) > MAX_ROUNDS:
            old, _ = self._slices.popitem(last=False)
            self._started.pop(old, None)

    def _close(self, epoch: int) -> None:
        """Our round for `epoch` is over: its slices go (the handlers still answering hold their own), and partners
        waiting for an attempt of it that will not come are answered. A failed round leaves no mark: the replica's
        next round may be at the same step."""
        for key in [k for k in self._slices if k[0] == epoch]:
            del self._slices[key]
        for key in [k for k in self._started if k[0] == epoch]:
            self._started.pop(key).set()
        while len(self._stepped) > MAX_ROUNDS:
            self._stepped.popitem(last=False)

    async def _slice_for(self, header: averaging_pb2.AverageHeader) -> OwnedSlice:
        """The slice a partner's call is for, once our own round reaches that attempt; Failed otherwise."""
        epoch, key = header.epoch, (header.epoch, header.attempt)
        if epoch in self._stepped:
            raise Failed(set(), f"this replica already stepped {epoch}", self._stepped[epoch], stepped=True)
        now = self.epoch_now()
        # a partner may invite us while we still apply the step before (peer.server.replica_round.join_round)
        if not now <= epoch <= now + 1:  # a verdict, not a refusal: the caller fails this round, blaming nobody
            raise Failed(set(), f"this replica is at step {now}, not {epoch}")
        if header.attempt >= self.limits.max_attempts:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"attempt {header.attempt}: rounds take at most {self.limits.max_attempts} (averaging.max_attempts)",
            )
        if key not in self._slices:
            if key not in self._started and len(self._started) >= 2 * MAX_ROUNDS:
                raise Failed(set(), "too many rounds waited for at once")
            event = self._started.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self.limits.group_timeout)
            except TimeoutError:
                self._started.pop(key, None)
                raise Failed(set(), f"this replica did not start attempt {header.attempt} of step {epoch}") from None
        owned = self._slices.get(key)
        if owned is None:
            raise Failed(set(), "the round is over here")
        return owned

    def _check_caller(self, header: averaging_pb2.AverageHeader, caller: str) -> None:
        """Refused (a gRPC status with its reason) unless the call is an admitted replica's, for this part."""
        sender = header.sender.peer_id
        if caller and caller != sender:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"the call comes from {caller}, not from {sender}")
        if not self.admitted(sender) or sender not in header.group or sender == self.peer_id:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{sender} is not an admitted replica of this part")
        if self.failures.left_out(sender):  # it failed our last rounds (peer.server.round_failures)
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{sender} failed this replica's last rounds: left out")
        if header.run_id != self.header_base.run_id:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"run {header.run_id!r} is not this one's", WRONG_RUN)
        if (header.stage, header.expert) != (self.header_base.stage, self.header_base.expert):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"stage {header.stage} {header.expert!r}: not ours")
        if len(header.sender.nonce) != slice_word.NONCE_BYTES:
            why = f"sender.nonce: must be {slice_word.NONCE_BYTES} bytes, not {len(header.sender.nonce)}"
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, why, BAD)

    async def serve(self, header: averaging_pb2.AverageHeader, frames, caller: str):
        """A partner's Average call (its header read, `frames` the rest): its pieces of our slice in, the averaged
        pieces out, then our verdict."""
        self._check_caller(header, caller)
        sender = header.sender.peer_id
        try:
            owned = await self._slice_for(header)
        except Failed as e:
            yield _verdict(
                averaging_pb2.AverageVerdict(ok=False, reason=e.reason, group=e.group or [], stepped=e.stepped)
            )
            return
        if list(header.group) != owned.attempt.group or header.total_elements != owned.attempt.flat.numel:
            why = "another group" if list(header.group) != owned.attempt.group else "another size"
            verdict = averaging_pb2.AverageVerdict(
                ok=False, reason=f"{sender} came with {why}", group=owned.attempt.group
            )
            verdict.total_elements = owned.attempt.flat.numel
            yield _verdict(verdict)
            if why == "another size":
                await owned.fail(
                    Failed({sender}, f"{sender} sent {header.total_elements} elements, not {owned.attempt.flat.numel}")
                )
            return
        if sender in owned.queues:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"{sender} already sends to this attempt", BAD)
        queue = owned.register(header.sender)
        reader = asyncio.ensure_future(self._read_pieces(frames, owned, sender, queue))
        try:
            for index in range(len(owned.pieces)):
                piece = await owned.result(index)
                if piece is None:
                    break
                yield piece  # the frame the owner built once, for every member
            if owned.failure is None and not owned.done:
                async with owned.changed:
                    while not owned.done and owned.failure is None:
                        await owned.changed.wait()
            verdict = owned.verdict()
            yield _verdict(verdict)
            if verdict.ok:  # what every slice's owner sent us, once our side has it (peer.server.slice_word)
                confirm = await owned.confirmation(3 * self.limits.read_timeout)
                yield message_frame(averaging_pb2.AverageFrame(confirm=confirm))
        finally:
            reader.cancel()

    async def _read_pieces(self, frames, owned: OwnedSlice, sender: str, queue: asyncio.Queue) -> None:
        """A member's pieces into its queue, at most the slice's count; its notice or its end as a failure."""
        count = 0
        try:
            async for raw in frames:
                try:
                    kind, body = parse_frame(raw)
                except FramingError:
                    kind, body = "malformed", None
                if kind == "verdict":  # the member gave the attempt up: whom it lost
                    # it names whom it lost; never us (we are here: then it is the one lost), nobody: itself
                    lost = set(body.lost) & set(owned.attempt.group) - {self.peer_id} or {sender}
                    await owned.fail(Failed(lost, f"{sender} gave the attempt up: {body.reason}"))
                    return
                if kind != "piece" or count >= len(owned.pieces):
                    await queue.put(Failed({sender}, f"{sender} sent a frame it should not ({kind})"))
                    return
                await queue.put(body)
                count += 1
            if count < len(owned.pieces):
                await queue.put(Failed({sender}, f"{sender} ended its stream after {count} pieces"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke: the member is gone or cut off
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(Failed({sender}, f"{sender}: its stream broke ({type(e).__name__})"))
            await owned.fail(Failed({sender}, f"{sender}: its stream broke ({type(e).__name__})"))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _failed(verdict) -> bool:
    return isinstance(verdict, averaging_pb2.AverageVerdict) and not verdict.ok


def _verdict(verdict: averaging_pb2.AverageVerdict) -> bytes:
    return message_frame(averaging_pb2.AverageFrame(verdict=verdict))

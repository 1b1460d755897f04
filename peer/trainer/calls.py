"""A trainer's calls with rerouting: each forward or backward goes to one live replica of the stage, with a
deadline from what it should cost there; a failed try bans that server and goes to another replica.

Calls is a piece of peer.trainer.trainer.Trainer, on the trainer's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc
from google.protobuf.message import DecodeError

from peer.model.numerics import all_finite
from peer.net.cadence import longest_ttl
from peer.net.client import gone_after, refuses_connections
from peer.swarm.router import NoServer
from peer.trainer.insistence import Insist
from peer.trainer.ledger import Receipt
from protocols import codec, framing, tensor_pb2
from protocols.failures import Reason, reason_of

logger = logging.getLogger(__name__)
# our own fault, not the server's: a malformed request, or this trainer's credential refused (revoked)
_CALLER_FAULTS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
WORK = {"forward": 1 / 3, "backward": 1.0}  # share of a forward+backward (a backward recomputes on a cache miss)


class MicroBatchFailed(RuntimeError):
    """A micro-batch could not pass a stage on any replica within the retries."""


class CallerFault(RuntimeError):
    """A server said our request was at fault (malformed, or our credential refused): its word, until a second
    replica says the same."""


class BadAnswer(RuntimeError):
    """A server answered with a tensor that cannot be right (wrong shape, NaN or Inf)."""


class Calls:
    """Forwards and backwards on the stages' replicas (Trainer inherits it)."""

    # ---- calls with rerouting -------------------------------------------------------------
    async def _wait_for_server(self, stage: int, pause: float, excluded: int = 0, insisted: str = "") -> None:
        """No server of `stage` can take the call (none live, or all banned, or the `excluded` ones: a replay
        avoids the process that lost it, or the one server it must go to, `insisted`, cannot take it now, for that
        reason): say so (which stage, why, since when), wait, look again."""
        since = self._no_server_since.setdefault(stage, time.time())
        waited = time.time() - since
        if not self.router.servers[stage] and self.tcfg.no_server_wait and waited > self.tcfg.no_server_wait:
            raise MicroBatchFailed(f"no server for stage {stage} answered for {self.tcfg.no_server_wait:.0f} s")
        if time.monotonic() - self._said_unserved.get(stage, 0.0) > 5.0:
            self._said_unserved[stage] = time.monotonic()
            known = len(self.router.servers[stage])
            why = (
                f"has a backward for the one server that may hold it ({insisted})"
                if insisted
                else "has no live server"
                if not known
                else f"has {known} server(s), {excluded} of them the process a replay must avoid and the rest banned"
            )
            logger.warning(
                "stage %d %s since %s (%.0f s); waiting for one",
                stage,
                why,
                time.strftime("%H:%M:%S", time.localtime(since)),
                time.time() - since,
            )
        await asyncio.sleep(pause)
        with contextlib.suppress(Exception):
            await self.router.refresh()

    async def _call(
        self,
        stage: int,
        method: str,
        request,
        payloads: dict | None = None,
        prefer: str | None = None,
        exclude: set[tuple[str, int]] | None = None,
        insist: str | None = None,
    ):
        """One forward or backward on some replica of `stage`; returns (response, payloads, peer id).

        `exclude`: (peer id, incarnation) of processes not to use (a replay avoids the one that lost the backward;
        the same peer restarted with the same key is a new incarnation, and welcome). `insist`: the only server to
        use while it lives (a killed start's journal says it may hold this backward already: it answers it again
        without adding it), however long it is banned or behind. A backward a server gave no answer for goes to it
        again alike, within bounds (peer.trainer.insistence). Forwards give up after max_retries failures;
        backwards never do (a later stage has counted the micro-batch already), they wait for a replica instead."""
        tried, refusers, attempts, pause = set(), set(), 0, 0.25  # refusers: servers that put the fault on us
        insist = Insist(insist, time.time(), journal=True) if insist is not None else None
        samples = request.inputs.shape[0] if request.inputs.shape else 1
        kind = f"{method}/{int(request.HasField('targets'))}/{int(getattr(request, 'train', True))}"
        sent = request.ByteSize() + sum(len(p) for p in (payloads or {}).values())  # once: the same every try
        moved = self._call_bytes(stage, method, request, sent)
        while True:
            insist = self._still_insisting(stage, insist)
            avoid = {pid for pid, r in self.router.servers[stage].items() if (pid, r.incarnation) in (exclude or ())}
            try:
                if insist is not None:
                    pid, record = await self._insisted(stage, insist)
                else:
                    pid, record = self.router.choose(stage, avoid | tried, prefer, kind)
            except NoServer as e:
                await self._wait_for_server(stage, pause, len(avoid), str(e) if insist is not None else "")
                pause, tried = min(pause * 2, 5.0), set()
                continue
            self._served_again(stage)
            timeout = self.router.deadline(pid, record, kind, samples, WORK[method], moved)
            if getattr(request, "step", 0):  # synchronous mode: the server may hold it for its step
                timeout += self.spec.training.sync_wait
            if insist is not None and not insist.journal:  # its one more try: what a call may take, within the bound
                timeout, insist.retried = max(timeout, min(self.tcfg.request_timeout, self._insist_left(insist))), True
            if method == "backward":  # before the call: a start after a kill sends it here again first
                self.journal.sent(request.uid, stage, pid)
            started = time.monotonic()
            self._count_bytes("sent", sent)
            journal = insist is not None and insist.journal
            answer, reason, blame, how = await self._try(
                stage, method, (request, payloads), pid, record, timeout, kind, refusers, journal
            )
            if answer is not None:
                return answer
            if await self._failed(stage, method, pid, record.endpoint, started, reason, blame, request.uid):
                tried.add(pid)
            if method == "backward" and not request.dry:
                insist = self._after_failure(stage, pid, insist, how)
            attempts += 1
            if method == "forward" and attempts >= self.tcfg.max_retries:
                raise MicroBatchFailed(f"stage {stage} {method} failed on {attempts} tries")

    def _served_again(self, stage: int) -> None:
        if stage in self._no_server_since:
            since = self._no_server_since.pop(stage)
            logger.warning("stage %d is served again after %.0f s", stage, time.time() - since)

    async def _try(self, stage, method, sent, pid, record, timeout, kind, refusers, journal):
        """`_attempt` with `sent` (request, payloads); a refusal that puts the fault on us is weighed (`_refused_by`)
        and is "blamed" in the answer: (answer, reason, blame, how)."""
        try:
            return await self._attempt(stage, method, *sent, pid, record, timeout, kind)
        except CallerFault as e:
            return None, self._refused_by(stage, method, pid, refusers, e, journal), True, "blamed"

    def _still_insisting(self, stage: int, insist: Insist | None) -> Insist | None:
        """`insist`, while the backward still goes to that server only (peer.trainer.insistence): None once it is
        lost (what it held went with it: the backward counts anywhere), moved to another stage (a journal's insist
        waited for it for ever: it is under no record of this stage), or the wait is over."""
        if insist is None or self.router.vanished(insist.pid):  # a leaving one still answers what it holds
            return None
        if self.router.elsewhere(insist.pid, stage):
            logger.warning(
                "stage %d: %s, which may hold a backward, serves another stage now; it goes on", stage, insist.pid
            )
            return None
        if insist.journal or self._insist_left(insist) > 0:
            return insist
        logger.warning("stage %d: %s held a backward unanswered too long; avoided, and it goes on", stage, insist.pid)
        self._avoid(stage, insist.pid)
        return None

    def _insist_left(self, insist: Insist) -> float:
        """Seconds left to insist (peer.trainer.insistence): trainer.unanswered_wait, never less than a frozen
        server's record may live on."""
        bound = max(self.tcfg.unanswered_wait, longest_ttl(self.cfg.network) + 1.0 + self.tcfg.refresh_period)
        return insist.since + bound - time.time()

    def _avoid(self, stage: int, pid: str) -> None:
        """Avoid `pid` for max_ban s (not the stage's only routable replica: that would stall the stage for nothing)."""
        if len(self.router.servers[stage]) > 1:
            self.router.ban(pid)

    async def _insisted(self, stage: int, insist: Insist) -> tuple[str, object]:
        """The insisted server, if the call may go to it now; else NoServer (wait). One that gave no answer gets its
        one more try once it showed it lives (a frozen one cannot): its record refreshed since (by the clocks'
        tolerance, 1 s), or a good answer to another call; bans or not. After a refusal with a reason, it is asked
        again once its failure ban ends. A port that refuses connections meanwhile is a process gone (a killed one's
        calls break before its port closes): dead, so lost."""
        if insist.journal or insist.alive:
            return self.router.only(stage, insist.pid, mind_bans=insist.journal or insist.refused)
        if not (
            self.router.refreshed_since(insist.pid, insist.since + 1.0)
            or self.router.answered_since(insist.pid, insist.since)
        ):
            record = self.router.latest.get(insist.pid)
            if record is not None and await refuses_connections(record.endpoint, self.cfg.network.probe_timeout):
                self.router.report_dead(insist.pid)
            raise NoServer(f"{insist.pid} has not shown it lives since it gave no answer")
        insist.alive = True
        return self.router.only(stage, insist.pid, mind_bans=False)

    def _after_failure(self, stage: int, pid: str, insist: Insist | None, how: str) -> Insist | None:
        """Whom a backward goes to after `pid` failed it (`how`: "unanswered", "refused" with a reason, "leaving" (a
        refusal that says it holds no such backward), "bad" answer, "blamed" us): `pid` only, if it gave no answer (it may have added it). Its one more try refused with a reason
        (busy, late, at another step): asked again later, within the bound. That try failed otherwise: it withholds
        what it took, or cannot serve it: avoided, and the backward goes to anyone."""
        if insist is None:
            return Insist(pid, time.time()) if how == "unanswered" else None
        if how == "leaving" and insist.pid == pid:
            return None  # a leaving server answers a backward it holds (peer.server.servicer): it holds none
        if insist.journal or insist.pid != pid or not insist.retried:
            return insist
        if how == "refused":
            insist.retried, insist.refused = False, True
            return insist
        logger.warning(
            "stage %d: %s failed a backward it may hold twice (%s); avoided, and it goes on", stage, pid, how
        )
        self._avoid(stage, pid)
        return None

    def _refused_by(
        self, stage: int, method: str, pid: str, refusers: set[str], fault: CallerFault, journal: bool
    ) -> str:
        """Server `pid` put the fault of a call on us: one server's word, believed
        (MicroBatchFailed) once a second replica says it too, or none other is known, or the call may go to this
        server alone (`journal`: a killed start's insist); until then that server is banned like any that failed."""
        refusers.update([pid, "insisted"] if journal else [pid])  # insisted: it alone may take it
        if len(refusers) >= 2 or len(self.router.servers[stage]) <= len(refusers):
            raise MicroBatchFailed(f"stage {stage} refused our {method}: {fault}") from None
        return str(fault)

    def _holds_experts(self, stage: int) -> bool:
        """Whether `stage` has mixture-of-experts layers (only there may a server say its experts did not answer: a
        server of another stage that says so is believed no more than any that failed)."""
        blocks = self.spec.stage_blocks(stage)
        return any(layer in blocks for layer in self.spec.moe_layers())

    async def _attempt(self, stage: int, method: str, request, payloads, pid: str, record, timeout: float, kind: str):
        """One try on one server: ((response, payloads, pid), "", _, "") on success, else (None, reason, blame, how):
        blame is False when the failure is not the server's own (its MoE layer's experts did not answer); how is
        "unanswered" when no refusal of the server's came back (it may have done the work), "leaving" for a refusal
        as leaving (a leaving server answers what it holds), "refused" when another with a reason did, "bad" for an answer that cannot be right."""
        started = time.monotonic()
        try:
            call = self.client.forward if method == "forward" else self.client.backward
            response, returned = await call(record.endpoint, request, payloads, timeout=timeout, peer=pid)
            self._count_bytes("received", response.ByteSize() + sum(len(p) for p in returned.values()))
            self._check_answer(stage, method, request, response, returned)
            self.router.report_success(pid, kind, time.monotonic() - started)
            if method == "backward":
                self.router.report_answer(pid, response.incarnation, response.stepped_seq)
            self._write_call(stage, method, pid, record.endpoint, started, None, request.uid)
            return (response, returned, pid), "", True, ""
        except grpc.aio.AioRpcError as e:
            if e.code() in _CALLER_FAULTS:
                raise CallerFault(f"{e.code().name}: {e.details()}") from None
            reason, blame = reason_of(e), True
            if reason == Reason.LEAVING:
                self.router.report_leaving(pid)
            elif reason == Reason.EXPERTS_UNAVAILABLE and self._holds_experts(stage):
                blame = False  # every replica of the stage would fail alike: wait for the experts instead
            elif reason is None and await gone_after(e, record.endpoint, self.cfg.network.probe_timeout):
                self.router.report_dead(pid)
            how = "unanswered" if reason is None else "leaving" if reason == Reason.LEAVING else "refused"
            return None, f"{e.code().name}: {e.details()}", blame, how
        except (BadAnswer, codec.TensorDecodeError, framing.FramingError, DecodeError) as e:
            return None, str(e), True, "bad"

    async def _failed(
        self, stage: int, method: str, pid: str, endpoint: str, started: float, reason: str, blame: bool, uid: str = ""
    ) -> bool:
        """Account a failed try: ban the server when it is to blame (True), else wait a ban's time."""
        if blame:
            ban = self.router.report_failure(pid)
            self.summary.bans += 1 if ban > 0 else 0
            if self.metrics is not None and ban > 0:
                self.metrics.bans.inc()
        else:
            ban = 0.0
            await asyncio.sleep(self.tcfg.ban_time)
        self.summary.failed_calls += 1
        self._write_call(stage, method, pid, endpoint, started, reason, uid)
        logger.warning(
            "stage %d %s on %s failed after %.1f s (%s); banned %.0f s, trying another replica",
            stage,
            method,
            endpoint,
            time.monotonic() - started,
            reason,
            ban,
        )
        return blame

    def _count_bytes(self, direction: str, n: int) -> None:
        if direction == "sent":
            self.summary.bytes_sent += n
        else:
            self.summary.bytes_received += n
        if self.metrics is not None:
            self.metrics.bytes.labels(direction, "activations").inc(n)

    def _write_call(
        self, stage: int, method: str, pid: str, endpoint: str, started: float, error: str | None, uid: str = ""
    ):
        if self.metrics is not None:
            self.metrics.calls.labels(method, "ok" if error is None else "error").inc()
            self.metrics.call_seconds.labels(method).observe(time.monotonic() - started)
        if self.tcfg.log_calls or error is not None:
            entry = {"type": "call", "stage": stage, "method": method, "peer": pid, "endpoint": endpoint, "uid": uid}
            entry.update(time=time.time(), seconds=time.monotonic() - started)
            if error is not None:
                entry["error"] = error
            self._write(entry)

    async def _backward(self, stage: int, request, payloads, prefer=None, exclude=None, insist=None):
        """A backward, with its receipt kept until the server steps it (a dry one adds nothing: no receipt);
        (response, payloads returned, the server's peer id)."""
        response, returned, pid = await self._call(stage, "backward", request, payloads, prefer, exclude, insist)
        if request.dry:
            return response, returned, pid
        receipt = (pid, response.incarnation, response.seq, time.time())
        self._keep_receipt(stage, request, payloads, receipt, response.epoch)
        self.journal.received(request.uid, stage, receipt)
        self.ledger.confirm(pid, response.incarnation, response.stepped_seq)
        return response, returned, pid

    def _hold_receipt(self, stage: int, request, payloads, receipt: tuple[str, int, int, float]) -> None:
        """A receipt an earlier start got for this micro-batch (its journal): into the ledger, settled like ours.
        `request` went dry this time; the receipt keeps it counted, for a replay if its server goes away first."""
        counted = type(request)()
        counted.CopyFrom(request)
        counted.dry = False
        self._keep_receipt(stage, counted, payloads, receipt)

    def _keep_receipt(self, stage: int, request, payloads, receipt: tuple[str, int, int, float], epoch=-1) -> None:
        """Into the ledger: (peer id, incarnation, seq, time answered) of the counted backward `request`, and the
        step it was taken at: the server's (`epoch`, what it answered) as far as it is credible, for the stage's
        step as last read may be a few steps old (peer.trainer.ledger.overdue)."""
        pid, incarnation, seq, heard = receipt
        samples = request.inputs.shape[0] if request.inputs.shape else 1
        step = self.router.stage_step(stage)
        if 0 <= step <= epoch <= step + self.tcfg.receipt_step_slack:
            step = epoch
        self.ledger.add(Receipt(stage, pid, incarnation, seq, request, dict(payloads or {}), samples, heard, step=step))

    def _call_bytes(self, stage: int, method: str, request, sent: int) -> int:
        """Bytes a call moves: its request (`sent` bytes), and the hidden states or input gradients it gets back."""
        returns = (method == "forward" and stage < self.num_stages - 1) or (method == "backward" and stage > 0)
        if not returns or not request.inputs.shape:
            return sent
        rows = math.prod(request.inputs.shape[:2])
        per_element = {tensor_pb2.NONE: 4, tensor_pb2.FP16: 2, tensor_pb2.BF16: 2, tensor_pb2.INT8: 1}[self.codec]
        return sent + rows * self.spec.model.hidden_size * per_element

    def _check_answer(self, stage: int, method: str, request, response, payloads: dict) -> None:
        last = stage == self.num_stages - 1
        if (last and request.HasField("targets")) and not (response.has_loss and math.isfinite(response.loss)):
            raise BadAnswer(f"stage {stage} returned no finite loss")
        expected_shape = list(request.inputs.shape)[:2] + [self.spec.model.hidden_size]
        if method == "forward" and not request.HasField("targets"):
            tensor = codec.decode(response.outputs, self.cfg.server.max_tensor_elements, payloads.get("outputs"))
        elif method == "backward" and stage > 0:
            tensor = codec.decode(
                response.grad_inputs, self.cfg.server.max_tensor_elements, payloads.get("grad_inputs")
            )
        else:
            return
        if list(tensor.shape) != expected_shape or not all_finite(tensor):
            raise BadAnswer(
                f"stage {stage} returned a {method} tensor of shape {list(tensor.shape)} that is wrong or not finite"
            )

"""A trainer's receipts settled: backwards the servers stepped are dropped, those whose server went away
before stepping them are replayed on another replica (peer.trainer.ledger), so every sample counts once.

Settling is a piece of peer.trainer.trainer.Trainer, on the trainer's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

import grpc

from peer.net.client import gone_after
from peer.trainer.calls import MicroBatchFailed
from peer.trainer.ledger import ANY_STEP, Check

logger = logging.getLogger(__name__)


class Settling:
    """Settling and draining the receipts of a Trainer (Trainer inherits it)."""

    # ---- receipts -------------------------------------------------------------------------
    async def settle(self) -> None:
        """Settle receipts the servers stepped; replay those whose server went away without stepping them."""
        async with self._settling:
            try:
                await self._settle()
            except (MicroBatchFailed, grpc.aio.AioRpcError) as e:
                logger.error("settling receipts failed: %s", e)

    async def _settle(self) -> None:
        replay, checks = self.ledger.review(
            self.router, self.tcfg.max_unstepped_steps, self.tcfg.unstepped_grace, self.tcfg.max_unstepped_stage_steps
        )
        verdicts: dict[tuple[int, str, int, int], int | None] = {}  # one look per (stage, server, step)
        for check in checks:
            key = (check.receipt.stage, check.receipt.peer_id, check.receipt.incarnation, check.epoch)
            if key not in verdicts:
                verdicts[key] = await self._covered_by_steps(check)
            covered = verdicts[key]
            if covered is not None and check.receipt.seq <= covered:
                self.journal.stepped(check.receipt.request.uid, check.receipt.stage)
                self.ledger.remove(check.receipt)  # the survivors' step counted it
            elif covered is not None and check.decisive:
                replay.append(check.receipt)
        for receipt in replay:
            logger.warning(
                "stage %d: server %s %s %d samples of ours; replaying them on another replica",
                receipt.stage,
                receipt.peer_id[-8:],
                "went away before stepping"
                if self.router.gone(receipt.peer_id, receipt.incarnation, receipt.heard)
                else f"(avoided now) kept unstepped, while its stage went {self.tcfg.max_unstepped_steps} steps on,",
                receipt.samples,
            )
            gone = {(receipt.peer_id, receipt.incarnation)}  # that process; the same key restarted is welcome
            await self._backward(receipt.stage, receipt.request, receipt.payloads, exclude=gone)
            self.ledger.remove(receipt)
            self.summary.replayed += 1
            self._write({"type": "replay", "stage": receipt.stage, "peer": receipt.peer_id, "time": time.time()})

    async def _covered_by_steps(self, check: Check) -> int | None:
        """How far the survivors' steps counted the gone server's additions (of the receipt's incarnation):
        the last addition covered, -1 for none; None while that is not known yet (the round of
        `check.epoch` has not finished on a survivor, or no replica answers).

        Any step of theirs counts, not only the round's: the gone server may have stepped alone later and
        a partner resynced from it, and a resync or a load inherits the donor's step records."""
        gone, incarnation = check.receipt.peer_id, check.receipt.incarnation
        answered, silent, covered = False, False, -1
        for pid, record in list(self.router.servers[check.receipt.stage].items()):
            try:
                info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2, peer=pid)
            except grpc.aio.AioRpcError as e:
                if pid != gone and not await gone_after(e, record.endpoint, self.cfg.network.probe_timeout):
                    silent = True  # hung (a stopped donor, say), and its steps may hold what we look for
                elif pid != gone:
                    self.router.report_dead(pid)
                continue
            if pid == gone and info.incarnation == incarnation:
                continue  # not gone after all: its own answers settle it
            if pid != gone and check.epoch != ANY_STEP and info.epoch < check.epoch:
                return None  # the round has not finished anywhere yet
            # the same key restarted is asked too: it holds the steps of the state it loaded
            answered = True
            covered = max(covered, _coverage(info.history, gone, incarnation, check.epoch))
        # a survivor hung, or nobody answered: wait. Taking silence for "not counted" would replay what a hung
        # survivor's step holds (counted twice); and a replay needs a replica that answers anyway
        return covered if answered and not silent else None

    async def drain(self) -> None:
        """At the end: wait until every receipt is stepped, replayed, or held by a live server's accumulator."""
        async with self._settling:
            await self._drain()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.tcfg.drain_timeout
        logger.info("draining %d receipts", len(self.ledger))
        while self.ledger.receipts and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self.router.refresh()
            holders = {r.peer_id: r.stage for r in self.ledger.receipts}
            alive = set()
            for pid, stage in holders.items():
                record = self.router.latest.get(pid)
                if record is None:
                    continue
                try:
                    info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2, peer=pid)
                    self.router.report_answer(pid, info.incarnation, info.stepped_seq)
                    # a replica more than a step behind its stage drops what it holds as it catches up (trainers
                    # replay it): not a place to leave receipts in; wait until it stepped them or dropped them
                    newest = max((r.epoch for r in self.router.servers[stage].values()), default=info.epoch)
                    if info.state == "serving" and info.epoch >= newest - 1:
                        alive.add((pid, info.incarnation))
                except grpc.aio.AioRpcError as e:
                    if await gone_after(e, record.endpoint, self.cfg.network.probe_timeout):
                        self.router.report_dead(pid)
            await self._settle()
            if all((r.peer_id, r.incarnation) in alive for r in self.ledger.receipts):
                return  # the rest waits in live accumulators for their next step
            logger.info(
                "settling %d receipts of %d server(s) that went away, or fell behind, before stepping them",
                sum(1 for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive),
                len({r.peer_id for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive}),
            )
            await asyncio.sleep(0.5)
        if self.ledger.receipts:
            logger.warning("%d receipts unsettled after %.0f s", len(self.ledger), self.tcfg.drain_timeout)


def _coverage(history, gone: str, incarnation: int, epoch: int = ANY_STEP) -> int:
    """The last addition of (gone, incarnation) that any step in `history` counted; -1 for none. A step
    `epoch` that lists `gone` as a member without saying what it counted (a peer too old to say) counted
    all that its round took."""
    seqs = [-1]
    for step in history:
        seqs += [p.seq for p in step.coverage if p.peer_id == gone and p.incarnation == incarnation]
        if step.epoch == epoch and gone in step.members and not step.coverage:
            seqs.append(sys.maxsize)
    return max(seqs)

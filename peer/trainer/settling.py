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
from peer.trainer.ledger import Check

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
        replay, checks = self.ledger.review(self.router)
        verdicts: dict[tuple[int, str, int, int], int | None] = {}  # one look per (stage, server, step)
        for check in checks:
            key = (check.receipt.stage, check.receipt.peer_id, check.receipt.incarnation, check.epoch)
            if key not in verdicts:
                verdicts[key] = await self._covered_by_round(check)
            covered = verdicts[key]
            if covered is not None and check.receipt.seq <= covered:
                self.journal.stepped(check.receipt.request.uid, check.receipt.stage)
                self.ledger.remove(check.receipt)  # the survivors' step counted it
            elif covered is not None and check.decisive:
                replay.append(check.receipt)
        for receipt in replay:
            logger.warning(
                "stage %d: server %s went away before stepping %d samples of ours; replaying them on another replica",
                receipt.stage,
                receipt.peer_id[-8:],
                receipt.samples,
            )
            gone = {(receipt.peer_id, receipt.incarnation)}  # that process; the same key restarted is welcome
            await self._backward(receipt.stage, receipt.request, receipt.payloads, exclude=gone)
            self.ledger.remove(receipt)
            self.summary.replayed += 1
            self._write({"type": "replay", "stage": receipt.stage, "peer": receipt.peer_id, "time": time.time()})

    async def _covered_by_round(self, check: Check) -> int | None:
        """How far the survivors' step `check.epoch` counted the gone server's additions (of the receipt's
        incarnation): the last addition it covered, -1 for none; None while that is not known yet."""
        gone, incarnation = check.receipt.peer_id, check.receipt.incarnation
        for pid, record in list(self.router.servers[check.receipt.stage].items()):
            if pid == gone:
                continue
            try:
                info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2)
            except grpc.aio.AioRpcError:
                continue
            if info.epoch < check.epoch:
                return None  # the round has not finished anywhere yet
            for step in info.history:
                if step.epoch != check.epoch or not step.members:
                    continue
                for part in step.coverage:
                    if part.peer_id == gone and part.incarnation == incarnation:
                        return part.seq
                if gone in step.members and not step.coverage:
                    return sys.maxsize  # a peer too old to say: the group counted all the round took
                return -1
        return None if not self.router.servers[check.receipt.stage] else -1

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
            holders = {r.peer_id for r in self.ledger.receipts}
            alive = set()
            for pid in holders:
                record = self.router.latest.get(pid)
                if record is None:
                    continue
                try:
                    info = await self.client.info(record.endpoint, timeout=self.tcfg.deadline_floor * 2)
                    self.router.report_answer(pid, info.incarnation, info.stepped_seq)
                    if info.state == "serving":
                        alive.add((pid, info.incarnation))
                except grpc.aio.AioRpcError as e:
                    if await gone_after(e, record.endpoint, self.cfg.network.probe_timeout):
                        self.router.report_dead(pid)
            await self._settle()
            if all((r.peer_id, r.incarnation) in alive for r in self.ledger.receipts):
                return  # the rest waits in live accumulators for their next step
            logger.info(
                "settling %d receipts of %d server(s) that went away before stepping them",
                sum(1 for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive),
                len({r.peer_id for r in self.ledger.receipts if (r.peer_id, r.incarnation) not in alive}),
            )
            await asyncio.sleep(0.5)
        if self.ledger.receipts:
            logger.warning("%d receipts unsettled after %.0f s", len(self.ledger), self.tcfg.drain_timeout)

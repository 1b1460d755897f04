"""A trainer's receipts for backwards that servers accumulated but have not stepped yet.

A server that dies takes its accumulator with it. So the trainer keeps each backward it sent
(the stage's inputs and output gradients, enough for any replica to recompute it) until the
server says the addition is in a finished optimizer step (`stepped_seq`), and replays it on
another replica if the server goes away first. Where the server was in an averaging round when it
went away, the survivors' step records say how far the round counted its accumulator (each
member's additions up to a seq); only what it did not count is replayed. Every sample is thus
counted once.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from peer.swarm.router import Router
from protocols import stage_pb2

STALE_ROUND = 2.0  # s after which a server's announced round is looked up in its partners' step records
ANY_STEP = -1  # a Check's epoch when no round was announced: any step the survivors hold may have counted it


@dataclass(eq=False)
class Receipt:
    stage: int
    peer_id: str
    incarnation: int
    seq: int
    request: stage_pb2.BackwardRequest  # what to send again on a replay
    payloads: dict
    samples: int
    heard: float  # time.time() the server answered
    nbytes: int = 0  # memory it holds, counted once when the ledger takes it
    step: int = -1  # the step most of the stage's replicas were at when the server took it (-1: unknown)


@dataclass
class Check:
    """A receipt whose server went away during a round: did the round's step `epoch` count it?

    The survivors' step says how far it counted the server's accumulator (its additions up to a
    seq): a receipt up to there is settled, one past it is replayed."""

    receipt: Receipt
    epoch: int  # the step the round made, if it succeeded; ANY_STEP: whichever step of the survivors counted it
    decisive: bool  # the server is gone: "not in the group" means replay (else it only may settle early)


def overdue(receipt: Receipt, router: Router, max_unstepped: int, stage_steps: int) -> bool:
    """Whether a live server kept `receipt` unstepped while it went `max_unstepped` steps past the step its stage
    was at when it took it, by its own record (its step and what it says is stepped, read together: an honest
    server's step two on has stepped it), or while its stage went `stage_steps` on (whatever it says of its own
    step; the slack covers records read late while the stage steps fast). It does not step what it takes, or
    says it does not. The server is banned; the receipt is for replaying."""
    if max_unstepped <= 0 or receipt.step < 0:
        return False
    record = router.last.get((receipt.peer_id, receipt.incarnation))
    own = record is not None and record.epoch >= receipt.step + max_unstepped and record.stepped_seq < receipt.seq
    if not own and router.stage_step(receipt.stage) < receipt.step + max(stage_steps, max_unstepped):
        return False
    router.ban(receipt.peer_id)
    return True


class Ledger:
    def __init__(self, on_empty=None, on_stepped=None) -> None:
        self.receipts: list[Receipt] = []
        self.nbytes = 0  # memory the kept requests hold
        self.held: Counter[str] = Counter()  # micro-batch uid -> its receipts kept
        self.on_empty = on_empty or (lambda uid: None)  # called with a uid whose last receipt went
        self.on_stepped = on_stepped or (lambda receipt: None)  # called with a receipt its server stepped

    def __len__(self) -> int:
        return len(self.receipts)

    def add(self, receipt: Receipt) -> None:
        receipt.nbytes = receipt.request.ByteSize() + sum(len(memoryview(p)) for p in receipt.payloads.values())
        self.receipts.append(receipt)
        self.nbytes += receipt.nbytes
        self.held[receipt.request.uid] += 1

    def confirm(self, peer_id: str, incarnation: int, stepped_seq: int) -> None:
        """A server said its additions up to `stepped_seq` are stepped: those receipts are done."""
        kept, done = [], []
        for r in self.receipts:
            stepped = r.peer_id == peer_id and r.incarnation == incarnation and r.seq <= stepped_seq
            (done if stepped else kept).append(r)
        if done:
            self.receipts = kept
            self.nbytes -= sum(r.nbytes for r in done)
            for receipt in done:
                self.on_stepped(receipt)
                self._release(receipt)

    def review(
        self, router: Router, max_unstepped: int = 0, grace: float = 0.0, stage_steps: int = 0
    ) -> tuple[list[Receipt], list[Check]]:
        """Settle what the router's records allow; return (receipts to replay, receipts to check with survivors).
        A receipt its live server left unstepped while it went `max_unstepped` steps on (or its stage
        `stage_steps`) is replayed too, and the server banned (`overdue`), once it is `grace` s old."""
        replay, check = [], []
        for (peer_id, incarnation), record in list(router.last.items()):
            self.confirm(peer_id, incarnation, record.stepped_seq)
        for (peer_id, incarnation), stepped_seq in list(router.answered.items()):
            self.confirm(peer_id, incarnation, stepped_seq)
        now = time.time()
        for r in self.receipts:
            last = router.last.get((r.peer_id, r.incarnation))
            in_round = last is not None and last.averaging_epoch >= 0 and r.seq <= last.round_seq
            if not router.gone(r.peer_id, r.incarnation, r.heard):
                if now - r.heard >= grace and overdue(r, router, max_unstepped, stage_steps):
                    replay.append(r)
                    continue
                if in_round and now - last.updated > STALE_ROUND:
                    # its round went quiet: if the survivors' step has it in the group, that settles it now,
                    # while their step records still reach back that far
                    check.append(Check(r, last.averaging_epoch + 1, decisive=False))
                continue
            # in a round: its step says; else the server may have stepped alone after its last record, and a
            # partner resynced from it since (so holds that step): the survivors' step records say either way
            check.append(Check(r, last.averaging_epoch + 1 if in_round else ANY_STEP, decisive=True))
        return replay, check

    def remove(self, receipt: Receipt) -> None:
        if receipt in self.receipts:
            self.receipts.remove(receipt)
            self.nbytes -= receipt.nbytes
            self._release(receipt)

    def _release(self, receipt: Receipt) -> None:
        uid = receipt.request.uid
        self.held[uid] -= 1
        if self.held[uid] <= 0:
            del self.held[uid]
            self.on_empty(uid)

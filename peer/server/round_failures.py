"""Partners whose word failed this replica's averaging rounds, and which are left out of them for now.

One member's word alone ends a member's round in two cases: an owner's verdict that it already stepped this round
(peer.server.allreduce), which a member must believe then (stepping the round again would count its gradients
twice), and any owner's failed verdict that comes after the member's own slice's average went out (another member
may hold every ok verdict of that attempt: running another would put two averages at one step). It is checked afterwards against something the claimant cannot take back: a partner that stepped is ahead
at the next round's invitation. One that answers at the step it claimed to have left failed that round on a false
word; after `max_failed_rounds` of those in a row it is left out of this replica's rounds (not invited, its
invitations declined, its Average calls refused) for a while, doubling each time. Every other word of a member
that would end a round (a verdict naming us lost or a group without us, a give-up naming us) makes the member that
said it the one lost instead (peer.server.allreduce). A round that steps with a partner clears it. A partner
proven to lie (peer.server.slice_word) is left out at once, for the longest ban."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)
MAX_TRACKED = 1024  # partners whose claims and failures are kept (the oldest go first)


class RoundFailures:
    """Per partner: the step it last claimed to have stepped, its false claims in a row, and until when it is
    left out (monotonic s)."""

    def __init__(self, max_failed_rounds: int, ban: float, max_ban: float):
        self.max_failed_rounds, self.ban, self.max_ban = max_failed_rounds, ban, max_ban
        self._claims: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._failed: dict[str, tuple[int, float]] = {}

    def claimed_stepped(self, peers: Iterable[str], epoch: int) -> None:
        """These owners said they stepped the round for `epoch` (ours failed on their word)."""
        for peer in peers:
            self._claims.pop(peer, None)
            self._claims[peer] = epoch
            while len(self._claims) > MAX_TRACKED:
                self._claims.popitem(last=False)

    def check(self, answered: dict[str, int], epoch: int) -> None:
        """Partners' answers (their steps) to our invitation to the round for `epoch`: one that said it stepped
        `epoch` and answers at it, or before, said what was not so."""
        for peer, step in answered.items():
            claimed = self._claims.pop(peer, None)
            if claimed == epoch and step <= claimed:
                self._failed_round(peer, f"said it stepped {claimed} and is at {step}")

    def _failed_round(self, peer: str, why: str) -> None:
        if peer not in self._failed and len(self._failed) >= MAX_TRACKED:
            self._failed.pop(next(iter(self._failed)))
        n = self._failed.get(peer, (0, 0.0))[0] + 1
        doubled = self.ban * 2 ** min(n - self.max_failed_rounds, 32)  # left out again: twice as long, to max_ban
        ban = min(doubled, self.max_ban) if n >= self.max_failed_rounds else 0.0
        self._failed[peer] = (n, time.monotonic() + ban if ban else 0.0)
        logger.warning(
            "averaging: %s %s: %d round(s) in a row failed on its word%s",
            peer,
            why,
            n,
            f"; left out of this replica's rounds for {ban:.0f} s" if ban else "",
        )

    def caught(self, peer: str, why: str) -> None:
        """A partner proven to lie (two averages of one slice under its signature, or a digest its owner never
        signed: peer.server.slice_word): left out at once, for `max_ban`."""
        if peer not in self._failed and len(self._failed) >= MAX_TRACKED:
            self._failed.pop(next(iter(self._failed)))
        n = max(self._failed.get(peer, (0, 0.0))[0] + 1, self.max_failed_rounds)
        self._failed[peer] = (n, time.monotonic() + self.max_ban)
        logger.warning("averaging: %s; left out of this replica's rounds for %.0f s", why, self.max_ban)

    def stepped(self, members: Iterable[str]) -> None:
        """A round stepped with these members: their failures are forgotten."""
        for peer in members:
            self._failed.pop(peer, None)

    def left_out(self, peer: str) -> bool:
        return self._failed.get(peer, (0, 0.0))[1] > time.monotonic()

"""Which steps of its part's other replicas a replica (peer.server.replica) believes: a step more than a few
past the one most replicas are at is nobody's (`_credible`), a step one replica alone is ahead at is its own
word when there are three or more (`_backed_only`), and a donor that failed to send the state of the step it
claimed is struck (`_strike`). A replica whose lone step set it apart from a group that stepped on takes the
group's state (`_rejoin`).

StepBelief is a piece of Replica, on the replica's event loop."""

from __future__ import annotations

import logging
import time

from dht.records import ServerRecord
from peer.swarm.consensus import agreed, backed, credible_limit

logger = logging.getLogger(__name__)


class StepBelief:
    """What a Replica believes of its partners' steps (Replica inherits it)."""

    def _step_limit(self) -> int:
        """The furthest step a replica of this part is believed at: server.max_resync_jump past the one most of them
        (this one too, when it serves and has not been stopped since it last loaded) are at."""
        steps = [
            r.epoch
            for pid, r in self.peers.items()
            if r.state == "serving" and pid not in self._distrusted and r.updated > self._unresponsive.get(pid, -1.0)
        ]
        if self.state == "serving" and not self.paused:
            steps.append(self.runtime.epoch)
        return credible_limit(steps, self.cfg.server.max_resync_jump)

    def _backed_only(self, records: list[ServerRecord]) -> list[ServerRecord]:
        """`records` less those ahead of this replica at a step that fewer than half of the part's serving replicas
        have reached (peer.swarm.consensus.agreed; this one counted at its own step, each other at its record's
        step, or as `records` say, fresher; one that did not answer an invitation still counts, so that a replica
        cannot leave the count by being silent once). A step one replica alone is ahead at, beside two others or
        more, is its own word: following it (waiting for it, loading its state) let one hostile replica claim a
        step further each time the others loaded it, so that they never stepped, went back to the weights it
        sent, or were led to the run's last step. Of two replicas, either is half; a replica just stopped (it did
        not see what the others did meanwhile) follows a credible step as before (`_credible`, `_strike`)."""
        steps = {pid: r.epoch for pid, r in self.peers.items() if r.state == "serving" and pid not in self._distrusted}
        steps.update((r.owner, r.epoch) for r in records if r.owner in steps)
        steps[self.dht.peer_id] = self.runtime.epoch
        if self.paused:
            return records
        limit = max(agreed(steps.values()), self.runtime.epoch)
        for r in records:
            if r.epoch > limit:
                _say_once(
                    self._lone,
                    r,
                    "%s: %s is alone at step %d, ahead of most replicas (at %d): not followed",
                    self.label,
                    limit,
                )
        return [r for r in records if r.epoch <= limit]

    def _ahead_unfollowed(self, epoch: int, answers: dict) -> bool:
        """Whether a replica that is not struck claims (in its record, or in its answer to our invitation) a step
        past `epoch` that this one does not follow (`_backed_only`): this replica must not step alone then (it
        would step apart from it, for good, if it is honest); it waits for a partner, or for the claim to be
        backed, struck, or gone (its record's end)."""
        claims = {pid: r.epoch for pid, r in self.peers.items() if r.state == "serving"}
        claims.update((pid, a.epoch) for pid, a in answers.items() if not isinstance(a, BaseException))
        return any(
            step > epoch and pid not in self._distrusted and not self._struck(pid) for pid, step in claims.items()
        )

    def _credible(self, records: list[ServerRecord]) -> list[ServerRecord]:
        """Those of `records` whose step is within server.max_resync_jump of the one most replicas of the part
        (this one too, when it serves) are at (peer.swarm.consensus); the others are said once."""
        records, limit = [r for r in records if r.owner not in self._distrusted], self._step_limit()
        agreed_at = limit - self.cfg.server.max_resync_jump
        for r in records:
            if r.epoch > limit:
                message = "%s: %s claims step %d, which most replicas do not back (they are at %d): not believed"
                _say_once(self._doubted, r, message, self.label, agreed_at)
        return [r for r in records if r.epoch <= limit]

    def _lone_since(self) -> int | None:
        """The first step this replica took alone since it last loaded a state (None: none): its weights may have
        been apart from every other replica's since then."""
        me = self.dht.peer_id
        return min(
            (h.epoch for h in self.runtime.history if h.members == [me] and h.epoch > self._rejoined), default=None
        )

    def _apart_alone(self) -> list[ServerRecord]:
        """The replicas to take the state of when this replica stepped alone (nobody answered its invitation)
        since it last loaded a state, and at least two others, more than half of the part's serving ones with it,
        are now at its step or past it, each after a step in a group: they did not follow a step only this one
        took (`_backed_only`), so its weights went apart from theirs for good (replicas average gradients, not
        weights). Empty otherwise, and after one try a step (`_rejoin`)."""
        rt = self.runtime
        if self.paused or self._rejoin_tried >= rt.epoch:
            return []
        if self._lone_since() is None:
            return []
        serving = [
            r
            for r in self._credible([r for r in self.peers.values() if r.state == "serving"])
            if not self._struck(r.owner) and r.updated > self._unresponsive.get(r.owner, -1.0)
        ]
        there = [r for r in serving if r.epoch >= rt.epoch and r.last_round > 1]
        if len(there) < 2 or 2 * len(there) <= len(serving) + 1:
            return []
        step = backed(r.epoch for r in there)
        return [r for r in there if r.epoch == step]

    async def _rejoin(self, donors: list[ServerRecord]) -> None:
        """Take the state of `donors` (`_apart_alone`), once a step: what this replica's lone steps put in its
        weights alone is lost (their samples were counted as stepped)."""
        alone, at = self._lone_since(), self.runtime.epoch
        logger.warning(
            "%s: stepped alone at step %d; takes the state of %d replicas that stepped on in a group (what its lone "
            "steps put in its weights alone is lost)",
            self.label,
            alone,
            len(donors),
        )
        self.stepping = True
        try:  # its reach bound counts its lone steps (`_apart`); gradients of weights steps old go, as in a resync
            if await self._load_from(donors, attempts=1) and self.runtime.epoch - at > 1:
                await self.run_torch(self._drop_stale, at)
        finally:
            self.stepping, self._rejoin_tried = False, at  # once a step, loaded or not

    def _strike(self, r: ServerRecord) -> None:
        """The donor that led a resync failed to send a state of its step that loads: asked again after
        server.donor_ban s, doubling with each failure in a row; after server.donor_strikes in a row, its claim
        to be ahead no longer counts (`_struck`), in its record or in its answers (`_round`). Forgotten once it is
        gone, or after a while without a new strike (`_forget_strikes`)."""
        server = self.cfg.server
        if r.owner not in self._donor_strikes and len(self._donor_strikes) >= 1024:
            return
        n = self._donor_strikes.get(r.owner, (0, 0.0))[0] + 1
        ban = min(server.donor_ban * 2 ** min(n - 1, 16), server.max_donor_ban)
        self._donor_strikes[r.owner] = (n, time.monotonic() + ban)
        if n == server.donor_strikes:
            logger.warning(
                "%s: %s failed to send its state %d times in a row: its step no longer counts until one loads",
                self.label,
                r.owner or r.endpoint,
                n,
            )

    def _struck(self, pid: str) -> bool:
        """Whether peer `pid` failed to send its state server.donor_strikes times in a row (and none loaded since)."""
        return self._donor_strikes.get(pid, (0, 0.0))[0] >= self.cfg.server.donor_strikes

    def _forget_strikes(self) -> None:
        """A struck donor starts anew once it is gone (no serving record), or once it was not struck again for
        server.max_donor_ban s after its last ban ended. Not merely because its record is no longer ahead: a
        peer can keep its record level and claim to be ahead in its Round answers only (each answer aborted the
        round and started a resync that failed, and its strikes went at the next look)."""
        now = time.monotonic()
        for pid in list(self._donor_strikes):
            r, (_, ban_until) = self.peers.get(pid), self._donor_strikes[pid]
            if r is None or r.state != "serving" or now > ban_until + self.cfg.server.max_donor_ban:
                del self._donor_strikes[pid]


def _say_once(said: set[str], r: ServerRecord, message: str, label: str, step: int) -> None:
    """Warn `message` (label, the claimant, its step, `step`) of a claim not believed, once per claimant: `said`
    holds those already named, at most 1024 (then it starts again)."""
    if r.owner in said:
        return
    if len(said) > 1024:
        said.clear()
    said.add(r.owner)
    logger.warning(message + " (said once)", label, r.owner or r.endpoint, r.epoch, step)


def forget_own_steps(runtime, since: int) -> None:
    """Torch thread: after a replica that went apart at step `since` took its partners' state, its own fingerprints
    of the steps from `since` on (before the loaded one) are of weights it no longer holds: unknown (empty) now,
    never compared with the partners' of those steps."""
    for step in runtime.history:
        if since <= step.epoch < runtime.epoch:
            step.values = []

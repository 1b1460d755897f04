"""The last server of a part hands its state over as it leaves (peer.server.replica).

A replica that leaves while no other serving replica holds its part at its step would take the
part's training since the last checkpoint with it. When the coordinator keeps checkpoints (its
`trained` or `archive` record of the part says `takes_handover`), the replica keeps announcing
itself as `leaving` and keeps answering GetState, and the coordinator, seeing a part whose only
holders are leaving, checkpoints at once (peer.coordinator.coordinator). The replica goes once the
coordinator offers a copy at its step (an `archive` record), or after `server.handover_timeout`.
A joiner may also load a leaving last server's state meanwhile. A SIGKILL leaves no time for any of
this: the part then goes back to the newest checkpoint, and the books say what that lost.

Handover is a piece of Replica, on the replica's event loop."""

from __future__ import annotations

import asyncio
import logging
import time

from peer.process.status_lines import say

logger = logging.getLogger(__name__)
HANDOVER_LOOK = 1.0  # s between looks at the DHT (and announcements as 'leaving') while handing over


class Handover:
    """A leaving Replica's hand-over of its part's state (Replica inherits it)."""

    def fed(self, peer: str, epoch: int) -> None:
        """`peer` took (a shard of) this replica's state of step `epoch`: a joiner that holds it now."""
        if peer:
            self._fed.pop(peer, None)
            self._fed[peer] = epoch
            while len(self._fed) > 64:
                self._fed.pop(next(iter(self._fed)))

    def _held_elsewhere(self) -> bool:
        """Whether the coordinator offers a copy of the part at this step or later (an `archive` record, which
        only the coordinator may publish: dht.records), or a replica that made this replica's last step with it
        (a member of that step's group, so it holds what this one holds) or took this step's state from it
        serves at this step or later. Any other replica's claim to be there is its word alone: a stranger's
        record must not send the last holder away."""
        epoch = self.runtime.epoch
        if any(r.state == "archive" and r.epoch >= epoch for r in self.peers.values()):
            return True
        last = next((f for f in reversed(self.runtime.history) if f.epoch == epoch), None)
        partners = set(last.members if last is not None else ()) - {self.dht.peer_id}
        partners |= {pid for pid, step in self._fed.items() if step == epoch}
        serving = [r for r in self.peers.values() if r.state == "serving" and r.epoch >= epoch and r.owner in partners]
        return bool(self._credible(serving))

    async def hand_over(self) -> None:
        """Leaving: if this is the last holder of the part's current state, wait (up to server.handover_timeout)
        until the coordinator's checkpoint holds it."""
        timeout = self.cfg.server.handover_timeout
        if timeout <= 0 or self.runtime.epoch == 0 or self.state != "serving":
            return
        await self.refresh_peers()
        if self._held_elsewhere():
            # replicas told to leave together each see the others serving at first: look again once their
            # 'leaving' is out
            await asyncio.sleep(HANDOVER_LOOK)
            await self.refresh_peers()
            if self._held_elsewhere():
                return
        if not any(r.takes_handover for r in self.peers.values()):
            logger.warning(
                "%s: the last server of it leaves at step %d and the coordinator keeps no checkpoints: a newcomer "
                "starts it from an older state (or waits for one)",
                self.label,
                self.runtime.epoch,
            )
            return
        say(
            f"{self.label.capitalize()}: the last server of it is leaving; waiting up to {timeout:g} s for the "
            f"coordinator to checkpoint its state (step {self.runtime.epoch})."
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(HANDOVER_LOOK)
            await self.publish(force=True)  # still 'leaving': the coordinator sees whose state to take
            await self.refresh_peers()
            if self._held_elsewhere():
                say(f"{self.label.capitalize()}: its state (step {self.runtime.epoch}) is held; leaving.")
                return
            if not any(r.takes_handover for r in self.peers.values()):
                logger.warning("%s: the coordinator is stopping and takes no handover; leaving", self.label)
                return
        logger.warning(
            "%s: the coordinator did not checkpoint its state within %g s (server.handover_timeout); leaving "
            "anyway: a newcomer starts it from the newest checkpoint",
            self.label,
            timeout,
        )

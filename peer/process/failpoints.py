"""Failpoints: named places where a test makes a real process fail on purpose, the way a busy DHT or a
full disk would, to check what follows (as etcd's gofail and TiKV's fail-rs do).

They are off unless the process's environment names them: SWARMTRAIN_FAILPOINTS="round.announce=3"
makes the next 3 passes through `round.announce` fail, and later ones pass. Each Failpoints reads the
environment once, when it is made; nothing is shared between the objects that hold one.

The places: `round.announce`, a replica's publish of the record that says what its round covers
(peer.server.replica_round): the DHT refuses it, while everything else works; `round.invite`, a replica's
invitations to a round of its own (peer.server.replica_round): none reaches a partner, as if none answered;
`backward.unanswered`, a stage server's first answer to a backward it counted (peer.server.servicer): it is held
until the caller's deadline has passed, as when the server is frozen (SIGSTOP) between adding a backward and
answering.
"""

from __future__ import annotations

import logging
import os

from dht.errors import UserError

logger = logging.getLogger(__name__)
ENV = "SWARMTRAIN_FAILPOINTS"
NAMES = ("round.announce", "round.invite", "backward.unanswered")


class FailpointError(UserError, ValueError):
    """SWARMTRAIN_FAILPOINTS names an unknown place or gives no count."""


class Failpoints:
    def __init__(self, spec: str = "") -> None:
        self.left = parse(spec)  # name -> passes that still fail

    @classmethod
    def from_env(cls) -> Failpoints:
        return cls(os.environ.get(ENV, ""))

    def fails(self, name: str) -> bool:
        """Whether this pass through `name` fails (and one fewer of the next ones will)."""
        if self.left.get(name, 0) <= 0:
            return False
        self.left[name] -= 1
        logger.warning("failpoint %s: failing on purpose (%s); %d more", name, ENV, self.left[name])
        return True


def parse(spec: str) -> dict[str, int]:
    """ "a=3,b=1" -> {"a": 3, "b": 1}; FailpointError names what is wrong."""
    left = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        if name not in NAMES:
            raise FailpointError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(NAMES)})")
        if not count.isdigit():
            raise FailpointError(f"{ENV}: {item!r} needs a count of failing passes, as {name}=3")
        left[name] = int(count)
    return left

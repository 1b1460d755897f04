"""When a peer refreshes one of its DHT records, and for how long each refresh lives.

While a record changes, it is refreshed every `network.announce_period` and lives `network.record_ttl`.
While it does not (a peer at rest), the period doubles at each unchanged refresh up to
`network.rest_announce_period`, and the record lives that much longer (the same margin over its period as
at the short one), so a resting peer costs a DHT store a rest period, not one every announce period. A
change makes the period short again. A refresh never shortens what the DHT holds: hivemind refuses a
store whose expiration is earlier than the one stored, so a short lifetime after a long one is stretched
to the long one's end.

Readers judge a record's age by the lifetime it states (`lifetime`), bounded by the longest an honest
peer may state: a record cannot make itself live longer than a resting one.
"""

from __future__ import annotations

import time

from peer.config.settings import NetworkConfig


def longest_ttl(net: NetworkConfig) -> float:
    """The longest lifetime an honest record states: that of a refresh at the rest period."""
    return net.record_ttl + max(0.0, net.rest_announce_period - net.announce_period)


def lifetime(stated: float, net: NetworkConfig) -> float:
    """How long a reader lets a record live from its `updated`: what it states (0: an older peer, which
    states none), never under record_ttl nor over longest_ttl."""
    return min(max(stated, net.record_ttl), longest_ttl(net))


class Cadence:
    """One record's refresh period and lifetime (module docstring)."""

    def __init__(self, net: NetworkConfig):
        self.net = net
        self.period = net.announce_period  # s until the next refresh is due
        self._held_until = 0.0  # unix time the DHT holds our last stored refresh until

    def next_period(self, changed: bool) -> float:
        """The period after a refresh: short if its record changed, else doubled up to the rest period."""
        rest = max(self.net.rest_announce_period, self.net.announce_period)
        return self.net.announce_period if changed else min(2 * self.period, rest)

    def ttl(self, changed: bool, now: float | None = None) -> float:
        """The lifetime of a refresh stored now: record_ttl's margin over the period it will wait (the next
        one), stretched to what the DHT already holds."""
        now = time.time() if now is None else now
        own = self.net.record_ttl + self.next_period(changed) - self.net.announce_period
        return min(max(own, self._held_until - now), longest_ttl(self.net))

    def stored(self, ttl: float, changed: bool, now: float | None = None) -> None:
        """A refresh of `ttl` s was stored; `changed`: its record differed from the one refreshed before."""
        now = time.time() if now is None else now
        self._held_until = max(self._held_until, now + ttl)
        self.period = self.next_period(changed)

    def wake(self) -> None:
        """Activity: refresh at the announce period again."""
        self.period = self.net.announce_period

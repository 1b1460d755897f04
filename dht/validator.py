"""A hivemind record validator: records under a signed subkey must carry their owner's signature."""

from __future__ import annotations

import json

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from dht import envelope, keys

MAX_OWNERS_SEEN = 4096  # owners remembered per watched key (a stranger's flood of keys only wakes the watcher)


class SignedRecordValidator(RecordValidatorBase):
    """Rejects a record whose subkey names a peer (`swt:<peer id>`) unless that peer signed it.

    The signature covers the key's DHT id, the subkey, the expiration time and the payload, so a
    record cannot be moved to another key, another owner, or a later expiry. Records under other
    subkeys (hivemind's own matchmaking entries) pass through; Swarmtrain's readers ignore them.
    """

    def __init__(self, watched: dict | None = None, arrivals: dict | None = None):
        # DHT key id -> a multiprocessing Event (made before the DHT process forks) set whenever a validly signed
        # record under that key arrives at this node: its owner hears of a store without polling (dht.node.touched)
        self.watched = watched or {}
        # DHT key id -> an Event set when a validly signed record arrives under that key from an owner not seen under
        # it before (a peer that joined), or one whose `state` changed (a server leaving): the coordinator looks at
        # the swarm then, not on every refresh
        self.arrivals = arrivals or {}
        # key id -> owner -> the `state` its last record said (bounded: MAX_OWNERS_SEEN owners a key)
        self._owners: dict[bytes, dict[str, object]] = {}

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False)
        except Exception:  # untrusted bytes: whatever msgpack raises, the subkey is not ours
            return True  # not a subkey of ours: leave it to hivemind
        owner = keys.owner_of_subkey(subkey)
        if owner is None:
            return True
        try:
            value = msgpack.unpackb(record.value, raw=False)  # hivemind serializes the stored value once more
        except Exception:  # untrusted bytes: whatever msgpack raises, the record is refused
            return False
        if not isinstance(value, bytes):
            return False
        payload = envelope.open_envelope(owner, record.key, record.subkey, record.expiration_time, value)
        if payload is not None and (event := self.watched.get(record.key)) is not None:
            event.set()
        if payload is not None and (event := self.arrivals.get(record.key)) is not None:
            self._arrived(record.key, owner, payload, event)
        return payload is not None

    def _arrived(self, key_id: bytes, owner: str, payload: bytes, event) -> None:
        """Set `event` when `owner` is new under the key, or its record's `state` changed (a server leaving)."""
        try:
            state = json.loads(payload).get("state")
        except Exception:  # a signed payload that is not a JSON object: its readers refuse it, no event
            return
        seen = self._owners.setdefault(key_id, {})
        if owner not in seen or seen[owner] != state:
            if owner not in seen and len(seen) >= MAX_OWNERS_SEEN:
                seen.clear()  # forgotten: a known owner may set the event once more
            seen[owner] = state
            event.set()

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)

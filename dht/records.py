"""Typed, versioned DHT records. Unknown fields are ignored so older and newer peers read each other.

A record is a peer's word about itself: readers do arithmetic on its numbers (routing weights, expiry times, the
books), so no float of a record may be NaN or infinite (`allow_inf_nan`), and amounts may not be negative; a
record that breaks either is ignored like any malformed one (dht.node). Losses alone may be NaN (a run that
diverged says so).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

Amount = Annotated[float, Field(ge=0)]  # a rate, a count or a duration: finite (as every float here), not negative
Loss = Annotated[float | None, Field(allow_inf_nan=True)]  # may be NaN: what a diverged run measures


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    # the peer id that signed the record, set by the reader (never read from the record's own fields): a caller
    # pins this peer's TLS name when it dials the record's endpoint
    _owner: str = PrivateAttr(default="")

    @property
    def owner(self) -> str:
        return self._owner

    @owner.setter
    def owner(self, peer_id: str) -> None:
        self._owner = peer_id

    def writers(self) -> frozenset[str]:
        """The roles whose credential lets a peer publish this record (readers drop it from any other role;
        the coordinator, the run's authority, may publish any). None but the coordinator by default."""
        return frozenset()

    version: int = 1  # bumped when a field changes meaning; readers ignore fields they do not know
    # the software that wrote the record (the swarmtrain release; set when a record is stored); "" from
    # peers older than this field
    software: str = ""


class RunSpecRecord(Record):
    """The run spec as the coordinator published it (a JSON-able dict, validated by the runtime)."""

    spec: dict[str, Any]
    coordinator_maddrs: list[str] = Field(default_factory=list)  # where the coordinator's DHT node listens
    published: float = 0.0  # unix time of publication


COORDINATOR_STATES = ("archive", "trained")  # ServerRecord states only the coordinator may publish


class ServerRecord(Record):
    """A replica's announcement (a stage server, or one expert of an expert host): where, how fast, which step."""

    stage: int  # the stage served; for an expert, the stage whose block holds its layer
    expert: str = ""  # "layer.index" for an expert of a mixture-of-experts layer; empty for a stage
    endpoint: str  # host:port of its gRPC server, as others should dial it
    throughput: Amount  # measured samples/s for forward+backward
    load: Amount = 0.0  # requests running or queued
    # optimizer steps taken by this part (local averaging mode: outer steps); replicas average at equal epochs
    epoch: int = 0
    step: int = 0  # training steps: the epoch, or in local mode the inner steps of all outer steps so far
    samples: int = 0  # samples accumulated since the last step
    samples_stepped: int = 0  # samples accounted by finished steps
    samples_averaging: int = 0  # samples taken out of the accumulator for the round under way
    averaging_epoch: int = -1  # the epoch this server is averaging for right now, else -1
    # joining (loading state, not routed to), serving, leaving (finishing its work, not routed to),
    # left (gone for good: the accumulator additions after stepped_seq were never stepped)
    state: str = "serving"
    incarnation: int = 0  # changes when the server drops its accumulator; receipts of another one are void
    stepped_seq: int = 0  # accumulator additions (backwards) of this incarnation in a finished step
    round_seq: int = 0  # while averaging_epoch >= 0: the additions that round covers if it succeeds
    started: float = 0.0  # unix time the server started
    updated: float = 0.0  # unix time of this announcement
    ttl: Amount = 0.0  # s this announcement lives from `updated` (longer at rest: peer.net.cadence); 0: record_ttl
    metrics: str = ""  # host:port of its Prometheus metrics (/metrics); empty: none
    requests: int = 0  # requests this peer served (all its parts together)
    errors: int = 0  # of those, the ones answered with an error
    dht: list[str] = Field(
        default_factory=list
    )  # this peer's DHT multiaddrs (a restarted coordinator rejoins through them)
    tp: int = 1  # tensor-parallel ranks the part is split over inside this peer
    devices: list[str] = Field(default_factory=list)  # torch devices it runs on, one per rank
    last_round: int = 0  # members of its last finished step: 1 alone, more averaged together; 0 none yet
    last_round_seconds: Amount = 0.0  # how long that step's round took
    rounds_failed: int = 0  # averaging rounds that failed (their samples waited for the next one)

    def writers(self) -> frozenset[str]:
        # a part's `archive` (a checkpoint offered) and `trained` (the step it reached) and the offer to take a
        # last server's handover are the coordinator's word: a server's record saying so counts nowhere
        if self.state in COORDINATOR_STATES or self.takes_handover:
            return frozenset()
        return frozenset({"experts"}) if self.expert else frozenset({"server"})

    moving_to: int = -1  # the stage this server means to move to (load balancing), else -1
    moving_since: float = 0.0  # unix time it announced that; the earliest such claim of a stage goes first
    relay: str = ""  # peer id of the relay that carries its calls (it cannot be dialled: NAT); empty: direct
    # per parameter, its sum then its sum of squares after step `epoch`, then those of its optimizer state (empty:
    # not known): replicas at one epoch must agree (peer.model.fingerprint)
    fingerprint: list[float] = Field(default_factory=list)
    # the coordinator's `trained` and `archive` records: it checkpoints a part at once when its last server
    # leaves, and that server waits for it (peer.server.replica_handover)
    takes_handover: bool = False
    # caller peer id -> samples of its backwards this server counted (the rows that arrived; the callers that
    # called last, at most server.max_counted_callers): the coordinator's books hold each trainer's own word on
    # what it completed to this (peer.swarm.books). Empty without admission (callers unknown)
    counted: dict[str, int] = Field(default_factory=dict)


class TrainerRecord(Record):
    """A trainer's announcement: what it has done so far."""

    samples: int = 0  # micro-batch samples completed (forward and backward through every stage)
    inflight: int = 0  # samples of the micro-batches under way (some stages may hold their backwards already)
    # [start time, samples completed] of this peer's earlier starts as a trainer (its journal): one that was
    # killed announced fewer than it completed
    predecessors: list[tuple[float, float]] = Field(default_factory=list)
    replaying: list[int] = Field(default_factory=list)  # per stage: samples whose server went away unstepped
    micro_batches: int = 0
    samples_per_second: Amount = 0.0
    train_loss: Loss = None  # recent mean training loss
    val_loss: Loss = None  # last validation loss (nats per token), if this trainer evaluates
    val_bits_per_byte: Loss = None  # the same validation in bits per byte of text (across tokenizers)
    epoch: int = 0  # highest stage training step seen
    failed_calls: int = 0  # calls that failed (each rerouted)
    bans: int = 0  # servers banned after a failed call, so far
    banned: list[str] = Field(default_factory=list)  # endpoints of the servers it has banned right now
    bytes_sent: int = 0  # bytes of its calls' requests (activations, gradients, targets)
    bytes_received: int = 0  # bytes of the answers
    metrics: str = ""  # host:port of its Prometheus metrics (/metrics); empty: none
    started: float = 0.0
    updated: float = 0.0

    def writers(self) -> frozenset[str]:
        return frozenset({"trainer"})


class RelayRecord(Record):
    """A reachable peer's offer to relay for peers that cannot be dialled (peer.net.relay), with its load."""

    endpoint: str  # host:port of its gRPC server with the Relay service
    relayed: int = 0  # peers it carries now
    capacity: int = 0  # the most it carries (relay.max_peers)
    connections: int = 0  # connections it forwards now (all relayed peers together)
    bytes_relayed: int = 0  # bytes forwarded so far, both ways
    rate: float = 0.0  # bytes/s forwarded recently, both ways
    role: str = ""  # what else this peer is: coordinator, server, experts, or relay alone
    updated: float = 0.0

    def writers(self) -> frozenset[str]:
        return frozenset({"relay", "server", "experts"})


class CredentialRequest(Record):
    """A peer asks the coordinator for a credential: its TLS key, bound to its identity by `proof`."""

    tls_key: str  # hex of the DER SubjectPublicKeyInfo of its P-256 TLS key
    roles: list[str]  # what it will do: server, experts, trainer
    nonce: str  # hex, fresh per request: names the request and is signed by the proof
    proof: str  # hex of the identity key's signature over the TLS key and the nonce (dht.credential)
    invite: str = ""  # invite mode: the public id of its invite code
    invite_mac: str = ""  # hex HMAC of the code's secret over peer id, TLS key and nonce: the secret stays private


class CredentialGrant(Record):
    """The coordinator's answer to a credential request."""

    nonce: str  # the request's
    certificate: str = ""  # PEM of the peer's certificate; empty when refused
    authority: str = ""  # PEM of the run's CA certificate (self-signed by the coordinator's key)
    error: str = ""  # why the request was refused


class RevocationList(Record):
    """Peers the coordinator revoked: their credentials no longer count anywhere."""

    peers: list[str] = Field(default_factory=list)
    updated: float = 0.0


class SpotCheckReport(Record):
    """A trainer's report of servers its spot checks found in the minority (wrong answers)."""

    wrong: dict[str, int] = Field(default_factory=dict)  # peer id -> spot checks it failed
    caught: dict[str, float] = Field(default_factory=dict)  # peer id -> unix time of the first check it failed
    updated: float = 0.0

    def writers(self) -> frozenset[str]:
        return frozenset({"trainer"})


class BooksRecord(Record):
    """The coordinator's books, per stage: the samples trainers completed against what the stage accounts
    (stepped by its rounds, pending in its servers' accumulators and rounds, waiting to be replayed)."""

    # per stage: completed, stepped, pending, replaying, inflight, servers, lag (peer.swarm.books.StageBooks)
    stages: list[dict[str, int]] = Field(default_factory=list)
    apart: list[str] = Field(default_factory=list)  # per stage: replicas at one step that differ, in words
    since: float = 0.0  # unix time the books have disagreed since (0: they balance)
    updated: float = 0.0


class SignedDigest(BaseModel):
    """One digest of a slice's averages (BLAKE3) and the owner's signature (Ed25519) of its statement with it, hex."""

    model_config = ConfigDict(extra="ignore")

    digest: str = Field(min_length=64, max_length=64)
    signature: str = Field(min_length=128, max_length=128)


PeerName = Annotated[str, Field(max_length=128)]
Nonce = Annotated[str, Field(min_length=32, max_length=32)]  # 16 bytes, hex


class AverageLie(BaseModel):
    """What an averaging owner signed twice with two different digests: the statement of its slice (the run, the
    part, the round's step, attempt, group and members' nonces: peer.server.slice_word) and both signed digests.
    Anyone holding the liar's peer id can check it; an honest owner signs one digest per statement."""

    model_config = ConfigDict(extra="ignore")

    liar: PeerName
    run_id: str = Field(max_length=128)
    stage: int = Field(ge=0)
    expert: str = Field(default="", max_length=64)
    epoch: int = Field(ge=0)
    attempt: int = Field(ge=0)
    group: list[PeerName] = Field(max_length=1023)  # averaging.max_group_size at most
    nonces: list[Nonce] = Field(max_length=1023)  # in group order
    words: list[SignedDigest] = Field(min_length=2, max_length=2)
    caught: float = 0.0  # unix time the replica saw it


class LieProofs(Record):
    """A replica's proofs that partners signed two different averages of one slice of a round: the coordinator checks
    each signature itself and revokes the liar on one replica's proof (peer.coordinator.authority)."""

    proofs: list[AverageLie] = Field(default_factory=list, max_length=16)
    updated: float = 0.0

    def writers(self) -> frozenset[str]:
        return frozenset({"server", "experts"})

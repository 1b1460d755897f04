"""Configuration as data: the run spec (shared by every peer of a run) and a peer's own settings.

Both are dataclasses with defaults, loaded from TOML and overridable by command-line flags.
A mistake is refused with a ConfigError naming the field and the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dht.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used; the message starts with the field's dotted name."""


# ---------------------------------------------------------------------------------------------
# run spec: what the coordinator publishes, signed, and every peer of the run follows
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    vocab_size: int = 256  # byte-level by default
    hidden_size: int = 192  # width of the residual stream
    num_layers: int = 4  # transformer blocks in the whole model
    num_heads: int = 6  # attention heads; hidden_size must divide evenly
    intermediate_size: int = 512  # SwiGLU inner width
    max_seq_len: int = 128  # longest sequence the rotary tables cover
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-5  # RMSNorm epsilon


@dataclass
class StagesConfig:
    num_stages: int = 2  # pipeline stages the blocks are split into
    boundaries: list[int] = field(default_factory=list)  # first block of stages 1..N-1; empty: split evenly


@dataclass
class TrainingConfig:
    micro_batch_size: int = 16  # sequences per micro-batch a trainer sends
    seq_len: int = 128  # tokens (bytes) per sequence
    target_batch_size: int = 64  # samples per global optimizer step, summed over all replicas of a stage
    total_steps: int = 300  # length of the learning-rate schedule; trainers stop when a stage reaches it
    lr: float = 3e-3  # peak learning rate (AdamW)
    warmup_steps: int = 20  # linear warmup, in optimizer steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    eps: float = 1e-8  # AdamW epsilon


COMPRESSIONS = ("none", "fp16", "bf16", "int8")
BYTE_VOCAB = 256  # tokens of the byte-level tokenizer every run uses today
AVERAGING_MODES = ("gradients", "local")


@dataclass
class CompressionConfig:
    activations: str = "none"  # hidden states and their gradients between stages and experts: none, fp16, bf16, int8
    averaging: str = "none"  # what replicas average (gradients; local mode: pseudo-gradients): none, fp16, bf16, int8
    block_size: int = 128  # int8: elements per float32 scale (blockwise absmax quantization)


@dataclass
class AveragingConfig:
    min_matchmaking_time: float = (
        5.0  # s a group leader waits at most for missing replicas (a full group starts at once)
    )
    request_timeout: float = 3.0  # s for one matchmaking request; short ones break groups on a loaded machine
    averaging_timeout: float = 30.0  # s for a whole round (matchmaking + all-reduce) before it fails
    # s a round waits for its whole group (the replicas it expects) to assemble before it fails: a group
    # that is not whole after the matchmaking window seldom becomes whole (at most averaging_timeout)
    group_timeout: float = 10.0
    max_group_size: int = 32  # most replicas averaged in one group
    pause_limit: float = 0.5  # s a server's forwards and backwards wait for a round; later they go on, one step stale
    # gradients: average gradients at every global step (exact data parallelism);
    # local: DiLoCo, inner optimizer steps on each replica's own gradients, then an outer Nesterov step
    # on the averaged pseudo-gradients every `inner_steps`
    mode: str = "gradients"
    inner_steps: int = 100  # local: inner optimizer steps of a replica between outer steps (DiLoCo's H)
    inner_batch_size: int = 0  # local: samples per inner step of one replica; 0: training.target_batch_size
    outer_lr: float = 0.7  # local: learning rate of the outer Nesterov step
    outer_momentum: float = 0.9  # local: momentum of the outer Nesterov step


@dataclass
class MoEConfig:
    num_experts: int = 0  # experts per mixture-of-experts layer; 0: every MLP is dense
    top_k: int = 2  # experts each token goes to
    layers: list[int] = field(default_factory=list)  # blocks whose MLP is a mixture; empty: all of them
    expert_size: int = 0  # SwiGLU inner width of one expert; 0: model.intermediate_size
    aux_loss_weight: float = 0.01  # weight of the load-balancing loss (Switch Transformer style)
    min_answers: int = 1  # of a token's top_k experts, at least this many must answer or the call fails


ADMISSION_MODES = ("open", "allowlist", "invite", "off")


@dataclass
class AdmissionConfig:
    # who may join: open (anyone, with a credential and TLS like everyone), allowlist (the peer ids
    # below), invite (codes from `peer coordinator invite`); off: no TLS and no credentials at all,
    # for a lab on a trusted network and for measuring what security costs
    mode: str = "open"
    allowlist: list[str] = field(default_factory=list)  # allowlist mode: peer ids that may join
    credential_ttl: float = (
        3600.0  # s a credential is valid; renewed at half-life: a coordinator may be away half this long
    )
    refresh: float = 5.0  # s between peers' reads of the revocation list: a revocation reaches all within this
    # distinct trainers whose spot checks must find a server wrong before the coordinator revokes it; 0: never
    revoke_after_reports: int = 2
    max_pending: int = 256  # credential requests the coordinator looks at per pass; more wait for the next


@dataclass
class RunSpec:
    name: str = "swarmtrain"  # the run's id in DHT keys: letters, digits, '-' and '_'
    seed: int = 0  # initial weights of every stage come from this seed
    model: ModelConfig = field(default_factory=ModelConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def moe_layers(self) -> list[int]:
        """The blocks whose MLP is a mixture of experts (none when moe.num_experts is 0)."""
        if not self.moe.num_experts:
            return []
        return sorted(self.moe.layers) if self.moe.layers else list(range(self.model.num_layers))

    @property
    def local_updates(self) -> bool:
        """DiLoCo mode: replicas step on their own gradients and average pseudo-gradients now and then."""
        return self.averaging.mode == "local"

    def inner_batch(self) -> int:
        """Local mode: samples per inner optimizer step of one replica."""
        return self.averaging.inner_batch_size or self.training.target_batch_size

    def stage_of_block(self, block: int) -> int:
        return next(s for s in range(self.stages.num_stages) if block in self.stage_blocks(s))

    def stage_blocks(self, stage: int) -> range:
        """The transformer blocks held by `stage`."""
        bounds = [0, *self.block_boundaries(), self.model.num_layers]
        return range(bounds[stage], bounds[stage + 1])

    def block_boundaries(self) -> list[int]:
        if self.stages.boundaries:
            return list(self.stages.boundaries)
        n, layers = self.stages.num_stages, self.model.num_layers
        return [round(i * layers / n) for i in range(1, n)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A short hash of the spec, to tell two versions apart."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        spec = from_dict(cls, data, "")
        spec.validate()
        return spec

    @classmethod
    def from_toml(cls, path: str | Path) -> RunSpec:
        return cls.from_dict(load_toml(path))

    def validate(self) -> None:
        m, s, t = self.model, self.stages, self.training
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ConfigError(f"name: must be letters, digits, '-' or '_', got {self.name!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            _positive(f"model.{name}", getattr(m, name))
        if m.vocab_size < BYTE_VOCAB:
            raise ConfigError(
                f"model.vocab_size: {m.vocab_size} cannot hold the byte-level tokenizer's {BYTE_VOCAB} tokens "
                f"(one per byte value); use at least {BYTE_VOCAB}"
            )
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
        if (m.hidden_size // m.num_heads) % 2:
            raise ConfigError("model.num_heads: head size hidden_size/num_heads must be even for rotary embeddings")
        _positive("stages.num_stages", s.num_stages)
        if s.num_stages > m.num_layers:
            raise ConfigError(f"stages.num_stages: {s.num_stages} stages cannot split {m.num_layers} blocks")
        if s.boundaries:
            if len(s.boundaries) != s.num_stages - 1:
                raise ConfigError(f"stages.boundaries: needs {s.num_stages - 1} entries, got {len(s.boundaries)}")
            bounds = [0, *s.boundaries, m.num_layers]
            if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
                raise ConfigError(
                    f"stages.boundaries: must rise strictly within 1..{m.num_layers - 1}, got {s.boundaries}"
                )
        for name in ("micro_batch_size", "seq_len", "target_batch_size", "total_steps"):
            _positive(f"training.{name}", getattr(t, name))
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"training.seq_len: {t.seq_len} is longer than model.max_seq_len {m.max_seq_len}")
        if t.target_batch_size < t.micro_batch_size:
            raise ConfigError(
                f"training.target_batch_size: {t.target_batch_size} is smaller than one micro-batch ({t.micro_batch_size})"
            )
        if not t.lr > 0:
            raise ConfigError(f"training.lr: must be positive, got {t.lr}")
        if t.warmup_steps < 0:
            raise ConfigError(f"training.warmup_steps: must be >= 0, got {t.warmup_steps}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"training.min_lr_ratio: must be within [0, 1], got {t.min_lr_ratio}")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
            raise ConfigError(f"training.betas: must be two numbers in [0, 1), got {t.betas}")
        c = self.compression
        for name in ("activations", "averaging"):
            if getattr(c, name) not in COMPRESSIONS:
                raise ConfigError(
                    f"compression.{name}: must be one of {', '.join(COMPRESSIONS)}, got {getattr(c, name)!r}"
                )
        if not 1 <= c.block_size <= 1 << 20:
            raise ConfigError(f"compression.block_size: must be within 1..1048576, got {c.block_size}")
        a = self.averaging
        if a.mode not in AVERAGING_MODES:
            raise ConfigError(f"averaging.mode: must be one of {', '.join(AVERAGING_MODES)}, got {a.mode!r}")
        _positive("averaging.inner_steps", a.inner_steps)
        if a.inner_batch_size < 0:
            raise ConfigError(f"averaging.inner_batch_size: must be >= 0, got {a.inner_batch_size}")
        if not a.outer_lr > 0:
            raise ConfigError(f"averaging.outer_lr: must be positive, got {a.outer_lr}")
        if not 0 <= a.outer_momentum < 1:
            raise ConfigError(f"averaging.outer_momentum: must be within [0, 1), got {a.outer_momentum}")
        if a.pause_limit < 0:
            raise ConfigError(f"averaging.pause_limit: must be >= 0, got {a.pause_limit}")
        for name in ("min_matchmaking_time", "request_timeout", "averaging_timeout"):
            if not getattr(a, name) > 0:
                raise ConfigError(f"averaging.{name}: must be positive, got {getattr(a, name)}")
        if not a.averaging_timeout > a.min_matchmaking_time:
            raise ConfigError(
                f"averaging.averaging_timeout: must be longer than averaging.min_matchmaking_time "
                f"({a.min_matchmaking_time:g} s), got {a.averaging_timeout:g}"
            )
        if not a.group_timeout > a.min_matchmaking_time:
            raise ConfigError(
                f"averaging.group_timeout: must be longer than averaging.min_matchmaking_time "
                f"({a.min_matchmaking_time:g} s), got {a.group_timeout:g}"
            )
        if not 2 <= a.max_group_size <= 1023:
            raise ConfigError(f"averaging.max_group_size: must be within 2..1023, got {a.max_group_size}")
        e = self.moe
        if e.num_experts < 0:
            raise ConfigError(f"moe.num_experts: must be >= 0, got {e.num_experts}")
        if e.num_experts:
            if not 1 <= e.top_k <= e.num_experts:
                raise ConfigError(f"moe.top_k: must be within 1..moe.num_experts ({e.num_experts}), got {e.top_k}")
            if not 1 <= e.min_answers <= e.top_k:
                raise ConfigError(f"moe.min_answers: must be within 1..moe.top_k ({e.top_k}), got {e.min_answers}")
            bad = [b for b in e.layers if not 0 <= b < m.num_layers]
            if bad or len(set(e.layers)) != len(e.layers):
                raise ConfigError(f"moe.layers: must be distinct blocks within 0..{m.num_layers - 1}, got {e.layers}")
            if e.expert_size < 0:
                raise ConfigError(f"moe.expert_size: must be >= 0, got {e.expert_size}")
            if e.aux_loss_weight < 0:
                raise ConfigError(f"moe.aux_loss_weight: must be >= 0, got {e.aux_loss_weight}")
        self._validate_admission()

    def _validate_admission(self) -> None:
        d = self.admission
        if d.mode not in ADMISSION_MODES:
            raise ConfigError(f"admission.mode: must be one of {', '.join(ADMISSION_MODES)}, got {d.mode!r}")
        if d.mode == "allowlist" and not d.allowlist:
            raise ConfigError("admission.allowlist: allowlist mode needs at least one peer id")
        from dht.identity import IdentityError, public_key_from_peer_id

        for i, peer in enumerate(d.allowlist):
            try:
                public_key_from_peer_id(peer)
            except IdentityError as e:
                raise ConfigError(f"admission.allowlist[{i}]: {e}") from None
        if not d.credential_ttl >= 10:
            raise ConfigError(f"admission.credential_ttl: must be at least 10 s, got {d.credential_ttl}")
        _positive("admission.refresh", d.refresh)
        _positive("admission.max_pending", d.max_pending)
        if d.revoke_after_reports < 0:
            raise ConfigError(f"admission.revoke_after_reports: must be >= 0, got {d.revoke_after_reports}")


# ---------------------------------------------------------------------------------------------
# a peer's own settings: where it listens, its limits and deadlines
# ---------------------------------------------------------------------------------------------
@dataclass
class NetworkConfig:
    host: str = "0.0.0.0"  # address the gRPC server listens on
    port: int = 0  # gRPC port; 0 picks a free one
    announce_host: str = ""  # address others dial for gRPC; empty: the host, or this machine's name when 0.0.0.0
    dht_host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # DHT listen multiaddrs
    dht_announce_maddrs: list[str] = field(default_factory=list)  # DHT multiaddrs to announce (public address)
    dht_startup_timeout: float = 20.0  # s to start the DHT node and reach the initial peers
    connect_timeout: float = 3.0  # s for the address given to join or status to answer at all (a TCP connect)
    spec_timeout: float = 5.0  # s to find the run spec the coordinator signed, once in the DHT
    dht_request_timeout: float = 3.0  # s for one DHT store or get (a call waits at most twice this)
    announce_period: float = 2.0  # s between refreshes of this peer's DHT record
    record_ttl: float = 10.0  # s a record lives unless refreshed; a dead peer vanishes after this
    progress_period: float = 0.5  # s between a server's looks at its stage's progress in the DHT


@dataclass
class ServerConfig:
    max_tensor_elements: int = 16 * 1024 * 1024  # largest tensor accepted in a request
    max_message_bytes: int = 256 * 1024 * 1024  # largest (streamed) request accepted
    chunk_bytes: int = 2 * 1024 * 1024  # largest chunk of a framed stream
    stream_bytes: int = 2 * 1024 * 1024  # messages above this travel as a framed stream (below, unary calls are faster)
    max_concurrent_requests: int = 64  # requests queued or running before RESOURCE_EXHAUSTED
    max_requests_per_peer: int = 16  # of those, the most one caller (peer id) may have; more: RESOURCE_EXHAUSTED
    max_inflight_bytes: int = 1024 * 1024 * 1024  # decoded request tensors held at once; more: RESOURCE_EXHAUSTED
    clip_factor: float = 10.0  # a backward's gradient norm above this times the running median is clipped to it
    clip_window: int = 64  # backwards in that running median (clipping starts once 8 are in)
    perturb_outputs: float = 0.0  # drills and tests only: add Gaussian noise of this std to forward outputs
    activation_cache_size: int = 32  # forwards kept for their backward (the backward recomputes on a miss)
    dedup_history: int = 1024  # uids of backwards added, so that a caller's retry of one is not counted twice
    fingerprint_history: int = 256  # optimizer steps remembered (parameter sums, group members) for peers to check
    state_load_timeout: float = 60.0  # s to download a stage's state from a peer
    state_donors: int = 3  # replicas a joiner loads its state from at once, each sending a part
    shutdown_grace: float = 5.0  # s to finish running requests (and a running round) when leaving
    # s from being told to leave (a signal, a revocation, a move) to the process's end: past it, it
    # exits regardless of what still runs (a hung averaging round, a stuck DHT call)
    leave_timeout: float = 10.0
    compute_dtype: str = "float32"  # the stage's matmuls: float32, or bfloat16 / float16 (autocast; for GPUs)
    throughput: float = 0.0  # samples/s this server announces; 0: measure it (a benchmark, then the real work)
    rebalance: str = "auto"  # move to a stage that needs it more: auto (unless --stage was given), always, never
    balance_period: float = 10.0  # s between a server's checks whether moving would help the swarm
    balance_margin: float = 0.2  # move only if the slowest stage's throughput then rises by this fraction
    balance_cooldown: float = 30.0  # s after starting before a server first considers moving
    # s a server waits after announcing that it means to move before it looks again; longer than an
    # announcement takes to be seen, so two servers that mean to move see each other and only one goes
    balance_settle: float = 2.0


@dataclass
class TrainerConfig:
    data: str = ""  # a text file or directory of files to train on; empty: Python's standard library
    seed: int = -1  # order of this trainer's micro-batches; -1: derived from the peer id, so trainers differ
    max_inflight: int = 2  # micro-batches in the pipeline at once
    max_micro_batches: int = 0  # stop after this many micro-batches (0: run until the schedule ends)
    deadline_floor: float = 1.0  # s: a call's deadline is this plus deadline_margin times its expected time
    deadline_margin: float = 3.0  # expected time (the server's measured latency for such a call) times this
    request_timeout: float = 30.0  # s: the longest deadline of one forward or backward call
    min_link_mbit: float = 10.0  # Mbit/s: a first call's deadline allows its bytes to cross a link this slow
    max_retries: int = (
        8  # tries of one forward on replicas before the micro-batch is given up (backwards never give up)
    )
    ban_time: float = 2.0  # s a failing server is avoided, doubling on each failure in a row
    max_ban: float = 60.0  # s: the longest ban
    no_server_wait: float = (
        0.0  # s to wait for a stage with no live server before giving up (0: wait as long as it takes)
    )
    max_receipt_mb: float = (
        256.0  # MiB of backwards kept until their server steps them (to replay); beyond, new ones wait
    )
    drain_timeout: float = 30.0  # s at the end to settle receipts (replaying those of servers that went away)
    eval_every: int = 0  # steps between validation runs (0: never)
    eval_batches: int = 4  # micro-batches of held-out data per validation run
    log_file: str = ""  # JSON lines: one per finished micro-batch, validation, failed call and replay
    log_calls: bool = False  # also log every successful call (for benchmarks/recovery.py)
    # print a progress line every few seconds when the output is not a terminal (a terminal always
    # gets a live progress bar)
    progress: bool = False
    refresh_period: float = 1.0  # s between refreshes of the server list (and settling of receipts)
    spot_check: float = 0.05  # fraction of forwards re-sent to a second replica to compare (0: none)
    # outputs agree when their largest difference is within this fraction of their largest magnitude
    # (the activation codec's own error is added to it)
    spot_check_tolerance: float = 0.02


@dataclass
class ExpertsConfig:
    max_batch_tokens: int = 8192  # an expert host merges concurrent requests for one expert up to this many rows
    max_wait: float = 0.001  # s a request waits for others to merge with before its batch runs
    max_request_tokens: int = 65536  # larger requests get RESOURCE_EXHAUSTED
    activation_cache_size: int = 64  # forward batches kept per expert for their backward (recompute on a miss)
    device: str = ""  # torch device of the hosted experts; empty: cuda when there is one, else cpu
    deadline_floor: float = 1.0  # s: a stage's call to an expert gets this plus deadline_margin x its latency
    deadline_margin: float = 3.0  # measured latency of such calls to that host, times this
    request_timeout: float = 30.0  # s: the longest deadline of one expert call
    min_link_mbit: float = 10.0  # Mbit/s: a first call's deadline allows its bytes to cross a link this slow
    ban_time: float = 2.0  # s a failing expert host is avoided, doubling on each failure in a row
    max_ban: float = 60.0  # s: the longest ban
    max_tries: int = 3  # replicas one expert call tries before the expert is skipped for that call
    refresh_period: float = 1.0  # s between a stage server's reads of the expert records


@dataclass
class MetricsConfig:
    port: int = 0  # HTTP port of this peer's Prometheus metrics (/metrics); 0: any free one; -1: none
    host: str = ""  # address the metrics endpoint listens on; empty: network.host


@dataclass
class DashboardConfig:
    port: int = 0  # HTTP port of the coordinator's web dashboard; 0: any free one; -1: none
    host: str = ""  # address the dashboard listens on; empty: network.host
    period: float = 2.0  # s between the coordinator's looks at the swarm for the dashboard (live updates)
    history: int = 2000  # points of the training curves kept (one per look)
    events: int = 500  # recent events kept
    silent_after: float = 6.0  # s without a new announcement before a server or trainer shows as silent
    max_clients: int = 16  # browsers streaming live updates at once; more are refused (503)
    client_queue: int = 4  # updates waiting for one slow browser; older ones are dropped
    keepalive: float = 15.0  # s of quiet before a comment keeps a browser's stream open
    write_timeout: float = 10.0  # s one update may take to reach a browser before its stream is closed
    retry: float = 2.0  # s a browser waits before reconnecting a lost stream


@dataclass
class CoordinatorConfig:
    report_period: float = 10.0  # s between the coordinator's looks at the run (summary line, checkpoints due)
    checkpoint_dir: str = ""  # where the coordinator writes checkpoints; empty: none
    checkpoint_every_steps: int = 0  # a checkpoint whenever the run's step crosses a multiple of this; 0: not by steps
    checkpoint_every_minutes: float = 30.0  # a checkpoint when this long has passed since the last; 0: not by time
    checkpoint_keep: int = 3  # complete checkpoints kept; older ones are removed
    checkpoint_timeout: float = 120.0  # s to download one part's state from a server
    # where the coordinator remembers its peers' DHT addresses, to rejoin the swarm after a restart;
    # empty: RUN.peers.json beside its identity key
    peers_file: str = ""
    rejoin_timeout: float = 10.0  # s a restarted coordinator tries its remembered peers before starting afresh
    # where the coordinator keeps the dashboard's curves and events, so a restart shows the run's past;
    # empty: RUN.timeline.json beside its identity key
    timeline_file: str = ""
    # s the signed run spec lives in the DHT after its last publication (every spec_republish s): newcomers
    # join through any peer while the coordinator is down for up to this long
    spec_ttl: float = 3600.0
    spec_republish: float = 30.0  # s between the coordinator's publications of the run spec
    relay: bool = True  # the coordinator relays for peers that cannot be dialled (bounded by relay.max_peers)
    relay_port: int = 0  # port of the coordinator's relay (gRPC); 0: any free one


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel ranks of a stage server in this box (Megatron-style shards); 1: none
    devices: list[str] = field(
        default_factory=list
    )  # one torch device per rank; empty: cuda:0.. when there are enough, else cpu
    start_timeout: float = 60.0  # s for the other ranks to start and join the group
    collective_timeout: float = 120.0  # s one collective may wait for the other ranks before it fails
    watch_period: float = 0.2  # s between checks that every rank is alive
    exit_grace: float = 15.0  # s a peer whose rank died has to leave cleanly before it exits regardless


@dataclass
class SecurityConfig:
    invite: str = ""  # an invite code from the run's coordinator (admission.mode = invite)
    admission_timeout: float = 30.0  # s to wait for the coordinator's answer to a credential request
    poll: float = 0.2  # s between looks for that answer (peers) or for new requests (coordinator)


@dataclass
class RelayConfig:
    # whether this peer's gRPC server can be dialled from outside: auto (another peer dials it back
    # to find out), public (assume so: never relayed), private (never: always served through a relay)
    reachability: str = "auto"
    # a stage server or expert host also relays for peers that cannot be dialled (when it can be dialled
    # itself); the coordinator relays by coordinator.relay, a relay-only peer by `peer join --role relay`
    offer: bool = False
    max_peers: int = 8  # peers this relay carries at once; more are refused
    # TCP ports a relay opens for the peers it carries, "FIRST-LAST" (e.g. "41000-41007", one per peer,
    # for a firewall); empty: any free ones
    ports: str = ""
    max_connections: int = 64  # connections forwarded at once for one relayed peer; more are closed
    chunk_bytes: int = 256 * 1024  # most bytes one forwarded chunk carries
    keepalive: float = 2.0  # s between a relay's keepalive signals to each peer it carries
    dead_after: float = 6.0  # s without a signal before a relayed peer drops its relay and moves to another
    probe_timeout: float = 3.0  # s for a relay to dial back a peer's endpoint (and for a ping)
    connect_timeout: float = 5.0  # s to attach to a relay, and for a relay to see a new connection carried
    candidates: int = 3  # relays pinged (latency) when choosing one; the best by latency and load is taken
    ban_time: float = 30.0  # s a relay that failed (or refused) is not chosen again, unless no other is left
    wait: float = 30.0  # s an unreachable peer waits for a relay to appear before it gives up


@dataclass
class PeerConfig:
    identity: str = ""  # path of this peer's Ed25519 key; empty: the user's config directory
    threads: int = 0  # torch threads; 0: torch's default
    network: NetworkConfig = field(default_factory=NetworkConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerConfig:
        cfg = from_dict(cls, data, "")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.server.leave_timeout > self.server.shutdown_grace:
            raise ConfigError(
                f"server.leave_timeout: must be longer than server.shutdown_grace ({self.server.shutdown_grace:g} s), "
                f"got {self.server.leave_timeout:g}"
            )
        if self.parallel.tp < 1:
            raise ConfigError(f"parallel.tp: must be at least 1, got {self.parallel.tp}")
        if self.relay.reachability not in ("auto", "public", "private"):
            raise ConfigError(f"relay.reachability: must be auto, public or private, got {self.relay.reachability!r}")
        for name in ("max_peers", "max_connections", "chunk_bytes", "candidates"):
            if getattr(self.relay, name) < 1:
                raise ConfigError(f"relay.{name}: must be at least 1, got {getattr(self.relay, name)}")
        for name in ("keepalive", "dead_after", "probe_timeout", "connect_timeout"):
            _positive(f"relay.{name}", getattr(self.relay, name))
        port_range(self.relay.ports)  # ConfigError names a malformed range
        net = self.network
        if net.record_ttl < 2 * net.dht_request_timeout + net.announce_period:
            raise ConfigError(
                f"network.record_ttl: must be at least 2 x network.dht_request_timeout + network.announce_period "
                f"({2 * net.dht_request_timeout + net.announce_period:g} s), got {net.record_ttl:g}: an announcement "
                "held up by a frozen DHT node must not let a live peer's record expire"
            )

    @classmethod
    def from_toml(cls, path: str | Path) -> PeerConfig:
        return cls.from_dict(load_toml(path))


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot be read by this user") from None


def port_range(text: str) -> list[int]:
    """The ports of "FIRST-LAST" (or one port), in order; [] for an empty text. ConfigError names relay.ports."""
    if not text.strip():
        return []
    first, _, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"relay.ports: expected FIRST-LAST like 41000-41007, got {text!r}") from None
    if not 1 <= low <= high <= 65535:
        raise ConfigError(f"relay.ports: expected 1 <= FIRST <= LAST <= 65535, got {text!r}")
    return list(range(low, high + 1))


def _positive(name: str, value: Any) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: must be positive, got {value}")


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from nested dicts, checking names and types; ConfigError names the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'spec'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (known: {', '.join(sorted(names))})")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name], prefix + f.name)
    return cls(**values)


def _convert(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, name)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported field type {hint}")


def apply_override(obj: Any, item: str) -> None:
    """Apply one `FIELD=VALUE` override (VALUE in TOML syntax, else taken as a string) to a config dataclass."""
    field_name, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    set_path(obj, field_name.strip(), value)


def set_path(obj: Any, dotted: str, value: Any) -> None:
    """Override one field (e.g. 'network.port') of a config dataclass with a flag's value, type-checked."""
    *parents, last = dotted.split(".")
    target = obj
    for i, part in enumerate(parents):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise ConfigError(f"{'.'.join(parents[: i + 1])}: unknown section")
        target = getattr(target, part)
    hints = typing.get_type_hints(type(target))
    if last not in hints:
        raise ConfigError(f"{dotted}: unknown field")
    setattr(target, last, _convert(hints[last], value, dotted))

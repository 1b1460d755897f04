"""A peer's own settings: where it listens, its limits and deadlines (not shared with the run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config.loading import ConfigError, from_dict, load_toml, port_range, require_positive


@dataclass
class NetworkConfig:
    host: str = "0.0.0.0"  # address the gRPC server listens on
    port: int = 0  # gRPC port; 0 picks a free one
    announce_host: str = ""  # address others dial for gRPC; empty: the host, or this machine's name when 0.0.0.0
    dht_host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # DHT listen multiaddrs
    dht_announce_maddrs: list[str] = field(default_factory=list)  # DHT multiaddrs to announce (public address)
    dht_startup_timeout: float = 20.0  # s to start the DHT node and reach the initial peers
    connect_timeout: float = 3.0  # s for the address given to join or status to answer at all (a TCP connect)
    probe_timeout: float = 1.0  # s for the TCP connect that tells a gone peer (refused) from a failed call
    spec_timeout: float = 5.0  # s to find the run spec the coordinator signed, once in the DHT
    dht_request_timeout: float = 3.0  # s for one DHT store or get (a call waits at most twice this)
    announce_period: float = 2.0  # s between refreshes of this peer's DHT record while it changes
    # s between refreshes of a record that does not change (a peer at rest): the period doubles from
    # announce_period at each unchanged refresh up to this, and the record lives as much longer (peer.net.cadence);
    # a change or a request makes it announce_period again. A dead resting peer vanishes after
    # record_ttl + rest_announce_period - announce_period
    rest_announce_period: float = 32.0
    record_ttl: float = 10.0  # s a record lives unless refreshed; a dead peer vanishes after this
    progress_period: float = 0.5  # s between a server's looks at its stage's progress in the DHT
    # s between a resting server's reads of its replicas' records: the read period doubles from progress_period
    # at each look that finds nothing changed (no request, round, step or replica's progress), up to this; any
    # request or round invitation makes it progress_period again at once
    rest_read_period: float = 32.0
    # a replica pushes its record to its partner replicas over gRPC as it changes (peer.server.replica_push): they
    # learn its samples, step and round at once, and read the DHT's records only once an announce period (at rest,
    # less often) unless a push to one of them fails
    push_timeout: float = 2.0  # s for one push (a Progress call) to a partner
    max_pushed_record_bytes: int = 65536  # largest signed record a pushed Progress call may carry
    # the most partners a replica knows (from the DHT and from pushes); a push from one more is refused
    max_partners: int = 64


@dataclass
class ServerConfig:
    max_tensor_elements: int = 16 * 1024 * 1024  # largest tensor accepted in a request
    max_message_bytes: int = 256 * 1024 * 1024  # largest (streamed) request accepted
    chunk_bytes: int = 2 * 1024 * 1024  # largest chunk of a framed stream
    stream_bytes: int = 2 * 1024 * 1024  # messages above this travel as a framed stream (below, unary calls are faster)
    max_concurrent_requests: int = 64  # requests queued or running before RESOURCE_EXHAUSTED
    max_requests_per_peer: int = 16  # of those, the most one caller (peer id) may have; more: RESOURCE_EXHAUSTED
    max_inflight_bytes: int = 1024 * 1024 * 1024  # decoded request tensors held at once; more: RESOURCE_EXHAUSTED
    # of those, the most one caller (peer id; without admission, host) may hold: one peer cannot take them all
    max_inflight_bytes_per_peer: int = 256 * 1024 * 1024
    # s a streamed request's tensors may take to arrive once its header has (the caller's deadline, if shorter,
    # applies): a stream that claims much and sends little is cut off
    read_timeout: float = 30.0
    clip_factor: float = 10.0  # a backward's gradient norm above this times the running median is clipped to it
    clip_window: int = 64  # backwards in that running median (clipping starts once 8 are in)
    perturb_outputs: float = 0.0  # drills and tests only: add Gaussian noise of this std to forward outputs
    activation_cache_size: int = 32  # forwards kept for their backward (the backward recomputes on a miss)
    dedup_history: int = 1024  # uids of backwards added, so that a caller's retry of one is not counted twice
    # longest request uid accepted (a trainer's are about 30 characters): uids are kept in the caches above
    max_uid_length: int = 128
    fingerprint_history: int = 256  # optimizer steps remembered (parameter sums, group members) for peers to check
    state_load_timeout: float = 60.0  # s at most one shard of a part's state may take to come from a peer
    # a shard's deadline: this many s plus its bytes at state_min_rate (at most state_load_timeout): a donor that
    # sends nothing holds a small state's transfer seconds, not a minute
    state_shard_floor: float = 10.0
    state_min_rate: float = 256 * 1024  # bytes/s: the slowest a donor may send a shard at (past state_shard_floor)
    # s a shard may be coming before an idle donor is asked for it too (and twice most shards' time, up to half its
    # deadline): the first answer is kept, so a donor that hangs delays a transfer this long while another answers
    state_patience: float = 5.0
    state_donors: int = 3  # replicas a joiner loads its state from at once, each sending a part
    # most shards a state request may split a part's state into (GetState's num_shards): a shard is at least
    # a tensor, so more only sizes work (a split of 2^32 sets); a joiner asks for at most this many
    max_state_shards: int = 1024
    state_retry_max: float = 10.0  # s: the longest pause between tries of a state download that failed
    # a replica takes the state of a step no more than this many steps past the one most replicas of its part
    # are at (peer.swarm.consensus): any admitted peer may claim any step, and one claim must not carry a stage
    max_resync_jump: int = 16
    # s a replica waits before it asks a donor that failed to send the state again (doubling each failure in a row,
    # up to max_donor_ban): a peer that claims a step ahead and never sends it is not asked twice a second
    donor_ban: float = 2.0
    max_donor_ban: float = 300.0
    # failures in a row after which a donor no longer counts as ahead of this replica (its claim no longer stops
    # it stepping) until it sends a state that loads: a claim never backed by a state freezes no stage
    donor_strikes: int = 4
    # other replicas asked, before a state loads, whether they held its parameters at its step (Info): when more
    # of them held others than held these, the state is refused (0: nobody is asked)
    second_opinions: int = 4
    # a replica behind its part takes a donor's state only if no parameter moved more than this many times the
    # peak learning rate per step between (an AdamW step moves an element by about lr at most, plus weight decay)
    max_update_per_step: float = 4.0
    # start a stage the run has already stepped from the seed when nobody holds its state (else it waits)
    seed_start: bool = False
    shutdown_grace: float = 5.0  # s to finish running requests (and a running round) when leaving
    # s the last server of a part waits as it leaves, when the coordinator keeps checkpoints, for the
    # coordinator to checkpoint its state (the process's leave_timeout grows by as much); 0: it does not wait
    handover_timeout: float = 60.0
    # s from being told to leave (a signal, a revocation, a move) to the process's end: past it, it
    # exits regardless of what still runs (a hung averaging round, a stuck DHT call)
    leave_timeout: float = 10.0
    # this server's matmuls, overriding the run's training.dtype: float32, or bfloat16 / float16 (autocast); "": the run's
    compute_dtype: str = ""
    throughput: float = 0.0  # samples/s this server announces; 0: measure it (a benchmark, then the real work)
    rebalance: str = "auto"  # move to a stage that needs it more: auto (unless --stage was given), always, never
    balance_period: float = 10.0  # s between a server's checks whether moving would help the swarm
    balance_margin: float = 0.2  # move only if the slowest stage's throughput then rises by this fraction
    # a server's announced throughput counts at most this many times the run's median claim when servers choose
    # and weigh stages (one record announcing 10^12 samples/s must not make its stage look served)
    balance_claim_cap: float = 4.0
    # callers whose counted backward samples a stage server announces (the latest ones; it keeps counting for 16
    # times as many): the coordinator's books count a trainer's claim of completed samples at most as far as each
    # stage counted its backwards
    max_counted_callers: int = 64
    balance_cooldown: float = 30.0  # s after starting before a server first considers moving
    # s a server waits after announcing that it means to move before it looks again; longer than an
    # announcement takes to be seen, so two servers that mean to move see each other and only one goes
    balance_settle: float = 2.0


@dataclass
class TrainerConfig:
    # a file or directory of text, JSON lines, parquet, arrow or saved datasets to train on (peer.data.sources);
    # empty: Python's standard library
    data: str = ""
    text_field: str = "text"  # the field (JSON lines) or column (parquet, arrow, saved datasets) holding the text
    # directory of this trainer's copy of the run's tokenizer (tokenizer.json); empty: the spec's data.tokenizer
    tokenizer: str = ""
    prefetch_sequences: int = 1024  # packed sequences the data thread keeps ready
    # where the data stream's position is saved, so a start after a stop goes on from there;
    # empty: KEY.RUN.data.json beside the trainer's identity
    data_position_file: str = ""
    tensorboard: str = ""  # directory for TensorBoard event files (needs the tensorboard extra); empty: none
    wandb: str = ""  # Weights & Biases project to log to (needs wandb; WANDB_MODE=offline works without network)
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
    # a backward its server has not stepped while it went this many steps past the step its stage was at when it
    # took it (by its own record), or while the stage went max_unstepped_stage_steps on: the server keeps what it
    # takes unstepped, or says so. It is replayed on another replica, and the server is banned for max_ban s (a
    # hoarder would fill max_receipt_mb and stall this trainer); 0: never
    max_unstepped_steps: int = 8
    # ... or while its stage went this many steps on, whatever the server says of its own step (the slack covers
    # records read late while a stage steps fast); at least max_unstepped_steps
    max_unstepped_stage_steps: int = 32
    # a server's answered step is taken as the step a backward was counted at (for max_unstepped_steps) up to
    # this many steps past its stage's step as last read; further, the stage's as read (a claim of its own)
    receipt_step_slack: int = 16
    # s a receipt is at least kept before that: an honest server's answers say what it stepped within a call or
    # two, but its record, read every refresh_period, may name a step many steps old while a stage steps fast
    unstepped_grace: float = 30.0
    drain_timeout: float = 30.0  # s at the end to settle receipts (replaying those of servers that went away)
    # s at most that a backward whose server gave no answer (its deadline passed, the stream broke) goes to that
    # server only, while it lives: it may have added it (and answers it again without adding it), and another
    # replica would count it twice (peer.trainer.insistence). Never less than a record's longest life
    unanswered_wait: float = 60.0
    # where the trainer keeps its micro-batches not yet settled, so a start after a kill finishes them once;
    # empty: KEY.RUN.journal.jsonl beside its identity key
    journal_file: str = ""
    # s from the first SIGINT/SIGTERM to the process's end: the micro-batches under way finish and their
    # receipts settle meanwhile; past it, it exits and says how many samples it could not place
    stop_timeout: float = 60.0
    eval_every: int = 0  # steps between validation runs (0: never)
    # s a validation waits for the validation set, built in the background from the start (training waits
    # meanwhile; past it, that validation is skipped); the last one, at the end, waits 10 times as long
    validation_wait: float = 30.0
    eval_batches: int = (
        0  # micro-batches of the validation set per validation run; 0: all of it (data.validation_bytes)
    )
    log_file: str = ""  # JSON lines: one per finished micro-batch, validation, failed call and replay
    log_calls: bool = False  # also log every successful call (for benchmarks/recovery.py)
    # print a progress line every few seconds when the output is not a terminal (a terminal always
    # gets a live progress bar)
    progress: bool = False
    refresh_period: float = 1.0  # s between refreshes of the server list (and settling of receipts)
    # a replica more optimizer steps behind the newest of its stage than this is not routed to (it resyncs)
    max_step_lag: int = 1
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
    max_step_lag: int = 1  # an expert's replica more steps behind its newest than this is not called (it resyncs)
    refresh_period: float = 1.0  # s between a stage server's reads of the expert records


@dataclass
class MetricsConfig:
    port: int = 0  # HTTP port of this peer's Prometheus metrics (/metrics); 0: any free one; -1: none
    # address the metrics endpoint listens on (unauthenticated): loopback by default, only this machine can read it;
    # empty: network.host
    host: str = "127.0.0.1"


@dataclass
class DashboardConfig:
    port: int = 0  # HTTP port of the coordinator's web dashboard; 0: any free one; -1: none
    # address the dashboard listens on (unauthenticated): loopback by default (--dashboard-host to open it);
    # empty: network.host
    host: str = "127.0.0.1"
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
    # s between the coordinator's looks at a swarm at rest (no trainer, no server's step, samples or state
    # changing; doubling from dashboard.period to this), and between its reads of spot-check reports while
    # there are none; a change makes the looks dashboard.period apart again. The records it refreshes at each
    # look (books, archive, trained parts) live 3 x the longer of this and network.record_ttl
    rest_period: float = 60.0
    checkpoint_dir: str = ""  # where the coordinator writes checkpoints; empty: none
    checkpoint_every_steps: int = 0  # a checkpoint whenever the run's step crosses a multiple of this; 0: not by steps
    checkpoint_every_minutes: float = 30.0  # a checkpoint when this long has passed since the last; 0: not by time
    checkpoint_keep: int = 3  # complete checkpoints kept; older ones are removed
    checkpoint_timeout: float = 120.0  # s to download one part's state from a server
    # s the run's last checkpoint waits, once a stage has reached training.total_steps, for every other stage to get
    # there too (its parts then all hold the last step); after that it is taken with the stages where they are
    end_checkpoint_wait: float = 30.0
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
    spec_republish: float = 120.0  # s between the coordinator's publications of the run spec
    relay: bool = True  # the coordinator relays for peers that cannot be dialled (bounded by relay.max_peers)
    relay_port: int = 0  # port of the coordinator's relay (gRPC); 0: any free one
    # s the books (samples completed against what each stage accounts) may stay off before a warning: records
    # lag the work by a few announce periods
    books_grace: float = 30.0
    # where the coordinator keeps the books (the trainers it has seen and what they completed), so a restarted
    # one goes on with them; empty: RUN.books.json beside its identity key
    books_file: str = ""
    # trainer starts and stage server starts the books remember (each after it is gone), at most
    books_max_entries: int = 4096

    def refreshed_ttl(self, net: NetworkConfig) -> float:
        """s the records the coordinator refreshes at each look live: three looks at rest."""
        return 3 * max(net.record_ttl, self.rest_period)


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
    poll: float = 0.2  # s between a joining peer's looks for that answer
    # s between the coordinator's passes over new credential requests (each is a DHT read: a pass every 0.2 s
    # cost the coordinator about 5 % of a core)
    requests_period: float = 0.5
    # s between those passes at rest: passes that see nothing new grow apart, doubling from requests_period up to
    # this; a request seen makes them requests_period apart again. A request stored on the coordinator's own DHT
    # node makes a pass at once (its validator sees it arrive: dht.node.SwarmDHT.touched)
    requests_rest_period: float = 5.0
    # s between the coordinator's looks at its revocation file and at spot-check reports (revocations reach
    # peers within admission.refresh anyway)
    reports_period: float = 1.0
    # s between the coordinator's DHT reads of credential requests while its own DHT node holds none new (it
    # looks at that every requests_period, without the network); in a swarm of more nodes than the DHT's
    # replication (5), a request stored on others only is answered within this
    requests_read_period: float = 5.0
    # s between a peer's DHT reads of the revocation list while its own DHT node holds the coordinator's copy (it
    # looks at that copy every admission.refresh, without the network: the coordinator stores each change on the
    # DHT's 5 nearest nodes, every node of a small swarm); a peer whose node holds none reads every refresh
    revocations_read_period: float = 60.0
    # s the coordinator's revocation list lives in the DHT (at least 4 x admission.refresh); it is stored again at a
    # third of that while unchanged, at once on a change
    revocations_ttl: float = 120.0
    # s between the coordinator's DHT reads of credential requests at rest: after a read that finds none waiting,
    # the read period doubles from requests_read_period up to this; a request seen makes it short again
    requests_rest_read_period: float = 20.0
    # before it revokes a reported server, the coordinator probes it and up to probe_partners (at least 2) other
    # replicas of its stage (peer.coordinator.referee): s each probe call may take; tries while fewer than two
    # partners answer at its step, and s between those tries; s before a server it could not judge, or found
    # right, is probed again
    probe_partners: int = 4
    probe_timeout: float = 10.0
    probe_tries: int = 3
    probe_wait: float = 0.5
    probe_again: float = 60.0


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
    # of those, the most from one address (a relay sees only TCP: who opens them is not known before the relayed
    # peer's TLS): one stranger's idle connections leave room for everyone else's
    max_connections_per_host: int = 16
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
    # glibc malloc arenas of the process; 0: glibc's default (8 per core). Few arenas keep the memory that
    # gRPC's threads free during a state download reusable: with the default, loading a stage held ~60 MB more
    malloc_arenas: int = 2
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
        for name in ("max_peers", "max_connections", "max_connections_per_host", "chunk_bytes", "candidates"):
            if getattr(self.relay, name) < 1:
                raise ConfigError(f"relay.{name}: must be at least 1, got {getattr(self.relay, name)}")
        for name in ("keepalive", "dead_after", "probe_timeout", "connect_timeout"):
            require_positive(f"relay.{name}", getattr(self.relay, name))
        port_range(self.relay.ports)  # ConfigError names a malformed range
        for name in (
            "poll",
            "requests_period",
            "reports_period",
            "requests_read_period",
            "revocations_read_period",
            "revocations_ttl",
            "requests_rest_period",
        ):
            require_positive(f"security.{name}", getattr(self.security, name))
        require_positive("coordinator.rest_period", self.coordinator.rest_period)
        if self.security.requests_rest_read_period < self.security.requests_read_period:
            raise ConfigError(
                "security.requests_rest_read_period: must be at least security.requests_read_period "
                f"({self.security.requests_read_period:g} s), got {self.security.requests_rest_read_period:g}"
            )
        require_positive("server.balance_claim_cap", self.server.balance_claim_cap)
        for name in ("state_load_timeout", "state_shard_floor", "state_min_rate", "state_patience", "state_donors"):
            require_positive(f"server.{name}", getattr(self.server, name))
        require_positive("server.max_counted_callers", self.server.max_counted_callers)
        require_positive("coordinator.books_max_entries", self.coordinator.books_max_entries)
        require_positive("trainer.max_unstepped_stage_steps", self.trainer.max_unstepped_stage_steps)
        net = self.network
        require_positive("network.probe_timeout", net.probe_timeout)
        require_positive("network.progress_period", net.progress_period)
        if net.rest_announce_period < net.announce_period:
            raise ConfigError(
                f"network.rest_announce_period: must be at least network.announce_period ({net.announce_period:g} s), "
                f"got {net.rest_announce_period:g}"
            )
        if net.rest_read_period < net.progress_period:
            raise ConfigError(
                f"network.rest_read_period: must be at least network.progress_period ({net.progress_period:g} s), "
                f"got {net.rest_read_period:g}"
            )
        if net.record_ttl < 2 * net.dht_request_timeout + net.announce_period:
            raise ConfigError(
                f"network.record_ttl: must be at least 2 x network.dht_request_timeout + network.announce_period "
                f"({2 * net.dht_request_timeout + net.announce_period:g} s), got {net.record_ttl:g}: an announcement "
                "held up by a frozen DHT node must not let a live peer's record expire"
            )

    @classmethod
    def from_toml(cls, path: str | Path) -> PeerConfig:
        return cls.from_dict(load_toml(path))

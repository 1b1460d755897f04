"""The run spec: what the coordinator publishes, signed, and every peer of the run follows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dht.identity import IdentityError, public_key_from_peer_id
from peer.config.families import ROPE_KINDS, check_architecture
from peer.config.loading import ConfigError, from_dict, load_toml, require_positive


@dataclass
class RopeScaling:
    kind: str = "default"  # rope_type as transformers names it: default, linear or llama3
    factor: float = 1.0  # linear and llama3: how much longer the context is than the base model's
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_position_embeddings / this are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_position_embeddings / this are kept
    original_max_position_embeddings: int = 8192  # llama3: the base model's context length


@dataclass
class ModelConfig:
    # a Hugging Face model directory (config.json; peer.config.model_dir). The coordinator reads it and fills
    # the fields below from it; peers get them with the signed spec and never need the files. Empty: the fields
    path: str = ""
    architecture: str = "LlamaForCausalLM"  # transformers' class name; see peer.config.families for the list
    vocab_size: int = 256  # byte-level by default
    hidden_size: int = 192  # width of the residual stream
    num_layers: int = 4  # transformer blocks in the whole model
    num_heads: int = 6  # attention heads (query heads)
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as num_heads
    head_dim: int = 0  # width of one head; 0: hidden_size / num_heads
    intermediate_size: int = 512  # SwiGLU inner width
    max_seq_len: int = 128  # longest sequence the rotary tables cover
    rope_theta: float = 10000.0  # rotary embedding base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # rotary frequencies for longer contexts
    norm_eps: float = 1e-5  # RMSNorm epsilon
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2)
    o_bias: bool = False  # the output projection has a bias (Llama with attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    tie_embeddings: bool = False  # the head shares the embedding's weights (refused across stages, see validate)
    # the model directory's config.json as read (the coordinator fills it): written back, updated, on export
    source_config: dict = field(default_factory=dict)
    # sha256 of the model directory's weight files, when it has some (the coordinator checks and pins them,
    # then serves each stage's tensors to the servers that join it); empty: every stage starts from the seed
    weights: str = ""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


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
    # clip each optimizer step's gradient to this L2 norm, taken per stage (over a split stage's ranks): each
    # stage's share of the model is clipped on its own (docs/architecture.md, "Fidelity"); 0: no clipping
    max_grad_norm: float = 0.0
    # the stages' matmuls in the whole run: float32, or bf16 / fp16 under torch.autocast (master weights,
    # optimizer state, gradients and what travels stay float32); a server's server.compute_dtype overrides it
    dtype: str = "float32"
    activation_checkpointing: bool = False  # recompute a stage's blocks in its backward instead of keeping activations
    # most tokens (batch x seq) one forward or backward may carry, so that what a stage builds and caches for a
    # request is bounded; 0: 8 x micro_batch_size x seq_len (a trainer sends micro_batch_size x seq_len)
    max_request_tokens: int = 0
    # synchronous mode: this many trainers feed every optimizer step, each exactly 1/N of its micro-batches, and a
    # server runs a micro-batch only once its stage has taken the steps before it: the swarm is then the plain loop
    # with the combined batch, step by step (a fixed set of trainers from the start, gradients averaging); 0: off,
    # asynchronous (a step takes whatever micro-batches arrive; forwards never wait for one)
    sync_trainers: int = 0
    sync_wait: float = 60.0  # synchronous mode: s a server holds a micro-batch for the step it belongs to

    def request_tokens(self) -> int:
        """The bound on tokens per request (max_request_tokens, or its default)."""
        return self.max_request_tokens or 8 * self.micro_batch_size * self.seq_len


COMPRESSIONS = ("none", "fp16", "bf16", "int8")
AVERAGING_COMPRESSIONS = (*COMPRESSIONS, "int4")  # int4 only for what replicas average, with error feedback
TRAINING_DTYPES = ("float32", "bf16", "fp16", "bfloat16", "float16")


BYTE_VOCAB = 256  # tokens of the byte-level tokenizer every run uses today


AVERAGING_MODES = ("gradients", "local")


AGGREGATES = ("mean", "median", "clipped")  # how a group's members' tensors become one (peer.server.robust)


@dataclass
class CompressionConfig:
    activations: str = "none"  # hidden states and their gradients between stages and experts: none, fp16, bf16, int8
    # what replicas average (gradients; local mode: pseudo-gradients): none, fp16, bf16, int8, int4 (4 bits an element;
    # local mode feeds each round's rounding error back into the next round's pseudo-gradient)
    averaging: str = "none"
    block_size: int = 128  # int8, int4: elements per float32 scale (blockwise absmax quantization)


@dataclass
class AveragingConfig:
    request_timeout: float = 3.0  # s for one round invitation (peer.server.replica_round caps it at 2)
    averaging_timeout: float = 30.0  # s for one all-reduce call between two members before it fails
    # s an owner waits for every member's first frame (and for its own round to start): members reach a round
    # at their own pace (a drain, the DHT announcement); one not there by then is left out of the attempt
    group_timeout: float = 10.0
    # s without bytes from a member whose pieces are due: it is taken for stopped or cut off, and the round goes
    # on without it (a dead member's refused or reset connection is seen at once)
    read_timeout: float = 5.0
    max_attempts: int = 3  # tries of a round, each without the members the one before lost (a quorum stays)
    piece_bytes: int = 1 << 20  # bytes of float32 per piece the all-reduce streams, reduces and encodes at once
    max_group_size: int = 32  # most replicas averaged in one group
    # a group's mean whose norm is more than this times the lower median of the norms its members with samples
    # said they sent (with one such member: the median of the last such references and of this replica's own
    # norms) is refused here, a round that failed (a member sent poison); 0: no check (gross poison: a
    # 1e4-everywhere part is 1e5x)
    max_norm_ratio: float = 100.0
    # after this many refused means in a row a replica steps alone with its own gradients: a poisoning
    # member delays the stage's steps, it does not stop them
    max_refused_rounds: int = 2
    # a partner that failed this many of a replica's rounds in a row (it was lost, or the round failed on its
    # word alone: a verdict that it stepped, that the others are lost, that the group is another) is left out of
    # that replica's rounds for `failed_ban` s, doubling each time after (to `max_failed_ban`): one
    # member that breaks every round delays a stage, it does not stop it
    max_failed_rounds: int = 3
    failed_ban: float = 30.0  # s a partner that failed max_failed_rounds rounds in a row is first left out
    max_failed_ban: float = 480.0  # s such a partner is left out at most, however often it failed again
    # how each part of a group's tensors becomes one: mean (sample-weighted, exact data parallelism),
    # median (coordinate-wise, each member with samples once), clipped (a centered clip from the median): the
    # last two bound what a minority of hostile members can move, at some cost in fidelity; with two members
    # each is the sample-weighted mean
    aggregate: str = "mean"
    # a member's weight is the samples it announced to the group, at most this many times the lower median
    # of the members' positive claims (one claiming 10^9 samples cannot outweigh the rest; of two replicas
    # with 1 and 100 samples, the second weighs 8: the first 11 % instead of 1 %); 0: no cap
    max_weight_ratio: float = 8.0
    pause_limit: float = 0.5  # s a server's forwards and backwards wait for a round; later they go on, one step stale
    # s a replica about to step first waits for the backwards of the training forwards it ran on its current
    # weights (new training forwards wait too, until the step is queued): their gradients then count in this
    # step instead of one step late on the stashed weights, at the cost of a pipeline bubble per step; 0: no
    # wait (the demo's spec sets 1)
    drain_limit: float = 0.0
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


@dataclass
class DataConfig:
    # directory of the tokenizer the run trains with (tokenizer.json: a model directory's, or one from
    # `peer tokenizer train`); empty: the byte-level default (a token per byte)
    tokenizer: str = ""
    # the tokenizer's hash, pinned: the coordinator fills it in from `tokenizer`; a trainer whose tokenizer
    # hashes otherwise is refused ("bytes": the byte-level default)
    tokenizer_fingerprint: str = ""
    # validation data (a file or directory, in any format --data reads); empty: documents held out of each
    # trainer's own data (validation_fraction of them, by a hash of their text: never trained on)
    validation: str = ""
    validation_fraction: float = 0.01  # documents held out of the data for validation when `validation` is empty
    validation_bytes: int = 1_000_000  # text one validation pass covers at least (all of it when there is less)
    shuffle_buffer: int = 1000  # documents a trainer's stream shuffles among (its order is seeded by its peer id)


ADMISSION_MODES = ("open", "allowlist", "invite", "off")


@dataclass
class AdmissionConfig:
    # who may join: invite (codes from `peer coordinator invite`: the default, since one hostile peer can still
    # stall or skew some steps, docs/security.md), allowlist (the peer ids below), open (anyone, with a credential
    # and TLS like everyone: a run of one's own machines, or one that accepts that risk); off: no TLS and no
    # credentials at all, for a lab on a trusted network and for measuring what security costs
    mode: str = "invite"
    allowlist: list[str] = field(default_factory=list)  # allowlist mode: peer ids that may join
    credential_ttl: float = (
        3600.0  # s a credential is valid; renewed at half-life: a coordinator may be away half this long
    )
    refresh: float = 5.0  # s between peers' reads of the revocation list: a revocation reaches all within this
    # distinct trainers whose spot checks must find a server wrong before the coordinator revokes it; 0: never
    revoke_after_reports: int = 2
    max_pending: int = 256  # credential requests the coordinator looks at per pass; more wait for the next
    # a trainer's spot-check report counts toward revoking a server only once the trainer has completed this many
    # samples (its announced record says so): a throwaway key cannot report
    min_reporter_samples: int = 256
    report_ttl: float = 3600.0  # s: a report of a check failed longer ago than this no longer counts


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
    data: DataConfig = field(default_factory=DataConfig)

    def moe_layers(self) -> list[int]:
        """The blocks whose MLP is a mixture of experts (none when moe.num_experts is 0)."""
        if not self.moe.num_experts:
            return []
        return sorted(self.moe.layers) if self.moe.layers else list(range(self.model.num_layers))

    @property
    def local_updates(self) -> bool:
        """DiLoCo mode: replicas step on their own gradients and average pseudo-gradients now and then."""
        return self.averaging.mode == "local"

    def sync_quota(self) -> int:
        """Synchronous mode: micro-batches each trainer sends for every optimizer step; 0: asynchronous."""
        t = self.training
        return t.target_batch_size // t.micro_batch_size // t.sync_trainers if t.sync_trainers else 0

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
        """ConfigError naming the first field that cannot be used."""
        self._validate_model()
        self._validate_stages()
        self._validate_training()
        self._validate_compression()
        self._validate_averaging()
        self._validate_moe()
        self._validate_admission()
        self._validate_data()

    def _validate_model(self) -> None:
        m = self.model
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ConfigError(f"name: must be letters, digits, '-' or '_', got {self.name!r}")
        check_architecture(m.architecture, "model.architecture")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            require_positive(f"model.{name}", getattr(m, name))
        if m.vocab_size < BYTE_VOCAB:
            raise ConfigError(
                f"model.vocab_size: {m.vocab_size} cannot hold the byte-level tokenizer's {BYTE_VOCAB} tokens "
                f"(one per byte value); use at least {BYTE_VOCAB}"
            )
        if m.num_kv_heads < 0 or m.num_heads % m.kv_heads:
            raise ConfigError(f"model.num_kv_heads: {m.num_kv_heads} does not divide model.num_heads {m.num_heads}")
        if m.head_dim < 0 or (not m.head_dim and m.hidden_size % m.num_heads):
            raise ConfigError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
        if m.head_size % 2:
            raise ConfigError("model.head_dim: the head size must be even for rotary embeddings")
        if m.rope_scaling.kind not in ROPE_KINDS:
            raise ConfigError(
                f"model.rope_scaling.kind: must be one of {', '.join(ROPE_KINDS)}, got {m.rope_scaling.kind!r}"
            )
        if m.tie_embeddings and self.stages.num_stages > 1:
            raise ConfigError(
                "model.tie_embeddings: the head shares the embedding's weights, and they would live on two stages "
                "(the first and the last); keeping them equal across stages is not supported yet: untie them "
                "(tie_word_embeddings = false in config.json) or run one stage"
            )

    def _validate_stages(self) -> None:
        m, s = self.model, self.stages
        require_positive("stages.num_stages", s.num_stages)
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

    def _validate_training(self) -> None:
        m, t = self.model, self.training
        for name in ("micro_batch_size", "seq_len", "target_batch_size", "total_steps"):
            require_positive(f"training.{name}", getattr(t, name))
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
        if not t.max_grad_norm >= 0:
            raise ConfigError(f"training.max_grad_norm: must be >= 0 (0: no clipping), got {t.max_grad_norm}")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
            raise ConfigError(f"training.betas: must be two numbers in [0, 1), got {t.betas}")
        if t.max_request_tokens and t.max_request_tokens < t.micro_batch_size * t.seq_len:
            raise ConfigError(
                f"training.max_request_tokens: {t.max_request_tokens} is less than one micro-batch "
                f"({t.micro_batch_size} x {t.seq_len} tokens)"
            )
        if t.dtype not in TRAINING_DTYPES:
            raise ConfigError(f"training.dtype: must be one of {', '.join(TRAINING_DTYPES)}, got {t.dtype!r}")
        self._validate_sync()

    def _validate_sync(self) -> None:
        t = self.training
        if t.sync_trainers < 0:
            raise ConfigError(f"training.sync_trainers: must be >= 0 (0: asynchronous), got {t.sync_trainers}")
        if not t.sync_wait > 0:
            raise ConfigError(f"training.sync_wait: must be positive, got {t.sync_wait}")
        if not t.sync_trainers:
            return
        micro_batches, rest = divmod(t.target_batch_size, t.micro_batch_size)
        if rest or micro_batches % t.sync_trainers:
            raise ConfigError(
                f"training.sync_trainers: {t.sync_trainers} trainers cannot share a step of {t.target_batch_size} "
                f"samples equally in micro-batches of {t.micro_batch_size}"
            )
        if self.averaging.mode != "gradients":
            raise ConfigError("training.sync_trainers: synchronous mode averages gradients, not averaging.mode local")
        if self.moe.num_experts:
            raise ConfigError(
                "training.sync_trainers: synchronous mode does not cover mixture-of-experts layers (their experts "
                "step on their own hosts, which hold no micro-batch for its step); set moe.num_experts = 0"
            )

    def _validate_compression(self) -> None:
        c = self.compression
        for name, allowed in (("activations", COMPRESSIONS), ("averaging", AVERAGING_COMPRESSIONS)):
            if getattr(c, name) not in allowed:
                raise ConfigError(f"compression.{name}: must be one of {', '.join(allowed)}, got {getattr(c, name)!r}")
        if c.averaging == "int4" and not self.local_updates:
            raise ConfigError(
                'compression.averaging: int4 is for averaging.mode = "local" (pseudo-gradients, with error feedback); '
                "gradient mode's per-step gradients take none, fp16, bf16 or int8"
            )
        if not 1 <= c.block_size <= 1 << 20:
            raise ConfigError(f"compression.block_size: must be within 1..1048576, got {c.block_size}")

    def _validate_averaging(self) -> None:
        a = self.averaging
        if a.mode not in AVERAGING_MODES:
            raise ConfigError(f"averaging.mode: must be one of {', '.join(AVERAGING_MODES)}, got {a.mode!r}")
        require_positive("averaging.inner_steps", a.inner_steps)
        if a.inner_batch_size < 0:
            raise ConfigError(f"averaging.inner_batch_size: must be >= 0, got {a.inner_batch_size}")
        if not a.outer_lr > 0:
            raise ConfigError(f"averaging.outer_lr: must be positive, got {a.outer_lr}")
        if not 0 <= a.outer_momentum < 1:
            raise ConfigError(f"averaging.outer_momentum: must be within [0, 1), got {a.outer_momentum}")
        if a.pause_limit < 0:
            raise ConfigError(f"averaging.pause_limit: must be >= 0, got {a.pause_limit}")
        if not a.drain_limit >= 0:
            raise ConfigError(f"averaging.drain_limit: must be >= 0, got {a.drain_limit}")
        if not a.max_norm_ratio >= 0:
            raise ConfigError(f"averaging.max_norm_ratio: must be >= 0 (0: no check), got {a.max_norm_ratio}")
        require_positive("averaging.max_refused_rounds", a.max_refused_rounds)
        require_positive("averaging.max_failed_rounds", a.max_failed_rounds)
        if not a.failed_ban >= 0:
            raise ConfigError(f"averaging.failed_ban: must be >= 0, got {a.failed_ban}")
        if not a.max_failed_ban >= a.failed_ban:
            raise ConfigError(
                f"averaging.max_failed_ban: must be at least averaging.failed_ban ({a.failed_ban:g}), "
                f"got {a.max_failed_ban:g}"
            )
        if a.aggregate not in AGGREGATES:
            raise ConfigError(f"averaging.aggregate: must be one of {', '.join(AGGREGATES)}, got {a.aggregate!r}")
        if not a.max_weight_ratio >= 0:
            raise ConfigError(f"averaging.max_weight_ratio: must be >= 0 (0: no cap), got {a.max_weight_ratio}")
        for name in ("request_timeout", "averaging_timeout", "group_timeout", "read_timeout"):
            if not getattr(a, name) > 0:
                raise ConfigError(f"averaging.{name}: must be positive, got {getattr(a, name)}")
        if not 1 <= a.max_attempts <= 16:
            raise ConfigError(f"averaging.max_attempts: must be within 1..16, got {a.max_attempts}")
        if not 4096 <= a.piece_bytes <= 64 << 20:
            raise ConfigError(f"averaging.piece_bytes: must be within 4096..{64 << 20}, got {a.piece_bytes}")
        if not 2 <= a.max_group_size <= 1023:
            raise ConfigError(f"averaging.max_group_size: must be within 2..1023, got {a.max_group_size}")

    def _validate_moe(self) -> None:
        m = self.model
        e = self.moe
        mixtral = m.architecture == "MixtralForCausalLM"
        if mixtral and (not e.num_experts or len(self.moe_layers()) != m.num_layers):
            raise ConfigError(
                "moe: MixtralForCausalLM has experts in every block (moe.num_experts > 0, moe.layers empty)"
            )
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

    def _validate_admission(self) -> None:
        d = self.admission
        if d.mode not in ADMISSION_MODES:
            raise ConfigError(f"admission.mode: must be one of {', '.join(ADMISSION_MODES)}, got {d.mode!r}")
        if d.mode == "allowlist" and not d.allowlist:
            raise ConfigError("admission.allowlist: allowlist mode needs at least one peer id")
        for i, peer in enumerate(d.allowlist):
            try:
                public_key_from_peer_id(peer)
            except IdentityError as e:
                raise ConfigError(f"admission.allowlist[{i}]: {e}") from None
        if not d.credential_ttl >= 10:
            raise ConfigError(f"admission.credential_ttl: must be at least 10 s, got {d.credential_ttl}")
        require_positive("admission.refresh", d.refresh)
        require_positive("admission.max_pending", d.max_pending)
        require_positive("admission.report_ttl", d.report_ttl)
        if d.min_reporter_samples < 0:
            raise ConfigError(f"admission.min_reporter_samples: must be >= 0, got {d.min_reporter_samples}")
        if d.revoke_after_reports < 0:
            raise ConfigError(f"admission.revoke_after_reports: must be >= 0, got {d.revoke_after_reports}")

    def _validate_data(self) -> None:
        d = self.data
        if not 0 <= d.validation_fraction <= 0.5:
            raise ConfigError(f"data.validation_fraction: must be within [0, 0.5], got {d.validation_fraction}")
        require_positive("data.validation_bytes", d.validation_bytes)
        require_positive("data.shuffle_buffer", d.shuffle_buffer)

"""Configuration as data: the run spec (shared by every peer of a run) and a peer's own settings.

Both are dataclasses with defaults and a comment per field, loaded from TOML and overridable by
command-line flags and `--set`. A mistake is refused with a ConfigError naming the field and the reason.

- peer.config.run: the run spec (RunSpec and its sections), which the coordinator signs;
- peer.config.settings: a peer's own settings (PeerConfig and its sections);
- peer.config.loading: TOML, `--set` overrides, and the checks they share.

Everything is re-exported here: `from peer.config import RunSpec`. It imports dht (errors, identity), nothing of peer.
"""

from peer.config.loading import (
    ConfigError,
    apply_override,
    from_dict,
    load_toml,
    port_range,
    require_positive,
    set_path,
)
from peer.config.run import (
    ADMISSION_MODES,
    AGGREGATES,
    AVERAGING_MODES,
    BYTE_VOCAB,
    COMPRESSIONS,
    AdmissionConfig,
    AveragingConfig,
    CompressionConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    RunSpec,
    StagesConfig,
    TrainingConfig,
)
from peer.config.settings import (
    CoordinatorConfig,
    DashboardConfig,
    ExpertsConfig,
    MetricsConfig,
    NetworkConfig,
    ParallelConfig,
    PeerConfig,
    RelayConfig,
    SecurityConfig,
    ServerConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "load_toml",
    "port_range",
    "require_positive",
    "from_dict",
    "apply_override",
    "set_path",
    "ModelConfig",
    "RopeScaling",
    "StagesConfig",
    "TrainingConfig",
    "COMPRESSIONS",
    "BYTE_VOCAB",
    "AGGREGATES",
    "AVERAGING_MODES",
    "CompressionConfig",
    "AveragingConfig",
    "MoEConfig",
    "ADMISSION_MODES",
    "AdmissionConfig",
    "RunSpec",
    "NetworkConfig",
    "ServerConfig",
    "TrainerConfig",
    "ExpertsConfig",
    "MetricsConfig",
    "DashboardConfig",
    "CoordinatorConfig",
    "ParallelConfig",
    "SecurityConfig",
    "RelayConfig",
    "PeerConfig",
]

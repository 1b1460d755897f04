"""A peer's settings from its command line: config file, flags, `--set` overrides, identity, device."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import socket

from dht.identity import Identity
from peer.config import ConfigError, PeerConfig, RunSpec, apply_override, set_path

# flag -> PeerConfig field; every flag is also settable in a peer config file or with --set
_FLAG_FIELDS = {
    "host": "network.host",
    "port": "network.port",
    "announce_host": "network.announce_host",
    "threads": "threads",
    "data": "trainer.data",
    "text_field": "trainer.text_field",
    "tokenizer": "trainer.tokenizer",
    "tensorboard": "trainer.tensorboard",
    "wandb": "trainer.wandb",
    "seed": "trainer.seed",
    "max_micro_batches": "trainer.max_micro_batches",
    "max_inflight": "trainer.max_inflight",
    "eval_every": "trainer.eval_every",
    "log_file": "trainer.log_file",
    "progress": "trainer.progress",
    "tp": "parallel.tp",
    "devices": "parallel.devices",
    "checkpoints": "coordinator.checkpoint_dir",
    "metrics_port": "metrics.port",
    "metrics_host": "metrics.host",
    "dashboard_port": "dashboard.port",
    "dashboard_host": "dashboard.host",
    "invite": "security.invite",
}


SPEC_SECTIONS = {f.name for f in dataclasses.fields(RunSpec)}  # `--set` on these goes to the run spec


# ---- settings from flags ----------------------------------------------------------------------
def _free_port(host: str) -> int:
    try:
        with socket.socket() as s:
            s.bind((host if host not in ("", "0.0.0.0") else "", 0))
            return s.getsockname()[1]
    except OSError as e:
        raise ConfigError(f"--host {host}: cannot listen there ({e.strerror or e})") from None


def _maddr(host: str, port: int) -> str:
    """The multiaddr of `host` (an IPv4 or IPv6 address, or a DNS name) and a TCP port."""
    try:
        kind = "ip4" if ipaddress.ip_address(host).version == 4 else "ip6"
    except ValueError:
        kind = "dns"
    return f"/{kind}/{host}/tcp/{port}"


def _dht_port(args: argparse.Namespace, cfg: PeerConfig) -> int | None:
    """The DHT port: --dht-port; for an announced address, the config file's, else --port + 1, else a free one."""
    if args.dht_port:
        return args.dht_port
    if not args.announce_host:
        return None
    configured = [m for m in cfg.network.dht_host_maddrs if not m.endswith("/tcp/0")]
    if configured:
        return int(configured[0].rsplit("/", 1)[1])
    return args.port + 1 if args.port else _free_port(args.host or "0.0.0.0")


def split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """`--set` items for the run spec (its sections and fields) and for the peer's own settings."""
    spec, peer = [], []
    for item in items:
        (spec if item.partition("=")[0].strip().split(".")[0] in SPEC_SECTIONS else peer).append(item)
    return spec, peer


def peer_config(args: argparse.Namespace, overrides: list[str] | None = None) -> PeerConfig:
    """The peer's settings: its config file, then its flags, then `overrides` (default: all its --set items)."""
    overrides = args.set if overrides is None else overrides
    cfg = PeerConfig.from_toml(args.config) if args.config else PeerConfig()
    for flag, path in _FLAG_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None and value is not False:
            set_path(cfg, path, value)
    host = args.host or "0.0.0.0"
    dht_port = _dht_port(args, cfg)  # an announced DHT address needs a fixed port
    if args.host is not None or dht_port is not None:
        cfg.network.dht_host_maddrs = [_maddr(host, dht_port or 0)]
    if args.announce_host:
        cfg.network.dht_announce_maddrs = [_maddr(args.announce_host, dht_port)]
    if args.identity:
        cfg.identity = args.identity
    for item in overrides:
        apply_override(cfg, item)
    cfg.validate()
    return cfg


def load_identity(cfg: PeerConfig) -> Identity:
    identity = Identity.load_or_create(cfg.identity or None)
    identity.lock()
    return identity


def place_device(args: argparse.Namespace, cfg: PeerConfig) -> None:
    """--device: the experts' device on an expert host, the stage's on a server; refused elsewhere."""
    if not args.device:
        return
    if args.experts is not None:
        cfg.experts.device = args.device
    elif args.role == "server":
        if args.devices or cfg.parallel.tp != 1:
            raise ConfigError("--device places a whole stage; with --tp give one device per rank with --devices")
        cfg.parallel.devices = [args.device]
    else:
        raise ConfigError(f"--device: a {args.role} holds no weights; it is for servers and expert hosts")

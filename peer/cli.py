"""The `peer` command: coordinator, join, status, keygen, export, generate, demo.

Startup is short on purpose: this module imports neither torch nor hivemind, so `peer --help`
answers at once; each command imports what it needs when it runs (the lazy imports below are
there for that reason). Every failure the user can act on (dht.errors.UserError) is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import socket
import sys

from dht.address import AddressError, answering, check_reachable, coordinator_peer_id
from dht.errors import UserError
from dht.identity import Identity, default_identity_path
from peer.config import ConfigError, PeerConfig, RunSpec, apply_override, set_path
from protocols.version import software_version

# flag -> PeerConfig field; every flag is also settable in a peer config file or with --set
_FLAG_FIELDS = {
    "host": "network.host",
    "port": "network.port",
    "announce_host": "network.announce_host",
    "threads": "threads",
    "data": "trainer.data",
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
    "dashboard_port": "dashboard.port",
    "invite": "security.invite",
}
SPEC_SECTIONS = {f.name for f in dataclasses.fields(RunSpec)}  # `--set` on these goes to the run spec
LONG_RUNNING = ("coordinator", "join", "demo", "status")  # commands whose children the reaper watches


# ---- the parser -------------------------------------------------------------------------------
def _add_peer_flags(p: argparse.ArgumentParser, spec_too: bool = False) -> None:
    p.add_argument(
        "--identity", help=f"this peer's Ed25519 key (created on first use; default {default_identity_path()})"
    )
    p.add_argument("--config", help="a TOML file of peer settings (see docs/run-spec.md); flags override it")
    what = "any peer setting or run-spec field" if spec_too else "any peer setting"
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override {what}, e.g. --set network.record_ttl=20"
        + (" or --set training.lr=1e-3" if spec_too else "")
        + " (VALUE in TOML syntax)",
    )
    p.add_argument("--host", help="address to listen on for gRPC and the DHT (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="gRPC port (default: any free one)")
    p.add_argument(
        "--dht-port",
        type=int,
        help="DHT (libp2p) port (default: any free one; with --announce-host, --port + 1 when --port is given)",
    )
    p.add_argument("--announce-host", help="address other machines dial to reach this one (public IP or name)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--metrics-port", type=int, help="Prometheus metrics on this HTTP port (default: any free one; -1: none)"
    )


def _add_coordinator(sub) -> None:
    p = sub.add_parser("coordinator", help="start a run: publishes the signed run spec, admits peers, checkpoints")
    p.add_argument("spec", help="the run spec, a TOML file (see examples/run.toml)")
    p.add_argument("--info-file", default="", help="also write the multiaddrs and join line to this JSON file")
    p.add_argument(
        "--initial-peers",
        nargs="+",
        action="extend",
        default=[],
        metavar="MADDR",
        help="start the run on an existing DHT through these multiaddrs (e.g. a hivemind-dht bootstrap node)",
    )
    p.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="write checkpoints of the run here (every coordinator.checkpoint_every_minutes / _steps)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="go on from a checkpoint (a checkpoint directory, or the newest complete one in DIR): "
        "servers that join start from its weights",
    )
    p.add_argument(
        "--dashboard-port",
        type=int,
        help="the web dashboard (swarm map, training curves, events) on this HTTP port "
        "(default: any free one; -1: none)",
    )
    _add_peer_flags(p, spec_too=True)

    p = sub.add_parser("coordinator-invite", help="(peer coordinator invite) print a single-use invite code")
    p.add_argument("--spec", required=True, help="the run spec the coordinator runs (names the run)")
    p.add_argument(
        "--roles",
        default="server,experts,trainer",
        help="what the invited peer may do (default: server,experts,trainer)",
    )
    p.add_argument("--hours", type=float, default=72.0, help="how long the code can be used (default 72)")
    p.add_argument("--identity", help="the coordinator's key (default: the user's)")
    p = sub.add_parser("coordinator-revoke", help="(peer coordinator revoke PEER) revoke a peer's credential")
    p.add_argument("peer", help="the peer id to revoke")
    p.add_argument("--spec", required=True, help="the run spec the coordinator runs (names the run)")
    p.add_argument("--reason", default="revoked by the run's owner", help="why (shown to the peer when it renews)")
    p.add_argument("--identity", help="the coordinator's key (default: the user's)")


def _add_join(sub) -> None:
    p = sub.add_parser(
        "join", help="join a run as a stage server (default), an expert host (--experts), a trainer or a relay"
    )
    p.add_argument(
        "maddr",
        help="the coordinator's multiaddr (/ip4/HOST/tcp/PORT/p2p/ID), or with --coordinator any peer's of the run",
    )
    p.add_argument(
        "--coordinator",
        metavar="PEER_ID",
        help="the run's coordinator (the /p2p/ part of the address it printed): then MADDR may be any peer of "
        "the run or a DHT bootstrap node, and the coordinator need not be up to join (with admission off)",
    )
    p.add_argument(
        "--role",
        choices=["server", "trainer", "relay"],
        default="server",
        help="server (default): serve a stage; trainer: train; relay: only carry the calls of peers that "
        "cannot be dialled (behind NAT), on a reachable machine",
    )
    p.add_argument("--invite", metavar="CODE", help="an invite code from the coordinator (runs that admit by invite)")
    p.add_argument(
        "--stage",
        type=int,
        help="serve this stage and stay on it (default: the stage with the least throughput, moving later if "
        "another stage needs the server more)",
    )
    p.add_argument(
        "--experts",
        metavar="N|L.E,...",
        help="host experts of the run's MoE layers: N of them (the least-replicated), or a list like 1.0,1.5 "
        "(expert 0 and 5 of block 1)",
    )
    p.add_argument(
        "--device",
        help="torch device of a server or expert host (default: cuda when there is one, else cpu); "
        "several for --tp: --devices",
    )
    p.add_argument(
        "--tp",
        type=int,
        help="server: split the stage over N tensor-parallel ranks in this box (NCCL on GPUs, gloo on CPU)",
    )
    p.add_argument(
        "--devices",
        type=lambda text: [d.strip() for d in text.split(",") if d.strip()],
        metavar="DEV,...",
        help="server: one torch device per rank, e.g. cuda:0,cuda:1 (default: cuda:0.. when there are enough, else cpu)",
    )
    p.add_argument("--data", help="trainer: a text file or directory (default: Python's standard library)")
    p.add_argument("--seed", type=int, help="trainer: seed of the micro-batch order")
    p.add_argument("--max-micro-batches", type=int, help="trainer: stop after this many micro-batches")
    p.add_argument("--max-inflight", type=int, help="trainer: micro-batches in the pipeline at once")
    p.add_argument("--eval-every", type=int, help="trainer: validate every N optimizer steps")
    p.add_argument("--log-file", help="trainer: write JSON lines of losses here")
    p.add_argument(
        "--progress",
        action="store_true",
        default=None,
        help="trainer: print progress lines when the output is not a terminal (a terminal gets a live bar)",
    )
    _add_peer_flags(p)


def _add_tools(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights to one safetensors file")
    p.add_argument("checkpoint", help="a checkpoint directory, or a directory of them (the newest complete one)")
    p.add_argument("out", help="the .safetensors file to write (loads into peer.model.StageModel)")

    p = sub.add_parser("generate", help="sample text from a checkpoint with the plain model (no swarm needed)")
    p.add_argument("checkpoint", help="a checkpoint directory (or a directory of them), or a `peer export` file")
    p.add_argument("--prompt", default="", help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest byte")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")

    p = sub.add_parser("status", help="print a table of a run's stages, servers and trainers")
    p.add_argument("maddr", help="the coordinator's multiaddr, or with --coordinator any peer's of the run")
    p.add_argument("--coordinator", metavar="PEER_ID", help="the run's coordinator, when MADDR is another peer")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the DHT and the spec")

    p = sub.add_parser("keygen", help="create this peer's Ed25519 identity and print its peer id")
    p.add_argument("--identity", help=f"where to write the key (default {default_identity_path()})")
    p.add_argument("--force", action="store_true", help="replace an existing key (its peer id is lost for good)")

    p = sub.add_parser("demo", help="run a whole small swarm on this machine and train for a few minutes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps to train (default: the demo spec's)")
    p.add_argument("--workdir", default="", help="keep logs and keys here (default: a temporary directory)")
    p.add_argument("--spec", default="", help="a run spec to use instead of the demo's")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer", description="Swarmtrain: train one model on computers lent by many people."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s (swarmtrain) {software_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_join(sub)
    _add_tools(sub)
    return parser


def normalize_argv(argv: list[str]) -> list[str]:
    """`peer coordinator invite|revoke ...` are commands of their own (coordinator-invite, ...)."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "coordinator" and argv[i + 1] in ("invite", "revoke"):
            argv[i : i + 2] = [f"coordinator-{argv[i + 1]}"]
            break
        if not arg.startswith("-"):
            break
    return argv


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


def _peer_config(args: argparse.Namespace, overrides: list[str] | None = None) -> PeerConfig:
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


def _identity(cfg: PeerConfig) -> Identity:
    identity = Identity.load_or_create(cfg.identity or None)
    identity.lock()
    return identity


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("peer").setLevel(logging.INFO)


# ---- the commands -----------------------------------------------------------------------------
def _keygen(args: argparse.Namespace) -> int:
    path = args.identity or default_identity_path()
    identity = Identity.create(path, replace=args.force)
    print(f"identity {path}\npeer id {identity.peer_id}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from peer.demo import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir, spec_path=args.spec)


def _generate(args: argparse.Namespace) -> int:
    from peer.generate import load_model, sample

    model = load_model(args.checkpoint)
    try:
        text = sample(model, args.prompt.encode(), args.tokens, args.temperature, args.top_k, args.seed)
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}") from None
    print(args.prompt + text.decode("utf-8", errors="replace"))
    return 0


def _export(args: argparse.Namespace) -> int:
    from peer.checkpoint import export

    count, params = export(args.checkpoint, args.out)
    print(f"Wrote {count} tensors ({params / 1e6:.2f}M parameters) to {args.out}.")
    return 0


def _status(args: argparse.Namespace) -> int:
    coordinator = coordinator_peer_id(args.maddr, args.coordinator)
    check_reachable(args.maddr, PeerConfig().network.connect_timeout)  # said in seconds, before the imports
    from dht.node import SwarmDHT  # lazy: hivemind and torch
    from peer.security import gate_for
    from peer.status import gather, render
    from peer.swarm import fetch_spec

    dht = SwarmDHT(Identity.generate(), [args.maddr], ["/ip4/0.0.0.0/tcp/0"], [], args.timeout, 5.0)
    try:
        spec = fetch_spec(dht, coordinator, timeout=args.timeout)
        dht.gate = gate_for(spec, coordinator)  # only admitted peers' records
        render(spec, gather(dht, spec))
    finally:
        dht.shutdown()
    return 0


def _admission(args: argparse.Namespace) -> int:
    from dht.identity import public_key_from_peer_id
    from peer.admission_files import create_invite, invites_file, revoke, revoked_file

    spec = RunSpec.from_toml(args.spec)
    identity = Identity.load(args.identity or default_identity_path())  # the running coordinator's key
    if args.command == "coordinator-invite":
        if spec.admission.mode != "invite":
            print(f"note: run '{spec.name}' has admission.mode = {spec.admission.mode!r}; codes count in invite mode")
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        try:
            code = create_invite(invites_file(identity, spec), roles, args.hours)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        print(f"Invite code (single use, {', '.join(roles)}, valid {args.hours:g} h):\n  {code}")
        print(f"The invited peer joins with:\n  peer join ADDR --invite {code}")
        return 0
    public_key_from_peer_id(args.peer)  # IdentityError names a malformed peer id
    added = revoke(revoked_file(identity, spec), args.peer, args.reason)
    said = "Revoked" if added else "Already revoked:"
    print(
        f"{said} {args.peer}. The running coordinator publishes it within a few seconds; every peer drops it "
        f"within admission.refresh ({spec.admission.refresh:g} s) after that."
    )
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    spec_overrides, peer_overrides = split_overrides(args.set)
    spec = RunSpec.from_toml(args.spec)
    for item in spec_overrides:
        apply_override(spec, item)
    spec.validate()
    cfg = _peer_config(args, peer_overrides)
    if args.initial_peers:  # an existing DHT: said in seconds if none of its addresses answers
        answer = answering(args.initial_peers, cfg.network.connect_timeout)
        if not answer:
            raise AddressError(f"--initial-peers: none of {', '.join(args.initial_peers)} answers")
        args.initial_peers = answer
    from peer.coordinator import run_coordinator  # lazy: hivemind and torch
    from peer.join import set_threads

    set_threads(cfg.threads)
    run_coordinator(
        spec, cfg, _identity(cfg), info_file=args.info_file, resume=args.resume or "", initial=args.initial_peers
    )
    return 0


def _join(args: argparse.Namespace) -> int:
    spec_overrides, peer_overrides = split_overrides(args.set)
    if spec_overrides:
        field = spec_overrides[0].partition("=")[0]
        raise ConfigError(f"{field}: a field of the run spec, which its coordinator sets for every peer")
    cfg = _peer_config(args, peer_overrides)
    _place_device(args, cfg)
    coordinator_peer_id(args.maddr, args.coordinator)  # a malformed address or id is said at once,
    check_reachable(args.maddr, cfg.network.connect_timeout)  # and a dead one in seconds, before the imports
    from peer.join import run_experts, run_relay, run_server, run_trainer, set_threads  # lazy: torch, hivemind

    set_threads(cfg.threads)
    if args.experts is not None:
        if args.role != "server" or args.stage is not None:
            raise ConfigError("--experts makes this peer an expert host: leave out --role and --stage")
        if cfg.parallel.tp != 1:
            raise ConfigError("--tp splits a stage; expert hosts hold whole experts (use --device)")
        run_experts(args.maddr, cfg, _identity(cfg), args.experts, args.coordinator)
        return 0
    if args.role == "trainer":
        if args.stage is not None:
            raise ConfigError("--stage is for servers; a trainer uses every stage")
        if cfg.parallel.tp != 1 or cfg.parallel.devices:
            raise ConfigError("--tp and --devices are for stage servers, not trainers")
        return run_trainer(args.maddr, cfg, _identity(cfg), args.coordinator)
    if args.role == "relay":
        if args.stage is not None or cfg.parallel.tp != 1:
            raise ConfigError("--stage and --tp are for stage servers; a relay serves no part")
        run_relay(args.maddr, cfg, _identity(cfg), args.coordinator)
        return 0
    run_server(args.maddr, cfg, _identity(cfg), args.stage, args.coordinator)
    return 0


def _place_device(args: argparse.Namespace, cfg: PeerConfig) -> None:
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


COMMANDS = {
    "keygen": _keygen,
    "demo": _demo,
    "status": _status,
    "coordinator-invite": _admission,
    "coordinator-revoke": _admission,
    "generate": _generate,
    "export": _export,
    "coordinator": _coordinator,
    "join": _join,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.command in LONG_RUNNING:
        import multiprocessing as mp

        from peer.lifetime import start_reaper

        start_reaper()  # before any child process: everything this command starts ends with it
        mp.set_start_method("fork", force=True)  # hivemind needs fork; gRPC objects are created after its processes
    _setup_logging(args.verbose)
    try:
        return COMMANDS[args.command](args) or 0
    except ConfigError as e:
        print(f"peer {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"peer {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.filename is None:
            raise
        print(f"peer {args.command}: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `peer` command line: every subcommand and flag (argparse)."""

from __future__ import annotations

import argparse

from dht.identity import default_identity_path
from protocols.version import software_version


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
    p.add_argument(
        "--metrics-host",
        help="address the metrics listen on (default 127.0.0.1: this machine only; they have no authentication)",
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
    p.add_argument(
        "--dashboard-host",
        help="address the dashboard listens on (default 127.0.0.1: this machine only; it has no authentication; "
        "0.0.0.0 opens it to anyone who can reach this machine)",
    )
    _add_peer_flags(p, spec_too=True)

    p = sub.add_parser("coordinator-invite", help="(peer coordinator invite) print an invite code")
    p.add_argument("--spec", required=True, help="the run spec the coordinator runs (names the run)")
    p.add_argument(
        "--roles",
        default="server,experts,trainer",
        help="what the invited peer may do (default: server,experts,trainer)",
    )
    p.add_argument("--hours", type=float, default=72.0, help="how long the code can be used (default 72)")
    p.add_argument("--uses", type=int, default=1, help="how many peers (each its own key) it admits (default 1)")
    p.add_argument("--identity", help="the coordinator's key (default: the user's)")
    p = sub.add_parser("coordinator-revoke", help="(peer coordinator revoke PEER) revoke a peer's credential")
    p.add_argument("peer", help="the peer id to revoke")
    p.add_argument("--spec", required=True, help="the run spec the coordinator runs (names the run)")
    p.add_argument("--reason", default="revoked by the run's owner", help="why (shown to the peer when it renews)")
    p.add_argument("--identity", help="the coordinator's key (default: the user's)")
    p = sub.add_parser(
        "coordinator-pardon",
        help="(peer coordinator pardon PEER) take a peer off the revocation list (an appeal: spot checks it failed "
        "before no longer count)",
    )
    p.add_argument("peer", help="the peer id to pardon")
    p.add_argument("--spec", required=True, help="the run spec the coordinator runs (names the run)")
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
    _add_trainer_flags(p)
    _add_peer_flags(p)


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `peer join --role trainer`."""
    p.add_argument(
        "--data",
        help="trainer: a file or directory of text, .jsonl, .parquet, .arrow or saved datasets, streamed "
        "(default: Python's standard library)",
    )
    p.add_argument("--text-field", help="trainer: the JSON field or column holding the text (default: text)")
    p.add_argument("--tokenizer", help="trainer: its copy of the run's tokenizer directory (default: the spec's)")
    p.add_argument("--tensorboard", metavar="DIR", help="trainer: write TensorBoard event files here")
    p.add_argument("--wandb", metavar="PROJECT", help="trainer: log to this Weights & Biases project")
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


def _add_tools(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory (transformers loads it)")
    p.add_argument("checkpoint", help="a checkpoint directory, or a directory of them (the newest complete one)")
    p.add_argument("out", help="the directory to write (new or empty): config.json, safetensors, tokenizer files")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the weights' dtype (training keeps float32 master weights)",
    )

    p = sub.add_parser("generate", help="sample text from a checkpoint with the plain model (no swarm needed)")
    p.add_argument("checkpoint", help="a checkpoint directory (or a directory of them), or a `peer export` directory")
    p.add_argument("--prompt", default="", help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (bytes, for the byte-level model)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest byte")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")

    p = sub.add_parser(
        "tokenizer-train", help="(peer tokenizer train DATA... --vocab-size N --out DIR) train a byte-level BPE"
    )
    p.add_argument("data", nargs="+", help="files or directories of text, .jsonl, .parquet, .arrow or saved datasets")
    p.add_argument("--vocab-size", type=int, required=True, help="tokens, with the 256 bytes and 2 special tokens")
    p.add_argument("--out", required=True, help="the directory to write (AutoTokenizer.from_pretrained loads it)")
    p.add_argument("--text-field", default="text", help="the JSON field or column holding the text")
    p.add_argument("--max-bytes", type=float, default=0, help="train on at most this much text (0: all of it)")

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
    """`peer coordinator invite|revoke ...` and `peer tokenizer train` are commands of their own (coordinator-invite, ...)."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if (arg, argv[i + 1]) in (
            ("coordinator", "invite"),
            ("coordinator", "revoke"),
            ("coordinator", "pardon"),
            ("tokenizer", "train"),
        ):
            argv[i : i + 2] = [f"{arg}-{argv[i + 1]}"]
            break
        if not arg.startswith("-"):
            break
    return argv

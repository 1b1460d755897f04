"""One function per `peer` command. Each imports the runtime it needs when it runs (torch, hivemind), so
that `peer --help` and quick commands answer at once: the imports inside functions below are there for that."""

from __future__ import annotations

import argparse

from dht.address import AddressError, answering, check_reachable, coordinator_peer_id
from dht.identity import Identity, default_identity_path, public_key_from_peer_id
from peer.cli.options import load_identity, peer_config, place_device, split_overrides
from peer.config import ConfigError, PeerConfig, RunSpec, apply_override
from peer.config.model_dir import resolve as resolve_model_dir
from peer.coordinator.admission_files import create_invite, invites_file, pardon, revoke, revoked_file
from peer.process import memory


# ---- the commands -----------------------------------------------------------------------------
def _keygen(args: argparse.Namespace) -> int:
    path = args.identity or default_identity_path()
    identity = Identity.create(path, replace=args.force)
    print(f"identity {path}\npeer id {identity.peer_id}")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from peer.data.tokenizer import train_tokenizer
    from peer.data.training_text import texts_of  # lazy: datasets

    texts = texts_of(args.data, args.text_field, int(args.max_bytes))
    tokenizer = train_tokenizer(texts, args.vocab_size, Path(args.out))
    print(
        f"Wrote a byte-level BPE tokenizer of {tokenizer.vocab_size} tokens to {args.out}/ (fingerprint "
        f"{tokenizer.fingerprint}); in the run spec: [data] tokenizer = {str(args.out)!r}, and "
        f"[model] vocab_size >= {tokenizer.vocab_size}."
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from peer.cli.demo import run_demo  # lazy: torch (its data)

    return run_demo(steps=args.steps, workdir=args.workdir, spec_path=args.spec)


def _generate(args: argparse.Namespace) -> int:
    from peer.cli.generate import Codec, load_model, sample  # lazy: torch

    model, codec = load_model(args.checkpoint), Codec(args.checkpoint)
    try:
        ids = sample(model, codec.encode(args.prompt), args.tokens, args.temperature, args.top_k, args.seed)
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}") from None
    print(args.prompt + codec.decode(ids))
    return 0


def _export(args: argparse.Namespace) -> int:
    from peer.coordinator.export import export  # lazy: torch

    count, params, files = export(args.checkpoint, args.out, dtype=args.dtype)
    print(f"Wrote {count} tensors ({params / 1e6:.2f}M parameters) to {args.out}/: {', '.join(files)}.")
    print(f"Load it with transformers: AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0


def _status(args: argparse.Namespace) -> int:
    coordinator = coordinator_peer_id(args.maddr, args.coordinator)
    check_reachable(args.maddr, PeerConfig().network.connect_timeout)  # said in seconds, before the imports
    # lazy: hivemind and torch, after the address was checked in seconds
    from dht.node import SwarmDHT
    from peer.net.security import gate_for
    from peer.swarm.discovery import fetch_spec
    from peer.swarm.status import gather, render

    dht = SwarmDHT(Identity.generate(), [args.maddr], ["/ip4/0.0.0.0/tcp/0"], [], args.timeout, 5.0)
    try:
        spec = fetch_spec(dht, coordinator, timeout=args.timeout)
        dht.gate = gate_for(spec, coordinator, dht)  # only admitted, unrevoked peers' records
        render(spec, gather(dht, spec))
    finally:
        dht.shutdown()
    return 0


def _admission(args: argparse.Namespace) -> int:
    spec = RunSpec.from_toml(args.spec)
    identity = Identity.load(args.identity or default_identity_path())  # the running coordinator's key
    if args.command == "coordinator-invite":
        if spec.admission.mode != "invite":
            print(f"note: run '{spec.name}' has admission.mode = {spec.admission.mode!r}; codes count in invite mode")
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        try:
            code = create_invite(invites_file(identity, spec), roles, args.hours, args.uses)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        uses = "single use" if args.uses == 1 else f"for {args.uses} peers"
        print(f"Invite code ({uses}, {', '.join(roles)}, valid {args.hours:g} h):\n  {code}")
        print(f"The invited peer joins with:\n  peer join ADDR --invite {code}")
        return 0
    public_key_from_peer_id(args.peer)  # IdentityError names a malformed peer id
    if args.command == "coordinator-pardon":
        removed = pardon(revoked_file(identity, spec), args.peer)
        said = "Pardoned" if removed else "Not revoked (its past spot checks no longer count):"
        print(f"{said} {args.peer}. The running coordinator publishes the list without it within a few seconds.")
        return 0
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
    spec = resolve_model_dir(spec)  # [model] path: its config.json into the spec, which peers then get signed
    spec.validate()
    from peer.data.tokenizer import pin_tokenizer  # lazy: tokenizers

    spec = pin_tokenizer(spec)  # [data] tokenizer: its fingerprint into the signed spec
    cfg = peer_config(args, peer_overrides)
    if args.initial_peers:  # an existing DHT: said in seconds if none of its addresses answers
        answer = answering(args.initial_peers, cfg.network.connect_timeout)
        if not answer:
            raise AddressError(f"--initial-peers: none of {', '.join(args.initial_peers)} answers")
        args.initial_peers = answer
    # lazy: hivemind and torch, after the arguments and addresses were checked in seconds
    from peer.cli.join import set_threads
    from peer.coordinator.coordinator import run_coordinator
    from peer.coordinator.pretrained import pin_weights

    set_threads(cfg.threads)
    memory.limit_arenas(cfg.malloc_arenas)
    spec = pin_weights(spec)  # a model directory's weights: every tensor checked, their hash in the signed spec
    run_coordinator(
        spec, cfg, load_identity(cfg), info_file=args.info_file, resume=args.resume or "", initial=args.initial_peers
    )
    return 0


def _join(args: argparse.Namespace) -> int:
    spec_overrides, peer_overrides = split_overrides(args.set)
    if spec_overrides:
        field = spec_overrides[0].partition("=")[0]
        raise ConfigError(f"{field}: a field of the run spec, which its coordinator sets for every peer")
    cfg = peer_config(args, peer_overrides)
    place_device(args, cfg)
    coordinator_peer_id(args.maddr, args.coordinator)  # a malformed address or id is said at once,
    check_reachable(args.maddr, cfg.network.connect_timeout)  # and a dead one in seconds, before the imports
    # lazy: hivemind and torch, after the arguments and the address were checked in seconds
    from peer.cli.join import set_threads
    from peer.cli.role_experts import run_experts
    from peer.cli.role_relay import run_relay
    from peer.cli.role_server import run_server
    from peer.cli.role_trainer import run_trainer

    set_threads(cfg.threads)
    memory.limit_arenas(cfg.malloc_arenas)
    if args.experts is not None:
        if args.role != "server" or args.stage is not None:
            raise ConfigError("--experts makes this peer an expert host: leave out --role and --stage")
        if cfg.parallel.tp != 1:
            raise ConfigError("--tp splits a stage; expert hosts hold whole experts (use --device)")
        run_experts(args.maddr, cfg, load_identity(cfg), args.experts, args.coordinator)
        return 0
    if args.role == "trainer":
        if args.stage is not None:
            raise ConfigError("--stage is for servers; a trainer uses every stage")
        if cfg.parallel.tp != 1 or cfg.parallel.devices:
            raise ConfigError("--tp and --devices are for stage servers, not trainers")
        return run_trainer(args.maddr, cfg, load_identity(cfg), args.coordinator)
    if args.role == "relay":
        if args.stage is not None or cfg.parallel.tp != 1:
            raise ConfigError("--stage and --tp are for stage servers; a relay serves no part")
        run_relay(args.maddr, cfg, load_identity(cfg), args.coordinator)
        return 0
    run_server(args.maddr, cfg, load_identity(cfg), args.stage, args.coordinator)
    return 0


COMMANDS = {
    "keygen": _keygen,
    "tokenizer-train": _tokenizer_train,
    "demo": _demo,
    "status": _status,
    "coordinator-invite": _admission,
    "coordinator-revoke": _admission,
    "coordinator-pardon": _admission,
    "generate": _generate,
    "export": _export,
    "coordinator": _coordinator,
    "join": _join,
}

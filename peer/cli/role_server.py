"""`peer join` as a stage server: choose a stage, build its runtime (whole or tensor-parallel), serve it."""

from __future__ import annotations

import asyncio
import os
import sys

import torch

from dht.identity import Identity
from peer.cli.join import connect, follow_admission, rejoin_argv, until_signalled
from peer.config import ConfigError, PeerConfig, RunSpec
from peer.model.runtime import COMPUTE_DTYPES, StageRuntime
from peer.model.tp import TPGroup, check_degree
from peer.model.tp_runtime import Ranks, ShardedStageRuntime, tp_devices
from peer.net.metrics import open_metrics, serve_metrics
from peer.process import memory
from peer.server.averaging import GradientAverager
from peer.server.dispatch import RemoteExperts
from peer.server.stage import StageServer
from peer.swarm.discovery import choose_stage


def _server_levels(server) -> dict:
    rt = server.runtime
    return {
        "step": ("gauge", "Training steps of this server's part", rt.progress),
        "samples_accumulated": ("gauge", "Samples in the accumulator, not yet in a step", rt.samples_accumulated),
        "samples_stepped": (
            "counter",
            "Samples accounted by finished steps (whole averaging group)",
            rt.samples_stepped,
        ),
        "throughput": ("gauge", "Measured samples/s of forward+backward", rt.throughput),
        "duplicates": ("counter", "Backwards a caller sent again, answered without being added twice", rt.duplicates),
        "queue_depth": ("gauge", "Requests running or queued", server.inflight),
        "steps_averaged": ("counter", "Steps averaged with other replicas", server.steps_averaged),
        "steps_alone": ("counter", "Steps taken alone", server.steps_alone),
        **server.push_levels(),
        **(server.uplink.levels() if server.uplink is not None else {}),
    }


def run_server(
    maddr: str, cfg: PeerConfig, identity: Identity, stage: int | None, coordinator: str | None = None
) -> None:
    dht, spec = connect(maddr, cfg, identity, "server", coordinator)
    averager = server = ranks = deadline = None
    try:
        splittable = _servable_stages(spec, cfg, stage)
        balance = cfg.server.rebalance == "always" or (cfg.server.rebalance == "auto" and stage is None)
        if stage is None:
            stage = choose_stage(dht, spec, splittable, cfg.server.balance_claim_cap)
        blocks = spec.stage_blocks(stage)
        print(
            f"Joined run '{spec.name}' (spec signed by its coordinator). Serving stage {stage} of "
            f"{spec.stages.num_stages} (blocks {blocks.start}-{blocks.stop - 1}).",
            flush=True,
        )
        experts = _remote_experts(spec, stage, cfg, dht)
        runtime, ranks = _stage_runtime(spec, stage, cfg, experts)
        runtime.configure_clipping(cfg.server.clip_factor, cfg.server.clip_window)
        runtime.perturb_outputs = cfg.server.perturb_outputs
        if cfg.server.perturb_outputs:
            print(f"DRILL: this server adds noise (std {cfg.server.perturb_outputs:g}) to its outputs.", flush=True)
        averager = GradientAverager(spec)
        if ranks is not None:
            ranks.start_group(runtime.tp, cfg.parallel.collective_timeout)
            print(
                f"Split stage {stage} over {runtime.tp_degree} tensor-parallel ranks on {', '.join(runtime.devices)} "
                f"(ranks 1.. are pids {', '.join(map(str, ranks.pids))}).",
                flush=True,
            )
        server = StageServer(spec, stage, cfg, dht, runtime, averager, balance=balance)
        server.before_serving = lambda before: _loaded(runtime, cfg, spec, experts, before)
        server.allowed_stages = splittable
        server.metrics = open_metrics(cfg, "stage server", lambda: _server_levels(server), dht)
        deadline = _serve(server, dht, cfg, experts, ranks)
    finally:
        if ranks is not None:
            ranks.close()
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    if ranks is not None and ranks.dead:
        raise SystemExit(f"peer join: {ranks.dead}; this peer stopped (the swarm routes around it)")
    if server is not None and server.move_to is not None:
        _rejoin(server.move_to, deadline)


def _servable_stages(spec: RunSpec, cfg: PeerConfig, stage: int | None) -> set[int]:
    """The stages this peer can serve (a peer split over tensor-parallel ranks: those that split over them);
    ConfigError for a --stage or settings that cannot be."""
    n = spec.stages.num_stages
    if stage is not None and not 0 <= stage < n:
        raise ConfigError(f"--stage {stage}: run '{spec.name}' has stages 0..{n - 1}")
    mode = cfg.server.rebalance
    if mode not in ("auto", "always", "never"):
        raise ConfigError(f"server.rebalance: must be auto, always or never, got {mode!r}")
    splittable = {s for s in range(n) if check_degree(spec, s, cfg.parallel.tp) is None}
    if not splittable:
        raise ConfigError(f"--tp {cfg.parallel.tp}: {check_degree(spec, 0, cfg.parallel.tp)}")
    return splittable


def _remote_experts(spec: RunSpec, stage: int, cfg: PeerConfig, dht) -> RemoteExperts | None:
    """The expert hosts of the stage's MoE layers (the gates live here), or None when it has none."""
    if not any(layer in spec.stage_blocks(stage) for layer in spec.moe_layers()):
        return None
    experts = RemoteExperts(spec, stage, cfg, dht)
    print(f"Blocks {experts.layers} are mixture-of-experts layers; their experts live on expert hosts.")
    return experts


def _loaded(runtime, cfg: PeerConfig, spec: RunSpec, experts, before: int) -> None:
    """Torch thread, the stage's weights just in: what holding them took (`before`: bytes resident
    before they came), then its throughput."""
    weights = sum(p.numel() * p.element_size() for p in runtime.params)
    mb = lambda n: f"{n / 2**20:.0f} MB"  # noqa: E731
    print(
        f"Memory: {mb(memory.peak())} at most by the time the stage's weights ({mb(weights)}) were in, "
        f"{mb(before)} before they came.",
        flush=True,
    )
    _set_throughput(runtime, cfg, spec, experts)


def _set_throughput(runtime, cfg: PeerConfig, spec: RunSpec, experts) -> None:
    """The stage's samples/s on this machine, as configured (server.throughput) or measured."""
    if cfg.server.throughput > 0:
        runtime.throughput, runtime.fixed_throughput = cfg.server.throughput, True
        print(f"Announcing {cfg.server.throughput:.1f} samples/s for this stage (server.throughput).", flush=True)
        return
    if experts is not None:
        experts.offline = True  # time this stage's own work; the experts' is their hosts'
    rate = runtime.benchmark(spec.training.micro_batch_size, spec.training.seq_len)
    if experts is not None:
        experts.offline = False
    print(f"Measured {rate:.1f} samples/s for this stage on this machine.", flush=True)


def _serve(server: StageServer, dht, cfg: PeerConfig, experts, ranks):
    """Serve until told to leave (or to move); the exit deadline's timer."""

    async def start():
        if ranks is not None:  # a rank that dies ends this peer: leave cleanly (exit_grace bounds it)
            loop = asyncio.get_running_loop()
            ranks.on_death = lambda reason: loop.call_soon_threadsafe(server.done.set)
        if experts is not None:
            await experts.bind()
        follow_admission(dht, server.done.set)
        serve_metrics(server.metrics, cfg)
        if await server.start():  # uplink.NoRelay: it cannot be dialled and no relay took it
            print(f"Serving stage {server.stage} at {server.endpoint} from step {server.runtime.epoch}.", flush=True)

    async def stop():
        if server.move_to is None:
            print("Leaving the swarm...", flush=True)
        else:
            print(f"Moving from stage {server.stage} to stage {server.move_to}...", flush=True)
        await server.stop()
        if experts is not None:
            await experts.close()

    moving = lambda: server.move_to is not None  # noqa: E731
    return asyncio.run(
        until_signalled(start, stop, server.done, cfg.server.leave_timeout + cfg.server.handover_timeout, moving)
    )


def _rejoin(stage: int, deadline) -> None:
    """This peer again, as a fresh process serving `stage`: hivemind's DHT node, which forks, must be created
    before any gRPC object in a process; the identity (same peer id) and settings carry over."""
    if deadline is not None:
        deadline.cancel()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, rejoin_argv(sys.argv[1:], stage))


def _stage_runtime(spec: RunSpec, stage: int, cfg: PeerConfig, experts):
    """The stage's runtime on this peer's device(s): split over `parallel.tp` ranks, or whole."""
    pcfg = cfg.parallel
    problem = check_degree(spec, stage, pcfg.tp)
    if problem:
        raise ConfigError(f"--tp {pcfg.tp}: {problem}")
    try:
        devices = tp_devices(pcfg)
    except ValueError as e:
        raise ConfigError(f"--devices: {e}") from None
    if cfg.server.compute_dtype and cfg.server.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            f"server.compute_dtype: must be empty (the run's training.dtype) or one of {', '.join(COMPUTE_DTYPES)}"
        )
    sizes = {
        "activation_cache_size": cfg.server.activation_cache_size,
        "fingerprint_history": cfg.server.fingerprint_history,
        "dedup_history": cfg.server.dedup_history,
        "compute_dtype": cfg.server.compute_dtype,
    }
    if pcfg.tp == 1:  # its weights come from the replicas or the seed once it serves (StageServer.start)
        return StageRuntime(spec, stage, experts=experts, device=devices[0], init=False, **sizes), None
    threads = cfg.threads
    if threads == 0 and devices[0] == "cpu":  # ranks on CPU share the cores rather than each take them all
        threads = max(1, (os.cpu_count() or 1) // pcfg.tp)
        torch.set_num_threads(threads)
    ranks = Ranks(pcfg, {**sizes, "spec": spec.to_dict(), "stage": stage, "threads": threads})
    runtime = ShardedStageRuntime(spec, stage, TPGroup(0, pcfg.tp, torch.device(devices[0])), ranks, devices, **sizes)
    return runtime, ranks

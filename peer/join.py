"""`peer join`: read and verify the run spec, then serve a stage or train."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

import torch

from dht import keys
from dht.address import coordinator_peer_id
from dht.identity import Identity
from dht.node import SwarmDHT
from dht.records import ServerRecord
from peer.config import ConfigError, PeerConfig, RunSpec
from peer.corpus import load_corpus
from peer.lifetime import exit_within
from peer.metrics import open_metrics, serve_metrics
from peer.security import Security
from peer.swarm import choose_stage, fetch_spec

logger = logging.getLogger(__name__)
MOVE_TIMEOUT_FACTOR = 3  # a server moving to another stage gets this many leave timeouts before it exits regardless


def connect(
    maddr: str, cfg: PeerConfig, identity: Identity, role: str, coordinator: str | None = None
) -> tuple[SwarmDHT, RunSpec]:
    """Join the DHT through `maddr` (any peer of the run), read the spec `coordinator` signed, get a credential.

    Without `coordinator`, `maddr` is the coordinator's own address and names it. The credential
    (peer.security) comes through the DHT, so no gRPC object exists yet when this returns:
    hivemind's averager, which forks, can still be created.
    """
    coordinator = coordinator_peer_id(maddr, coordinator)
    net = cfg.network  # (the CLI checked that something answers at maddr: dht.address.check_reachable)
    dht = SwarmDHT(
        identity,
        [maddr],
        net.dht_host_maddrs,
        net.dht_announce_maddrs,
        net.dht_startup_timeout,
        net.dht_request_timeout,
        client_mode=cfg.relay.reachability == "private",  # nobody can dial it: it only asks the DHT
    )
    try:
        spec = fetch_spec(dht, coordinator, timeout=net.spec_timeout)
        if spec.admission.mode != "off":
            security = Security(spec, cfg, identity, dht, coordinator, (role,))
            security.obtain()
            dht.security = security  # its renewal thread starts later (follow_admission): after hivemind forks
            left = security.credential.not_after - time.time()
            valid = f"{left / 60:.0f} min" if left >= 120 else f"{left:.0f} s"
            print(f"Admitted to run '{spec.name}' as {role} (credential valid {valid}, renewed).", flush=True)
    except BaseException:
        dht.shutdown()
        raise
    return dht, spec


def follow_admission(dht: SwarmDHT, on_revoked) -> None:
    """Renew the credential and follow revocations from now on; `on_revoked` (on this event loop) if revoked."""
    if dht.security is None:
        return
    loop = asyncio.get_running_loop()

    def revoked():
        print("This peer's credential was revoked by the run's coordinator; leaving the swarm.", flush=True)
        loop.call_soon_threadsafe(on_revoked)

    dht.security.on_revoked = revoked
    dht.security.start()


async def _until_signalled(
    start, stop, done: asyncio.Event, leave_timeout: float, moving=lambda: False
) -> threading.Timer:
    """Run until SIGINT/SIGTERM/SIGHUP (or `done` is set), then stop.

    From the moment it is told to leave, the process has `leave_timeout` seconds to end, whatever
    is still running (a server that `moving()` to another stage: three times that, to hand over
    and start anew); the deadline's timer is returned, for a process that execs itself after.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, done.set)
    try:
        await start()
        await done.wait()
    finally:
        bound = leave_timeout * (MOVE_TIMEOUT_FACTOR if moving() else 1)
        deadline = exit_within(bound, f"still leaving the swarm after {bound:g} s")
        await stop()
    return deadline


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
        "queue_depth": ("gauge", "Requests running or queued", server.inflight),
        "steps_averaged": ("counter", "Steps averaged with other replicas", server.steps_averaged),
        "steps_alone": ("counter", "Steps taken alone", server.steps_alone),
        **(server.uplink.levels() if server.uplink is not None else {}),
    }


def rejoin_argv(argv: list[str], stage: int) -> list[str]:
    """The command line of this peer, serving `stage` and still free to move."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--stage":
            skip = True
        elif not arg.startswith("--stage="):
            args.append(arg)
    return [sys.executable, "-m", "peer.cli", *args, "--stage", str(stage), "--set", "server.rebalance=always"]


def run_server(
    maddr: str, cfg: PeerConfig, identity: Identity, stage: int | None, coordinator: str | None = None
) -> None:
    from peer.averaging import GradientAverager
    from peer.server import StageServer

    dht, spec = connect(maddr, cfg, identity, "server", coordinator)
    averager = server = ranks = deadline = None
    try:
        n = spec.stages.num_stages
        if stage is not None and not 0 <= stage < n:
            raise ConfigError(f"--stage {stage}: run '{spec.name}' has stages 0..{n - 1}")
        mode = cfg.server.rebalance
        if mode not in ("auto", "always", "never"):
            raise ConfigError(f"server.rebalance: must be auto, always or never, got {mode!r}")
        balance = mode == "always" or (mode == "auto" and stage is None)
        from peer.tp import check_degree

        # a peer split over tensor-parallel ranks serves only the stages that split over them
        splittable = {s for s in range(n) if check_degree(spec, s, cfg.parallel.tp) is None}
        if not splittable:
            raise ConfigError(f"--tp {cfg.parallel.tp}: {check_degree(spec, 0, cfg.parallel.tp)}")
        if stage is None:
            stage = choose_stage(dht, spec, splittable)
        blocks = spec.stage_blocks(stage)
        print(
            f"Joined run '{spec.name}' (spec signed by its coordinator). Serving stage {stage} of {n} "
            f"(blocks {blocks.start}-{blocks.stop - 1}).",
            flush=True,
        )
        experts = None
        if any(layer in blocks for layer in spec.moe_layers()):
            from peer.dispatch import RemoteExperts

            experts = RemoteExperts(spec, stage, cfg, dht)  # the gates live here, the experts on expert hosts
            print(f"Blocks {experts.layers} are mixture-of-experts layers; their experts live on expert hosts.")
        runtime, ranks = _stage_runtime(spec, stage, cfg, experts)
        runtime.configure_clipping(cfg.server.clip_factor, cfg.server.clip_window)
        runtime.perturb_outputs = cfg.server.perturb_outputs
        if cfg.server.perturb_outputs:
            print(f"DRILL: this server adds noise (std {cfg.server.perturb_outputs:g}) to its outputs.", flush=True)
        # hivemind's averager forks: create it before any gRPC channel or server, and before the other ranks
        template = runtime.full_template() if ranks is not None else runtime.params
        averager = GradientAverager(dht, keys.averaging_prefix(spec.name, stage), template, spec)
        if ranks is not None:
            ranks.start_group(runtime.tp, cfg.parallel.collective_timeout)
            print(
                f"Split stage {stage} over {runtime.tp_degree} tensor-parallel ranks on {', '.join(runtime.devices)} "
                f"(ranks 1.. are pids {', '.join(map(str, ranks.pids))}).",
                flush=True,
            )
        if cfg.server.throughput > 0:
            runtime.throughput, runtime.fixed_throughput = cfg.server.throughput, True
            print(f"Announcing {cfg.server.throughput:.1f} samples/s for this stage (server.throughput).", flush=True)
        else:
            if experts is not None:
                experts.offline = True  # time this stage's own work; the experts' is their hosts'
            rate = runtime.benchmark(spec.training.micro_batch_size, spec.training.seq_len)
            if experts is not None:
                experts.offline = False
            print(f"Measured {rate:.1f} samples/s for this stage on this machine.", flush=True)
        server = StageServer(spec, stage, cfg, dht, runtime, averager, balance=balance)
        server.allowed_stages = splittable
        server.metrics = open_metrics(cfg, "stage server", lambda: _server_levels(server))

        async def start():
            if ranks is not None:  # a rank that dies ends this peer: leave cleanly (exit_grace bounds it)
                loop = asyncio.get_running_loop()
                ranks.on_death = lambda reason: loop.call_soon_threadsafe(server.done.set)
            if experts is not None:
                await experts.bind()
            follow_admission(dht, server.done.set)
            serve_metrics(server.metrics, cfg)
            await server.start()  # uplink.NoRelay: it cannot be dialled and no relay took it
            print(f"Serving stage {stage} at {server.endpoint} from step {runtime.epoch}.", flush=True)

        async def stop():
            if server.move_to is None:
                print("Leaving the swarm...", flush=True)
            else:
                print(f"Moving from stage {stage} to stage {server.move_to}...", flush=True)
            await server.stop()
            if experts is not None:
                await experts.close()

        deadline = asyncio.run(
            _until_signalled(start, stop, server.done, cfg.server.leave_timeout, lambda: server.move_to is not None)
        )
    finally:
        if ranks is not None:
            ranks.close()
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    if ranks is not None and ranks.dead:
        raise SystemExit(f"peer join: {ranks.dead}; this peer stopped (the swarm routes around it)")
    if server is not None and server.move_to is not None:
        # a fresh process for the new stage: hivemind's averager must be created before any gRPC
        # object in a process, and the identity (same peer id) and settings carry over
        if deadline is not None:
            deadline.cancel()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, rejoin_argv(sys.argv[1:], server.move_to))


def _stage_runtime(spec: RunSpec, stage: int, cfg: PeerConfig, experts):
    """The stage's runtime on this peer's device(s): split over `parallel.tp` ranks, or whole."""
    from peer.runtime import COMPUTE_DTYPES, StageRuntime
    from peer.tp import TPGroup, check_degree
    from peer.tp_runtime import Ranks, ShardedStageRuntime, tp_devices

    pcfg = cfg.parallel
    problem = check_degree(spec, stage, pcfg.tp)
    if problem:
        raise ConfigError(f"--tp {pcfg.tp}: {problem}")
    try:
        devices = tp_devices(pcfg)
    except ValueError as e:
        raise ConfigError(f"--devices: {e}") from None
    if cfg.server.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"server.compute_dtype: must be one of {', '.join(COMPUTE_DTYPES)}")
    sizes = {
        "activation_cache_size": cfg.server.activation_cache_size,
        "fingerprint_history": cfg.server.fingerprint_history,
        "dedup_history": cfg.server.dedup_history,
        "compute_dtype": cfg.server.compute_dtype,
    }
    if pcfg.tp == 1:
        return StageRuntime(spec, stage, experts=experts, device=devices[0], **sizes), None
    threads = cfg.threads
    if threads == 0 and devices[0] == "cpu":  # ranks on CPU share the cores rather than each take them all
        threads = max(1, (os.cpu_count() or 1) // pcfg.tp)
        torch.set_num_threads(threads)
    ranks = Ranks(pcfg, {**sizes, "spec": spec.to_dict(), "stage": stage, "threads": threads})
    runtime = ShardedStageRuntime(spec, stage, TPGroup(0, pcfg.tp, torch.device(devices[0])), ranks, devices, **sizes)
    return runtime, ranks


def run_experts(maddr: str, cfg: PeerConfig, identity: Identity, choice: str, coordinator: str | None = None) -> None:
    """Host experts of the run's MoE layers: `choice` is how many (the least-replicated) or which."""
    from peer.averaging import GradientAverager
    from peer.expert import ExpertRuntime
    from peer.expert_host import (
        ExpertHost,
        all_experts,
        best_device,
        choose_experts,
        expert_counts,
        parse_expert_choice,
    )
    from peer.replica import Part

    dht, spec = connect(maddr, cfg, identity, "experts", coordinator)
    averagers: dict[str, GradientAverager] = {}
    try:
        if not spec.moe_layers():
            raise ConfigError(f"--experts: run '{spec.name}' has no mixture-of-experts layers (moe.num_experts is 0)")
        try:
            wanted = parse_expert_choice(spec, choice)
        except ValueError as e:
            raise ConfigError(f"--experts {choice}: {e}") from None
        if isinstance(wanted, int):
            known = all_experts(spec)
            records = {uid: dht.get(keys.expert_key(spec.name, uid), ServerRecord) for uid in known}
            wanted = choose_experts(expert_counts(records), min(wanted, len(known)))
        device = best_device(cfg.experts.device)
        print(
            f"Joined run '{spec.name}' (spec signed by its coordinator). Hosting {len(wanted)} expert(s) on "
            f"{device}: {', '.join(wanted)}.",
            flush=True,
        )
        runtimes = {
            uid: ExpertRuntime(spec, uid, device, cfg.experts.activation_cache_size, cfg.server.fingerprint_history)
            for uid in wanted
        }
        rate = next(iter(runtimes.values())).benchmark(min(cfg.experts.max_batch_tokens, 128))
        for runtime in runtimes.values():
            runtime.throughput = rate
            runtime.configure_clipping(cfg.server.clip_factor, cfg.server.clip_window)
        print(f"Measured {rate:.0f} tokens/s per expert on this machine.", flush=True)
        # hivemind's averagers fork: create them before any gRPC channel or server
        for uid, runtime in runtimes.items():
            prefix = Part(0, uid).averaging_prefix(spec.name)
            averagers[uid] = GradientAverager(dht, prefix, runtime.params, spec)
        host = ExpertHost(spec, cfg, dht, runtimes, averagers)
        metrics = open_metrics(
            cfg,
            "expert host",
            lambda: {
                "queue_depth": ("gauge", "Expert calls running or queued", host.inflight),
                "experts": ("gauge", "Experts hosted", len(runtimes)),
                "step": (
                    "gauge",
                    "Highest training step of the hosted experts",
                    max(r.progress for r in runtimes.values()),
                ),
                **(host.uplink.levels() if host.uplink is not None else {}),
            },
        )
        host.metrics = metrics
        for replica in host.replicas.values():
            replica.metrics = metrics

        async def start():
            follow_admission(dht, done.set)
            serve_metrics(metrics, cfg)
            await host.start()
            loaded = f"; loaded the state of {', '.join(host.loaded)} from replicas" if host.loaded else ""
            print(f"Serving experts {', '.join(wanted)} at {host.endpoint}{loaded}.", flush=True)

        async def stop():
            print("Leaving the swarm...", flush=True)
            await host.stop()

        done = asyncio.Event()
        asyncio.run(_until_signalled(start, stop, done, cfg.server.leave_timeout))
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()


def run_relay(maddr: str, cfg: PeerConfig, identity: Identity, coordinator: str | None = None) -> None:
    """A peer that only relays: carries the calls of peers that cannot be dialled (peer.relay)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from peer.relay import RelayService, add_relay
    from peer.server import announce_host, grpc_server, listen

    dht, spec = connect(maddr, cfg, identity, "relay", coordinator)
    try:
        net = cfg.network
        relay = RelayService(cfg, spec.name, announce_host(net.host, net.announce_host), dht.security, "relay")
        metrics = open_metrics(cfg, "relay", relay.levels)
        done, tasks = asyncio.Event(), []

        async def start():
            follow_admission(dht, done.set)
            serve_metrics(metrics, cfg)
            server = grpc_server(cfg, dht.security)
            add_relay(server, relay)
            checker = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checker, server)
            port = listen(server, f"{net.host}:{net.port}", dht.security)
            await server.start()
            await checker.set("", health_pb2.HealthCheckResponse.SERVING)
            relay.endpoint = f"{relay.announce_host}:{port}"
            tasks.extend([server, asyncio.create_task(relay.announce(dht))])
            print(f"Relaying for peers that cannot be dialled, at {relay.endpoint} (peer {dht.peer_id}).", flush=True)

        async def stop():
            print("Leaving the swarm...", flush=True)
            if tasks:
                server, announcing = tasks
                announcing.cancel()
                relay.close()
                await server.stop(0.5)

        asyncio.run(_until_signalled(start, stop, done, cfg.server.leave_timeout))
    finally:
        dht.shutdown()


def run_trainer(maddr: str, cfg: PeerConfig, identity: Identity, coordinator: str | None = None) -> int:
    from peer.progress import TrainerProgress
    from peer.trainer import Trainer

    corpus = load_corpus(cfg.trainer.data)
    dht, spec = connect(maddr, cfg, identity, "trainer", coordinator)
    try:
        print(
            f"Joined run '{spec.name}' as a trainer on {corpus.source} "
            f"({len(corpus.train) / 1e6:.1f} MB train, {len(corpus.validation) / 1e6:.1f} MB held out).",
            flush=True,
        )
        trainer = Trainer(spec, cfg, dht, corpus)
        s = trainer.summary
        trainer.metrics = open_metrics(
            cfg,
            "trainer",
            lambda: {
                "samples": ("counter", "Samples through every stage, forward and backward", s.samples),
                "micro_batches": ("counter", "Micro-batches completed", s.micro_batches),
                "failed_calls": ("counter", "Calls that failed and were rerouted", s.failed_calls),
                "replayed": ("counter", "Backwards replayed on another replica", s.replayed),
                "samples_per_second": ("gauge", "Samples/s over the last 20 s", trainer.samples_per_second()),
                "train_loss": ("gauge", "Recent mean training loss", trainer.train_loss() or 0.0),
                "receipts": ("gauge", "Backwards kept until their server steps them", len(trainer.ledger)),
            },
        )
        serve_metrics(trainer.metrics, cfg)

        async def main():
            loop = asyncio.get_running_loop()
            task = asyncio.current_task()

            def on_signal():
                if trainer.stopping:
                    task.cancel()  # a second signal: stop now
                else:
                    print("Stopping: finishing the micro-batches under way (again to stop at once)...", flush=True)
                    trainer.request_stop()

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal)
            follow_admission(dht, task.cancel)  # revoked: stop at once (its calls are refused now)
            return await trainer.run()

        trainer.progress = TrainerProgress(spec.training.total_steps, cfg.trainer.progress)
        try:
            summary = asyncio.run(main())
        except asyncio.CancelledError:
            trainer.progress.close()
            print("Stopped.", flush=True)
            return 1
        finally:
            trainer.progress.close()  # the terminal gets its cursor back, whatever happened
        val = f", validation loss {summary.val_losses[-1][1]:.3f}" if summary.val_losses else ""
        print(
            f"Done: {summary.micro_batches} micro-batches ({summary.samples} samples) in {summary.seconds:.0f} s, "
            f"reached step {summary.epoch}{val}; {summary.failed_micro_batches} given up, "
            f"{summary.failed_calls} calls rerouted, {summary.replayed} backwards replayed.",
            flush=True,
        )
        return 0 if summary.failed_micro_batches == 0 else 3
    finally:
        dht.shutdown()


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)

"""`peer join --experts`: host experts of the run's mixture-of-experts layers."""

from __future__ import annotations

import asyncio

from dht import keys
from dht.identity import Identity
from dht.records import ServerRecord
from peer.cli.join import connect, follow_admission, until_signalled
from peer.config import ConfigError, PeerConfig
from peer.model.expert import ExpertRuntime
from peer.net.metrics import open_metrics, serve_metrics
from peer.server.averaging import GradientAverager
from peer.server.expert_host import (
    ExpertHost,
    all_experts,
    best_device,
    choose_experts,
    expert_counts,
    parse_expert_choice,
)
from peer.server.replica_push import push_levels


def run_experts(maddr: str, cfg: PeerConfig, identity: Identity, choice: str, coordinator: str | None = None) -> None:
    """Host experts of the run's MoE layers: `choice` is how many (the least-replicated) or which."""
    dht, spec = connect(maddr, cfg, identity, "experts", coordinator)
    averagers: dict[str, GradientAverager] = {}
    try:
        wanted = _chosen_experts(spec, dht, choice)
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
        for uid in runtimes:
            averagers[uid] = GradientAverager(spec)
        host = ExpertHost(spec, cfg, dht, runtimes, averagers)
        metrics = open_metrics(cfg, "expert host", lambda: _host_levels(host), dht)
        host.metrics = metrics
        done = asyncio.Event()
        for replica in host.replicas.values():
            replica.metrics = metrics
            replica.told_to_leave = done.is_set  # a signal while it loads: it stops trying

        async def start():
            follow_admission(dht, done.set)
            serve_metrics(metrics, cfg)
            await host.start()
            loaded = f"; loaded the state of {', '.join(host.loaded)} from replicas" if host.loaded else ""
            print(f"Serving experts {', '.join(wanted)} at {host.endpoint}{loaded}.", flush=True)

        async def stop():
            print("Leaving the swarm...", flush=True)
            await host.stop()

        asyncio.run(until_signalled(start, stop, done, cfg.server.leave_timeout + cfg.server.handover_timeout))
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()


def _chosen_experts(spec, dht, choice: str) -> list[str]:
    """The experts `choice` names, or that many of the least-replicated ones; ConfigError when it cannot be."""
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
    return wanted


def _host_levels(host) -> dict:
    runtimes = [replica.runtime for replica in host.replicas.values()]
    return {
        "queue_depth": ("gauge", "Expert calls running or queued", host.inflight),
        "experts": ("gauge", "Experts hosted", len(runtimes)),
        "step": ("gauge", "Highest training step of the hosted experts", max(r.progress for r in runtimes)),
        **push_levels(host.replicas.values()),
        **(host.uplink.levels() if host.uplink is not None else {}),
    }

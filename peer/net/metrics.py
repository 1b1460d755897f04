"""Prometheus metrics of one peer (prometheus-client), on its own registry, served over HTTP.

Events are counted where they happen: served requests (per method and outcome, with a latency
histogram), calls a trainer makes, bytes in and out per kind, bans, averaging rounds and their
duration. Levels (step, throughput, queue depth, samples) are read from the live objects at
each scrape (`watch`). `metrics.port` sets the HTTP port (0: any free one; -1: none); the peer
prints the address and announces it in its DHT record, so the coordinator can gather the swarm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from peer.config import ConfigError, PeerConfig
from peer.net.serving import http_host
from peer.process.status_lines import say

logger = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Watched:
    """A collector that reads levels and totals from the live objects at scrape time."""

    def __init__(self):
        self.sources: list[Callable[[], dict[str, tuple[str, str, float]]]] = []

    def collect(self):
        for source in self.sources:
            try:
                values = source()
            except Exception as e:  # a scrape must never take the peer down
                logger.warning("metrics source failed: %s", e)
                continue
            for name, (kind, doc, value) in values.items():
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                if not isinstance(value, dict):
                    yield family(f"swarm_{name}", doc, value=float(value))
                    continue
                # {(label values...): value}: labelled by operation and kind (dht.node's DHT counts)
                labelled = family(f"swarm_{name}", doc, labels=["operation", "kind"])
                for labels, v in sorted(value.items()):
                    labelled.add_metric(list(labels), float(v))
                yield labelled


class Metrics:
    """One peer's metrics; `role` labels nothing but the help text, the names are shared."""

    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "swarm_requests", "Requests this peer served", ["method", "outcome"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "swarm_request_seconds",
            "Seconds to serve a request, by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.calls = Counter(
            "swarm_calls", "Calls this peer made to others", ["method", "outcome"], registry=self.registry
        )
        self.call_seconds = Histogram(
            "swarm_call_seconds",
            "Seconds of a call to another peer",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.bytes = Counter(
            "swarm_bytes",
            "Bytes of messages, by direction (sent, received) and kind",
            ["direction", "kind"],
            registry=self.registry,
        )
        self.bans = Counter("swarm_bans", "Servers banned after a failed call", registry=self.registry)
        self.rounds = Counter("swarm_rounds", "Averaging rounds, by outcome", ["outcome"], registry=self.registry)
        self.round_seconds = Histogram(
            "swarm_round_seconds", "Seconds of an averaging round", buckets=ROUND_BUCKETS, registry=self.registry
        )
        self.served = self.failed = 0  # requests served, and those that failed (for the DHT summary)
        self._watched = _Watched()
        self.registry.register(self._watched)
        self.endpoint = ""

    def request(self, method: str, ok: bool, seconds: float) -> None:
        self.requests.labels(method, "ok" if ok else "error").inc()
        self.request_seconds.labels(method).observe(seconds)
        self.served += 1
        self.failed += 0 if ok else 1

    def watch(self, source: Callable[[], dict[str, tuple[str, str, float]]]) -> None:
        """Read `source()` at every scrape: {name: ("gauge" | "counter", help, value)}."""
        self._watched.sources.append(source)

    def serve(self, host: str, port: int, announce: str) -> str:
        """Start the HTTP endpoint (port 0: any free one; -1: none); its announced address, or empty."""
        if port < 0:
            return ""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.endpoint = f"{announce}:{server.server_port}"
        return self.endpoint


def open_metrics(cfg: PeerConfig, role: str, source, dht=None):
    """This peer's Prometheus metrics (None with metrics.port = -1), reading levels from `source` and the DHT
    operations `dht` (dht.node.SwarmDHT) made."""
    if cfg.metrics.port < 0:
        return None
    metrics = Metrics(role)
    metrics.watch(source)
    if dht is not None:
        metrics.watch(dht.levels)
    return metrics


def serve_metrics(metrics, cfg: PeerConfig) -> None:
    """Start the metrics' HTTP endpoint (after hivemind's forks) and say where it is."""
    if metrics is None:
        return
    host = cfg.metrics.host or cfg.network.host
    try:
        endpoint = metrics.serve(host, cfg.metrics.port, http_host(host, cfg.network.announce_host))
    except OSError as e:
        raise ConfigError(f"metrics.port: cannot listen on {host}:{cfg.metrics.port} ({e.strerror or e})") from None
    say(f"Prometheus metrics at http://{endpoint}/metrics.")

"""The trainer's view of the servers: who serves each stage, how fast they answer, who is banned."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from dht import keys
from dht.node import SwarmDHT
from dht.records import ServerRecord


@dataclass
class _Health:
    latency: float = 0.0  # exponential moving average of call seconds, 0 until measured
    failures: int = 0
    banned_until: float = 0.0


class NoServer(RuntimeError):
    """No live, unbanned server for a stage."""


class Router:
    def __init__(self, dht: SwarmDHT, run_id: str, num_stages: int, ban_time: float, rng_seed: int | None = None):
        self.dht, self.run_id, self.num_stages, self.ban_time = dht, run_id, num_stages, ban_time
        self.servers: list[dict[str, ServerRecord]] = [{} for _ in range(num_stages)]
        self.health: dict[str, _Health] = {}
        self.rng = random.Random(rng_seed)
        self.max_epoch = 0

    async def refresh(self) -> None:
        for stage in range(self.num_stages):
            records = await self.dht.aget(keys.servers_key(self.run_id, stage), ServerRecord)
            self.servers[stage] = {pid: r for pid, r in records.items() if r.stage == stage and r.state == "serving"}
            for r in self.servers[stage].values():
                self.max_epoch = max(self.max_epoch, r.epoch)

    def weight(self, peer_id: str, record: ServerRecord) -> float:
        health = self.health.get(peer_id, _Health())
        latency_factor = 1.0 / (1.0 + health.latency * max(record.throughput, 1e-3))  # slow answers count against
        return max(record.throughput, 1e-3) / (1.0 + record.load) * latency_factor

    def choose(
        self, stage: int, exclude: set[str] = frozenset(), prefer: str | None = None
    ) -> tuple[str, ServerRecord]:
        """Pick a server of `stage` at random, weighted by throughput and measured latency; skip banned ones."""
        now = time.monotonic()
        candidates = [
            (pid, r)
            for pid, r in self.servers[stage].items()
            if pid not in exclude and self.health.get(pid, _Health()).banned_until <= now
        ]
        if not candidates:
            raise NoServer(f"no live server for stage {stage}")
        for pid, r in candidates:
            if pid == prefer:
                return pid, r
        weights = [self.weight(pid, r) for pid, r in candidates]
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    def report_success(self, peer_id: str, seconds: float) -> None:
        health = self.health.setdefault(peer_id, _Health())
        health.latency = seconds if health.latency == 0 else 0.8 * health.latency + 0.2 * seconds
        health.failures = 0

    def report_failure(self, peer_id: str) -> float:
        """Ban a failing server, for longer each time it fails in a row; returns the ban length."""
        health = self.health.setdefault(peer_id, _Health())
        health.failures += 1
        ban = self.ban_time * (2 ** min(health.failures - 1, 6))
        health.banned_until = time.monotonic() + ban
        return ban

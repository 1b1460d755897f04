"""The coordinator's web dashboard: the swarm map, training curves and recent events, live.

An aiohttp server on its own thread and event loop (the coordinator's loop is plain threads and
hivemind's synchronous DHT calls). The coordinator hands it the run's state after every look at
the DHT (`publish`); browsers load the page (`peer/coordinator/web/`), fetch the whole state once
(`GET /api/state`) and then get each new look pushed as a server-sent event (`GET /api/stream`):
the servers, experts and trainers as they are now, the newest point of the curves and the newest
events. The number of streaming clients and each one's queue are bounded; a slow client loses
old updates, never the coordinator's time. Everything is read-only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from dataclasses import asdict
from pathlib import Path

from aiohttp import web

from dht.records import ServerRecord, TrainerRecord
from peer.config import DashboardConfig, RunSpec
from peer.coordinator.timeline import Timeline, part_name
from peer.model.moe import expert_uid
from peer.swarm.status import coverage, devices_label

logger = logging.getLogger(__name__)
WEB = Path(__file__).parent / "web"
STATIC = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}
RECENT_EVENTS = 50  # events sent with each pushed update (a client keeps those it has not seen)


def _clean(value):
    """JSON-safe: non-finite floats become null (browsers' JSON.parse refuses NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def health(r: ServerRecord, quiet: float, silent_after: float) -> str:
    """ok; or what is wrong: joining, leaving, left, silent (no announcement lately), errors (>10% failed)."""
    if r.state != "serving":
        return r.state
    if quiet > silent_after:
        return "silent"
    if r.requests >= 20 and r.errors > 0.1 * r.requests:
        return "errors"
    return "ok"


def server_view(pid: str, r: ServerRecord, timeline: Timeline, now: float) -> dict:
    quiet = timeline.quiet_for((part_name(r), pid), r.updated, now)
    return {
        "peer": pid[-8:],
        "endpoint": r.endpoint,
        "state": r.state,
        "health": health(r, quiet, timeline.silent_after(r)),
        "throughput": r.throughput,
        "load": r.load,
        "step": r.epoch,
        "tp": r.tp,
        "devices": devices_label(r.devices),
        "requests": r.requests,
        "errors": r.errors,
        "last_round": r.last_round,
        "last_round_seconds": r.last_round_seconds,
        "quiet": quiet,
        "uptime": max(now - r.started, 0.0) if r.started else None,
        "metrics": r.metrics,
    }


def trainer_view(pid: str, t: TrainerRecord, timeline: Timeline, now: float) -> dict:
    quiet = timeline.quiet_for(("trainer", pid), t.updated, now)
    return {
        "peer": pid[-8:],
        "samples": t.samples,
        "samples_per_second": t.samples_per_second,
        "train_loss": t.train_loss,
        "val_loss": t.val_loss,
        "val_bits_per_byte": t.val_bits_per_byte,
        "step": t.epoch,
        "failed_calls": t.failed_calls,
        "bans": t.bans,
        "banned": list(t.banned),
        "bytes_sent": t.bytes_sent,
        "bytes_received": t.bytes_received,
        "health": "silent" if quiet > timeline.stale_after else "ok",
        "quiet": quiet,
    }


def swarm_state(spec: RunSpec, look: dict, timeline: Timeline, now: float, coordinator: dict) -> dict:
    """The whole state the page shows, from one look (`peer.swarm.status.gather`) and the timeline."""
    stages = []
    for stage, records in enumerate(look["stages"]):
        blocks = spec.stage_blocks(stage)
        servers = [
            server_view(pid, r, timeline, now)
            for pid, r in sorted(records.items(), key=lambda kv: kv[1].endpoint)
            if r.stage == stage and not r.expert
        ]
        serving = [s for s in servers if s["state"] == "serving"]
        stages.append(
            {
                "stage": stage,
                "blocks": f"{blocks.start}-{blocks.stop - 1}",
                "throughput": sum(s["throughput"] for s in serving),
                "step": max((s["step"] for s in serving), default=0),
                "servers": servers,
            }
        )
    experts = []
    for row in coverage(spec, look.get("experts", {})):
        layer = row["layer"]
        cells = []
        for e in range(spec.moe.num_experts):
            found = look["experts"].get(expert_uid(layer, e), {})
            hosts = [server_view(pid, r, timeline, now) for pid, r in sorted(found.items())]
            cells.append({"index": e, "uid": expert_uid(layer, e), "hosts": hosts})
        experts.append({"layer": layer, "hosted": row["hosted"], "missing": row["missing"], "experts": cells})
    trainers = [trainer_view(pid, t, timeline, now) for pid, t in sorted(look["trainers"].items())]
    point = timeline.points[-1] if timeline.points else None
    return {
        "run": {
            "name": spec.name,
            "total_steps": spec.training.total_steps,
            "target_batch_size": spec.training.target_batch_size,
            "num_stages": spec.stages.num_stages,
            "mode": spec.averaging.mode,
            "model": {k: getattr(spec.model, k) for k in ("hidden_size", "num_layers", "num_heads", "vocab_size")},
            "moe": {"num_experts": spec.moe.num_experts, "top_k": spec.moe.top_k, "layers": spec.moe_layers()},
        },
        "updated": now,
        "totals": asdict(point) if point else None,
        "stages": stages,
        "experts": experts,
        "trainers": trainers,
        "coordinator": coordinator,
    }


class Dashboard:
    """The HTTP server; `publish` may be called from any thread."""

    def __init__(self, cfg: DashboardConfig, timeline: Timeline):
        self.cfg, self.timeline = cfg, timeline
        self.endpoint = ""
        self._full = b"{}"  # the last state with the whole history and events, as served by /api/state
        self._clients: set[asyncio.Queue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closing = False  # set on the server's loop when it stops: no new streams

    # ---- the coordinator's side ------------------------------------------------------------
    def start(self, host: str, port: int, announce: str) -> str:
        """Listen on host:port (0: any free one) on a thread of its own; returns the announced address."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve():
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                bound = loop.run_until_complete(self._open(host, port))
                self.endpoint = f"{announce}:{bound}"
            except BaseException as e:  # handed to the starting thread, which raises it
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=serve, name="dashboard", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self.endpoint

    def publish(self, state: dict) -> None:
        """The newest state: kept for /api/state and pushed to every streaming client."""
        full = dict(state)
        full["history"] = [asdict(p) for p in self.timeline.points]
        full["events"] = [asdict(e) for e in self.timeline.events]
        update = dict(state)
        update["events"] = [asdict(e) for e in list(self.timeline.events)[-RECENT_EVENTS:]]
        body = json.dumps(_clean(full)).encode()
        message = b"data: " + json.dumps(_clean(update)).encode() + b"\n\n"
        with self._lock:
            self._full = body
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._push, message)

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # ---- the server's side (its own loop) ----------------------------------------------------
    async def _open(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._api_state)
        app.router.add_get("/api/stream", self._stream)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return self._runner.addresses[0][1]

    async def _close(self) -> None:
        self._closing = True
        self._push(None)  # ends each stream
        if self._runner is not None:
            await self._runner.cleanup()

    def _push(self, message: bytes | None) -> None:
        for queue in self._clients:
            if queue.full():  # a slow client loses its oldest update, never the coordinator's time
                queue.get_nowait()
            queue.put_nowait(message)

    async def _index(self, request: web.Request) -> web.Response:
        return web.FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text=f"no such file: {name}")
        return web.FileResponse(WEB / name, headers={"Content-Type": STATIC[name], "Cache-Control": "no-cache"})

    async def _api_state(self, request: web.Request) -> web.Response:
        with self._lock:
            body = self._full
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-cache"})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if self._closing:
            raise web.HTTPServiceUnavailable(text="the coordinator is stopping")
        if len(self._clients) >= self.cfg.max_clients:
            raise web.HTTPServiceUnavailable(
                text=f"too many dashboard clients (dashboard.max_clients = {self.cfg.max_clients})"
            )
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.cfg.client_queue)
        self._clients.add(queue)  # before the first await: the bound holds for streams starting together
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        try:
            await response.prepare(request)
            await response.write(f"retry: {int(self.cfg.retry * 1000)}\n\n".encode())
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), timeout=self.cfg.keepalive)
                except TimeoutError:
                    message = b": keepalive\n\n"  # a comment: keeps proxies from closing a quiet stream
                if message is None:
                    break
                await asyncio.wait_for(response.write(message), timeout=self.cfg.write_timeout)
        except TimeoutError:
            # a browser that stopped reading: drop its connection, or it would hold a socket and
            # the server's shutdown while its unread bytes wait
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass
        finally:
            self._clients.discard(queue)
        return response

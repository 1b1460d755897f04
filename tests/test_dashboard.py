"""The coordinator's web dashboard: the events it derives, its HTTP API, and the page in a real browser."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from browser import Browser, find_chromium

from dht.records import ServerRecord, TrainerRecord
from peer.config import DashboardConfig
from peer.coordinator.dashboard import Dashboard
from peer.coordinator.timeline import Timeline


def server(stage: int, endpoint: str, state: str = "serving", epoch: int = 0, updated: float = 0.0, **kw):
    return ServerRecord(
        stage=stage, endpoint=endpoint, throughput=10.0, state=state, epoch=epoch, updated=updated, **kw
    )


def look(stages, trainers=None):
    return {"stages": stages, "trainers": trainers or {}, "experts": {}}


def kinds(timeline: Timeline) -> list[tuple[str, str]]:
    return [(e.kind, e.text) for e in timeline.events]


def test_the_timeline_tells_joins_moves_leaves_steps_bans_and_silence():
    tl = Timeline(max_points=3, max_events=100, stale_after=5.0)
    a, b = server(0, "h:1", updated=1), server(1, "h:2", updated=1)
    tl.observe(look([{"A": a}, {"B": b}]), now=10)
    assert kinds(tl) == [("join", "h:1 (A) joined stage 0"), ("join", "h:2 (B) joined stage 1")]
    # A moves to stage 1 (its old record says left); B steps, averaged with 2 replicas
    moved = server(1, "h:3", state="joining", updated=12, tp=2)
    stepped = server(1, "h:2", epoch=1, updated=12, last_round=2, last_round_seconds=0.25)
    t1 = TrainerRecord(samples=8, samples_per_second=2.0, train_loss=5.0, updated=12, banned=["h:9"])
    tl.observe(look([{"A": server(0, "h:1", state="left", updated=12)}, {"A": moved, "B": stepped}], {"T": t1}), now=12)
    new = kinds(tl)[2:]
    assert ("move", "h:3 (A) moved from stage 0 to stage 1, tensor-parallel over 2") in new
    assert ("step", "stage 1 reached step 1: averaged by 2 replicas in 0.25 s") in new
    assert ("trainer", "trainer T joined") in new and ("ban", "trainer T banned h:9 after a failed call") in new
    # A and B stop announcing (their records stay the same): each is silent once, then B's record expires
    tl.observe(look([{}, {"A": moved, "B": stepped}], {"T": t1}), now=18.5)
    assert kinds(tl)[-1][0] == "silent" and "h:2 (B) of stage 1 has not announced for 6 s" in kinds(tl)[-1][1]
    tl.observe(look([{}, {"A": moved, "B": stepped}], {}), now=19)
    assert sum(k == "silent" for k, _ in kinds(tl)) == 2
    tl.observe(look([{}, {}], {}), now=20)
    assert ("vanish", "h:2 (B) of stage 1 vanished: its record expired") in kinds(tl)
    assert ("trainer", "trainer T left") in kinds(tl)
    assert len(tl.points) == 3  # bounded
    assert [p.step for p in tl.points] == [1, 1, 0]
    assert tl.since(len(tl.events) - 1) == [vars(tl.events[-1])]


def test_the_timeline_is_kept_across_a_restart(tmp_path):
    tl = Timeline()
    tl.observe(look([{"A": server(0, "h:1", updated=1)}]), now=10)
    tl.save(tmp_path / "t.json", "run-a")
    assert Timeline().load(tmp_path / "t.json", "run-b") == 0  # another run's past is not shown
    again = Timeline()
    assert again.load(tmp_path / "t.json", "run-a") == 1
    assert [vars(p) for p in again.points] == [vars(p) for p in tl.points]
    assert again.add("coordinator", "restarted").id == tl.events[-1].id + 1  # ids go on: pages see it as new
    # the first look after the restart only takes note: the server it sees joined before
    again.observe(look([{"A": server(0, "h:1", updated=2)}]), now=11)
    assert [e.kind for e in again.events] == ["join", "coordinator"]
    again.observe(look([{}]), now=30)
    assert again.events[-1].kind == "vanish"
    (tmp_path / "cut.json").write_text('{"points": [{"time": 1')
    point = dict(vars(tl.points[0]), time="x")
    (tmp_path / "bad.json").write_text(json.dumps({"run": "run-a", "points": [point], "events": []}))
    for name in ("cut.json", "bad.json", "none.json"):
        assert Timeline().load(tmp_path / name, "run-a") == 0


def test_the_dashboard_serves_its_state_and_streams_updates():
    tl = Timeline()
    tl.add("coordinator", "started")
    dash = Dashboard(DashboardConfig(max_clients=1, keepalive=0.5), tl)
    endpoint = dash.start("127.0.0.1", 0, "127.0.0.1")
    try:
        dash.publish({"run": {"name": "x"}, "loss": float("nan")})
        state = json.loads(urllib.request.urlopen(f"http://{endpoint}/api/state", timeout=10).read())
        assert state["run"] == {"name": "x"} and state["loss"] is None  # NaN is not JSON: null
        assert [e["text"] for e in state["events"]] == ["started"] and state["history"] == []
        page = urllib.request.urlopen(f"http://{endpoint}/", timeout=10).read().decode()
        assert "/static/dashboard.js" in page
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://{endpoint}/static/../coordinator.py", timeout=10)
        assert missing.value.code == 404

        async def stream():
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://{endpoint}/api/stream") as first,
            ):
                assert first.headers["Content-Type"] == "text/event-stream"
                async with session.get(f"http://{endpoint}/api/stream") as second:
                    assert second.status == 503 and "dashboard.max_clients" in await second.text()
                await asyncio.sleep(0.2)
                tl.add("join", "a server joined")
                dash.publish({"run": {"name": "x"}, "n": 2})
                while True:
                    line = (await asyncio.wait_for(first.content.readline(), 10)).decode()
                    if line.startswith("data: "):
                        return json.loads(line[6:])

        update = asyncio.run(stream())
        assert update["n"] == 2 and update["events"][-1]["text"] == "a server joined"
    finally:
        dash.stop()


SPEC = {
    "name": "dash",
    "seed": 6,
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 32},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 4, "seq_len": 32, "target_batch_size": 8, "total_steps": 1000, "lr": 0.01},
    "data": {"validation_bytes": 2048},  # a quick look: 16 micro-batches a validation
}


@pytest.fixture
def browser(tmp_path):
    if find_chromium() is None:
        if os.environ.get("SWARMTRAIN_REQUIRE_BROWSER"):
            pytest.fail("no Chromium found (Debian: apt-get install chromium)")
        pytest.skip("no Chromium found (Debian: apt-get install chromium)")
    b = Browser(tmp_path)
    try:
        yield b
    finally:
        b.close()


def artifacts() -> Path:
    path = Path(os.environ.get("SWARMTRAIN_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_dashboard_shows_a_running_swarm_live(swarm, browser):
    swarm.coordinator(SPEC, extra=["--set", "dashboard.period=1", "--set", "coordinator.report_period=2"])
    url = swarm.peers[0].wait_for(r"Dashboard at (http://\S+/)", 30).group(1)
    split = swarm.server("split", 0, ["--tp", "2"])
    whole, last = swarm.server("whole", 0), swarm.server("last", 1)
    endpoints = {name: swarm.endpoint(p) for name, p in (("split", split), ("whole", whole), ("last", last))}
    trainer = swarm.trainer("t0", ["--seed", "3", "--max-inflight", "2", "--eval-every", "2"], tty=True)

    browser.open(url)
    cards = "document.querySelectorAll('.card[data-health=ok]').length"
    browser.wait_until(f"{cards} === 3", 60, "three healthy server cards")
    split_card = f"document.querySelector('.card[data-endpoint=\"{endpoints['split']}\"]')"
    assert browser.evaluate(f"{split_card}.closest('.stage').dataset.stage") == "0"
    assert "TP 2" in browser.evaluate(f"{split_card}.innerText") and "cpu x2" in browser.evaluate(
        f"{split_card}.innerText"
    )
    # training curves: train and validation loss drawn from several points; steps with their averaging rounds
    browser.wait_until(
        "Number(document.querySelector('#chart-loss path.val')?.dataset.points) >= 2", 120, "a validation curve"
    )
    browser.wait_until(
        "Number(document.querySelector('#chart-loss path.train')?.dataset.points) >= 3", 60, "a loss curve"
    )
    averaged = "document.getElementById('events').innerText.includes('averaged by 2 replicas')"
    browser.wait_until(averaged, 60, "a step averaged by both stage-0 replicas")
    events = browser.evaluate("document.getElementById('events').innerText")
    for text in (
        f"{endpoints['split']}",
        "joined stage 0, tensor-parallel over 2",
        "reached step",
        "averaged by 2 replicas",
    ):
        assert text in events, events
    trainers = browser.evaluate("document.getElementById('trainers').innerText")
    assert "kB" in trainers or "MB" in trainers, trainers  # bytes the trainer sent and received
    # live: the page changes without a reload, and shows a server killed mid-run
    updates = int(browser.evaluate("document.body.dataset.updates"))
    whole.signal(signal.SIGKILL)
    gone = f"[...document.querySelectorAll('#events li')].some(li => /(silent|vanish)/.test(li.dataset.kind) && li.innerText.includes('{endpoints['whole']}'))"
    browser.wait_until(gone, 60, "an event for the killed server")
    assert int(browser.evaluate("document.body.dataset.updates")) > updates
    assert browser.evaluate(
        f"document.querySelector('.card[data-endpoint=\"{endpoints['whole']}\"]')?.dataset.health"
    ) in (None, "silent")
    shot = browser.screenshot(artifacts() / "dashboard.png")
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
    t = state["trainers"][0]
    assert t["bytes_sent"] > 0 and t["bytes_received"] > 0 and t["samples"] > 0
    assert trainer.proc.poll() is None  # the run goes on
    # the trainer at a terminal: a live progress bar, redrawn in place
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", trainer.output())  # without colours and cursor moves
    bar = re.findall(r"step [━╺╸ ]+(\d+)/1000\s+[\d.]+ samples/s \| train loss [\d.]+", screen)
    assert len(bar) >= 2 and int(bar[-1]) > int(bar[0]), screen[-2000:]

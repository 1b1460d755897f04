"""Nothing lost, nothing counted twice, with real processes: trainers and servers that restart with
the same key, and a trainer told to stop while a stage has nobody to take its backwards.

Each test ends with the books: for each stage, the samples its servers stepped plus what waits in
their accumulators equals the samples the trainers completed, exactly."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.calls import books_balance, check_books, info, settled_infos
from test_faults import completed, wait_micro_batches

SPEC = {
    "name": "lost",
    "seed": 5,
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "max_seq_len": 32},
    "stages": {"num_stages": 2},
    # no step in these tests: every sample must still be in the accumulators at the end
    "training": {"micro_batch_size": 4, "seq_len": 32, "target_batch_size": 100000, "total_steps": 1000},
}


def two_stages(swarm) -> tuple[list, list[str]]:
    swarm.coordinator(SPEC)
    servers = [swarm.server(f"s{stage}", stage) for stage in range(2)]
    return servers, [swarm.endpoint(s) for s in servers]


def test_a_trainer_restarted_with_its_key_and_data_order_is_counted_again(swarm):
    """Its micro-batches' uids are new (a nonce per start): the servers, which remember the first run's
    uids, do not take the second run's backwards for retries of them."""
    _, endpoints = two_stages(swarm)
    for _ in range(2):  # the same key (t.pem) and the same seed: the same data, in the same order
        trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "4"])
        assert trainer.wait(120) == 0, trainer.output()[-3000:]
    samples = completed(swarm, ["t"])
    assert samples == 2 * 4 * 4
    for stage, endpoint in enumerate(endpoints):
        check_books([info(endpoint)], samples, stage)
    assert f"stage 1: balanced ({samples} completed; 0 stepped + {samples} pending" in books_balance(swarm, samples)


def test_a_trainer_killed_mid_run_and_started_again_with_its_key_finishes_its_micro_batches_once(swarm):
    """SIGKILLed with micro-batches under way (some stages hold their backwards, others not) and the rest
    unsettled: started again with the same key, it runs them again from its journal under their uids.
    Every stage then holds each micro-batch once, and the coordinator's books balance, counting what the
    killed start completed (it never announced all of it). The stages step meanwhile: a micro-batch a stage
    had stepped goes to it dry (input gradients only), one it holds is answered again without being added."""
    swarm.coordinator(STEPPING)
    endpoints = [swarm.endpoint(swarm.server(f"s{stage}", stage)) for stage in range(2)]
    trainer = swarm.trainer("t", ["--seed", "0"])
    wait_micro_batches(swarm, ["t"], 12, 120)
    trainer.signal(signal.SIGKILL)
    trainer.wait(30)
    again = swarm.trainer("t", ["--seed", "1", "--max-micro-batches", "4"])
    assert again.wait(120) == 0, again.output()[-3000:]
    assert re.search(r"the last start of this trainer left \d+ micro-batches unsettled", again.output())
    samples = completed(swarm, ["t"])
    for stage, endpoint in enumerate(endpoints):
        check_books([info(endpoint)], samples, stage)
    books_balance(swarm, samples)


@pytest.mark.slow  # about 40 s: the slow tier
def test_a_trainer_started_again_while_a_replica_holding_its_backwards_hangs_counts_each_once(swarm):
    """SIGKILLed with backwards in both replicas of stage 1, and started again while one of them is SIGSTOPped:
    the backwards that replica answered (their receipts are in the journal) go dry to the other, and the
    receipts wait in the new start's ledger until the replica, resumed, answers for them. Sent there counted
    instead, after the hung replica timed out, they would be in both replicas' accumulators: counted twice."""
    swarm.coordinator(SPEC)
    lasting = ["--set", "network.record_ttl=30"]  # the hang is shorter than a record lives: nothing is dropped
    first = swarm.endpoint(swarm.server("s0", 0, lasting))
    hung, other = swarm.server("s1a", 1, lasting), swarm.server("s1b", 1, lasting)
    ends = [swarm.endpoint(hung), swarm.endpoint(other)]
    trainer = swarm.trainer("t", ["--seed", "0", *lasting])
    wait_micro_batches(swarm, ["t"], 12, 120)
    trainer.signal(signal.SIGKILL)
    trainer.wait(30)
    assert info(ends[0]).samples_accumulated > 0, "the replica to hang holds no backward of the killed start"
    hung.signal(signal.SIGSTOP)
    try:
        restarted = time.time()
        again = swarm.trainer("t", ["--seed", "1", "--max-micro-batches", "4", *lasting])
        left = int(again.wait_for(r"left (\d+) micro-batches unsettled", 60).group(1))
        deadline = time.monotonic() + 90
        while sum(1 for e in swarm.log("t") if e["time"] > restarted and _ran_again(e)) < left:
            assert time.monotonic() < deadline, again.output()[-3000:]
            time.sleep(0.5)
    finally:
        hung.signal(signal.SIGCONT)
    assert again.wait(120) == 0, again.output()[-3000:]
    samples = completed(swarm, ["t"])
    check_books([info(first)], samples, 0)
    check_books([info(e) for e in ends], samples, 1)
    books_balance(swarm, samples)


def test_a_backward_whose_answer_never_came_goes_to_its_server_again_and_counts_once(swarm):
    """Replica a of stage 1 adds its first backward but answers it only after the trainer's deadline (a failpoint:
    as if SIGSTOPped just after adding it). The trainer sends it to a again, which answers with the first addition
    and adds nothing. Sent to replica b instead (as any failed call is), it would sit in both replicas'
    accumulators: counted twice (benchmarks/chaos.py found it so, a donor frozen mid-answer)."""
    swarm.coordinator(SPEC)
    first = swarm.endpoint(swarm.server("s0", 0))
    late = swarm.server("s1a", 1, env={"SWARMTRAIN_FAILPOINTS": "backward.unanswered=1"})
    ends = [swarm.endpoint(late), swarm.endpoint(swarm.server("s1b", 1))]
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "16"])
    assert trainer.wait(180) == 0, trainer.output()[-3000:]
    late.wait_for(r"failpoint backward.unanswered: failing on purpose \(\w+\); 0 more", 5)
    assert re.search(r"stage 1 backward on \S+ failed after [\d.]+ s \(DEADLINE_EXCEEDED", trainer.output())
    samples = completed(swarm, ["t"])
    check_books([info(first)], samples, 0)
    check_books([info(e) for e in ends], samples, 1)
    books_balance(swarm, samples)


def test_a_leaving_server_answers_a_backward_it_added_and_refuses_any_other(swarm):
    """A server adds a backward but its answer never reaches the caller (a failpoint holds it past the caller's
    deadline), and then it is told to leave (SIGTERM). Asked again while it leaves, it answers that backward with
    the first addition's number and adds nothing: its caller settles it by the server's steps (a round under way
    as it leaves may step it) instead of counting it at another replica as well. A backward it never added is
    refused as leaving (peer.server.servicer; the trainer's side: test_an_unanswered_backward_goes_...)."""
    import asyncio
    import contextlib

    import grpc
    from helpers.calls import client as admitted_client

    from protocols import codec, stage_pb2

    swarm.coordinator(SPEC)
    grace = ["--set", "server.shutdown_grace=60", "--set", "server.leave_timeout=90"]
    held = swarm.server("s1", 1, grace, env={"SWARMTRAIN_FAILPOINTS": "backward.unanswered=1"})
    end = swarm.endpoint(held)
    x, y = torch.randn(2, 32, 64), torch.randint(0, 256, (2, 32))

    def request(uid: str):
        return stage_pb2.BackwardRequest(
            run_id="lost", stage=1, uid=uid, inputs=codec.encode(x), targets=codec.encode(y)
        )

    async def leaving() -> None:
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(info, end)).state != "leaving":
            assert time.monotonic() < deadline, held.output()[-3000:]
            await asyncio.sleep(0.1)

    async def scenario():
        client = admitted_client(end, 2**20, 2**28)
        try:
            first = asyncio.create_task(client.backward(end, request("held"), timeout=20))
            await asyncio.to_thread(held.wait_for, r"failpoint backward.unanswered: failing on purpose", 30)
            held.signal(signal.SIGTERM)
            await leaving()
            again, _ = await client.backward(end, request("held"), timeout=10)
            try:
                await client.backward(end, request("new"), timeout=10)
                refused = None
            except grpc.aio.AioRpcError as e:
                refused = e
            with contextlib.suppress(grpc.aio.AioRpcError):
                await first
            return again, refused
        finally:
            await client.close()

    again, refused = asyncio.run(scenario())
    assert again.seq == 1, again
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "leaving" in refused.details(), refused.details()
    assert held.wait(120) == 0, held.output()[-3000:]


def _ran_again(event: dict) -> bool:
    """A log line of a micro-batch an earlier start left: completed before (recovered) or not (index -1)."""
    return event["type"] == "recovered" or (event["type"] == "micro_batch" and event["index"] == -1)


def test_a_replay_goes_to_the_stages_only_server_restarted_with_its_key(swarm):
    """The only server of stage 1 is SIGKILLed with backwards of ours in its accumulator and comes back
    with the same key: the replay avoids the dead process, not the peer, and lands on the new one."""
    (_, last), (first_end, _) = two_stages(swarm)
    trainer = swarm.trainer("t", ["--seed", "0"])
    wait_micro_batches(swarm, ["t"], 4, 120)
    last.signal(signal.SIGKILL)
    last.wait(30)
    again = swarm.server("s1", 1)  # s1.pem: the same peer id, a new incarnation
    last_end = swarm.endpoint(again)
    trainer.wait_for(r"replaying them on another replica", 60)
    wait_micro_batches(swarm, ["t"], len(swarm.log("t")) + 4, 120)  # and it trains on
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(90) == 0, trainer.output()[-3000:]
    samples = completed(swarm, ["t"])
    check_books([info(first_end)], samples, 0)
    check_books([info(last_end)], samples, 1)
    books_balance(swarm, samples)  # the coordinator's books agree: the replayed samples are in the new process


def test_a_trainer_told_to_stop_ends_in_time_when_a_stage_has_no_server(swarm):
    """Its backwards to a stage whose only server is gone can go nowhere: a SIGTERM still ends it, within
    trainer.stop_timeout, saying how many backwards no server stepped."""
    (_, last), _ = two_stages(swarm)
    trainer = swarm.trainer("t", ["--seed", "0", "--set", "trainer.stop_timeout=5"])
    wait_micro_batches(swarm, ["t"], 4, 120)
    last.signal(signal.SIGKILL)
    trainer.wait_for(r"stage 1 has no live server since", 60)
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(30) == 1, trainer.output()[-3000:]
    assert "not yet stepped by stage(s) " in trainer.output()


STEPPING = {**SPEC, "training": {**SPEC["training"], "target_batch_size": 16}}


@pytest.mark.slow
def test_a_joiner_whose_donor_hangs_mid_download_waits_and_serves_the_stages_state(swarm):
    """The only replica of stage 0 hangs (SIGSTOP) while a joiner asks it for its state: the joiner keeps
    trying, saying why, and serves only once it holds the stage's state, never the seed's weights."""
    swarm.coordinator(STEPPING)
    ttl = ["--set", "network.record_ttl=30"]  # the frozen donor stays in the DHT meanwhile
    donor, last = swarm.server("a", 0, ttl), swarm.server("s1", 1, ttl)
    donor_end, _ = swarm.endpoint(donor), swarm.endpoint(last)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "16", *ttl])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    step = info(donor_end).epoch
    assert step >= 2

    donor.signal(signal.SIGSTOP)  # hung (its DHT process still answers: its record stays)
    try:
        joiner = swarm.server("b", 0, [*ttl, "--set", "server.state_load_timeout=2"])
        joiner.wait_for(r"Could not load the state of stage 0 from 1 peer\(s\) \(.+\); trying again in", 90)
    finally:
        donor.signal(signal.SIGCONT)
    joined = joiner.wait_for(r"Serving stage 0 at (\S+) from step (\d+)", 90)
    assert int(joined.group(2)) == step
    assert "starting from the run's seed" not in joiner.output()
    samples = completed(swarm, ["t"])
    check_books(settled_infos([donor_end, swarm.known(joined.group(1), "b")]), samples, 0)


def dht_process(peer) -> int:
    """A peer's hivemind DHT process: its child whose own child is the libp2p daemon."""
    from peer.process.reaper import children

    def name(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    found = [c for c in children(peer.proc.pid) if any(name(g) == "p2pd" for g in children(c))]
    assert len(found) == 1, f"{peer.name}: DHT processes {found}"
    return found[0]


@pytest.mark.slow
def test_a_replica_whose_dht_hangs_fails_rounds_resyncs_and_loses_nothing(swarm):
    """Replica a's DHT process hangs (SIGSTOP) for 4 s, twice, while its stage steps every few micro-batches:
    its announcements and reads fail, rounds with it fail or go without it (their gradients put back), and
    it falls behind and resyncs from its partner. The books stay exact, both replicas at one step and equal.
    (A hung DHT also holds up a's calls, so no round of a's ever gets as far as its announcement: the case of
    a DHT that refuses that one store, while all else works, is left to the code's reading.)"""
    from test_faults import check_same_parameters

    swarm.coordinator(STEPPING)
    quick = ["--set", "network.dht_request_timeout=0.5"]  # loopback stores take milliseconds
    a, b, last = swarm.server("a", 0, quick), swarm.server("b", 0, quick), swarm.server("s1", 1)
    ends = [swarm.endpoint(a), swarm.endpoint(b)]
    last_end = swarm.endpoint(last)
    trainer = swarm.trainer("t", ["--seed", "0"])
    wait_micro_batches(swarm, ["t"], 16, 120)
    hanging = dht_process(a)
    for _ in range(2):
        os.kill(hanging, signal.SIGSTOP)
        try:
            time.sleep(4.0)  # rounds come about every second; the records live 10 s
        finally:
            os.kill(hanging, signal.SIGCONT)
        wait_micro_batches(swarm, ["t"], len(swarm.log("t")) + 8, 120)
    assert "could not announce in the DHT" in a.output()
    wait_micro_batches(swarm, ["t"], len(swarm.log("t")) + 12, 120)  # and the stage goes on
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(90) == 0, trainer.output()[-3000:]
    samples = completed(swarm, ["t"])
    infos = settled_infos(ends)
    check_books(infos, samples, 0)
    check_same_parameters(infos, 0)
    check_books(settled_infos([last_end]), samples, 1)
    books_balance(swarm, samples)


@pytest.mark.slow
def test_a_replica_whose_round_announcement_the_dht_refuses_sits_the_round_out_and_its_death_loses_nothing(swarm):
    """The DHT refuses replica a's announcement of what its round covers (a failpoint, while all else works):
    a sits that round out and puts its gradients back, so no step counts what trainers cannot look up. It is
    SIGKILLed right then: the trainer asks the survivor's step records, replays what no step counted, and the
    books are exact."""
    swarm.coordinator(STEPPING)
    refused = {"SWARMTRAIN_FAILPOINTS": "round.announce=3"}  # the announcement's three tries
    a, b, last = swarm.server("a", 0, env=refused), swarm.server("b", 0), swarm.server("s1", 1)
    b_end, last_end = swarm.endpoint(b), swarm.endpoint(last)
    swarm.endpoint(a)
    trainer = swarm.trainer("t", ["--seed", "0"])
    a.wait_for(r"could not announce the round for step \d+ in the DHT; sitting it out", 120)
    a.signal(signal.SIGKILL)
    a.wait(30)
    wait_micro_batches(swarm, ["t"], len(swarm.log("t")) + 8, 120)  # the stage goes on with b
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(90) == 0, trainer.output()[-3000:]
    samples = completed(swarm, ["t"])
    check_books(settled_infos([b_end]), samples, 0)
    check_books(settled_infos([last_end]), samples, 1)
    books_balance(swarm, samples)


def test_a_replica_behind_its_stage_is_not_routed_to():
    """A replica more than `max_step_lag` steps behind the newest of its stage computes with old weights:
    trainers leave it out until it resyncs (one step behind, as replicas are for a moment after a round,
    is still routed to)."""
    from types import SimpleNamespace

    from dht.records import ServerRecord
    from peer.config.settings import TrainerConfig
    from peer.swarm.router import Router

    def record(epoch: int, state: str = "serving") -> ServerRecord:
        return ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0, epoch=epoch, state=state)

    router = SimpleNamespace(cfg=TrainerConfig(), dead=set(), leaving=set(), distrusted=set())
    records = {"new": record(7), "one-behind": record(6), "behind": record(4), "joining": record(9, "joining")}
    assert set(Router._routable(router, records, [7, 6, 4])) == {"new", "one-behind"}
    # a replica that claims a step most of them do not back draws nothing, and moves nothing (peer.swarm.consensus)
    records["far"] = record(1000)
    assert set(Router._routable(router, records, [7, 6, 4, 1000])) == {"new", "one-behind"}


def test_a_server_that_may_hold_a_backward_is_waited_for_until_it_died_left_or_expired():
    """A recovered micro-batch's backward that an earlier start sent and got no answer for goes only to that server
    (peer.trainer.calls, `insist`) until the router takes it for lost: dead, left, caught lying, or its record
    expired (or never seen); a record missing from one DHT read, but not expired, is not enough."""
    from types import SimpleNamespace

    from dht.records import ServerRecord
    from peer.config import NetworkConfig
    from peer.swarm.router import NoServer, Router

    now = time.time()
    latest = {
        p: ServerRecord(stage=1, endpoint="127.0.0.1:1", throughput=1.0, updated=now)
        for p in ("live", "missed", "dead", "leaving")
    }
    latest["expired"] = ServerRecord(stage=1, endpoint="127.0.0.1:2", throughput=1.0, updated=now - 60)
    # a resting server's record says it lives longer (peer.net.cadence): 20 s old, it has not expired; one that
    # claims to live a day is believed no longer than a resting one (record_ttl + rest - announce period: 24 s)
    latest["resting"] = ServerRecord(stage=1, endpoint="127.0.0.1:3", throughput=1.0, updated=now - 20, ttl=24.0)
    latest["boaster"] = ServerRecord(stage=1, endpoint="127.0.0.1:4", throughput=1.0, updated=now - 60, ttl=86400.0)
    router = SimpleNamespace(
        dead={"dead"},
        leaving={"left", "leaving"},
        distrusted={"liar"},
        latest=latest,
        present={"live", "leaving"},
        net=NetworkConfig(),
    )
    router.vanished = lambda p: Router.vanished(router, p)
    names = ("live", "missed", "dead", "expired", "left", "leaving", "liar", "unseen", "resting", "boaster")
    lost = {p for p in names if Router.lost(router, p)}
    assert lost == {"dead", "expired", "left", "leaving", "liar", "unseen", "boaster"}
    # one that says it is leaving, while its record lives, still answers a backward it holds: not vanished
    assert {p for p in names if Router.vanished(router, p)} == lost - {"leaving"}
    router.servers, router.health = [{}, {}], {}  # none routable: a leaving one is asked all the same
    assert Router.only(router, 1, "leaving") == ("leaving", latest["leaving"])
    for pid in ("live", "left"):
        with pytest.raises(NoServer):
            Router.only(router, 1, pid)
    with pytest.raises(NoServer):  # of another stage than asked
        Router.only(router, 0, "leaving")


def test_an_unanswered_backward_goes_to_its_server_again_while_it_may_hold_it():
    """A backward a server gave no answer for (no refusal of its own) goes to that server only, which may hold it:
    while it shows no sign of life (frozen) the backward waits, until the server is lost or the bound passed (then
    it is avoided); once it lives (its record refreshed, or another answer), one more try, asked again after a
    refusal with a reason; a failure otherwise (no answer, a wrong one, or one that blames us) has it avoided and
    the backward goes on. A first refusal with a reason, and a dry backward (which adds nothing), go on at once.
    peer.trainer.insistence"""
    import asyncio
    from types import SimpleNamespace

    from peer.config import NetworkConfig
    from peer.config.settings import TrainerConfig
    from peer.swarm.router import NoServer
    from peer.trainer.calls import CallerFault, Calls
    from protocols import stage_pb2

    record = SimpleNamespace(endpoint="127.0.0.1:1", incarnation=1)
    outcomes = {
        "none": (None, "DEADLINE_EXCEEDED", True, "unanswered"),
        "refused": (None, "RESOURCE_EXHAUSTED", True, "refused"),
        "bad": (None, "a tensor that cannot be right", True, "bad"),
        "leaving": (None, "UNAVAILABLE: this server is leaving the swarm", True, "leaving"),
    }

    class Tries(Calls):
        def __init__(self, answers: list, refreshed=1e9, answered=1e9, lost=1e9, moved=1e9) -> None:
            self.tcfg = TrainerConfig(unanswered_wait=0.5, refresh_period=0.1)
            self.answers, self.tried, self.at, self.avoided, self.waits = answers, [], [], [], []
            self.cfg = SimpleNamespace(network=NetworkConfig(record_ttl=0.2, rest_announce_period=2.0))
            self.cfg.network.rest_announce_period = self.cfg.network.announce_period  # records live 0.2 s at most
            self._no_server_since, self.journal, began = {}, SimpleNamespace(sent=lambda *a: None), time.time()
            after = lambda s: time.time() - began > s  # noqa: E731

            def only(stage, pid, mind_bans=True):
                if pid == "hung" and after(moved):  # under no record of this stage now
                    raise NoServer(f"server {pid} of stage {stage} cannot take a call now")
                return pid, record

            self.router = SimpleNamespace(
                servers=[{"hung": record, "other": record}],
                latest={},  # no endpoint to probe: a frozen server's port takes connections anyway
                lost=lambda pid: after(lost),
                vanished=lambda pid: after(lost),
                only=only,
                elsewhere=lambda pid, stage: pid == "hung" and after(moved),
                choose=lambda stage, exclude, prefer, kind: (
                    "hung" if "hung" not in {*exclude, *self.avoided} and not after(min(lost, moved)) else "other",
                    record,
                ),
                deadline=lambda *a: 1.0,
                refreshed_since=lambda pid, since: after(refreshed),
                answered_since=lambda pid, since: after(answered),
                ban=self.avoided.append,
            )

        def _call_bytes(self, *a) -> int:
            return 0

        def _count_bytes(self, *a) -> None:
            pass

        async def _wait_for_server(self, *a) -> None:
            self.waits.append(a)
            await asyncio.sleep(0.05)

        async def _attempt(self, stage, method, request, payloads, pid, record, timeout, kind):
            self.tried.append(pid)
            self.at.append(time.monotonic())
            answer = self.answers.pop(0) if pid == "hung" else "answer"
            if answer == "blame":
                raise CallerFault("INVALID_ARGUMENT: says it is ours")
            return outcomes.get(answer) or ((None, {}, pid), "", True, "")

        async def _failed(self, *a) -> bool:
            return True

    def tries(answers: list, dry: bool = False, insist: str | None = None, **when) -> tuple:
        calls = Tries(answers, **when)
        request = stage_pb2.BackwardRequest(uid="u", dry=dry)
        answer = asyncio.run(calls._call(0, "backward", request, insist=insist))[2]
        return answer, calls.tried, calls.avoided, calls.at[-1] - calls.at[0]

    for sign in ("refreshed", "answered"):  # frozen, then it shows it lives: asked again then, not before
        answer, tried, avoided, waited = tries(["none", "answer"], **{sign: 0.3})
        assert (answer, tried, avoided) == ("hung", ["hung", "hung"], []) and waited >= 0.25
    frozen = Tries(["none", "answer"], refreshed=0.3)  # its wait says whom it waits for, and why
    asyncio.run(frozen._call(0, "backward", stage_pb2.BackwardRequest(uid="u")))
    assert frozen.waits and all("hung has not shown it lives" in waited[-1] for waited in frozen.waits)
    assert tries(["none", "refused", "answer"], refreshed=0)[:3] == ("hung", ["hung"] * 3, [])
    for again in ("none", "bad", "blame"):  # it lives but withholds (or blames us): avoided, and on
        assert tries(["none", again], refreshed=0)[:3] == ("other", ["hung", "hung", "other"], ["hung"])
    assert tries(["none"], lost=0.3)[:3] == ("other", ["hung", "other"], [])  # frozen until lost: anywhere
    answer, tried, avoided, waited = tries(["none"])  # frozen past the bound (1.3 s): avoided, and on
    assert (answer, tried, avoided) == ("other", ["hung", "other"], ["hung"]) and waited >= 1.2
    assert tries(["refused"])[1] == ["hung", "other"]  # a refusal with a reason added nothing
    # leaving, it answers what it holds (peer.server.servicer): refused as leaving, it holds none: anywhere
    assert tries(["none", "leaving"], refreshed=0)[:3] == ("other", ["hung", "hung", "other"], [])
    assert tries(["none"], dry=True)[1] == ["hung", "other"]
    # a killed start's journal names it: insisted on while it lives, however long; but once it serves another
    # stage (under no record of this one) it holds nothing of this stage: the backward goes on
    assert tries(["none", "none", "answer"], insist="hung", refreshed=0)[:3] == ("hung", ["hung"] * 3, [])
    assert tries([], insist="hung", moved=0)[:2] == ("other", ["other"])


def trained_then_emptied(swarm, extra: list[str] = ()) -> tuple[int, str, object]:
    """2 stages of one server each, trained a few steps. Returns the step stage 1 reached, stage 0's
    endpoint and stage 1's server."""
    swarm.coordinator(STEPPING, extra=["--set", "coordinator.report_period=0.5", *extra])
    first, last = swarm.server("s0", 0), swarm.server("s1", 1)
    first_end, last_end = swarm.endpoint(first), swarm.endpoint(last)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "16"])
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    step = info(last_end).epoch
    assert step >= 2
    return step, first_end, last


@pytest.mark.slow
def test_a_stage_left_with_no_server_and_no_checkpoint_is_waited_for_not_restarted_from_the_seed(swarm):
    step, _, last = trained_then_emptied(swarm)
    swarm.peers[0].wait_for(r"stage 1: 1 server\(s\) at step [1-9]", 30)  # the coordinator has seen it step
    last.signal(signal.SIGKILL)
    newcomer = swarm.server("n1", 1)
    newcomer.wait_for(rf"Stage 1 was trained to step {step}, but no server and no checkpoint holds its state", 90)
    newcomer.signal(signal.SIGTERM)
    assert newcomer.wait(30) == 0, newcomer.output()[-3000:]
    assert "starting from the run's seed" not in newcomer.output()
    assert "Serving stage 1 at" not in newcomer.output()


@pytest.mark.slow
def test_a_stage_left_with_no_server_loads_the_coordinators_newest_checkpoint(swarm):
    every = ["--set", "coordinator.checkpoint_every_steps=2", "--set", "coordinator.checkpoint_every_minutes=0"]
    root = swarm.workdir / "ckpt"
    step, first_end, last = trained_then_emptied(swarm, ["--checkpoints", str(root), *every])
    written = swarm.peers[0].wait_for(r"Wrote checkpoint \S+ \(step (\d+)", 60)
    last.signal(signal.SIGKILL)
    newcomer = swarm.server("n1", 1)
    joined = newcomer.wait_for(r"Serving stage 1 at (\S+) from step (\d+)", 120)
    assert 2 <= int(joined.group(2)) <= step and int(written.group(1)) >= 2
    assert "starting from the run's seed" not in newcomer.output()
    assert re.search(r"Loaded the state of stage 1 \(step [1-9]\d*\)", newcomer.output())


@pytest.mark.slow
def test_a_coordinator_resumed_from_an_older_checkpoint_into_its_directory_checkpoints_on_and_serves_the_newest(
    swarm,
):
    """The coordinator is SIGKILLed and resumed from an older checkpoint of its own directory (`--resume
    D/older --checkpoints D`) while the swarm trains on. It says each part's step; checkpoints stay due;
    the one it resumed from is pruned (checkpoint_keep 2) while it serves the newest instead; and a newcomer
    to a stage left with no server loads that newest checkpoint, not the one the coordinator started from."""
    from helpers.processes import descendants

    from peer.coordinator import checkpoint

    root = swarm.workdir / "ckpt"
    every = ["--set", "coordinator.checkpoint_every_steps=2", "--set", "coordinator.checkpoint_every_minutes=0"]
    extra = ["--checkpoints", str(root), "--set", "coordinator.checkpoint_keep=2", *every]
    swarm.coordinator(STEPPING, extra=extra)
    first, last = swarm.server("s0", 0), swarm.server("s1", 1)
    swarm.endpoint(first), swarm.endpoint(last)
    trainer = swarm.trainer("t", ["--seed", "0"])
    coordinator = swarm.peers[0]
    deadline = time.monotonic() + 120
    while len(checkpoint.complete(root)) < 2:
        assert time.monotonic() < deadline, coordinator.output()[-3000:]
        time.sleep(0.2)
    coordinator.known_pids.update(descendants(coordinator.proc.pid))
    os.killpg(coordinator.proc.pid, signal.SIGKILL)  # its process and its DHT
    older = checkpoint.complete(root)[0]  # (a write prunes only once it is whole: two are left)
    older_step = checkpoint.read_manifest(older)["step"]
    newest_before = max(checkpoint.read_manifest(p)["step"] for p in checkpoint.complete(root))

    (swarm.workdir / "coordinator.json").unlink()
    swarm.coordinator(STEPPING, extra=[*extra, "--resume", str(older)])
    resumed = swarm.peers[-1]
    said = resumed.wait_for(r"Resuming from (\S+) \(step (\d+); (.*)\), served at", 60)
    # each part named (with its own step where the parts' steps differ)
    assert int(said.group(2)) == older_step and "stage 0" in said.group(3) and "stage 1" in said.group(3)
    # checkpoints stay due from the step it resumed from: two more, past the newest before, prune the older
    deadline = time.monotonic() + 120
    while (
        older.exists() or max(checkpoint.read_manifest(p)["step"] for p in checkpoint.complete(root)) <= newest_before
    ):
        assert time.monotonic() < deadline and trainer.proc.poll() is None, resumed.output()[-3000:]
        time.sleep(0.3)
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(90) == 0, trainer.output()[-3000:]
    while True:  # no step comes any more: let the checkpoint under way, if any, be written
        log = resumed.output()
        begun = re.findall(r"checkpoint at step (\d+): pulling", log)
        n = begun[-1] if begun else None
        if n is None or re.search(rf"Wrote checkpoint \S+ \(step {n},|checkpoint at step {n} (skipped|failed)", log):
            break
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.3)
    newest = checkpoint.read_manifest(checkpoint.latest(root))
    last.signal(signal.SIGKILL)  # no handover: the stage's state of last resort is the newest checkpoint
    last.wait(30)
    newcomer = swarm.server("n1", 1)
    joined = newcomer.wait_for(r"Serving stage 1 at (\S+) from step (\d+)", 120)
    assert int(joined.group(2)) == newest["parts"]["stage 1"]["epoch"] > older_step
    assert re.search(r"Loaded the state of stage 1 \(step [1-9]\d*\)", newcomer.output())


def test_the_last_server_of_a_stage_hands_its_state_to_the_coordinator_as_it_leaves(swarm):
    """No checkpoint is due, yet the only server of stage 1 leaving (SIGTERM) waits until the coordinator has
    checkpointed its state, and a newcomer goes on from that very step: nothing the stage learned is lost."""
    never = ["--set", "coordinator.checkpoint_every_steps=1000", "--set", "coordinator.checkpoint_every_minutes=0"]
    step, _, last = trained_then_emptied(swarm, ["--checkpoints", str(swarm.workdir / "ckpt"), *never])
    before = info(swarm.endpoint(last))
    last.signal(signal.SIGTERM)
    last.wait_for(r"Stage 1: the last server of it is leaving; waiting up to \d+ s for the coordinator", 30)
    swarm.peers[0].wait_for(rf"The last server of stage 1 is leaving at step {step}: checkpointing its state", 30)
    assert last.wait(60) == 0, last.output()[-3000:]
    assert f"Stage 1: its state (step {step}) is held; leaving." in last.output()
    newcomer = swarm.server("n1", 1)
    joined = newcomer.wait_for(r"Serving stage 1 at (\S+) from step (\d+)", 120)
    assert int(joined.group(2)) == step
    after = info(swarm.known(joined.group(1), "n1"))
    assert (after.epoch, after.samples_stepped) == (before.epoch, before.samples_stepped)


def test_a_checkpoint_keeps_a_parts_newer_copy_when_its_servers_hold_an_older_step(tmp_path):
    """A stage restarted from an older state (or with no server) never takes a checkpoint's copy of it back:
    the previous checkpoint's copy is carried into the next, and pruning keeps it."""
    from peer.config import PeerConfig, RunSpec
    from peer.coordinator import checkpoint
    from peer.coordinator.checkpointer import Checkpointer

    spec = RunSpec.from_dict(STEPPING)

    def part(stage: int, epoch: int) -> checkpoint.Part:
        return checkpoint.Part(f"stage {stage}", {"epoch": epoch}, {"param/w": torch.full((3,), float(epoch))})

    first = checkpoint.write(tmp_path, spec.to_dict(), spec.fingerprint(), 10, [part(0, 10), part(1, 10)], keep=1)
    cfg = PeerConfig.from_dict({"coordinator": {"checkpoint_dir": str(tmp_path)}})
    checkpointer = Checkpointer(spec, cfg, dht=None)
    checkpointer.previous = first
    before = checkpointer._previous_parts()
    parts = [checkpointer._newest("stage 0", part(0, 12), before), checkpointer._newest("stage 1", part(1, 3), before)]
    assert checkpointer._newest("stage 1", None, before).carried_from == first  # no server at all: carried too
    second = checkpoint.write(tmp_path, spec.to_dict(), spec.fingerprint(), 12, parts, keep=1)
    assert checkpoint.complete(tmp_path) == [second]  # the first is pruned; its copy of stage 1 lives on
    manifest = checkpoint.read_manifest(second)
    assert {n: e["epoch"] for n, e in manifest["parts"].items()} == {"stage 0": 12, "stage 1": 10}
    _, tensors = checkpoint.load_part(second, manifest, "stage 1")
    assert torch.equal(tensors["param/w"], torch.full((3,), 10.0))


def test_the_books_say_in_words_what_is_lost_or_counted_twice():
    from dht.records import ServerRecord, TrainerRecord
    from peer.swarm.books import Books

    def server(stage: int, stepped: int, pending: int, state: str = "serving") -> ServerRecord:
        return ServerRecord(
            stage=stage, endpoint="h:1", throughput=1.0, samples_stepped=stepped, samples=pending, state=state
        )

    books = Books(2)
    trainers = {"t": TrainerRecord(samples=40, inflight=4, replaying=[0, 8], started=1.0)}
    stages = [{"a": server(0, 32, 8), "b": server(0, 32, 8)}, {"c": server(1, 16, 12)}]
    first, second = books.observe(stages, trainers)
    assert first.extra == 4 and not first.balanced  # 48 accounted: 40 completed and 4 under way explain 44
    assert "4 samples are counted more than once" in first.words(0)
    assert second.missing == 4 and "4 completed samples are in no step, accumulator or replay" in second.words(1)
    assert books.since > 0
    # the trainer leaves (its record expires): its samples stay counted
    stages = [{"a": server(0, 40, 0)}, {"c": server(1, 40, 0), "gone": server(1, 99, 99, "left")}]
    assert all(b.balanced for b in books.observe(stages, {})) and books.since == 0
    # a restarted coordinator goes on with the books it saved: the trainer that left is still counted
    again = Books.from_dict(2, json.loads(json.dumps(books.to_dict())))
    assert all(b.balanced and b.completed == 40 for b in again.observe(stages, {}))


def test_the_books_hold_a_trainer_s_word_to_what_every_stage_counted_of_its_backwards():
    """With admission on, a key that says it completed 10,000 samples (a new start every second) and sent nothing
    completed none; an honest trainer's samples count as far as each stage counted them (servers gone too), plus
    what it holds for replay there; and a restarted coordinator keeps what the servers said."""
    from dht.records import ServerRecord, TrainerRecord
    from peer.swarm.books import Books

    def server(stage: int, stepped: int, counted: dict, started: float = 1.0, state="serving") -> ServerRecord:
        r = ServerRecord(stage=stage, endpoint="h:1", throughput=1.0, samples_stepped=stepped, state=state)
        r.started, r.counted = started, counted
        return r

    books = Books(2, vouched=True)
    trainers = {"t": TrainerRecord(samples=40, replaying=[0, 8], started=1.0)}
    trainers |= {f"liar{i}": TrainerRecord(samples=10_000, replaying=[10_000, 0], started=float(i)) for i in range(5)}
    stages = [{"a": server(0, 40, {"t": 24}), "b": server(0, 40, {"t": 16})}, {"c": server(1, 32, {"t": 32})}]
    first, second = books.observe(stages, trainers)
    assert first.completed == 40 and first.balanced and second.balanced, (first.words(0), second.words(1))
    # a server restarted (a new start): what its first start counted is remembered, as is a server gone
    stages = [{"a": server(0, 40, {}, started=2.0)}, {"c": server(1, 40, {"t": 40})}]
    trainers["t"].replaying = [0, 0]
    assert all(b.balanced and b.completed == 40 for b in books.observe(stages, trainers))
    again = Books.from_dict(2, json.loads(json.dumps(books.to_dict())), vouched=True)
    assert all(b.balanced and b.completed == 40 for b in again.observe(stages, trainers))
    # its record lags the servers' (announced every few seconds): what every stage counted beyond it is the lag,
    # not samples counted twice; a stage that steps more than every stage counted still is
    lagging = Books(2, vouched=True)
    stages = [{"a": server(0, 40, {"t": 40})}, {"c": server(1, 40, {"t": 40})}]
    (first, second) = lagging.observe(stages, {"t": TrainerRecord(samples=32, started=1.0)})
    assert first.lag == 8 and first.balanced and second.balanced, (first.words(0), second.words(1))
    assert "+8 completed since the trainers announced" in first.words(0)
    stages[1]["c"].samples_stepped = 48
    assert lagging.observe(stages, {"t": TrainerRecord(samples=32, started=1.0)})[1].extra == 8
    # a key's server record that says it counted the key itself vouches for nothing; a negative replay claim is 0
    self_counted = Books(1, vouched=True)
    forged = server(0, 0, {"liar": 500})
    (stage,) = self_counted.observe([{"liar": forged}], {"liar": TrainerRecord(samples=500, replaying=[-9], started=1)})
    assert stage.completed == 0 and stage.replaying == 0 and stage.balanced, stage.words(0)
    # without admission (callers unknown), a trainer's word stands
    assert Books(2).observe(stages, trainers)[0].completed == 40 + 5 * 10_000


def test_a_resumed_run_checkpoints_on_from_its_step_and_replaces_a_checkpoint_of_the_same_step(tmp_path):
    """Resumed from step 4 into a directory that holds step 8 (a later, abandoned history): checkpoints are
    due again from step 4 on, carry parts from the resumed one, and the one of step 8 is replaced whole."""
    from types import SimpleNamespace

    from peer.config import PeerConfig, RunSpec
    from peer.coordinator import checkpoint
    from peer.coordinator.coordinator import Coordinator
    from peer.coordinator.timeline import Timeline

    spec = RunSpec.from_dict(STEPPING)

    def write(step: int, value: float):
        parts = [checkpoint.Part(f"stage {s}", {"epoch": step}, {"param/w": torch.full((2,), value)}) for s in (0, 1)]
        return checkpoint.write(tmp_path, spec.to_dict(), spec.fingerprint(), step, parts, keep=5)

    resumed, later = write(4, 4.0), write(8, 8.0)
    cfg = PeerConfig.from_dict({"coordinator": {"checkpoint_dir": str(tmp_path), "checkpoint_every_steps": 2}})
    run = Coordinator(spec, cfg, identity=None, dht=None)
    run.archive, run.resumed, run.timeline = SimpleNamespace(step=4, path=resumed), True, Timeline()
    run._open_checkpoints()
    assert run.checkpointer.due(6) and run.checkpointer.previous == resumed
    again = write(8, 9.0)  # step 8 of this history replaces the abandoned one
    assert again == later and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000008"]
    _, tensors = checkpoint.load_part(again, checkpoint.read_manifest(again), "stage 1")
    assert torch.equal(tensors["param/w"], torch.full((2,), 9.0))


def test_replicas_at_one_step_that_hold_different_parameters_unbalance_the_books():
    from dht.records import ServerRecord, TrainerRecord
    from peer.model.fingerprint import first_difference
    from peer.swarm.books import Books, from_record

    assert first_difference([1.0, 4.0, 2.0, 9.0], [1.0, 4.0, 2.0, 9.0 * (1 + 1e-6)]) is None  # rounding
    assert first_difference([1.0, 4.0, 2.0, 9.0], [1.0, 4.0, 2.0, 9.1]) == 1
    assert first_difference([1.0, 4.0], [1.5, 4.0]) == 0 and first_difference([], [1.0, 4.0]) is None

    def server(endpoint: str, epoch: int, fingerprint: list[float]) -> ServerRecord:
        return ServerRecord(stage=0, endpoint=endpoint, throughput=1.0, epoch=epoch, fingerprint=fingerprint)

    books = Books(1)
    trainers = {"t": TrainerRecord(samples=0, started=1.0)}
    same = {"a": server("a:1", 3, [1.0, 4.0]), "b": server("b:1", 3, [1.0, 4.0]), "c": server("c:1", 2, [9.0, 81.0])}
    (stage,) = books.observe([same], trainers)
    assert stage.balanced and not stage.apart  # c is a step behind: nothing to compare it with
    apart = {**same, "c": server("c:1", 3, [1.0, 4.5])}
    (stage,) = books.observe([apart], trainers)
    assert not stage.balanced and books.since > 0
    words = from_record(books.record([stage]))[0].words(0)
    assert "replicas at step 3 hold different parameters: a:1" in words and "c:1" in words, words


def test_a_state_whose_parameters_do_not_match_its_donors_fingerprint_is_refused():
    """Shards mixed from replicas that went apart (or damaged on the way) do not load: the part keeps its
    parameters and the joiner tries again."""
    from peer.config import RunSpec
    from peer.model.part_state import StateError
    from peer.model.runtime import StageRuntime

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    donor, joiner = StageRuntime(spec, 1), StageRuntime(spec, 1)
    donor.apply_step([torch.full_like(p, 0.1) for p in donor.params], 4, 0, ["donor"], {})
    metadata, tensors = donor.snapshot()
    assert len(metadata["fingerprint"]) == 8 * len(donor.params)  # each parameter's, then its AdamW state's
    before = [p.detach().clone() for p in joiner.params]
    names = donor.param_names
    for name in (f"param/{names[3]}", f"optim/{names[2]}/exp_avg_sq", f"optim/{names[1]}/step"):
        damaged = {**tensors, name: tensors[name] * 1.5 + 0.01}
        try:
            joiner.load_state(metadata, damaged, "joiner")
            raise AssertionError(f"a state whose {name} does not match its fingerprint was loaded")
        except StateError as e:
            assert f"state's {name} does not match" in str(e) and "fingerprint" in str(e), e
    assert joiner.epoch == 0 and all(torch.equal(a, b) for a, b in zip(before, joiner.params, strict=True))
    joiner.load_state(metadata, tensors, "joiner")
    assert joiner.epoch == 1 and joiner.history[-1].values == donor.history[-1].values


def test_a_state_whose_optimizer_state_or_step_no_adamw_step_leaves_is_refused_as_poisoned():
    """Adam moments that are not finite, a negative second moment, a step count of 0, first moments larger than
    the second allow (peer.model.part_state.moment_bound), an epoch that is not a step: each refused (Poisoned: its
    donor is not asked again), naming the tensor, and nothing loaded."""
    from peer.config import RunSpec
    from peer.model.part_state import Poisoned
    from peer.model.runtime import StageRuntime

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    donor, joiner = StageRuntime(spec, 1), StageRuntime(spec, 1)
    donor.apply_step([torch.full_like(p, 0.1) for p in donor.params], 4, 0, ["donor"], {})
    metadata, tensors = donor.snapshot()
    name = donor.param_names[2]
    rotten = [
        ({}, {f"optim/{name}/exp_avg": torch.full_like(tensors[f"optim/{name}/exp_avg"], float("nan"))}, "finite"),
        ({}, {f"optim/{name}/exp_avg_sq": -tensors[f"optim/{name}/exp_avg_sq"] - 1}, "negative"),
        ({}, {f"optim/{name}/step": tensors[f"optim/{name}/step"] * 0}, "at least one step"),
        # first moments no gradients leave beside those second moments: one step would move the weights ~|m|/eps x lr
        ({}, {f"optim/{name}/exp_avg": tensors[f"optim/{name}/exp_avg_sq"].sqrt() * 2 + 1e-3}, "larger than"),
        ({"epoch": 1e9}, {}, "not a step"),
        ({"epoch": -1}, {}, "not a step"),
        # read before anything loads: a malformed step record left the weights loaded and the step unchanged
        ({"step_coverage": {"1": {"x": 7}}}, {}, "step records are malformed"),
    ]
    for meta_change, tensor_change, words in rotten:
        with pytest.raises(Poisoned) as caught:
            joiner.load_state({**metadata, **meta_change}, {**tensors, **tensor_change}, "joiner")
        assert words in str(caught.value), str(caught.value)
        assert not meta_change and name in str(caught.value) or meta_change
        assert joiner.epoch == 0 and not joiner.optimizer.state
    joiner.load_state(metadata, tensors, "joiner")
    assert joiner.epoch == 1


def test_the_coordinator_vets_a_pulled_state_before_a_checkpoint_keeps_it():
    """peer.coordinator.vetting: a replica's real state passes, and gives the fingerprint its replica keeps for
    the step; a step past the credible one, a tensor the part has no place for, non-finite parameters, a rotten
    optimizer slot, parameters other than the fingerprint given with them, metadata a resume would fail on (another
    part, a count that is not one, a tensor count other than the tensors, step records that do not parse): each
    refused, naming what."""
    from peer.config import RunSpec
    from peer.coordinator.vetting import seconds, vet
    from peer.model.part_state import Poisoned, StateError
    from peer.model.runtime import StageRuntime

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    donor = StageRuntime(spec, 1)
    donor.apply_step([torch.full_like(p, 0.1) for p in donor.params], 4, 0, ["donor"], {})
    metadata, tensors = donor.snapshot()
    values = vet(spec, 1, "", metadata, tensors, 1, 1e-4)
    assert values == donor.history[-1].values and not seconds(donor.history, 1, values, 1e-4)
    assert "differ" in seconds(donor.history, 1, [v + 1 for v in values], 1e-4)
    name = donor.param_names[0]
    moved = {**tensors, f"param/{name}": tensors[f"param/{name}"] + 1e-2}
    bad = [
        (metadata, tensors, 0, StateError, "past the part's credible step 0"),
        (metadata, {**tensors, "param/extra": torch.zeros(2)}, 1, StateError, "'param/extra'"),
        (metadata, {**tensors, f"param/{name}": tensors[f"param/{name}"] * float("inf")}, 1, Poisoned, "not finite"),
        (metadata, {**tensors, f"optim/{name}/step": tensors[f"optim/{name}/step"] * 0}, 1, Poisoned, "one step"),
        (metadata, {**tensors, f"optim/{name}/exp_avg": tensors[f"optim/{name}/exp_avg"] + 1}, 1, Poisoned, "larger"),
        (metadata, moved, 1, StateError, "do not match the fingerprint"),
        ({**metadata, "epoch": "1"}, tensors, 1, Poisoned, "not a step"),
        ({**metadata, "part": "stage 0"}, tensors, 1, StateError, "not stage 1"),
        ({**metadata, "samples_stepped": "x"}, tensors, 1, Poisoned, "samples_stepped is 'x', not a count"),
        ({**metadata, "tensor_count": 999}, tensors, 1, StateError, "says 999 tensors"),
        ({**metadata, "step_coverage": {"1": {"p": [1]}}}, tensors, 1, Poisoned, "step records are malformed"),
    ]
    for meta, state, limit, kind, words in bad:
        with pytest.raises(kind) as caught:
            vet(spec, 1, "", meta, state, limit, 1e-4)
        assert words in str(caught.value), str(caught.value)


def test_a_trainers_journal_gives_a_start_after_a_kill_what_the_last_left_unsettled(tmp_path):
    from peer.trainer.journal import Entry, Journal

    path = tmp_path / "t.run.journal.jsonl"
    first = Journal(path, compact_after=5)
    assert first.open(100.0) == []
    tokens = torch.arange(8).reshape(2, 4)
    for i in range(4):
        first.begin(Entry(f"u{i}", tokens + i, tokens))
        first.sent(f"u{i}", 1, "peer-b")
    for i in range(3):
        first.done(f"u{i}", 2)
    first.settled("u0")  # every stage stepped it
    first.sent("u1", 0, "peer-a")
    first.stepped("u1", 1)  # stage 1 stepped u1: it gets u1 dry next time
    first.received("u2", 1, ("peer-b", 7, 3, 123.5))  # stage 1's receipt: the next start holds it, sends u2 dry
    # killed here: u1 and u2 completed but are not settled; u3 is under way
    with path.open("a") as f:
        f.write('{"done": "u3", "sam')  # a line the kill cut off
    second = Journal(path)
    left = {e.uid: e for e in second.open(200.0)}
    assert sorted(left) == ["u1", "u2", "u3"]
    assert left["u1"].sent == {1: "peer-b", 0: "peer-a"} and torch.equal(left["u3"].inputs, tokens + 3)
    assert left["u1"].stepped == {1} and left["u2"].stepped == set()
    assert left["u2"].receipts == {1: ("peer-b", 7, 3, 123.5)} and left["u3"].receipts == {}
    assert left["u1"].done_before and not left["u3"].done_before  # u3 counts when this start completes it
    assert second.predecessors == [[100.0, 6]]
    second.done("u1", 2)
    second.done("u3", 2)
    assert second.completed == 2
    second.close(clean=True)  # a clean stop: what is done is the live servers'; u2 never ran again
    third = Journal(path)
    assert [e.uid for e in third.open(300.0)] == ["u2"] and third.predecessors == [[100.0, 6], [200.0, 2]]
    assert third.entries["u2"].receipts == {1: ("peer-b", 7, 3, 123.5)}  # kept through the rewrites


def test_a_dry_backward_adds_nothing_and_a_dropped_accumulator_still_knows_what_it_stepped():
    """What a trainer started again after a kill relies on: a stage that stepped a micro-batch answers it dry
    (input gradients only), and a replica that dropped its accumulator still answers a stepped uid again
    (as stepped) instead of adding it twice, while an unstepped one it dropped is added anew."""
    from peer.config import RunSpec
    from peer.model.runtime import StageRuntime

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    rt = StageRuntime(spec, 0)
    x, g = torch.randint(0, 256, (2, 8)), torch.randn(2, 8, 32)
    _, _, seq = rt.backward("a", x, g, None, count=False)
    assert seq == 0 and rt.samples_accumulated == 0 and rt.seq == 0
    rt.backward("a", x, g, None)
    rt.apply_step(rt.take_gradients()[0], 2, rt.taken_seq, ["me"], {})  # "a" is stepped
    rt.backward("b", x, g, None)  # "b" is not
    assert rt.drop_accumulator() == 2
    assert rt.backward("a", x, g, None)[2] == 0 and rt.samples_accumulated == 0  # answered as stepped
    assert rt.backward("b", x, g, None)[2] == 1 and rt.samples_accumulated == 2  # replayed: added


def test_a_replica_resynced_from_a_partner_that_stepped_alone_settles_the_partners_receipts():
    """A server steps alone, its partner resyncs from it, then it dies before the trainer heard it stepped:
    the trainer's receipts are not in an announced round, yet the partner holds the step that counted them.
    The survivors' step records say so (any step), and the trainer settles them instead of replaying."""
    from types import SimpleNamespace

    from peer.config import RunSpec
    from peer.model.runtime import StageRuntime
    from peer.trainer.ledger import ANY_STEP, Ledger, Receipt
    from peer.trainer.settling import _coverage
    from protocols import stage_pb2

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    donor, partner = StageRuntime(spec, 0), StageRuntime(spec, 0)
    x, g = torch.randint(0, 256, (2, 8)), torch.randn(2, 8, 32)
    donor.backward("a", x, g, None)
    donor.backward("b", x, g, None)
    grads, samples = donor.take_gradients()
    donor.apply_step(grads, samples, donor.taken_seq, ["donor"], {"donor": (donor.incarnation, donor.taken_seq)})
    donor.backward("d", x, g, None)
    grads, samples = donor.take_gradients()
    donor.apply_step(grads, samples, donor.taken_seq, ["donor"], {"donor": (donor.incarnation, donor.taken_seq)})
    partner.backward("c", x, g, None)  # the partner stepped alone too, apart: its own step 1 is not the donor's
    grads, samples = partner.take_gradients()
    partner.apply_step(grads, samples, partner.taken_seq, ["partner"], {"partner": (partner.incarnation, 1)})
    partner.load_state(*donor.snapshot(), "partner")
    history = [
        stage_pb2.StepFingerprint(
            epoch=f.epoch,
            members=f.members,
            coverage=[stage_pb2.Coverage(peer_id=p, incarnation=i, seq=s) for p, (i, s) in f.coverage.items()],
        )
        for f in partner.history
    ]
    assert _coverage(history, "donor", donor.incarnation) == 3
    assert [(f.epoch, f.members) for f in partner.history] == [(1, ["donor"]), (2, ["donor"])]
    assert _coverage(history, "donor", donor.incarnation + 1) == -1  # another life of it: nothing
    assert _coverage(history, "partner", partner.incarnation) == -1  # its own step 1 was replaced

    ledger = Ledger()
    request = stage_pb2.BackwardRequest(uid="a")
    ledger.add(Receipt(0, "donor", donor.incarnation, 1, request, {}, 2, heard=1.0))
    router = SimpleNamespace(last={}, answered={}, gone=lambda pid, incarnation, heard: True)
    replay, checks = ledger.review(router)
    assert replay == [] and [(c.epoch, c.decisive) for c in checks] == [(ANY_STEP, True)]


def test_a_live_server_that_keeps_a_backward_unstepped_while_its_stage_steps_on_is_avoided_and_it_is_replayed():
    """A receipt whose server is alive but has not stepped it while most of its stage's replicas went
    trainer.max_unstepped_steps on: the server does not step what it takes, or says so (a hoarder would fill the
    trainer's receipt budget and stall it). It is replayed elsewhere and the server banned; one a step short of
    that, or taken before any replica was read, waits."""
    from types import SimpleNamespace

    from dht.records import ServerRecord
    from peer.trainer.ledger import Ledger, Receipt
    from protocols import stage_pb2

    banned = []
    own = ServerRecord(stage=0, endpoint="127.0.0.1:1", throughput=1.0, epoch=12, state="serving", incarnation=1)
    router = SimpleNamespace(
        last={("hoarder", 1): own},
        answered={},
        gone=lambda *a: False,
        stage_step=lambda stage: 12,
        ban=lambda pid: banned.append(pid),
    )
    ledger = Ledger()
    for uid, step in (("overdue", 4), ("recent", 5), ("unknown", -1)):
        ledger.add(Receipt(0, "hoarder", 1, 1, stage_pb2.BackwardRequest(uid=uid), {}, 2, heard=1.0, step=step))
    replay, checks = ledger.review(router, 8, 0.0, 32)  # its own record: step 12, nothing stepped
    assert [r.request.uid for r in replay] == ["overdue"] and banned == ["hoarder"] and checks == []
    assert ledger.review(router, 0) == ([], [])  # 0: never
    # a server whose record stays at an old step: its stage going 32 steps on decides (trainer.max_unstepped_stage_steps)
    ledger = Ledger()
    own.epoch = 5
    for uid, step in (("overdue", 4), ("recent", 5)):
        ledger.add(Receipt(0, "hoarder", 1, 1, stage_pb2.BackwardRequest(uid=uid), {}, 2, heard=1.0, step=step))
    router.stage_step = lambda stage: 36
    assert [r.request.uid for r in ledger.review(router, 8, 0.0, 32)[0]] == ["overdue"]
    assert ledger.review(router, 8, 0.0, 33)[0] == []


def test_a_gone_servers_receipts_wait_while_a_survivor_is_silent_and_settle_by_any_step_that_counted_them():
    """What the trainer asks the survivors before a replay: any step of theirs that counted the gone server's
    additions settles them; a survivor that does not answer (hung, as a stopped donor) makes it wait, never
    replay (its step may hold them); a round not finished on a survivor waits too."""
    import asyncio
    from types import SimpleNamespace

    import grpc

    from peer.trainer.ledger import ANY_STEP, Check, Receipt
    from peer.trainer.settling import Settling
    from protocols import stage_pb2

    def step(epoch: int, seq: int | None) -> stage_pb2.StepFingerprint:
        coverage = [] if seq is None else [stage_pb2.Coverage(peer_id="gone", incarnation=7, seq=seq)]
        return stage_pb2.StepFingerprint(epoch=epoch, members=["b"], coverage=coverage)

    answers = {}

    async def info(endpoint, timeout, peer=None):
        answer = answers[endpoint]
        if answer is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "deadline")
        return answer

    def verdict(epoch: int, **servers) -> int | None:
        answers.clear()
        answers.update({f"{pid}:1": a for pid, a in servers.items()})
        trainer = SimpleNamespace(
            router=SimpleNamespace(servers=[{pid: SimpleNamespace(endpoint=f"{pid}:1") for pid in servers}]),
            client=SimpleNamespace(info=info),
            tcfg=SimpleNamespace(deadline_floor=1.0),
            cfg=SimpleNamespace(network=SimpleNamespace(probe_timeout=1.0)),
        )
        receipt = Receipt(0, "gone", 7, 5, stage_pb2.BackwardRequest(uid="u"), {}, 4, heard=1.0)
        return asyncio.run(Settling._covered_by_steps(trainer, Check(receipt, epoch, decisive=True)))

    def survivor(epoch: int, *steps) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(epoch=epoch, incarnation=1, history=list(steps))

    assert verdict(ANY_STEP, b=survivor(9, step(8, 3), step(9, 6))) == 6  # stepped alone later, b resynced
    assert verdict(ANY_STEP, b=survivor(9, step(9, None))) == -1  # no step of b's counted any: replayed
    assert verdict(ANY_STEP, b=survivor(9, step(9, 6)), c=None) is None  # c hangs: wait
    assert verdict(ANY_STEP, gone=None, b=survivor(9, step(9, 6))) == 6  # the gone one's silence is no news
    assert verdict(ANY_STEP) is None and verdict(ANY_STEP, c=None) is None  # nobody answers: wait
    assert verdict(9, b=survivor(8, step(8, 3))) is None  # b has not finished the round of step 9 yet
    assert verdict(9, b=survivor(10, step(9, None), step(10, 6))) == 6  # the round left it out; a later step not


def test_claims_about_this_replica_s_own_additions_and_steps_are_held_to_what_it_knows():
    """A donor's step may say it counted this replica's additions up to 2^63: its stepped_seq goes no further than
    the additions it made (else trainers' receipts would be confirmed for backwards no step holds). A state of a
    step behind this replica's own is refused (a resync that would take it back). A server of a stage without
    experts that says its experts did not answer is blamed like any that failed."""
    from types import SimpleNamespace

    from peer.config import RunSpec
    from peer.model.part_state import StateError
    from peer.model.runtime import StageRuntime
    from peer.server.replica_state import StateTransfer
    from peer.trainer.calls import Calls

    spec = RunSpec.from_dict(
        {"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2}, "stages": {"num_stages": 2}}
    )
    runtime = StageRuntime(spec, 1)
    runtime.seq = 3
    runtime.drop_covered(runtime.incarnation, 2**63)
    assert runtime.stepped_seq == 3
    runtime.epoch = 5
    replica = SimpleNamespace(runtime=runtime)
    with pytest.raises(StateError, match="behind this replica's 5"):
        StateTransfer._not_behind(replica, {"epoch": 4})
    StateTransfer._not_behind(replica, {"epoch": 5})
    moe = RunSpec.from_dict(
        {
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2},
            "stages": {"num_stages": 2},
            "moe": {"num_experts": 4, "layers": [1]},
        }
    )
    assert not Calls._holds_experts(SimpleNamespace(spec=spec), 1)
    assert [Calls._holds_experts(SimpleNamespace(spec=moe), s) for s in (0, 1)] == [False, True]


def test_the_books_keep_room_for_honest_trainers_whatever_keys_announce():
    """A key announcing a new start at every look (or thousands of predecessors), and many keys that claim work and
    sent nothing, fill the books' tables: a peer keeps only its newest starts, and a full table lets go of keys no
    stage counted, so an honest trainer that comes later is still counted."""
    from dht.records import ServerRecord, TrainerRecord
    from peer.swarm.books import Books

    books = Books(1, vouched=True, max_entries=64)
    flood = {"liar": TrainerRecord(samples=5, started=0.0, predecessors=[[float(i), 5] for i in range(1, 500)])}
    flood |= {f"sybil{i}": TrainerRecord(samples=9, started=1.0) for i in range(100)}
    server = ServerRecord(stage=0, endpoint="h:1", throughput=1.0, samples_stepped=40)
    server.started, server.counted = 1.0, {"honest": 40}
    books.observe([{"s": server}], flood)
    assert len(books.trainers) <= 64 and sum(k[0] == "liar" for k in books.trainers) <= 16
    alone = Books(1, vouched=True, max_entries=64)
    alone.observe([{}], {"liar": flood["liar"]})
    assert sorted(k[1] for k in alone.trainers) == [float(i) for i in range(484, 500)]  # its newest 16 starts
    (stage,) = books.observe([{"s": server}], {"honest": TrainerRecord(samples=40, started=2.0)})
    assert ("honest", 2.0) in books.trainers and stage.completed == 40 and stage.balanced, stage.words(0)

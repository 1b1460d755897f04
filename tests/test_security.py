"""Admission, TLS, revocation and spot checks, with real peers as real processes on loopback."""

from __future__ import annotations

import re
import subprocess
import time

import grpc
import pytest
from helpers.calls import TestCredential, channel, info, peer_at
from helpers.specs import SMALL
from helpers.swarm import PEER, ROOT

from dht.identity import Identity
from protocols import stage_pb2, stage_pb2_grpc

SPEC = {**SMALL, "name": "secure"}


def _identities(workdir, *names) -> dict[str, str]:
    ids = {}
    for name in names:
        identity = Identity.generate()
        identity.save(workdir / f"{name}.pem")
        ids[name] = identity.peer_id
    return ids


def _peer_command(swarm, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*PEER, *args], cwd=swarm.workdir, capture_output=True, text=True, timeout=120, check=False)


def test_only_admitted_peers_serve_call_publish_and_average_and_revocation_cuts_access(swarm):
    ids = _identities(swarm.workdir, "s0a", "s0b", "s1", "trainer", "intruder")
    allowed = [ids[n] for n in ("s0a", "s0b", "s1", "trainer")]
    # credentials of 12 s: renewed (at half-life) several times while the test runs
    admission = {"mode": "allowlist", "allowlist": allowed, "refresh": 2.0, "credential_ttl": 12.0}
    spec = {**SPEC, "admission": admission}
    swarm.coordinator(spec)
    servers = {name: swarm.server(name, stage) for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1))}
    endpoints = {name: swarm.endpoint(peer) for name, peer in servers.items()}

    # -- a peer that is not on the allowlist cannot serve: it is told why, and exits
    intruder = swarm.server("intruder", 1)
    assert intruder.wait(60) != 0
    assert "not on the run's allowlist" in intruder.output()

    # -- nor call a stage: without a certificate, or with one of another authority, TLS refuses it
    request = stage_pb2.InfoRequest()
    with grpc.insecure_channel(endpoints["s1"]) as plain, pytest.raises(grpc.RpcError) as refused:
        stage_pb2_grpc.StageStub(plain).Info(request, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    forged_dir = swarm.workdir / "forged"
    forged_dir.mkdir()
    (forged_dir / "run.toml").write_text((swarm.workdir / "run.toml").read_text())
    Identity.generate().save(forged_dir / "coordinator.pem")  # the same run name, another key
    forged = TestCredential(forged_dir)
    options = [("grpc.ssl_target_name_override", forged.target_name(peer_at(endpoints["s1"])))]
    with (
        grpc.secure_channel(endpoints["s1"], forged.channel_credentials(), options=options) as ch,
        pytest.raises(grpc.RpcError) as refused,
    ):
        stage_pb2_grpc.StageStub(ch).Info(request, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # -- nor publish records others use, nor join averaging: a rogue announces a stage-1 server
    # that does not exist and keeps asking stage 0's replicas to average huge values
    rogue = swarm.start(
        "rogue", [str(ROOT / "tests" / "helpers" / "rogue.py"), swarm.maddr, "intruder.pem", "120"], python=True
    )
    rogue.wait_for(r"ROGUE \S+ up", 60)
    trainer = swarm.trainer("trainer")
    trainer.wait_for(r"Admitted to run 'secure' as trainer", 60)
    deadline = time.monotonic() + 180
    while min(info(endpoints["s0a"]).epoch, info(endpoints["s0b"]).epoch) < 2:
        assert time.monotonic() < deadline, "stage 0 did not reach step 2"
        time.sleep(1)
    members = {m for e in ("s0a", "s0b") for f in info(endpoints[e]).history for m in f.members}
    assert ids["intruder"] not in members
    assert {ids["s0a"], ids["s0b"]} <= members  # the admitted replicas did average together
    status = subprocess.Popen(  # while the rogue still announces its fake server
        [*PEER, "status", swarm.maddr], cwd=swarm.workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # it was the replicas' TLS that keeps it out: every all-reduce call it made failed its handshake (it holds no
    # certificate of this run), so no replica's averaging ever read a frame of it
    deadline = time.monotonic() + 90
    while "ROUND " not in rogue.output():
        assert time.monotonic() < deadline, rogue.output()[-3000:]
        time.sleep(0.5)
    assert "UNAVAILABLE" in rogue.output(), rogue.output()[-3000:]
    assert not any(c.get("endpoint") == "127.0.0.1:9" for c in swarm.log("trainer") if c["type"] == "call")
    out, err = status.communicate(timeout=120)
    assert status.returncode == 0, err
    assert "127.0.0.1:9" not in out and endpoints["s1"] in out
    rogue.terminate()  # after status: a DHT node that just died slows the lookups of those that knew it
    rogue.wait(30)
    rounds = re.findall(r"ROUND epoch=\d+ replicas=2 members=(\S+)", rogue.output())
    assert rounds and all(r == "none" for r in rounds), rogue.output()[-3000:]

    assert "renewed this peer's credential" in servers["s1"].output()  # and kept serving on the new one

    # -- a revoked peer loses access within the refresh period: this test's own credential first
    mine = TestCredential(swarm.workdir)
    with channel(endpoints["s1"]) as ch:
        stub = stage_pb2_grpc.StageStub(ch)
        assert stub.Info(request, timeout=5).stage == 1
    revoked_me = _peer_command(
        swarm, "coordinator", "revoke", mine.identity.peer_id, "--spec", "run.toml", "--identity", "coordinator.pem"
    )
    assert revoked_me.returncode == 0, revoked_me.stderr
    started = time.monotonic()
    code = None
    while time.monotonic() - started < 15:
        options = [("grpc.ssl_target_name_override", mine.target_name(peer_at(endpoints["s1"])))]
        with grpc.secure_channel(endpoints["s1"], mine.channel_credentials(), options=options) as ch:
            try:
                stage_pb2_grpc.StageStub(ch).Info(request, timeout=5)
            except grpc.RpcError as e:
                code, message = e.code(), e.details()
                break
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    assert code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in message
    assert elapsed < 2.0 + 4.0, f"the revocation took {elapsed:.1f} s to reach a server (refresh 2 s)"

    # -- and a revoked trainer is told, and leaves
    revoked = _peer_command(
        swarm, "coordinator", "revoke", ids["trainer"], "--spec", "run.toml", "--identity", "coordinator.pem"
    )
    assert revoked.returncode == 0 and "Revoked" in revoked.stdout
    trainer.wait_for(r"credential was revoked", 30)
    assert trainer.wait(60) is not None
    swarm.peers[0].wait_for(rf"Revoked peer {ids['trainer']}", 10)


def test_invite_codes_admit_as_many_peers_as_they_say(swarm):
    """Invite admission is the default: a peer without a code, with a wrong one, or with a code used up is refused;
    a code of `--uses 2` admits two peers (each its own key) and no third."""
    swarm.coordinator({**SPEC, "admission": {}})  # the run spec's default (the fixture's is open)
    assert re.search(r"Admission: invite .*\n.*peer coordinator invite --spec", swarm.peers[0].output())

    def invite(*more: str) -> str:
        made = _peer_command(
            swarm, "coordinator", "invite", "--spec", "run.toml", "--identity", "coordinator.pem", *more
        )
        assert made.returncode == 0, made.stderr
        return re.search(r"--invite (\S+)", made.stdout).group(1)

    code, pair = invite(), invite("--uses", "2")
    uninvited = swarm.server("uninvited", 0)
    invited = swarm.server("invited", 0, ["--invite", code])
    wrong = swarm.server("wrong", 1, ["--invite", code.split(".")[0] + ".not-the-secret"])
    first, second = (swarm.server(name, 1, ["--invite", pair]) for name in ("first", "second"))
    for peer in (invited, first, second):
        swarm.endpoint(peer)
    again = swarm.server("again", 1, ["--invite", code])  # another peer with the same code, once it was used
    third = swarm.server("third", 1, ["--invite", pair])
    assert uninvited.wait(60) != 0 and "admits peers by invite" in uninvited.output()
    assert wrong.wait(60) != 0 and "the code is wrong" in wrong.output()
    assert again.wait(60) != 0 and "was used already" in again.output()
    assert third.wait(60) != 0 and "was used already (by 2 peers)" in third.output()


def _stage_story(swarm, *names) -> str:
    """What a slow catch needs explained: each replica's steps and rounds, the trainer's spot checks."""
    story = []
    for name in names:
        lines = (swarm.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        told = [line[:200] for line in lines if re.search(r"step \d+|round|resync|spot check|Serving|Joined", line)]
        story.append(f"--- {name}: {len(told)} lines\n" + "\n".join(told[:40]))
    return "\n".join(story)


def test_a_server_that_perturbs_its_outputs_is_caught_banned_and_revoked(swarm):
    ids = _identities(swarm.workdir, "honest-a", "honest-b", "noisy", "last")
    swarm.coordinator({**SPEC, "admission": {"mode": "open", "revoke_after_reports": 1, "refresh": 2.0}})
    peers = [
        swarm.server("honest-a", 0),
        swarm.server("honest-b", 0),
        swarm.server("noisy", 0, ["--set", "server.perturb_outputs=0.5"]),
        swarm.server("last", 1),
    ]
    for peer in peers:
        swarm.endpoint(peer)
    # a spot check re-sends 25 % of forwards here (5 % by default): caught sooner, the same path
    trainer = swarm.trainer("trainer", ["--max-micro-batches", "600", "--set", "trainer.spot_check=0.25"])
    trainer.wait_for(r"answered wrong \(two other replicas agree\); banned and reported", 300)
    caught = [e for e in swarm.log("trainer") if e["type"] == "spot_check"]
    assert caught and {e["wrong"] for e in caught} == {ids["noisy"]}, caught
    # the noisy server is one of the two replicas compared in 2/3 of the spot checks: caught after ~6
    # micro-batches on average, after 100 about once in 10^7 runs
    assert caught[0]["index"] < 100, (caught[0], _stage_story(swarm, "honest-a", "honest-b", "noisy", "trainer"))
    swarm.peers[0].wait_for(rf"Revoked peer {ids['noisy']}: spot checks of 1 trainer", 30)
    peers[2].wait_for(r"credential was revoked", 30)
    assert peers[2].wait(60) is not None
    print(f"caught at micro-batch {caught[0]['index']}")


def test_gradient_contributions_far_above_the_median_are_clipped_and_non_finite_ones_refused():
    import math

    import torch

    from peer.config import RunSpec
    from peer.model.part import BadGradient
    from peer.model.runtime import StageRuntime

    runtime = StageRuntime(RunSpec.from_dict(SPEC), 1)
    runtime.configure_clipping(10.0, 16)
    typical = [torch.randn_like(p) * 0.01 for p in runtime.params]
    norm = math.sqrt(sum(float(g.square().sum()) for g in typical))
    for _ in range(8):
        assert runtime.guard_gradients(typical, 4)[0] is not None
    huge = runtime.guard_gradients([g * 1000 for g in typical], 4)
    clipped = math.sqrt(sum(float(g.square().sum()) for g in huge))
    assert runtime.clipped == 1 and abs(clipped - 10 * norm) < 1e-3 * norm
    same = runtime.guard_gradients([g * 2 for g in typical], 4)  # within the bound: untouched
    assert torch.equal(same[0], typical[0] * 2) and runtime.clipped == 1
    poisoned = [g.clone() for g in typical]
    poisoned[0][0] = float("nan")
    with pytest.raises(BadGradient, match="not finite"):
        runtime.guard_gradients(poisoned, 4)
    assert runtime.refused_gradients == 1


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_streams_that_claim_the_largest_tensor_and_send_nothing_hold_no_memory_and_the_run_goes_on(swarm):
    """An admitted peer (a trainer's credential) opens 16 ForwardStream calls at stage 0, each header claiming a
    tensor of 16M int32 ids (64 MiB), then sends none of it: the old server allocated 1 GiB at once. Now the
    claims count against its limits before any byte is read (256 MiB per caller: 4 admitted, 12 refused),
    buffers grow only as bytes arrive, and server.read_timeout cuts the 4 off. The server's memory stays flat,
    and a trainer trains on through it. Then one forward of 4M real token ids (far past a micro-batch) is refused
    before stage 0 builds anything for it (training.max_request_tokens)."""
    swarm.coordinator(SPEC)
    quick = ["--set", "server.read_timeout=4"]
    first, last = swarm.server("s0", 0, quick), swarm.server("s1", 1, quick)
    endpoint = swarm.endpoint(first)
    swarm.endpoint(last)
    trainer = swarm.trainer("t", ["--seed", "0", "--max-micro-batches", "60"])
    wait_for_micro_batches = time.monotonic() + 60
    while len([e for e in swarm.log("t") if e["type"] == "micro_batch"]) < 5:
        assert time.monotonic() < wait_for_micro_batches, trainer.output()[-3000:]
        time.sleep(0.2)
    before = _rss_mb(first.proc.pid)
    bomb = swarm.start(
        "bomb",
        [
            str(ROOT / "tests" / "helpers" / "bomb.py"),
            "claim",
            swarm.maddr,
            "bomb.pem",
            endpoint,
            "16",
            str(16 << 20),
            "15",
        ],
        python=True,
    )
    bomb.wait_for(r"BOMB up", 60)
    peak, deadline = before, time.monotonic() + 60
    while "BOMB codes" not in bomb.output():
        peak = max(peak, _rss_mb(first.proc.pid))
        assert time.monotonic() < deadline, bomb.output()[-3000:]
        time.sleep(0.05)
    codes = dict(re.findall(r"([A-Z_]+)=(\d+)", bomb.output().split("BOMB codes", 1)[1]))
    assert codes == {"DEADLINE_EXCEEDED": "4", "RESOURCE_EXHAUSTED": "12"}, bomb.output()[-2000:]
    assert peak - before < 150, f"stage 0's memory grew from {before:.0f} to {peak:.0f} MB under the bomb"
    assert trainer.wait(120) == 0, trainer.output()[-3000:]
    assert len([e for e in swarm.log("t") if e["type"] == "micro_batch"]) == 60
    # one forward of 4M real token ids (16 MiB): far past what the run sends (training.max_request_tokens),
    # refused before stage 0 builds anything for them
    before = _rss_mb(first.proc.pid)
    ids = swarm.start(
        "ids",
        [
            str(ROOT / "tests" / "helpers" / "bomb.py"),
            "tokens",
            swarm.maddr,
            "ids.pem",
            endpoint,
            "1",
            str(4 << 20),
            "0",
        ],
        python=True,
    )
    said = ids.wait_for(r"BOMB said (.*)", 120).group(1)
    assert said.startswith("INVALID_ARGUMENT") and "training.max_request_tokens" in said, said
    assert _rss_mb(first.proc.pid) - before < 150
    assert info(endpoint).state == "serving"
    # its state split into 2^32 - 1 shards (a set each would be allocated for the split): refused by the bound,
    # before any work, to an admitted server; a trainer may not ask for a part's state at all
    answers = {}
    for mode in ("shards", "shards-trainer"):
        asker = swarm.start(
            mode,
            [str(ROOT / "tests" / "helpers" / "bomb.py"), mode, swarm.maddr, f"{mode}.pem", endpoint, "1"]
            + [str(2**32 - 1), "0"],
            python=True,
        )
        answers[mode] = asker.wait_for(r"BOMB said (.*)", 120).group(1)
    assert answers["shards"].startswith("INVALID_ARGUMENT"), answers
    assert "server.max_state_shards" in answers["shards"], answers
    assert answers["shards-trainer"].startswith("PERMISSION_DENIED"), answers
    assert _rss_mb(first.proc.pid) - before < 150
    assert info(endpoint).state == "serving"

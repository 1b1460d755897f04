"""A stage server that answers wrong and tries not to be caught (tests/test_attacks.py runs it).

`python liar.py MODE peer-arguments...` runs `peer ARGS` with one change:
- `dodge`: every Forward answer claims the step after the one it computed at, so a spot check that compares
  only answers at one step never compares it (run it with `--set server.perturb_outputs=...` to make its
  outputs wrong as well); `lag`: the same, claiming the step before;
- `last`: as a last stage, every backward's loss is 1 higher and the gradients it sends back are tripled,
  what a broken or hostile last stage would do to every stage before it;
- `stay`: it reads the revocation list like everyone, but does not stop when it finds itself there: it keeps
  serving (and its relay attachment) for whoever still takes it;
- `blame`: every forward and backward is refused as the caller's fault (INVALID_ARGUMENT), so that a trainer
  that believed it would give its micro-batches up instead of banning this server;
- `freeze`: it claims one step past the least advanced of its partners (tests/helpers/hostile.py), in its
  records and answers, and fails every GetState: honest replicas see a believable replica ahead, which they
  must load from before they step, and it never sends its state; `hang`: the same, but every GetState hangs
  (it sends nothing and never ends the call) instead of failing at once; `mute`: it serves and steps honestly,
  but every GetState hangs, so that a joiner that waited for each donor's call to end would wait its deadline;
- `silent`: it serves and steps honestly, and announces itself as the fastest replica by far, but fails every Info
  (a replica's own word on its step): a joiner that asked it, the transfer's lead, for its step, and tried again
  whenever it failed to answer, never loaded;
- `relabel`: it serves and steps honestly and announces itself as the fastest replica, but answers every Info one
  step past its own, and a request for the state of that step with its own parameters times 1.001 under that
  step's number (fingerprinted as they are, so the state is sound): a step nobody else reached, its word alone;
- `far`: it serves honestly, but its record's training step is 10^9, beside its true epoch: what a replica
  that wants every trainer to think the run has ended would announce;
- `ahead`: its records, its state and its answers are honest, except every Round invitation, which it declines
  saying it is a step ahead (its state of that step never comes: it has none), so that an inviter that
  believed the answer would abort every round;
- `stepped`: as an owner in the averaging all-reduce it answers every partner's Average call that it already
  stepped the round (a member must then give its round up: stepping it again would count its gradients twice),
  and it never steps ahead: without a check of that word, every round of its stage would fail;
- `stepped-ahead`: the same, and it answers the next invitation to a round it said it stepped one step ahead
  (its word kept consistent; a step it alone claims, which nobody follows);
- `split`: as an owner in the averaging all-reduce it sends one member (the first other in the group) its slice's
  averages times 1.01, the others the true ones, each with a verdict that signs the digest of what that member
  got: replicas that stepped what they got would hold different weights under one step number;
- `hoard`: it serves and steps like any replica, but says (in its records and answers) that none of the backwards
  it took is stepped, so that its trainers keep every receipt of it until their receipt budget is full.
"""

from __future__ import annotations

import sys

import grpc

from peer.cli.main import main
from peer.net.refusal import Refused
from peer.net.security import Security
from peer.server.replica import Replica
from peer.server.servicer import ServicerBase, StageServicer
from peer.server.stage import StageServer
from protocols import stage_pb2


def dodging(by: int = 1):
    forward = StageServicer._forward

    async def elsewhere(self, request, payloads, deadline):
        response, out = await forward(self, request, payloads, deadline)
        response.epoch = max(response.epoch + by, 0)
        return response, out

    return elsewhere


def wrong_last():
    backward = StageServer.backward

    async def wrong(self, *args, **kwargs):
        grad_inputs, loss, *rest = await backward(self, *args, **kwargs)
        if loss is not None:
            loss, grad_inputs = loss + 1.0, (grad_inputs * 3 if grad_inputs is not None else None)
        return (grad_inputs, loss, *rest)

    return wrong


def staying():
    refresh = Security.refresh_revocations

    def ignore_own(self):
        self.on_revoked = None  # what a peer does when it finds itself revoked: here, nothing
        refresh(self)

    return ignore_own


def blaming():
    async def refuse_all(self, request, payloads, deadline):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "inputs: malformed (they are not)")

    return refuse_all


def failing_state():
    async def unavailable(self, request_bytes, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "busy, try again")
        yield b""  # an async generator, as the real handler

    return unavailable


def hanging_state():
    async def hang(self, request_bytes, context):
        import asyncio

        print("HUNG a GetState", flush=True)
        try:
            await asyncio.Event().wait()  # nothing, ever: the caller's deadline ends it
        except asyncio.CancelledError:
            print("a hung GetState ended", flush=True)  # its caller gave up on it (or its deadline passed)
            raise
        yield b""

    return hang


def ahead_in_rounds():
    async def ahead(self, request, context):
        replica = self._replica(request.run_id, request.stage, request.expert)
        return stage_pb2.RoundResponse(joining=False, epoch=replica.runtime.epoch + 1)

    return ahead


def stepped_verdicts(claimed: set | None = None):
    from protocols import averaging_pb2
    from protocols.averaging_frames import message_frame

    async def serve(self, header, frames, caller):
        if claimed is not None:
            claimed.add(header.epoch)
        verdict = averaging_pb2.AverageVerdict(ok=False, stepped=True, reason=f"already stepped {header.epoch}")
        yield message_frame(averaging_pb2.AverageFrame(verdict=verdict))

    return serve


def ahead_of_claims(claimed: set):
    """Round answers one step past a round it said it stepped (`stepped_verdicts`): its word kept consistent."""
    answer = ServicerBase.Round

    async def ahead(self, request, context):
        if request.epoch in claimed:
            return stage_pb2.RoundResponse(joining=False, epoch=request.epoch + 1)
        return await answer(self, request, context)

    return ahead


def splitting():
    from peer.server.allreduce import AllReduce
    from peer.server.slice_word import new_digest, statement
    from protocols import averaging_pb2
    from protocols.averaging_frames import message_frame, parse_frame, piece_frame

    serve = AllReduce.serve

    async def split(self, header, frames, caller):
        victim = min(p for p in header.group if p != self.peer_id)
        lying, digest, index = header.sender.peer_id == victim, new_digest(), 0
        async for frame in serve(self, header, frames, caller):
            kind, body = parse_frame(frame)
            if lying and kind == "piece":
                start, end = self._slices[(header.epoch, header.attempt)].pieces[index]
                encoded = self.codec.encode(self.codec.decode(body, end - start) * 1.01)
                digest.update(encoded)
                frame, index = piece_frame(encoded), index + 1
            elif lying and kind == "verdict" and body.ok:
                nonces, group = [c.nonce for c in body.gathered], list(header.group)
                prefix = statement(self.header_base, header.epoch, header.attempt, group, self.peer_id, nonces)
                body.digest = digest.digest()
                body.signature = self.sign(prefix + body.digest)
                frame = message_frame(averaging_pb2.AverageFrame(verdict=body))
                print(f"LIAR split step {header.epoch} for {victim}", flush=True)
            yield frame

    return split


def silent():
    record = Replica.record

    def fastest(self):
        announced = record(self)
        announced.throughput = 1e9
        return announced

    async def unavailable(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "busy, try again")

    return fastest, unavailable


def relabelling():
    from peer.model.part import PartRuntime
    from peer.model.part_state import state_fingerprint

    record, info, snapshot = Replica.record, ServicerBase.Info, PartRuntime.snapshot

    def fastest(self):
        announced = record(self)
        announced.throughput = 1e9
        return announced

    async def ahead(self, request, context):
        response = await info(self, request, context)
        response.epoch += 1
        return response

    def relabelled(self, shard=0, num_shards=1, epoch=None):
        if epoch is None or epoch != self.epoch + 1:
            return snapshot(self, shard, num_shards, epoch)
        metadata, tensors = snapshot(self, shard, num_shards, None)
        moved = {n: t * 1.001 if n.startswith("param/") else t for n, t in self.state_tensors().items()}
        everything = {n: t.detach().cpu() for n, t in moved.items()}
        fingerprint = state_fingerprint(everything, self.param_names, False)
        print(f"LIAR sent step {epoch} of its own", flush=True)
        return dict(metadata, epoch=epoch, fingerprint=fingerprint), {n: everything[n] for n in tensors}

    return fastest, ahead, relabelled


def far_step():
    record = Replica.record

    def far(self):
        announced = record(self)
        announced.step = 10**9
        return announced

    return far


if __name__ == "__main__":
    if sys.argv[1] in ("dodge", "lag"):
        StageServicer._forward = dodging(1 if sys.argv[1] == "dodge" else -1)
    elif sys.argv[1] == "stay":
        Security.refresh_revocations = staying()
    elif sys.argv[1] == "blame":
        StageServicer._forward = StageServicer._backward = blaming()
    elif sys.argv[1] in ("freeze", "hang"):
        from hostile import claiming

        Replica.publish = claiming(1, 0.0)
        ServicerBase.GetState = failing_state() if sys.argv[1] == "freeze" else hanging_state()
    elif sys.argv[1] == "mute":
        ServicerBase.GetState = hanging_state()
    elif sys.argv[1] == "silent":
        Replica.record, ServicerBase.Info = silent()
    elif sys.argv[1] == "relabel":
        from peer.model.part import PartRuntime

        Replica.record, ServicerBase.Info, PartRuntime.snapshot = relabelling()
    elif sys.argv[1] == "far":
        Replica.record = far_step()
    elif sys.argv[1] == "ahead":
        ServicerBase.Round = ahead_in_rounds()
    elif sys.argv[1] == "hoard":
        from peer.model.part import PartRuntime

        PartRuntime.stepped_seq = property(lambda self: 0, lambda self, value: None)
    elif sys.argv[1] == "split":
        from peer.server.allreduce import AllReduce

        AllReduce.serve = splitting()
    elif sys.argv[1] == "stepped":
        from peer.server.allreduce import AllReduce

        AllReduce.serve = stepped_verdicts()
    elif sys.argv[1] == "stepped-ahead":
        from peer.server.allreduce import AllReduce

        claims: set[int] = set()
        AllReduce.serve, ServicerBase.Round = stepped_verdicts(claims), ahead_of_claims(claims)
    else:
        StageServer.backward = wrong_last()
    print(f"LIAR {sys.argv[1]}", flush=True)
    sys.exit(main(sys.argv[2:]))

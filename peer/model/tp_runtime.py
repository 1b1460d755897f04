"""A stage split over the tensor-parallel ranks of one peer (peer.model.tp): rank 0 serves, the others follow.

Rank 0 is the peer's own process: it owns the gRPC server and the DHT presence. The other ranks
are child processes (`python -m peer.model.rank`) that hold their shards and nothing else. For every
operation on the stage, rank 0 writes a command (one JSON line) to each rank's stdin, broadcasts
the operation's tensors over the group, and then every rank runs the same code on its shards, so
their accumulators, optimizer states and counters stay in step. Decisions that depend on the
clock (a request's deadline) are rank 0's, shared with `agree`.

Towards the rest of the swarm a split stage looks unsplit: what a round averages, what a state
transfer sends and what a joiner loads are the full tensors, gathered to rank 0 or scattered
from it, so replicas of one stage at different degrees average and share state as equals.

A rank that dies ends the peer: rank 0 watches the processes and calls `on_death` (the server
leaves cleanly, and the process exits after `parallel.exit_grace` regardless); the other ranks
exit when rank 0's pipe closes or rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import subprocess
import sys
import threading
import time

import torch

from peer.config import ParallelConfig, RunSpec
from peer.model.numerics import squared_norm
from peer.model.part_state import OPTIMIZER_SLOTS, Fingerprint, StateError, shards_by_bytes
from peer.model.runtime import InputError, Late, RankDied, StageRuntime
from peer.model.tp import TPGroup, free_port, full_shape, shard_dim, state_dim
from peer.process.lifetime import exit_now, exit_within, tied_to_me

logger = logging.getLogger(__name__)
_EXPECTED = (InputError, Late, StateError)  # raised alike on every rank: the group stays in step

_DTYPES = {
    str(d): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
}


def tp_devices(pcfg: ParallelConfig) -> list[str]:
    """One device per rank: as configured, else cuda:0.. when there are enough GPUs, else cpu."""
    if pcfg.devices:
        if len(pcfg.devices) != pcfg.tp:
            raise ValueError(f"parallel.devices names {len(pcfg.devices)} devices for {pcfg.tp} ranks (--tp)")
        try:
            devices = [torch.device(d) for d in pcfg.devices]
        except RuntimeError as e:
            raise ValueError(f"parallel.devices: {e}") from None
        kinds = {d.type for d in devices}
        if kinds - {"cpu", "cuda"} or len(kinds) > 1:
            raise ValueError(f"parallel.devices must be all cpu or all cuda devices, got {', '.join(pcfg.devices)}")
        if kinds == {"cuda"}:
            indices = [d.index or 0 for d in devices]
            if len(set(indices)) != len(indices):
                raise ValueError(f"parallel.devices names a GPU twice: {', '.join(pcfg.devices)}")
            if max(indices) >= torch.cuda.device_count():
                raise ValueError(f"parallel.devices: this machine has {torch.cuda.device_count()} visible GPUs")
            return [f"cuda:{i}" for i in indices]
        return ["cpu"] * pcfg.tp
    if torch.cuda.is_available() and torch.cuda.device_count() >= pcfg.tp:
        return [f"cuda:{i}" for i in range(pcfg.tp)]
    return ["cpu"] * pcfg.tp


class Ranks:
    """Rank 0's handle on the other ranks: their processes, their command pipes, and the watch on them."""

    def __init__(self, pcfg: ParallelConfig, init: dict):
        self.cfg = pcfg
        self.init = init  # what every rank is told first: spec, stage, settings
        self.procs: list[subprocess.Popen] = []
        self.closing = False
        self.dead: str = ""  # why the group is broken, once it is
        self._lock = threading.Lock()
        self.on_death = self._default_on_death

    def start_group(self, tp: TPGroup, timeout: float) -> None:
        """Start ranks 1..tp-1, watch them, and connect rank 0 (`tp`) to the group they form."""
        port = free_port()
        devices = tp_devices(self.cfg)
        for rank in range(1, self.cfg.tp):
            proc = subprocess.Popen(
                tied_to_me([sys.executable, "-m", "peer.model.rank"]),  # never outlives rank 0, even its SIGKILL
                stdin=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl+C goes to rank 0, which stops the others
            )
            self.procs.append(proc)
            message = {
                **self.init,
                "rank": rank,
                "world": self.cfg.tp,
                "port": port,
                "device": devices[rank],
                "timeout": timeout,
                "watch_period": self.cfg.watch_period,
            }
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        # a rank that fails to start ends the process (on_death's default) rather than leave the join waiting
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        late = threading.Timer(
            self.cfg.start_timeout, self._died, (f"the other ranks did not join within {self.cfg.start_timeout} s",)
        )
        late.daemon = True
        late.start()
        tp.connect(port, timeout)
        late.cancel()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, message: dict) -> None:
        if self.dead:
            raise RankDied(self.dead)
        line = (json.dumps(message) + "\n").encode()
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):  # ValueError: the pipe was closed (leaving)
                self._died(f"tensor-parallel rank {rank} (pid {proc.pid}) is gone")
                raise RankDied(self.dead) from None

    def fail(self, reason: str) -> None:
        """The group is out of step (an operation failed on rank 0): stop the other ranks.

        A collective fails at once when a rank dies, often before the watch sees the exit: then the
        exit is the reason given.
        """
        time.sleep(self.cfg.watch_period)
        self._died(self._exited() or reason)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def _exited(self) -> str:
        """Which rank has exited and how, or empty."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {how}"
        return ""

    def _watch(self) -> None:
        while not self.closing and not self.dead:
            reason = self._exited()
            if reason and not self.closing:
                self._died(reason)
                return
            time.sleep(self.cfg.watch_period)

    def _died(self, reason: str) -> None:
        with self._lock:
            if self.dead or self.closing:
                return
            self.dead = reason
        logger.error("%s: this peer stops", reason)
        # the owner leaves cleanly if it can; after exit_grace the process ends regardless, never a hang
        exit_within(self.cfg.exit_grace, reason)
        self.on_death(reason)

    @staticmethod
    def _default_on_death(reason: str) -> None:
        exit_now(reason)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the other ranks: close their pipes (they exit at the end of input), then kill stragglers."""
        self.closing = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # the torch thread may still sit in a collective with a rank that is gone (NCCL waits out its
        # timeout): the process must end anyway once its owner is done
        exit_within(self.cfg.exit_grace + 30.0, "still busy after leaving", 0)


class ShardedStageRuntime(StageRuntime):
    """A stage runtime on one rank of a split stage; rank 0's (with `ranks`) also drives the others.

    The public operations take and return full tensors on rank 0; the `_op_*` methods are what
    every rank runs, given the same command.
    """

    def __init__(self, spec: RunSpec, stage: int, tp: TPGroup, ranks: Ranks | None = None, devices=(), **kwargs):
        self.tp, self.ranks = tp, ranks
        super().__init__(spec, stage, tp=tp, device=str(tp.device), **kwargs)
        self.tp_degree = tp.world
        self.devices = list(devices) or [str(tp.device)] * tp.world
        self.dims = [shard_dim(n) for n in self.param_names]
        self.full_shapes = [full_shape(p.shape, d, tp.world) for p, d in zip(self.params, self.dims, strict=True)]

    def full_template(self) -> list[torch.Tensor]:
        """Zeros shaped like the unsplit parameters: what the stage's replicas average."""
        return [torch.zeros(shape) for shape in self.full_shapes]

    # ---- commands -----------------------------------------------------------------------------
    def _call(self, op: str, meta: dict, tensors=(), full=None):
        """Rank 0: have every rank run `_op_<op>(meta, tensors, full)`; returns rank 0's result."""
        descs = [None if t is None else [list(t.shape), str(t.dtype)] for t in tensors]
        self.ranks.send({"op": op, "meta": meta, "tensors": descs})
        on_gpu = torch.cuda.device(self.tp.device) if self.tp.device.type == "cuda" else contextlib.nullcontext()
        with on_gpu:
            return self._run(op, meta, tensors, full)

    def _run(self, op: str, meta: dict, tensors, full):
        try:
            received = [None if t is None else self.tp.broadcast(t) for t in tensors]
            return getattr(self, f"_op_{op}")(meta, received, full)
        except _EXPECTED:
            raise
        except Exception as e:  # a collective that failed on rank 0 ends the group: any error, said as RankDied
            self.ranks.fail(f"tensor-parallel {op} failed on rank 0 ({e})")
            raise RankDied(self.ranks.dead) from e

    def serve(self, commands) -> None:
        """Ranks 1..: run rank 0's commands (JSON lines from `commands`) until the input ends."""
        for line in commands:
            message = json.loads(line)
            received = [
                None if d is None else self.tp.broadcast(torch.empty(d[0], dtype=_DTYPES[d[1]]))
                for d in message["tensors"]
            ]
            try:
                getattr(self, f"_op_{message['op']}")(message["meta"], received, None)
            except _EXPECTED:
                pass  # rank 0 raised the same, and answers the caller

    def _agree(self, flag: bool) -> bool:
        return self.tp.agree(flag)

    def _squared_norm(self, grads, exact: bool = True) -> float:
        """Summed over the ranks: each rank's shards, and the replicated parameters once (rank 0's)."""
        mine = [
            g
            for g, dim in zip(grads, self.dims, strict=True)
            if g is not None and (dim is not None or not self.tp.rank)
        ]
        return float(self.tp.sum(torch.tensor([squared_norm(mine, exact)], dtype=torch.float64)).item())

    def _shared_scale(self, scale: float) -> float:
        return float(self.tp.broadcast(torch.tensor([scale], dtype=torch.float64)).item())

    # ---- the operations callers use on rank 0 -------------------------------------------------
    def forward(self, uid, inputs, targets, train):
        self.check_inputs(inputs)  # checked before anything is sent: every rank then runs alike
        self.check_targets(inputs, targets, required=False)
        return self._call("forward", {"uid": uid, "train": train}, [inputs, targets])

    def backward(self, uid, inputs, grad_outputs, targets, deadline=None, count=True):
        self.check_inputs(inputs)
        self.check_targets(inputs, targets, required=self.model.is_last)
        self.check_grad_outputs(inputs, grad_outputs)
        meta = {"uid": uid, "deadline": deadline, "count": count}
        return self._call("backward", meta, [inputs, grad_outputs, targets])

    def benchmark(self, batch: int, seq_len: int, repeats: int = 2) -> float:
        return self._call("benchmark", {"batch": batch, "seq_len": seq_len, "repeats": repeats})

    def drop_accumulator(self) -> int:
        return self._call("drop_accumulator", {})

    def inner_step(self) -> None:
        self._call("inner_step", {})

    def take_for_round(self):
        return self._call("take_for_round", {})

    def full_parameters(self) -> list[torch.Tensor]:
        """The unsplit parameters (CPU copies), gathered from every rank."""
        return self._call("parameters", {})

    def apply_round(self, averaged, group_samples, seq, members, coverage=None) -> None:
        meta = {"samples": group_samples, "seq": seq, "members": members, "coverage": coverage or {}}
        self._call("apply_round", meta, full=averaged)

    def restore_round(self, taken, samples, seq) -> None:
        self._call("restore_round", {"samples": samples, "seq": seq}, full=taken)

    def snapshot(self, shard: int = 0, num_shards: int = 1, epoch: int | None = None):
        """Gathered from the ranks anew for each shard (a split donor keeps no copy: `epoch` is not used)."""
        return self._call("snapshot", {"shard": shard, "num_shards": num_shards})

    def load_state(self, metadata: dict, tensors: dict[str, torch.Tensor], me: str = "") -> None:
        shapes = self._check_state(metadata, tensors)
        self._call("load_state", {"metadata": metadata, "me": me, "shapes": shapes}, full=tensors)

    # ---- what every rank runs -----------------------------------------------------------------
    def _op_forward(self, meta, tensors, full):
        return StageRuntime.forward(self, meta["uid"], tensors[0], tensors[1], meta["train"])

    def _op_backward(self, meta, tensors, full):
        deadline = meta["deadline"] if self.ranks is not None else None  # the clock is rank 0's
        return StageRuntime.backward(self, meta["uid"], *tensors, deadline, meta.get("count", True))

    def _op_benchmark(self, meta, tensors, full):
        return StageRuntime.benchmark(self, meta["batch"], meta["seq_len"], meta["repeats"])

    def _op_drop_accumulator(self, meta, tensors, full):
        return StageRuntime.drop_accumulator(self)

    def _op_inner_step(self, meta, tensors, full):
        # replicated parameters (norms) step with rank 0's gradients everywhere, so they never drift apart
        for acc, dim in zip(self.accumulator, self.dims, strict=True):
            if dim is None:
                acc.copy_(self.tp.broadcast(acc))
        StageRuntime.inner_step(self)

    def _op_take_for_round(self, meta, tensors, full):
        local, samples = StageRuntime.take_for_round(self)
        return [self.tp.gather(t, d) for t, d in zip(local, self.dims, strict=True)], samples

    def _op_parameters(self, meta, tensors, full):
        return [self.tp.gather(p, d) for p, d in zip(self.params, self.dims, strict=True)]

    def _scatter_params(self, full) -> list[torch.Tensor]:
        return [
            self.tp.scatter(None if full is None else f, p.detach().float(), d)
            for f, p, d in zip(full or [None] * len(self.params), self.params, self.dims, strict=True)
        ]

    def _op_apply_round(self, meta, tensors, full):
        coverage = {pid: (int(c[0]), int(c[1])) for pid, c in meta.get("coverage", {}).items()}
        StageRuntime.apply_round(
            self, self._scatter_params(full), meta["samples"], meta["seq"], meta["members"], coverage
        )

    def _op_restore_round(self, meta, tensors, full):
        if self.local:
            self.forget_delta()
        else:
            self.restore_gradients(self._scatter_params(full), meta["samples"], meta["seq"])

    def _op_snapshot(self, meta, tensors, full):
        local = self.state_tensors()
        sizes = {
            k: math.prod(full_shape(t.shape, state_dim(k), self.tp.world)) * t.element_size() for k, t in local.items()
        }
        num_shards = max(meta["num_shards"], 1)
        wanted = shards_by_bytes(sizes, num_shards)[meta["shard"]] if num_shards > 1 else set(local)
        gathered = {key: self.tp.gather(local[key], state_dim(key)) for key in sorted(wanted)}
        return self.state_metadata(len(local)), gathered

    def _op_load_state(self, meta, tensors, full):
        local = {}
        for key, (shape, dtype) in sorted(meta["shapes"].items()):
            dim = state_dim(key)
            local_shape = list(shape)
            if dim is not None:
                local_shape[dim] //= self.tp.world
            like = torch.empty(local_shape, dtype=_DTYPES[dtype])
            local[key] = self.tp.scatter(None if full is None else full[key], like, dim).cpu()
        StageRuntime.load_state(self, meta["metadata"], local, meta["me"])

    # ---- helpers ------------------------------------------------------------------------------
    def _check_state(self, metadata: dict, tensors: dict[str, torch.Tensor]) -> dict:
        """Rank 0, before anything is sent: the donor's full state fits this stage; the shapes of what loads."""
        source = self.check_state(metadata, tensors, self.full_shapes)
        self.check_fingerprint(metadata, tensors, source)
        reads = {f"{source}/{n}" for n in self.param_names}
        reads |= {f"outer/momentum/{n}" for n in self.param_names} if self.local else set()
        reads |= {f"optim/{n}/{s}" for n in self.param_names for s in ("step", "exp_avg", "exp_avg_sq")}
        shapes = {}
        for key, t in tensors.items():
            if key in reads:
                if t.dtype not in (torch.float32, torch.float64) and not key.endswith("/step"):
                    raise StateError(f"{key} in the state is {t.dtype}, not float32")
                shapes[key] = [list(t.shape), str(t.dtype)]
        return shapes

    def fingerprint_values(self) -> list[float]:
        """The unsplit state's fingerprint (peer.model.part_state.state_fingerprint): shards summed over ranks,
        replicated tensors (and step counts) counted once; moments are split as their parameters are."""
        rows = list(zip(self.anchor if self.local else self.params, self.dims, strict=True))
        rows += list(zip(self.momentum, self.dims, strict=True)) if self.local else []
        for p, d in [] if self.local else zip(self.params, self.dims, strict=True):
            state = self.optimizer.state.get(p, {})
            rows += [(state.get(slot), None if slot == "step" else d) for slot in OPTIMIZER_SLOTS]  # a count: whole
        zero = torch.zeros(2, dtype=torch.float64, device=self.params[0].device)
        pairs = []  # on the device: one sum over ranks and one read back for all, not one per tensor
        for t, d in rows:
            keep = t is not None and (d is not None or self.tp.rank == 0)
            x = t.detach().double().to(zero.device) if keep else None
            pairs.append(torch.stack([x.sum(), x.pow(2).sum()]) if keep else zero)
        return self.tp.sum(torch.cat(pairs)).cpu().tolist()


__all__ = ["Fingerprint", "RankDied", "Ranks", "ShardedStageRuntime", "tp_devices"]

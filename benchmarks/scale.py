"""A ~125M-parameter Llama on this machine's CPUs: 3 stages x 2 replicas, a joiner, a checkpoint, a resume.

The model is a Hugging Face model directory (config.json of LlamaForCausalLM: hidden 768, 12
layers, 12 heads with 4 key/value heads, vocab 32000, and its weights in model.safetensors) that
only the coordinator reads. One run:

1. a coordinator (checkpoints every few steps), one server per stage, each loading its stage's
   tensors from the coordinator, then a second for stages 0 and 1 loading them from the first; each
   a `peer join` process with one torch thread;
2. a trainer runs `--steps` optimizer steps; once it is under way a sixth server joins stage 2 and
   loads the stage's whole state (weights and Adam) from the serving replica: its join time;
3. the swarm is killed; a coordinator started with `--resume` serves the newest checkpoint, and a
   server per stage loads it: resume time;
4. the single-process loop trains the same model with as many torch threads as the machine has.

Figures: what loading its weights took each server (its peak RSS by then less its RSS before it
built the stage, over the weights' bytes: goal <= 1.5), peak RSS of each server over the whole run
(VmHWM) over its stage's state bytes (weights + Adam moments, float32), join and checkpoint and
resume seconds, and samples/s of the swarm over the single process (goal >= 0.85; the swarm shares
these cores among 6 servers, a trainer and a coordinator).

    python benchmarks/scale.py [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, add_workdir, run, workdir  # noqa: E402
from peer.cli.demo import SERVING, Processes, dict_to_toml, loopback_coordinator, loopback_join  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.config.model_dir import resolve  # noqa: E402
from peer.data.corpus import load_corpus  # noqa: E402
from peer.model.llama import StageModel, count_parameters  # noqa: E402
from peer.trainer.local import train_local  # noqa: E402

# hidden, layers, heads, kv heads, vocab, seq, micro-batch, samples per step. A real run of a 125M model steps on
# about half a million tokens (GPT-3 Small's batch); on these 2 cores one such step would take minutes, so the
# full run steps on 32 samples of 64 tokens (2,048 tokens, the least issue 48 allows): 8 micro-batches of 4 a step,
# enough to keep 3 stages busy, and 6 steps fit the 5 minutes a benchmark has
FULL = {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "vocab": 32000, "seq": 64, "micro": 4, "batch": 32}
QUICK = {"hidden": 128, "layers": 3, "heads": 4, "kv_heads": 2, "vocab": 1024, "seq": 32, "micro": 2, "batch": 4}


def model_directory(where: Path, size: dict) -> Path:
    """A Llama model directory: config.json, and pretrained weights (see `write_weights`)."""
    where.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size["vocab"],
        "hidden_size": size["hidden"],
        "intermediate_size": size["hidden"] * 8 // 3 // 64 * 64,
        "num_hidden_layers": size["layers"],
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    (where / "config.json").write_text(json.dumps(config, indent=2))
    return where


def write_weights(where: Path, spec: RunSpec) -> None:
    """model.safetensors: the model's weights as transformers names them (here: our seed's), which only the
    coordinator reads; each server gets its stage's tensors from it."""
    save_file({n: t.contiguous() for n, t in StageModel(spec).state_dict().items()}, str(where / "model.safetensors"))


def run_spec(model: Path, size: dict, steps: int) -> dict:
    return {
        "name": "scale",
        "model": {"path": str(model), "max_seq_len": size["seq"]},
        "stages": {"num_stages": 3},
        "admission": {"mode": "open"},  # its own peers, started without invite codes
        "training": {
            "micro_batch_size": size["micro"],
            "seq_len": size["seq"],
            "target_batch_size": size["batch"],
            "total_steps": 10 * steps,
            "warmup_steps": 2,
            "lr": 3e-4,
        },
        # a round moves ~170 MB per replica of a full-size stage: room for it on two busy cores
        "averaging": {"averaging_timeout": 120.0, "group_timeout": 60.0},
    }


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


def seconds_in(log: str, pattern: str) -> float:
    found = re.findall(pattern, log)
    return float(found[-1]) if found else float("nan")


def start_coordinator(procs: Processes, tmp: Path, extra: list[str]) -> str:
    info = tmp / "coordinator.json"
    info.unlink(missing_ok=True)
    procs.start("coordinator", loopback_coordinator("run.toml", str(info), *extra))
    procs.wait_until(lambda: info.exists(), 120, "benchmark: the coordinator's start")
    return json.loads(info.read_text())["join"].split()[-1]


def serve(procs: Processes, maddr: str, servers: dict[str, int], loaded: bool = False) -> None:
    """Start servers (name -> stage) at once; wait until each serves (or, `loaded`, loaded a replica's state)."""
    # few cached forwards: 6 servers of a 125M model share 24 GiB here
    sets = ["--set", "server.rebalance=never", "--set", "server.activation_cache_size=6"]
    for name, stage in servers.items():
        procs.start(name, loopback_join(maddr, name, "--stage", str(stage), *sets))
    want = re.compile("Loaded the state") if loaded else SERVING  # not "Joined run ... Serving stage 0 of 3"
    procs.wait_until(
        lambda: all(want.search(procs.log(n)) for n in servers), 300, f"benchmark: {list(servers)} serving"
    )


def loading(procs: Processes, servers: list[str], figures: Figures) -> None:
    """What loading its stage's weights took each server: its peak RSS by then less its RSS just before
    they came (the runtime's baseline: gRPC server, averager, an unwritten stage), over the weights'
    bytes (goal <= 1.5)."""
    said = r"Memory: (\d+) MB at most by the time the stage's weights \((\d+) MB\) were in, (\d+) MB before they came"
    ratios = []
    for name in servers:
        peak, weights, before = (float(x) for x in re.findall(said, procs.log(name))[-1])
        ratios.append((peak - before) / weights)
    figures["load_over_weights"] = "/".join(f"{r:.2f}" for r in ratios)
    figures["load_over_weights_max"] = max(ratios)


def train(procs: Processes, maddr: str, tmp: Path, spec: RunSpec, steps: int, figures: Figures) -> None:
    """The trainer's steps; a server joins stage 2 once they are under way. Swarm samples/s into figures."""
    per_step = spec.training.target_batch_size // spec.training.micro_batch_size
    args = ["--role", "trainer", "--seed", "0", "--max-inflight", "4", "--log-file", "t.jsonl"]
    trainer = procs.start("t", loopback_join(maddr, "t", *args, "--max-micro-batches", str((steps + 2) * per_step)))
    log = tmp / "t.jsonl"

    def batches() -> list[dict]:
        lines = log.read_text().splitlines() if log.exists() else []
        return [e for e in map(json.loads, lines) if e["type"] == "micro_batch"]

    procs.wait_until(lambda: len(batches()) >= 3 * per_step, 600, "benchmark: training under way")
    serve(procs, maddr, {"s2b": 2}, loaded=True)  # mid-run: the whole stage state from the serving replica
    figures["join_s"] = seconds_in(
        procs.log("s2b"), r"Loaded the state of stage 2 \(step \d+\) from \d+ peers? in ([\d.]+) s"
    )
    if trainer.wait(900) != 0:
        raise RuntimeError(f"the trainer failed:\n{procs.log('t')[-2000:]}")
    done = batches()
    skip = 2 * per_step  # the first steps include connection set-up
    seconds = done[-1]["time"] - done[skip - 1]["time"]
    figures["swarm_sps"] = sum(e["samples"] for e in done[skip:]) / seconds
    figures["last_loss"] = done[-1]["loss"]


def swarm(tmp: Path, spec_dict: dict, spec: RunSpec, steps: int, figures: Figures) -> None:
    (tmp / "run.toml").write_text(dict_to_toml(spec_dict))
    state_bytes = [3 * 4 * count_parameters(StageModel(spec, s)) for s in range(3)]  # weights + 2 Adam moments
    figures["stage_state_mb"] = "/".join(f"{b / 2**20:.0f}" for b in state_bytes)
    procs = Processes(tmp)
    try:
        every = ["--checkpoints", "ckpt", "--set", f"coordinator.checkpoint_every_steps={max(steps // 2, 2)}"]
        maddr = start_coordinator(procs, tmp, every)
        serve(procs, maddr, {f"s{stage}a": stage for stage in range(3)})  # from the coordinator's weights
        serve(procs, maddr, {f"s{stage}b": stage for stage in range(2)}, loaded=True)  # from s0a, s1a
        loading(procs, ["s0a", "s1a", "s2a", "s0b", "s1b"], figures)
        train(procs, maddr, tmp, spec, steps, figures)
        servers = {n: stage for n, stage in (("s0a", 0), ("s1a", 1), ("s2a", 2), ("s0b", 0), ("s1b", 1), ("s2b", 2))}
        peaks = {n: peak_rss(procs.procs[n][0].pid) for n in servers}
        figures["rss_mb"] = "/".join(f"{p / 2**20:.0f}" for p in peaks.values())
        ratios = [peaks[n] / state_bytes[s] for n, s in servers.items()]
        figures["rss_over_state"] = "/".join(f"{r:.2f}" for r in ratios)
        figures["rss_over_state_max"] = max(ratios)
        written = r"Wrote checkpoint \S+ \(step \d+, \d+ parts\) in ([\d.]+) s"
        procs.wait_until(lambda: re.search(written, procs.log("coordinator")), 300, "benchmark: a checkpoint")
        figures["checkpoint_s"] = seconds_in(procs.log("coordinator"), written)
        procs.stop()
        resume(procs, tmp, figures)
    finally:
        procs.stop()


def resume(procs: Processes, tmp: Path, figures: Figures) -> None:
    """The swarm is gone: a coordinator serves the newest checkpoint and one server per stage loads it."""
    started = time.monotonic()
    procs.procs.clear()
    maddr = start_coordinator(procs, tmp, ["--resume", "ckpt"])
    for stage in range(3):
        procs.start(f"r{stage}", loopback_join(maddr, f"r{stage}", "--stage", str(stage)))
    procs.wait_until(
        lambda: all(re.search(r"Serving stage \d+ at \S+ from step [1-9]", procs.log(f"r{s}")) for s in range(3)),
        300,
        "benchmark: servers resumed from the checkpoint",
    )
    figures["resume_s"] = time.monotonic() - started


def body(args: argparse.Namespace, figures: Figures) -> None:
    size = QUICK if args.quick else FULL
    steps = args.steps or (4 if args.quick else 6)
    with workdir(args.workdir, "swarmtrain-scale-") as tmp:
        spec_dict = run_spec(model_directory(tmp / "model", size), size, steps)
        spec = resolve(RunSpec.from_dict(spec_dict))
        write_weights(tmp / "model", spec)
        figures.update(params_m=count_parameters(StageModel(spec)) / 1e6, steps=steps, cpus=os.cpu_count())
        swarm(tmp, spec_dict, spec, steps, figures)
    torch.set_num_threads(os.cpu_count() or 1)
    local_steps = max(steps // 5, 2)
    train_local(spec, load_corpus(), 1)  # warm up
    result = train_local(spec, load_corpus(), local_steps)
    figures["local_sps"] = result.samples / result.seconds
    figures["ratio"] = figures["swarm_sps"] / figures["local_sps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps the swarm trains (default 6; quick 4)")
    add_workdir(parser)
    add_quick(parser, "a 1M-parameter model of the same layout, 4 steps")
    run(parser, body)


if __name__ == "__main__":
    main()

"""What a safe checkpoint costs: ours (atomic, fsynced, checksummed) against a plain safetensors save.

Both sides write the same state, a real stage's parameters and AdamW moments
(`PartRuntime.state_tensors`), to the same disk in one run:
- plain: `safetensors.torch.save_file` of each part, then `load_file`; and the same save with
  each file fsynced (what durability alone costs);
- ours: `peer.coordinator.checkpoint.write` (a hidden tmp directory, each file fsynced, SHA-256 per file, the
  manifest last, a rename into place, pruning to `keep`), then `read_manifest(verify=True)` (every
  checksum) and `load_part`, as `--resume` and `peer export` read it.
Reported: the median seconds and MB/s of each, and the ratios. A plain save leaves its data in
the page cache; ours waits for the disk (fsync), so the write ratio depends on the disk. Last line `key=value ...`.

    python benchmarks/checkpoint.py [--hidden 512] [--layers 8] [--stages 2] [--repeats 7] [--dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import Figures, add_quick, run  # noqa: E402
from peer.config import RunSpec  # noqa: E402
from peer.coordinator import checkpoint  # noqa: E402
from peer.model.runtime import StageRuntime  # noqa: E402

# the sizes of a run, and of a --quick one; a flag given on the command line overrides both
FULL = {"hidden": 512, "layers": 8, "repeats": 7}
QUICK = {"hidden": 256, "layers": 2, "repeats": 3}


def parts_for(args) -> tuple[RunSpec, list[checkpoint.Part]]:
    spec = RunSpec.from_dict(
        {
            "name": "ckpt-bench",
            "model": {
                "hidden_size": args.hidden,
                "num_layers": args.layers,
                "num_heads": max(1, args.hidden // 64),
                "intermediate_size": args.hidden * 11 // 4,
                "max_seq_len": 128,
            },
            "stages": {"num_stages": args.stages},
        }
    )
    parts = []
    for stage in range(args.stages):
        rt = StageRuntime(spec, stage)
        tensors = rt.state_tensors()
        parts.append(checkpoint.Part(rt.name, rt.state_metadata(len(tensors)), tensors, peer="bench"))
    return spec, parts


def plain_side(root: Path, r: int, spec: RunSpec, fingerprint: str, parts: list, results: dict) -> None:
    plain = root / f"plain-{r}"
    plain.mkdir()
    files = [plain / checkpoint.part_file(p.name) for p in parts]
    started = time.perf_counter()
    for part, file in zip(parts, files, strict=True):
        save_file(part.tensors, str(file))
    results["plain_write"].append(time.perf_counter() - started)
    started = time.perf_counter()
    for file in files:
        load_file(str(file))
    results["plain_read"].append(time.perf_counter() - started)
    started = time.perf_counter()  # the same, each file flushed to disk: what durability alone costs
    for part, file in zip(parts, files, strict=True):
        synced = file.with_suffix(".synced")
        save_file(part.tensors, str(synced))
        with open(synced, "rb+") as f:
            os.fsync(f.fileno())
    results["plain_synced_write"].append(time.perf_counter() - started)
    shutil.rmtree(plain)


def ours_side(root: Path, r: int, spec: RunSpec, fingerprint: str, parts: list, results: dict) -> None:
    started = time.perf_counter()
    path = checkpoint.write(root / "ours", {"name": spec.name}, fingerprint, r, parts)
    results["ours_write"].append(time.perf_counter() - started)
    started = time.perf_counter()
    manifest = checkpoint.read_manifest(path, verify=True)
    for name in manifest["parts"]:
        checkpoint.load_part(path, manifest, name)
    results["ours_read"].append(time.perf_counter() - started)


def report(results: dict, figures: Figures) -> None:
    """The medians of the repeats so far, as figures."""
    median = {k: statistics.median(v) for k, v in results.items()}
    figures.update(
        plain_write_s=median["plain_write"],
        ours_write_s=median["ours_write"],
        write_ratio=median["ours_write"] / median["plain_write"],
        plain_synced_write_s=median["plain_synced_write"],
        synced_write_ratio=median["ours_write"] / median["plain_synced_write"],
        plain_read_s=median["plain_read"],
        ours_read_s=median["ours_read"],
        read_ratio=median["ours_read"] / median["plain_read"],
    )


def body(args: argparse.Namespace, figures: Figures) -> None:
    for key, full in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else full)
    spec, parts = parts_for(args)
    nbytes = sum(t.numel() * t.element_size() for p in parts for t in p.tensors.values())
    mb = nbytes / 1e6
    figures["state_mb"] = mb
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results = {"plain_write": [], "plain_synced_write": [], "plain_read": [], "ours_write": [], "ours_read": []}
    fingerprint = spec.fingerprint()
    try:
        for r in range(args.repeats):
            # the two sides take turns going first: a write right after another one's is slower on some disks
            sides = [plain_side, ours_side] if r % 2 == 0 else [ours_side, plain_side]
            for side in sides:
                side(root, r, spec, fingerprint, parts, results)
            report(results, figures)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"state: {mb:.1f} MB in {len(parts)} parts ({args.layers} blocks, hidden {args.hidden}); median of {args.repeats}"
    )
    for key, values in results.items():
        seconds = statistics.median(values)
        print(f"  {key:18s} {seconds:7.3f} s  {mb / seconds:8.1f} MB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def sized(name: str, what: str) -> None:
        key = name.lstrip("-")
        parser.add_argument(name, type=int, help=f"{what} (default {FULL[key]}; quick {QUICK[key]})")

    sized("--hidden", "model width")
    sized("--layers", "transformer blocks over all stages")
    parser.add_argument("--stages", type=int, default=2)
    sized("--repeats", "timed saves and loads of each side; medians are reported")
    parser.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
    add_quick(parser, "hidden 256, 2 blocks, 3 repeats")
    run(parser, body)


if __name__ == "__main__":
    main()

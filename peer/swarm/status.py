"""`peer status`: a table of a run's stages, servers and trainers, read from the DHT."""

from __future__ import annotations

import math
import time

from rich.console import Console
from rich.table import Table

from dht import keys
from dht.node import SwarmDHT
from dht.records import BooksRecord, RelayRecord, ServerRecord, TrainerRecord
from peer.config import RunSpec
from peer.model.moe import expert_uid
from peer.swarm.books import from_record
from protocols.version import software_version


def gather(dht: SwarmDHT, spec: RunSpec, books: bool = True) -> dict:
    """A look at the run from the DHT: every part's records, the trainers', the relays' and (with `books`; the
    coordinator keeps its own) the books."""
    stages = [dht.get(keys.servers_key(spec.name, s), ServerRecord) for s in range(spec.stages.num_stages)]
    trainers = dht.get(keys.trainers_key(spec.name), TrainerRecord)
    experts = {
        expert_uid(layer, e): dht.get(keys.expert_key(spec.name, expert_uid(layer, e)), ServerRecord)
        for layer in spec.moe_layers()
        for e in range(spec.moe.num_experts)
    }
    relays = dht.get(keys.relays_key(spec.name), RelayRecord)
    books = dht.get(keys.books_key(spec.name), BooksRecord) if books else {}
    return {"stages": stages, "trainers": trainers, "experts": experts, "relays": relays, "books": books}


def coverage(spec: RunSpec, experts: dict[str, dict[str, ServerRecord]]) -> list[dict]:
    """Per MoE layer: experts hosted, replicas of each, and which have no live host."""
    rows = []
    for layer in spec.moe_layers():
        replicas = {}
        for e in range(spec.moe.num_experts):
            found = experts.get(expert_uid(layer, e), {})
            replicas[e] = sum(1 for r in found.values() if r.state == "serving")
        hosted = [e for e, n in replicas.items() if n]
        rows.append(
            {
                "layer": layer,
                "hosted": len(hosted),
                "replicas": replicas,
                "missing": [e for e, n in replicas.items() if not n],
            }
        )
    return rows


def devices_label(devices: list[str]) -> str:
    """cpu x2, or cuda:0,cuda:1; '?' for a peer too old to say."""
    if not devices:
        return "?"
    if len(set(devices)) == 1 and len(devices) > 1:
        return f"{devices[0]} x{len(devices)}"
    return ",".join(devices)


def render(spec: RunSpec, state: dict, console: Console | None = None) -> None:
    console = console or Console(width=None if Console().is_terminal else 140)
    now = time.time()
    stages: list[dict[str, ServerRecord]] = state["stages"]
    trainers: dict[str, TrainerRecord] = state["trainers"]
    global_step = max((r.epoch for servers in stages for r in servers.values()), default=0)
    samples = sum(t.samples for t in trainers.values())
    console.print(
        f"[bold]Run '{spec.name}'[/bold]: global step {global_step}/{spec.training.total_steps}, "
        f"{samples} samples trained, target batch {spec.training.target_batch_size} samples "
        f"(this peer runs swarmtrain {software_version()})"
    )
    console.print(_servers_table(spec, stages, now))
    if spec.moe_layers():
        console.print(_experts_table(spec, state.get("experts", {})))
    relays: dict[str, RelayRecord] = state.get("relays", {})
    if relays:
        console.print(_relays_table(relays))
    console.print(_trainers_table(trainers, now))
    _print_books(console, state.get("books", {}), now)


def _print_books(console: Console, found: dict[str, BooksRecord], now: float) -> None:
    """The coordinator's books of the run (peer.swarm.books), in words, per stage."""
    if not found:
        console.print("Books: the coordinator has not announced any (yet).")
        return
    record = max(found.values(), key=lambda r: r.updated)
    books = from_record(record)
    state = "balance" if all(b.balanced for b in books) else f"disagree (for {now - record.since:.0f} s)"
    console.print(f"[bold]Books[/bold] (samples; as of {now - record.updated:.0f} s ago): they {state}")
    for stage, b in enumerate(books):
        console.print(f"  {b.words(stage)}")


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    return table


def _servers_table(spec: RunSpec, stages: list[dict[str, ServerRecord]], now: float) -> Table:
    columns = ("stage", "blocks", "server", "endpoint", "state", "tp", "devices", "samples/s", "load", "step", "age")
    table = _table("Stages and servers", (*columns, "version"))
    for stage, servers in enumerate(stages):
        blocks = spec.stage_blocks(stage)
        if not servers:
            row = [str(stage), f"{blocks.start}-{blocks.stop - 1}", "[red]none[/red]"]
            table.add_row(*row, *[""] * 9)
        for pid, r in sorted(servers.items(), key=lambda kv: kv[1].endpoint):
            if r.state in ("archive", "trained"):  # the coordinator's: its checkpoint of the stage, or its step
                what = "checkpoint" if r.state == "archive" else "trained"  # "trained": its step, no copy
                row = [str(stage), f"{blocks.start}-{blocks.stop - 1}", "coordinator", r.endpoint or "-", what]
                table.add_row(*row, "", "", "", "", str(r.epoch), "", r.software or "?")
                continue
            table.add_row(
                str(stage),
                f"{blocks.start}-{blocks.stop - 1}",
                pid[-8:],
                f"{r.endpoint} via relay {r.relay[-8:]}" if r.relay else r.endpoint,
                r.state,
                str(r.tp),
                devices_label(r.devices),
                f"{r.throughput:.1f}",
                f"{r.load:.0f}",
                str(r.epoch),
                f"{now - r.started:.0f} s",
                r.software or "?",
            )
    return table


def _experts_table(spec: RunSpec, experts: dict) -> Table:
    title = f"Experts ({spec.moe.num_experts} per layer, top-{spec.moe.top_k})"
    table = _table(title, ("layer", "hosted", "replicas per expert", "missing", "hosts"))
    for row in coverage(spec, experts):
        hosts = {
            r.endpoint
            for e in range(spec.moe.num_experts)
            for r in experts.get(expert_uid(row["layer"], e), {}).values()
            if r.state == "serving"
        }
        missing = ", ".join(map(str, row["missing"]))
        table.add_row(
            str(row["layer"]),
            f"{row['hosted']}/{spec.moe.num_experts}",
            " ".join(f"{e}:{n}" for e, n in row["replicas"].items()),
            f"[red]{missing}[/red]" if missing else "none",
            str(len(hosts)),
        )
    return table


def _relays_table(relays: dict[str, RelayRecord]) -> Table:
    columns = ("relay", "role", "endpoint", "peers", "connections", "MB relayed", "MB/s now")
    table = _table("Relays (for peers that cannot be dialled)", columns)
    for pid, r in sorted(relays.items(), key=lambda kv: kv[1].endpoint):
        table.add_row(
            pid[-8:],
            r.role,
            r.endpoint,
            f"{r.relayed}/{r.capacity}",
            str(r.connections),
            f"{r.bytes_relayed / 1e6:.1f}",
            f"{r.rate / 1e6:.2f}",
        )
    return table


def _trainers_table(trainers: dict[str, TrainerRecord], now: float) -> Table:
    columns = (
        "trainer",
        "samples",
        "samples/s",
        "train loss",
        "val loss",
        "val ppl",
        "bits/byte",
        "step",
        "age",
        "version",
    )
    table = _table("Trainers", columns)
    for pid, t in sorted(trainers.items()):
        table.add_row(
            pid[-8:],
            str(t.samples),
            f"{t.samples_per_second:.1f}",
            f"{t.train_loss:.3f}" if t.train_loss is not None else "-",
            f"{t.val_loss:.3f}" if t.val_loss is not None else "-",
            f"{math.exp(min(t.val_loss, 700.0)):.1f}" if t.val_loss is not None else "-",
            f"{t.val_bits_per_byte:.3f}" if t.val_bits_per_byte is not None else "-",
            str(t.epoch),
            f"{now - t.started:.0f} s",
            t.software or "?",
        )
    if not trainers:
        table.add_row("none", *[""] * (len(columns) - 1))
    return table

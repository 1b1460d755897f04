"""The docs cannot drift from the code: README's command lines run through the real parser and
settings, and docs/run-spec.md lists every field of the run spec and the peer settings and every
flag of every command."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import typing
from pathlib import Path

import pytest

from dht.identity import Identity
from peer.cli.options import peer_config, place_device, split_overrides
from peer.cli.parser import build_parser, normalize_argv
from peer.config import PeerConfig, RunSpec

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
A_PEER_ID = Identity.generate().peer_id


def _fenced_peer_lines() -> list[tuple[str, str]]:
    """(where, command) of every `peer ...` line inside a fenced code block of README and docs/."""
    found = []
    for path in DOCS:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip().startswith("```"):
                inside = not inside
            elif inside and line.strip().startswith("peer "):
                command = line.split("  #", 1)[0].strip()
                found.append((f"{path.name}:{number}", command))
    return found


def _inline_peer_spans() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            found += [(f"{path.name}:{number}", m) for m in re.findall(r"`(peer [a-z][^`]*)`", line)]
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_readme_has_peer_lines_to_check():
    assert len(_fenced_peer_lines()) >= 10


@pytest.mark.parametrize(("where", "command"), _fenced_peer_lines())
def test_every_documented_command_line_parses_and_builds_its_settings(where, command, tmp_path):
    argv = shlex.split(command.replace("12D3KooW...", A_PEER_ID))[1:]
    try:
        args = build_parser().parse_args(normalize_argv(argv))
    except SystemExit as e:
        pytest.fail(f"{where}: `{command}` does not parse (exit {e.code})")
    if args.command in ("coordinator", "join"):
        spec_items, peer_items = split_overrides(args.set)
        cfg = peer_config(args, peer_items)
        if args.command == "join":
            assert not spec_items, f"{where}: a run-spec field set on a join"
            place_device(args, cfg)
        if args.announce_host:
            assert cfg.network.dht_announce_maddrs, f"{where}: an announced host, but no announced DHT address"
            assert "/tcp/0" not in cfg.network.dht_announce_maddrs[0]


def test_inline_commands_name_real_subcommands_and_flags():
    commands = _subparsers(build_parser())
    for where, span in _inline_peer_spans():
        words = normalize_argv(span.split()[1:])
        if not words or words[0].startswith("<"):
            continue  # `peer <command>: ...`, a message pattern
        assert words[0] in commands, f"{where}: `{span}` names no command"
        known = {s for a in commands[words[0]]._actions for s in a.option_strings}
        for flag in re.findall(r"(--[a-z][a-z-]*)", span):
            assert flag in known, f"{where}: `{span}`: {words[0]} has no {flag}"


def _sections(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _documented(text: str, heading: str) -> set[str]:
    """Field names in the table that follows `heading` (a line starting with it) in run-spec.md."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    names, seen_table = set(), False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen_table = True
            cell = line.split("|")[1].strip()
            if cell.startswith("`") and cell.endswith("`"):
                names.add(cell.strip("`"))
        elif seen_table:
            break
    return names


@pytest.mark.parametrize("cls", [RunSpec, PeerConfig])
def test_run_spec_md_lists_every_field(cls):
    text = (ROOT / "docs" / "run-spec.md").read_text()
    top = "## Run spec" if cls is RunSpec else "## Peer settings"
    top_fields = {f.name for f in dataclasses.fields(cls)}
    block = text[text.index(top) :]
    assert top_fields <= _documented(block, "Top level:"), f"{cls.__name__}: top level lacks fields"
    for section, section_cls in _sections(cls).items():
        wanted = {f.name for f in dataclasses.fields(section_cls)}
        missing = wanted - _documented(text, f"`[{section}]`")
        assert not missing, f"docs/run-spec.md: [{section}] lacks {sorted(missing)}"


def test_run_spec_md_lists_every_flag_of_every_command():
    text = (ROOT / "docs" / "run-spec.md").read_text()
    for name, parser in _subparsers(build_parser()).items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    listed = re.search(rf"`{re.escape(flag)}(?![a-z-])", text)  # `--device` is not `--devices`
                    assert listed, f"docs/run-spec.md does not list `peer {name} {flag}`"

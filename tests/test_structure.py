"""The code's shape: packages used in one direction, no import cycles, small modules and functions.

Read from the source with `ast` (nothing is imported), so it checks every import, including those inside
functions and under `if TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("protocols", "dht", "peer")
SIZED = ("protocols", "dht", "peer", "benchmarks")
# lowest first: a module may import from its own layer and the layers before it, never from a later one
LAYERS = (
    "protocols",
    "dht",
    "peer.process",
    "peer.config",
    "peer.net",
    "peer.model",
    "peer.data",
    "peer.swarm",
    "peer.server",
    "peer.trainer",
    "peer.coordinator",
    "peer.cli",
)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources(tops) -> dict[str, Path]:
    """Dotted module name -> file, for the packages `tops` (generated protobuf code left out)."""
    found = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ours that one import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in CHECKED]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    if base.split(".")[0] not in CHECKED:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    sources = _sources(CHECKED)
    known = set(sources)
    graph = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(), str(path))
        deps = set()
        for node in ast.walk(tree):
            deps.update(d for d in _imported(node, module, path.name == "__init__.py", known) if d != module)
        graph[module] = deps
    return graph


def _layer(module: str) -> int:
    matches = [i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")]
    assert matches, f"{module} is in no layer: add its package to LAYERS"
    return max(matches)


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    wrong = [
        f"{module} (layer {LAYERS[_layer(module)]}) imports {dep} (layer {LAYERS[_layer(dep)]})"
        for module, deps in sorted(import_graph().items())
        if module != "peer"
        for dep in sorted(deps)
        if dep != "peer" and _layer(dep) > _layer(module)
    ]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    path, on_path, done = [], set(), set()

    def visit(node: str) -> list[str] | None:
        if node in on_path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        on_path.add(node)
        for dep in sorted(graph.get(node, ())):
            found = visit(dep)
            if found:
                return found
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    return visit(start)


def test_no_import_cycles():
    graph = import_graph()
    cycles = {" -> ".join(c) for m in graph if (c := _cycle_from(m, graph))}
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def _import_blocks(body: list[ast.stmt]):
    """Runs of consecutive import statements in one statement list: (first line, last line)."""
    block = None
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            block = (block[0] if block else node.lineno, node.end_lineno)
            continue
        if block:
            yield block
        block = None
    if block:
        yield block


def test_imports_inside_functions_say_why():
    """An import inside a function is there for startup time (or an optional extra): a `# lazy: why` comment
    on the line before a run of such imports, or on one of their lines, says so."""
    silent = []
    for path in _sources(CHECKED).values():
        lines = path.read_text().splitlines()
        for func in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                bodies = [getattr(node, field, None) for field in ("body", "orelse", "finalbody")]
                for first, last in (b for body in bodies if isinstance(body, list) for b in _import_blocks(body)):
                    if not any("# lazy" in line for line in lines[first - 2 : last]):
                        silent.append(f"{path.relative_to(ROOT)}:{first}: {lines[first - 1].strip()}")
    assert not silent, "imports inside functions without a '# lazy: why' comment:\n" + "\n".join(sorted(set(silent)))


def test_modules_and_functions_are_small():
    big = []
    for path in _sources(SIZED).values():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            big.append(f"{rel}: {n} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                big.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    assert not big, "too big:\n" + "\n".join(big)


def test_catch_alls_say_why_and_never_hide_the_error():
    """An `except Exception` (or BaseException, or bare) is a boundary that must not die: its line says why
    in a comment, and it hides nothing: it raises, or it logs at WARNING or above (never debug or info)."""
    wrong = []
    for path in _sources(CHECKED).values():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            caught = node.type
            names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
            if caught is not None and not any(
                isinstance(n, ast.Name) and n.id in ("Exception", "BaseException") for n in names
            ):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if "#" not in lines[node.lineno - 1]:
                wrong.append(f"{where}: no comment saying why it catches everything")
            quiet = [
                call.func.attr
                for call in ast.walk(node)
                if isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in ("debug", "info")
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "logger"
            ]
            if quiet:
                wrong.append(f"{where}: logs what it caught at {quiet[0]} (WARNING or above, or let it raise)")
    assert not wrong, "catch-alls:\n" + "\n".join(sorted(wrong))


def test_the_runtime_uses_hivemind_for_its_dht_alone():
    """hivemind is the DHT (dht.node); replicas average through our own all-reduce (peer.server.allreduce), so no
    module of ours imports hivemind's averaging, its compression or its internals beyond the DHT."""
    allowed = ("hivemind", "hivemind.dht", "hivemind.p2p", "hivemind.utils")
    wrong = []
    for path in _sources(CHECKED).values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            wrong += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if name.split(".")[0] == "hivemind" and not name.startswith(allowed[1:]) and name != "hivemind"
            ]
    assert not wrong, "modules of ours that import hivemind beyond its DHT:\n" + "\n".join(wrong)

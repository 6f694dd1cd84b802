"""The package's layers: imports point only downward, and no module imports itself back.

The layer order is written out here (lowest first); docs/architecture.md draws it. A
module belongs to the layer of the longest prefix listed. Within one layer any import
is allowed (but no cycle). ``hier_localsgd.core`` is four layers, its subpackages in
CORE_ORDER: every core module lives in one of them, and imports between them point down. Every ``import`` counts, those inside functions too (they run
as surely as the others, only later); imports under ``if TYPE_CHECKING:`` do not (they
never run: they name a type for annotations, e.g. ``Config`` in the launcher).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

PACKAGE = "hier_localsgd"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# The core subpackages, lowest first: process plumbing, the job secret and the no-code state format, model-state numerics, a level's
# links (process group and link emulation), the torchft-facing pieces.
CORE_ORDER: Tuple[str, ...] = ("runtime", "security", "tensors", "links", "ft")

# Lowest first. experiments.sections (the experiments' config sections, dataclasses only)
# and chaos_faults (the fault kinds they name) sit below the root config that composes
# them; the experiment drivers above it load configurations of their own.
LAYERS: List[Tuple[str, Sequence[str]]] = [
    ("base", ("hier_localsgd", "hier_localsgd.costs", "hier_localsgd.errors")),
    ("core", ("hier_localsgd.core",)),  # the package itself: a docstring, nothing else
    *[(f"core.{sub}", (f"hier_localsgd.core.{sub}",)) for sub in CORE_ORDER],
    ("sync", ("hier_localsgd.sync",)),
    ("train", ("hier_localsgd.train",)),
    ("launch", ("hier_localsgd.launch",)),
    ("tools", ("hier_localsgd.tools",)),
    ("experiment sections", ("hier_localsgd.experiments.sections", "hier_localsgd.experiments.chaos_faults")),
    ("config", ("hier_localsgd.config",)),
    ("job", ("hier_localsgd.job",)),  # a process's place in the job and its exit path (the public API)
    ("api", ("hier_localsgd.api",)),  # HierarchicalDiLoCo: the public API's sync object
    # Programs on the public API, as a user's are: the built-in loop and the bench's bare loop.
    ("programs", ("hier_localsgd.train.trainer", "hier_localsgd.train.bare")),
    ("experiments", ("hier_localsgd.experiments",)),
    ("cli", ("hier_localsgd.cli", "hier_localsgd.__main__", "hier_localsgd.spare")),  # entry points
]

Edge = Tuple[str, str, int]  # importer, imported, line


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[Tuple[ast.AST, int]]:
    """Every import node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, known: Set[str]) -> Optional[str]:
    """The package module ``name`` loads (its longest known prefix), or None if outside."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(mods: Optional[Dict[str, Path]] = None) -> List[Edge]:
    mods = modules() if mods is None else mods
    known = set(mods)
    out: List[Edge] = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, line in _imports(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                base = node.module or ""
                if node.level:  # relative import
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                # "from pkg import module" loads the module; "from module import name" the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                r = _resolve(t, known) if t.split(".")[0] == PACKAGE else None
                if r is not None and r != mod:
                    out.append((mod, r, line))
    return out


def layer_of(mod: str) -> Tuple[int, str]:
    best: Tuple[int, int, str] = (-1, -1, "")
    for i, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best[1]:
                best = (i, len(p), name)
    if best[0] < 0:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS in tests/test_layers.py")
    return best[0], best[2]


def upward(all_edges: List[Edge]) -> List[str]:
    bad = []
    for a, b, line in all_edges:
        (la, na), (lb, nb) = layer_of(a), layer_of(b)
        if lb > la:
            bad.append(f"{a}:{line} ({na}) imports {b} ({nb}), a higher layer")
    return bad


def cycles(all_edges: List[Edge]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in all_edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer() -> None:
    for mod in modules():
        layer_of(mod)


def test_imports_point_downward() -> None:
    bad = upward(edges())
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    found = cycles(edges())
    assert not found, found


def test_the_checks_catch_a_violation() -> None:
    """The checks can fail: a synthetic upward edge and a synthetic cycle are reported."""
    real = edges()
    assert real, "no package imports found: the walk is broken"
    assert ("hier_localsgd.core.ft.managers", "hier_localsgd.core.runtime.addresses") in {(a, b) for a, b, _ in real}
    up = upward(real + [("hier_localsgd.core.runtime.phases", "hier_localsgd.experiments.chaos", 1)])
    assert up == [
        "hier_localsgd.core.runtime.phases:1 (core.runtime) imports hier_localsgd.experiments.chaos (experiments), a higher layer"
    ]
    # Between core subpackages: links may not import ft (as link.py once imported presence.py).
    up = upward(real + [("hier_localsgd.core.links.link", "hier_localsgd.core.ft.presence", 1)])
    assert up == ["hier_localsgd.core.links.link:1 (core.links) imports hier_localsgd.core.ft.presence (core.ft), a higher layer"]
    loop = cycles(real + [("hier_localsgd.core.runtime.addresses", "hier_localsgd.core.ft.managers", 1)])
    assert any({"hier_localsgd.core.runtime.addresses", "hier_localsgd.core.ft.managers"} <= set(c) for c in loop), loop


def test_core_is_its_subpackages_in_order() -> None:
    """Every module of hier_localsgd.core sits in one of CORE_ORDER's subpackages, those
    layers come right after core itself in CORE_ORDER's order, each subpackage's
    ``__init__`` is a docstring and nothing else (no re-exports), and every edge between
    two subpackages points to a lower one."""
    mods = modules()
    subs = {f"hier_localsgd.core.{s}" for s in CORE_ORDER}
    assert subs <= set(mods), sorted(subs - set(mods))
    for mod in mods:
        if mod.startswith("hier_localsgd.core."):
            assert mod.split(".")[2] in CORE_ORDER, f"{mod} is in no core subpackage {CORE_ORDER}"
    names = [name for name, _ in LAYERS]
    at = names.index("core")
    assert names[at : at + 1 + len(CORE_ORDER)] == ["core", *(f"core.{s}" for s in CORE_ORDER)]
    for sub in ["", *(f".{s}" for s in CORE_ORDER)]:
        body = ast.parse(mods[f"hier_localsgd.core{sub}"].read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), (
            f"hier_localsgd.core{sub}/__init__.py holds more than its docstring"
        )
    rank = {f"hier_localsgd.core.{s}": i for i, s in enumerate(CORE_ORDER)}
    between = [
        (a, b, line)
        for a, b, line in edges(mods)
        if a.startswith("hier_localsgd.core.") and b.startswith("hier_localsgd.core.")
        and a.split(".")[2] != b.split(".")[2]
    ]
    assert between, "no import between core subpackages found: the walk is broken"
    bad = [f"{a}:{line} imports {b}" for a, b, line in between if rank[".".join(b.split(".")[:3])] > rank[".".join(a.split(".")[:3])]]
    assert not bad, "\n".join(bad)


def test_type_checking_imports_are_skipped(tmp_path: Path) -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hier_localsgd.config import Config\nimport hier_localsgd.costs\n"
    p = tmp_path / "m.py"
    p.write_text(src)
    found = [b for b, _ in _imports(ast.parse(src))]
    assert len(found) == 2  # typing's import and costs; not the TYPE_CHECKING one

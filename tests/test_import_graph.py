"""flashgen's modules import each other without cycles, so each can be read (and imported) after
what it builds on: spec -> codegen -> build -> emit -> rewrite -> runtime/jax -> cli.

Every import statement counts, also those inside functions (a deferred import is still a
dependency), and so does an import by name: in a module that calls ``import_module``
(importlib's), every string literal naming a flashgen module is an edge (a plugin list kept as a
tuple of names included). A package's __init__ importing its own submodules is an edge like any
other, so a submodule importing names back from its package's __init__ (the registry pattern
that works only by statement order) is a cycle: shared names live in a module of their own.
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "flashgen"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the flashgen module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        if any(_calls_import_module(n) for n in ast.walk(tree)):  # imports by name
            graph[mod] |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                           and isinstance(n.value, str) and n.value in mods and n.value != mod}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` depends on pkg.sub only; `from pkg import name` on pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in filter(None, map(owner, targets)):
                if t != mod:
                    graph[mod].add(t)
    return graph


def _calls_import_module(node) -> bool:
    """`importlib.import_module(...)` or `import_module(...)`."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "import_module") or \
        (isinstance(f, ast.Attribute) and f.attr == "import_module")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_package_import_graph_is_acyclic():
    graph = import_graph()
    assert {"flashgen.emit", "flashgen.build", "flashgen.jax.sharding"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()  # the edges the issue named, and how they point now
    assert "flashgen.sharding_rule" in graph["flashgen.emit"]
    assert "flashgen.emit" in graph["flashgen.jax.sharding"]
    assert "flashgen.bench_common" in graph["flashgen.bench_variants"]
    # issue 16: the subcommand plugins cli.py imports by name, and a package's own submodules
    assert {"flashgen.bench", "flashgen.cli_rewrite", "flashgen.cli_cache",
            "flashgen.emulate.check"} <= graph["flashgen.cli"]
    assert "flashgen.cli_args" in graph["flashgen.bench"]
    assert "flashgen.cli_args" in graph["flashgen.emulate.check"]
    assert "flashgen.emulate.semantics.arith" in graph["flashgen.emulate.semantics"]
    assert "flashgen.emulate.semantics.registry" in graph["flashgen.emulate.semantics.arith"]

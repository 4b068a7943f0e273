"""No import cycles among the modules of src/k3jax and conversion/; no k3jax module imported inside a
function (a lazy third-party import says why); imports name the module that defines the name;
and (at the end) no function in serve/ or inference/ over 120 lines.

The import graph is read from the source with `ast`; nothing is imported, so a cycle is found
even when no test happens to trigger it (a cycle through a function-level import only bites
when that function first runs, or when the modules are imported in another order).

Edges, from the module whose file holds the import statement:
  * `import a.b.c` -> `a.b.c`; `from pkg import name` -> `pkg.name` when that is a module, else
    `pkg`; `from pkg import *` -> `pkg`; relative imports are resolved against the module's
    package first. Only modules of ours become nodes; jax, numpy and the stdlib do not.
  * Importing `a.b.c` also runs `a/__init__` and `a/b/__init__`, so it is an edge to those
    packages too. Modelling this costs nothing while an `__init__` imports only its own
    submodules (those edges are dropped, below), and it catches the cycle that does hurt: an
    `__init__` importing a module outside its package that imports back into the package.
  * Dropped: an edge from a package's `__init__` to a module inside that package. Python
    handles that order (the package is in sys.modules before its body runs), and every such
    package would otherwise sit in a cycle with each submodule that imports a sibling through
    the package path. The price: a submodule reading a name its package's `__init__` defines
    after importing that submodule is not caught here (its tests fail with an ImportError).
  * Imports inside functions and classes count: they run later, but they run. Imports under
    `if TYPE_CHECKING:` never run and are skipped (the `else:` branch counts).
"""
from __future__ import annotations

import ast
import textwrap
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (directory on sys.path, top-level package) of every package this repository ships.
PACKAGES = ((REPO / "src", "k3jax"), (REPO, "conversion"))


def find_modules(packages) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__) for every .py under the packages."""
    modules = {}
    for root, top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            modules[".".join(parts)] = (path, is_pkg)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every Import / ImportFrom in the tree (function bodies included), minus TYPE_CHECKING."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children = node.orelse
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _targets(node, name: str, is_pkg: bool, modules) -> list[str]:
    """The modules one import statement in module `name` names (before adding parents)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:                                   # relative: from the module's own package
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if alias.name != "*" and sub in modules else base)
    return out


def _where(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def import_graph(modules) -> dict[str, dict[str, str]]:
    """module -> {imported module: 'file:line' of the first statement making that edge}."""
    graph = {}
    for name, (path, is_pkg) in modules.items():
        edges = graph.setdefault(name, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            for target in _targets(node, name, is_pkg, modules):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):   # the target and every package above it
                    dep = ".".join(parts[:i])
                    if dep not in modules or dep == name:
                        continue
                    if is_pkg and dep.startswith(name + "."):
                        continue                     # a package's __init__ loading its own modules
                    edges.setdefault(dep, f"{_where(path)}:{node.lineno}")
    return graph


def _components(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def find_cycles(graph) -> list[list[str]]:
    """Readable cycles, each [a, b, ..., a]: per component, the shortest cycle through each of its
    modules (BFS inside the component), rotated to start at its smallest name, without repeats.
    Not every elementary cycle (there can be exponentially many), but every module of every
    cyclic component appears in at least one reported chain."""
    cycles = []
    for comp in _components(graph):
        members = set(comp)
        for start in comp:
            prev, queue = {start: None}, deque([start])
            while queue:
                v = queue.popleft()
                if start in graph[v]:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    path.reverse()                           # start ... v
                    i = path.index(min(path))
                    cycle = path[i:] + path[:i]
                    if cycle + [cycle[0]] not in cycles:
                        cycles.append(cycle + [cycle[0]])
                    break
                for w in sorted(graph[v]):
                    if w in members and w not in prev:
                        prev[w] = v
                        queue.append(w)
    return cycles


def describe(cycles, graph) -> str:
    lines = []
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle))
        lines += [f"      {a} imports {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return "\n".join(lines)


def test_no_import_cycles():
    graph = import_graph(find_modules(PACKAGES))
    assert "k3jax.kernels.kda.chunked" in graph and "conversion.param_map" in graph  # found them
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + describe(cycles, graph)


def test_detector_finds_a_cycle(tmp_path):
    """A fake package: one real cycle (relative and function-level imports) among patterns that
    must not count (an __init__ loading its submodules, a TYPE_CHECKING import)."""
    files = {
        "pkg/__init__.py": "from pkg import a\nfrom pkg.c import C\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .a import x\n    return x\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nimport pkg\nif TYPE_CHECKING:\n"
                    "    from pkg.d import D\nC = 1\n",
        "pkg/d.py": "import pkg.c\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    graph = import_graph(find_modules([(tmp_path, "pkg")]))
    assert graph["pkg.c"] == {"pkg": graph["pkg.c"]["pkg"]}            # not pkg.d
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert "pkg.a -> pkg.b -> pkg.a" in describe(find_cycles(graph), graph)


# ---- where imports stand (issue 51): at module top, naming the module that defines the name ----

def _function_local_imports(path: Path):
    """(import node, whether a comment gives its reason) of every import inside a function of
    ``path``: a comment on its line or the line above, or above the lazy import block it ends."""
    text = path.read_text()
    lines = text.splitlines()
    found = []

    def walk(node, inside: bool):
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    walk(ast.parse(text, filename=str(path)), False)
    explained, out = set(), []
    for node in sorted(found, key=lambda n: n.lineno):
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        ok = "#" in lines[node.lineno - 1] or "#" in above or node.lineno - 1 in explained
        if ok:
            explained.add(node.end_lineno)
        out.append((node, ok))
    return out


def _ours(node) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return bool(getattr(node, "level", 0)) or any(n.split(".")[0] in ("k3jax", "conversion") for n in names)


def test_no_function_local_import_of_our_modules():
    """A k3jax module imported inside a function hides the import direction (a lower module reaching
    up): move the thing down instead. A third-party import may stay lazy with a one-line reason (a
    comment on its line or the line above: an optional or slow dependency)."""
    local, unexplained = [], []
    for name, (path, _) in find_modules(PACKAGES[:1]).items():
        for node, explained in _function_local_imports(path):
            where = f"{_where(path)}:{node.lineno}: {ast.unparse(node)}"
            if _ours(node):
                local.append(where)
            elif not explained:
                unexplained.append(where)
    assert not local, "function-local imports of k3jax modules:\n  " + "\n  ".join(local)
    assert not unexplained, "lazy third-party imports without a reason:\n  " + "\n  ".join(unexplained)


def _reexported(modules) -> dict[str, dict[str, str]]:
    """package -> {name its __init__ imports from another module (and does not define): that module}."""
    out = {}
    for name, (path, is_pkg) in modules.items():
        if not is_pkg:
            continue
        names = out.setdefault(name, {})
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    names[alias.asname or alias.name] = node.module
    return out


def test_imports_name_the_defining_module():
    """``from k3jax.optim import make_optimizer`` reads make_optimizer through optim/__init__;
    ``from k3jax.optim.muon import make_optimizer`` names where it is defined."""
    modules = find_modules(PACKAGES)
    reexported = _reexported(modules)
    files = [p for p, _ in modules.values()] + sorted((REPO / "tests").glob("*.py")) + \
        sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module in reexported and not node.level):
                continue
            if modules[node.module][0] == path:
                continue                                  # the package's own __init__
            for alias in node.names:
                src = reexported[node.module].get(alias.name)
                if src and f"{node.module}.{alias.name}" not in modules:
                    found.append(f"{_where(path)}:{node.lineno}: {alias.name} from {node.module} (defined in {src})")
    assert not found, "imports through a re-exporting __init__:\n  " + "\n  ".join(found)


# ---- how long a function may grow (issue 51, item 4) ----

MAX_FUNCTION_LINES = 120
SHORT_FUNCTION_PACKAGES = ("serve", "inference")     # under src/k3jax


def function_lengths(root: Path) -> dict[str, int]:
    """'file:line name' -> lines from ``def`` to its last line (decorators not counted), for every
    function, method and nested function of the .py files under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{_where(path)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_long_functions_in_serve_and_inference():
    """A function over 120 lines (a closure holding every route, a constructor doing five jobs) is
    more than a reader can hold at once: split it by concern."""
    lengths = {}
    for pkg in SHORT_FUNCTION_PACKAGES:
        lengths |= function_lengths(REPO / "src" / "k3jax" / pkg)
    assert any(k.endswith(" create_app") for k in lengths)                      # found them
    long = sorted(f"{k}: {n} lines" for k, n in lengths.items() if n > MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(long)

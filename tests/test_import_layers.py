"""The import layers of the package, drawn from the code itself: every module's imports (at module
top and inside functions) parsed with `ast`, folded into rooms (a subpackage or a top-level
module of `das_jax`). The rooms sit on floors (`FLOORS`, ground first); an import may only point
to the same or a lower floor, and no two rooms may import each other, even through others."""
from __future__ import annotations

import ast
import collections
import pathlib

import das_jax

PKG = pathlib.Path(das_jax.__file__).parent

# Ground floor first. A room imports only rooms on its own floor or below; rooms on one floor
# must not form a circle. `cli` is the top floor: nothing imports it; `bench` is imported by
# nothing but `cli`.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "_lazy", "arg_types", "json_values", "malloc", "registry"),
    ("models", "data", "parallel"),
    ("drafter", "engine"),
    ("speculation", "draft_head"),
    ("config",),
    ("rollout", "testing"),
    ("rl",),
    ("plan",),
    ("bench",),
    ("cli",),
)
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def _module_name(path: pathlib.Path, root: pathlib.Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _lazy_exports(init: pathlib.Path, root: pathlib.Path) -> dict[str, str]:
    """{name: module} of a package whose `__init__` declares its lazy surface as a literal
    `_EXPORTS = {name: submodule or "das_jax.module"}` (see `das_jax._lazy`; a value may be a
    module-level string constant); else {}."""
    package = _module_name(init, root)
    constants: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            constants[node.targets[0].id] = node.value.value
        elif node.targets[0].id == "_EXPORTS":
            out = {}
            for key, value in zip(node.value.keys, node.value.values):
                where = (constants[value.id] if isinstance(value, ast.Name)
                         else ast.literal_eval(value))
                out[ast.literal_eval(key)] = (where if where.startswith("das_jax.")
                                              else f"{package}.{where}")
            return out
    return {}


def import_edges(root: pathlib.Path = PKG) -> dict[str, set[tuple[str, int]]]:
    """{module: {(imported das_jax module, line)}} for every module under `root`, top-level and
    in-function imports alike (relative imports resolved). `from pkg import name` imports the
    module `pkg.name` when that is a module, the module that defines `name` when it is one of
    `pkg`'s lazy exports, else `pkg` itself."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(f, root) for f in files}
    lazy = {_module_name(f, root): _lazy_exports(f, root) for f in files
            if f.name == "__init__.py"}
    edges: dict[str, set[tuple[str, int]]] = collections.defaultdict(set)
    for f in files:
        me = _module_name(f, root)
        package = me if f.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        targets.append(f"{base}.{a.name}")
                    else:
                        targets.append(lazy.get(base, {}).get(a.name, base))
            for t in targets:
                if t.split(".")[0] == "das_jax" and t != "das_jax":
                    edges[me].add((t, node.lineno))
    return edges


def room_edges(edges) -> dict[tuple[str, str], list[str]]:
    """{(room, imported room): ["module:line -> target", ...]} between different rooms."""
    out: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for module, targets in edges.items():
        for target, line in sorted(targets):
            a, b = _room(module), _room(target)
            if a != b:
                out[(a, b)].append(f"{module}:{line} -> {target}")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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


def layer_violations(edges) -> list[str]:
    bad = []
    rooms = room_edges(edges)
    for (a, b), where in sorted(rooms.items()):
        if a not in FLOOR or b not in FLOOR:
            bad.append(f"room {a if a not in FLOOR else b} has no floor in FLOORS: {where[0]}")
        elif FLOOR[b] > FLOOR[a]:
            bad += [f"arrow back up ({a} on floor {FLOOR[a]} -> {b} on floor {FLOOR[b]}): {w}"
                    for w in where]
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in rooms:
        graph[a].add(b)
    bad += [f"import circle between rooms {' <-> '.join(c)}" for c in circles(graph)]
    return bad


def module_circles(edges) -> list[str]:
    """Every circle between modules (A imports B and B imports A, directly or through others;
    top-level and in-function imports alike), as "a <-> b <-> ...", modules sorted."""
    graph = {module: {target for target, _ in targets} for module, targets in edges.items()}
    return [" <-> ".join(c) for c in circles(graph)]


# Circles being opened elsewhere right now; each entry names its modules. Remove an entry once its
# circle is gone (the test below fails on a stale entry).
KNOWN_MODULE_CIRCLES: set[str] = set()


def test_rooms_import_only_their_floor_and_below_and_form_no_circle():
    edges = import_edges()
    assert len(edges) > 50
    # Every room of the package has a floor.
    rooms = {_room(_module_name(f)) for f in PKG.rglob("*.py")} - {"das_jax"}
    assert rooms <= set(FLOOR), sorted(rooms - set(FLOOR))
    assert layer_violations(edges) == []


def test_modules_form_no_circle():
    found = set(module_circles(import_edges()))
    assert sorted(found - KNOWN_MODULE_CIRCLES) == []
    assert sorted(KNOWN_MODULE_CIRCLES - found) == [], "a known circle is gone: drop its entry"


def test_named_boundaries():
    rooms = room_edges(import_edges())
    importers = collections.defaultdict(set)
    for a, b in rooms:
        importers[b].add(a)
    assert not importers["cli"]                             # nothing imports a command
    assert importers["bench"] <= {"cli"}                    # bench is outside the library
    for low in ("config", "rollout", "rl", "speculation"):  # the engine stays below them
        assert ("engine", low) not in rooms, rooms.get(("engine", low))
    assert ("config", "rl") not in rooms and ("config", "rollout") not in rooms
    assert ("parallel", "config") not in rooms


def test_the_check_catches_an_arrow_up_and_a_circle(tmp_path):
    pkg = tmp_path / "das_jax"
    for rel, text in {"__init__.py": "",
                      "engine/__init__.py": "",
                      "engine/step.py": "def f():\n    from das_jax.rl import trainer\n",
                      "rl/__init__.py": "",
                      "rl/trainer.py": "from das_jax.engine import step\n",
                      "models/__init__.py": "from ..data import x\n",
                      "data/__init__.py": "",
                      "data/x.py": "import das_jax.models\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    found = layer_violations(import_edges(pkg))
    assert any("arrow back up (engine" in f and "das_jax.engine.step:2" in f for f in found)
    assert "import circle between rooms engine <-> rl" in found
    assert "import circle between rooms data <-> models" in found


def test_the_check_catches_a_module_circle_inside_a_room(tmp_path):
    pkg = tmp_path / "das_jax"
    for rel, text in {"__init__.py": "",
                      "models/__init__.py": "from das_jax._lazy import lazy_exports\n"
                                            "_EXPORTS = {'Tok': 'tok'}\n",
                      "models/tok.py": "def f():\n    from .load import read\n",
                      "models/load.py": "import numpy\nfrom . import gguf as g\n",
                      "models/gguf.py": "from das_jax.models import Tok\n",
                      # Not a circle: `from . import sibling` does not import the package itself.
                      "drafter/__init__.py": "from .ngram import Ngram\n",
                      "drafter/ngram.py": "from . import kernels\n",
                      "drafter/kernels.py": ""}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    edges = import_edges(pkg)
    assert ("das_jax.models.tok", 1) in edges["das_jax.models.gguf"]      # through the lazy surface
    assert module_circles(edges) == [
        "das_jax.models.gguf <-> das_jax.models.load <-> das_jax.models.tok"]
    assert layer_violations(edges) == []                  # one room: the room check cannot see it


def test_no_lazy_export_is_named_like_a_submodule():
    # Importing submodule `pkg.x` sets the attribute `pkg.x` to the module, so a lazy export
    # named `x` would then import as the module instead of the function or class.
    files = sorted(PKG.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    clashes = [f"{_module_name(f)}.{name}" for f in files if f.name == "__init__.py"
               for name in _lazy_exports(f, PKG) if f"{_module_name(f)}.{name}" in modules]
    assert clashes == []


# Third-party packages heavy enough to defer: an import written inside a function may only
# defer one of these (or a das_jax module that loads one) that its module does not load already.
HEAVY = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "torch", "transformers",
                   "matplotlib", "tensorboardX", "scipy", "numba", "gguf", "tokenizers",
                   "safetensors", "math_verify", "tqdm", "accelerate"})


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported (module body, and
    inside its top-level `if` / `try` blocks)."""
    out = set()
    for node in tree.body:
        for n in (ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.add(id(n))
    return out


def deferred_imports(root: pathlib.Path = PKG) -> list[str]:
    """`file:line: text` of every import of a das_jax module written inside a function that
    loads no heavy package (`HEAVY`) its module does not load at import time already: such an
    import defers nothing and belongs at the top of the module."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(f, root): f for f in files}
    lazy = {_module_name(f, root): _lazy_exports(f, root) for f in files
            if f.name == "__init__.py"}
    top_mods, top_third, inner = collections.defaultdict(set), collections.defaultdict(set), []
    for me, f in modules.items():
        src = f.read_text()
        tree = ast.parse(src, str(f))
        top = _top_level_nodes(tree)
        package = me if f.name == "__init__.py" else me.rpartition(".")[0]
        parts = me.split(".")
        top_mods[me] |= {".".join(parts[:i]) for i in range(1, len(parts))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            mods, third = set(), set()
            if isinstance(node, ast.Import):
                for a in node.names:
                    (mods.add(a.name) if a.name.startswith("das_jax") else
                     third.add(a.name.split(".")[0]))
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith("das_jax"):
                    third.add(base.split(".")[0])
                else:
                    mods.add(base)
                    for a in node.names:
                        if f"{base}.{a.name}" in modules:
                            mods.add(f"{base}.{a.name}")
                        elif a.name in lazy.get(base, {}):
                            mods.add(lazy[base][a.name])
            if id(node) in top:
                top_mods[me] |= mods
                top_third[me] |= third
            elif mods:
                inner.append((me, f, node, mods, third, ast.get_source_segment(src, node)))

    def heavy(module: str) -> set[str]:
        seen, todo, out = set(), [module], set()
        while todo:
            m = todo.pop()
            if m in seen or m not in modules:
                continue
            seen.add(m)
            out |= top_third[m] & HEAVY
            todo.extend(top_mods[m])
        return out

    bad = []
    for me, f, node, mods, third, text in inner:
        adds = set(third) & HEAVY
        for t in mods:
            adds |= heavy(t)
        if not adds - heavy(me):
            bad.append(f"{f.relative_to(root.parent)}:{node.lineno}: {text}")
    return bad


def test_imports_inside_functions_defer_a_heavy_dependency():
    assert deferred_imports() == []


def test_the_check_catches_an_import_inside_a_function_that_defers_nothing(tmp_path):
    pkg = tmp_path / "das_jax"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "light.py").write_text("import os\n")
    (pkg / "a" / "heavy.py").write_text("import jax\n")
    (pkg / "a" / "user.py").write_text(
        "def f():\n    from das_jax.a import light\n\n"
        "def g():\n    from das_jax.a import heavy\n")
    (pkg / "a" / "loaded.py").write_text(
        "import jax\n\ndef f():\n    from das_jax.a import heavy\n")
    assert sorted(deferred_imports(pkg)) == ["das_jax/a/loaded.py:4: from das_jax.a import heavy",
                                             "das_jax/a/user.py:2: from das_jax.a import light"]

"""Imports inside functions only where they defer something, each saying what: an `import` written
inside a function (or a method, or a class inside one) carries a comment `deferred import: <what>`
(or `deferred: <what>`), on its own lines or above it in the same block of imports, e.g.

    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.engine import Programs

A block is the run of import statements directly above, with blank lines and comment lines between
them; any other statement (or `try:`, a docstring, ...) ends it. Whether the import really defers
a heavy package is checked for das_jax targets by `test_import_layers.deferred_imports`."""
from __future__ import annotations

import ast
import pathlib
import re

import das_jax

PKG = pathlib.Path(das_jax.__file__).parent

# "deferred import: jax (...)" / "deferred: a subprocess-only path": the word, a colon, the what.
DEFERRED = re.compile(r"\bdeferred\b(?: imports?)?\s*:\s*\S")


def _in_function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out = []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return out


def undeclared_imports(src: str, name: str = "<string>") -> list[int]:
    """Line numbers of the in-function imports of `src` that no `deferred` comment covers."""
    tree = ast.parse(src, name)
    lines = src.splitlines()
    # Import statements by their last line: the block above an import steps over whole imports.
    ends = {n.end_lineno: n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}

    def says(first: int, last: int) -> bool:
        # An import statement holds no string literal, so its `#` starts a comment.
        return any(DEFERRED.search(lines[ln - 1].partition("#")[2])
                   for ln in range(first, last + 1))

    bad = []
    for node in _in_function_imports(tree):
        ok, ln = says(node.lineno, node.end_lineno), node.lineno - 1
        while not ok and ln >= 1:
            text = lines[ln - 1].strip()
            if not text or text.startswith("#"):
                ok, ln = says(ln, ln), ln - 1
            elif ln in ends and ends[ln].col_offset == node.col_offset:
                ok, ln = says(ends[ln].lineno, ln), ends[ln].lineno - 1
            else:
                break
        if not ok:
            bad.append(node.lineno)
    return bad


def test_imports_inside_functions_say_what_they_defer():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 50
    bad = [f"{f.relative_to(PKG.parent)}:{line}" for f in files
           for line in undeclared_imports(f.read_text(), str(f))]
    assert bad == [], ("imports inside functions without a `# deferred import: <what>` comment "
                       "(move them to the module top, or say what they defer):\n"
                       + "\n".join(bad))


def test_the_check_catches_an_undeclared_import():
    src = '''\
import os


def f():
    """Doc."""
    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.engine import Programs   # same block: covered by the comment above
    return jax, Programs


def g():
    x = 1
    import hashlib  # a hash
    return x, hashlib


def h():
    try:
        from math_verify import parse  # noqa: PLC0415  deferred import: math_verify
    except ImportError:
        return None
    import json
    return parse, json


class C:
    def m(self):
        import tempfile  # deferred  (says no what)
        return tempfile
'''
    assert undeclared_imports(src) == [15, 24, 30]

"""Generate the module table of docs/index.md from the code: each unit's layer and the cp_packing modules it imports.

    python scripts/gen_module_table.py           # print the table
    python scripts/gen_module_table.py --write   # rewrite the table between the markers of docs/index.md
    python scripts/gen_module_table.py --check   # exit 1 if the table is stale (the test suite runs this)

Every module of ``cp_packing/`` is parsed with ``ast`` (nothing is imported). A *unit* is a top-level module
(``loss.py``) or a subpackage (``attention/``); its imports are the cp_packing modules that its modules import
outside the unit, at module level (``if TYPE_CHECKING:`` blocks excluded) and, in another column, only inside
functions. Rows follow :data:`LAYERS`, bottom to top; an import of a higher layer is marked **(up)**. The
"what lives there" cells are kept as written in docs/index.md (a new unit starts with its docstring's first
sentence). ``tests/test_docs.py`` checks the table and that the layering is one-way.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from functools import cache

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
PACKAGE = "cp_packing"
INDEX = os.path.join(ROOT, "docs", "index.md")
BEGIN = "<!-- module-table:begin (generated: python scripts/gen_module_table.py --write) -->"
END = "<!-- module-table:end -->"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("_checks", "_imports"),
    ("groups",),
    ("agreement",),
    ("formats",),
    ("packed_seq",),
    ("padding",),
    ("labels",),
    ("layouts",),
    ("cost",),
    ("sharding", "adapters"),
    ("options", "capabilities", "model_features"),
    ("attention",),
    ("loss",),
    ("packing", "loader"),
    ("distributed", "gradients"),
    ("hf", "trainer"),
    ("report",),
    ("testing",),
    ("tools",),
    ("__init__",),
    ("__main__",),  # `python -m cp_packing` imports the package first (its early SIGTERM list: STARTUP_SIGTERMS)
)
"""The units, bottom to top (DESIGN.md section 6): a unit may import its own layer and those below it."""


@cache
def modules() -> dict[str, str]:
    """Every module of the package: dotted name -> path (``cp_packing.attention`` for its ``__init__.py``)."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(folder, name)
    return dict(sorted(out.items()))


def _targets(node: ast.AST) -> list[str]:
    """The cp_packing modules an import statement names (``from a import b``: ``a.b`` when it is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
        return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules() else node.module
                for a in node.names]
    return []


@cache
def imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """``(module level, only inside functions)``: the cp_packing modules ``module`` imports (itself excluded)."""
    top: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            (lazy if in_function else top).update(_targets(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    with open(modules()[module]) as f:
        visit(ast.parse(f.read()), False)
    return frozenset(top - {module}), frozenset(lazy - top - {module})


def unit_of(module: str) -> str:
    """``cp_packing.attention.plan`` -> ``attention``; ``cp_packing`` -> ``__init__``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def layer_of(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(f"unit {unit!r} has no layer: add it to LAYERS in scripts/gen_module_table.py")


def short(module: str) -> str:
    return module[len(PACKAGE) + 1:] or "__init__"


def edges(kind: str = "module") -> list[tuple[str, str]]:
    """``(importer, imported)`` module pairs; ``kind``: ``"module"`` (module level) or ``"function"``."""
    return [(m, t) for m in modules() for t in sorted(imports(m)[0 if kind == "module" else 1])]


def upward(kind: str = "module") -> list[tuple[str, str]]:
    """The imports that go up the layers (the importer's layer below the imported's)."""
    return [(m, t) for m, t in edges(kind) if layer_of(unit_of(m)) < layer_of(unit_of(t))]


def cycles() -> list[list[str]]:
    """The import cycles at module level (strongly connected components of more than one module)."""
    graph = {m: sorted(imports(m)[0]) for m in modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return found


def loaded_by(module: str) -> frozenset[str]:
    """The cp_packing modules that ``import module`` loads in a fresh interpreter: the module, its parent packages
    and, transitively, what each imports at module level."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in modules():
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(imports(m)[0])
    return frozenset(seen)


# ------------------------------------------------------------------------------------------------------ the table


def _key(unit: str) -> str:
    if unit == "__init__" or unit == "__main__":
        return f"`{unit}.py`"
    return f"`{unit}/`" if f"{PACKAGE}.{unit}" in modules() and modules()[f"{PACKAGE}.{unit}"].endswith(
        "__init__.py") else f"`{unit}.py`"


def _units() -> list[str]:
    found = {unit_of(m) for m in modules()}
    for unit in found:
        layer_of(unit)  # every unit has a layer
    return [u for units in LAYERS for u in units if u in found]


def _first_sentence(unit: str) -> str:
    module = PACKAGE if unit == "__init__" else f"{PACKAGE}.{unit}"
    with open(modules()[module]) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")


def _imports_cell(unit: str, kind: int) -> str:
    here = layer_of(unit)
    names = sorted({t for m in modules() if unit_of(m) == unit for t in imports(m)[kind] if unit_of(t) != unit})
    if kind == 1:  # a module some other module of the unit imports at module level is not "only in functions"
        top = {t for m in modules() if unit_of(m) == unit for t in imports(m)[0]}
        names = [t for t in names if t not in top]
    cells = [f"`{short(t)}`" + (" **(up)**" if layer_of(unit_of(t)) > here else "") for t in names]
    return ", ".join(cells) or "nothing"


def _descriptions(text: str) -> dict[str, str]:
    """The "what lives there" cells of the table in ``text``, by module cell."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 5 and cells[1].startswith("`"):
            out[cells[1]] = cells[2]
    return out


def render(current: str) -> str:
    """The table (markers included); descriptions from ``current`` (docs/index.md's text)."""
    described = _descriptions(current)
    header = "| layer | module | what lives there | imports (module level) | imports inside functions only |"
    lines = [BEGIN, "", header, "|---|---|---|---|---|"]
    for unit in _units():
        key = _key(unit)
        lines.append(f"| {layer_of(unit)} | {key} | {described.get(key) or _first_sentence(unit)} | "
                     f"{_imports_cell(unit, 0)} | {_imports_cell(unit, 1)} |")
    return "\n".join(lines + ["", END])


def updated(text: str) -> str:
    """docs/index.md's text with the table regenerated."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/index.md has no table markers ({BEGIN} ... {END})")
    return pattern.sub(lambda _: render(text), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with open(INDEX) as f:
        text = f.read()
    new = updated(text)
    if args.write:
        if new != text:
            with open(INDEX, "w") as f:
                f.write(new)
        return 0
    if args.check:
        if new != text:
            print("docs/index.md's module table is stale: run python scripts/gen_module_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    print(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())

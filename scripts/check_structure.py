#!/usr/bin/env python3
"""Structure guard for tp_ext (issue 56, item 5; docs/design.md "Guard in make test").

Three rules, each read from the source with ``ast`` (nothing is imported):

1. size: in the upper floors (``UPPER_FLOORS``) no file over 600 lines (``source.count("\\n")``)
   and no function over 80 lines (``end_lineno - lineno + 1``, from the ``def`` line: decorators
   are not counted; methods and nested functions included).
2. probing: nowhere in tp_ext/ a ``getattr`` / ``hasattr`` on the parallel state: (a) its first
   argument a name or attribute ending in one of ``STATE_NAMES`` (or a call of
   ``parallel_state()``), (b) its second argument a string naming a field or property of
   ``ParallelState`` (tp_ext/distributed/mesh.py) or ``ParallelDims`` (tp_ext/dims.py), both
   lists read from those files; and in the upper floors (c) a class recognised by its name:
   ``type(x).__name__`` (or ``x.__class__.__name__``, ``__qualname__``) compared, tested with
   ``in`` or ``.startswith`` / ``.endswith``. tp_ext/parallelize/ is exempt from (c) alone: its
   job is recognising transformers' own classes (GPT-2's Conv1D, every architecture's RMSNorm
   class) without importing transformers; tp_ext's own classes declare what they are.
3. cycles: no import cycle among tp_ext's modules. Every Import / ImportFrom counts, function
   level included; those under ``if TYPE_CHECKING:`` do not. An edge goes to the module a
   statement names: ``import tp_ext.a.b`` -> tp_ext.a.b; ``from tp_ext.a import b`` ->
   tp_ext.a.b when that is a module, else tp_ext.a (a name its ``__init__`` defines). The
   packages an import runs on the way (tp_ext/__init__.py, tp_ext/a/__init__.py) are not edges,
   or every re-exporting ``__init__`` would make a cycle. Each strongly connected component of
   more than one module is reported with one cycle through it.

Prints one line per violation under a heading per rule and a summary line; exits 1 when there
is a violation, 0 when there is none, 2 when the tree cannot be checked (no tp_ext/ under the
root). ``--root DIR`` checks another tree (default: the repository this script lives in).
"""

import ast
import os
import sys
from pathlib import Path

PACKAGE = "tp_ext"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# the upper floors: packages (every .py under them) and single modules, relative to tp_ext/
UPPER_FLOOR_PACKAGES = (
    "cli",
    "training",
    "planner",
    "parallelize",
    "models",
    "generation",
    "pipeline",
    "checkpoint",
    "serving",
)
UPPER_FLOOR_FILES = ("config.py", "dims.py")
# where recognising a (transformers) class by its name is the mechanism: rule 2 (c) does not apply
FOREIGN_CLASS_READERS = ("parallelize",)
# a getattr / hasattr whose first argument ends in one of these probes the parallel state
STATE_NAMES = frozenset({"parallel", "state", "parallel_state", "dims"})
STATE_CALLS = frozenset({"parallel_state"})  # getattr(parallel_state(), ...)
# where the parallel state's attributes are read from: (file under tp_ext/, class)
STATE_CLASSES = (("distributed/mesh.py", "ParallelState"), ("dims.py", "ParallelDims"))
PROBES = frozenset({"getattr", "hasattr"})
NAME_ATTRS = frozenset({"__name__", "__qualname__"})
NAME_TESTS = frozenset({"startswith", "endswith"})
STR_WRAPPERS = frozenset({"lower", "upper", "casefold", "strip"})

RULES = (
    ("size", "rule 1: size in the upper floors (files <= 600 lines, functions <= 80 lines)"),
    ("probing", "rule 2: no probing of the parallel state (getattr / hasattr, class names)"),
    ("cycles", "rule 3: no import cycles among tp_ext's modules"),
)


class Source:
    """One parsed .py file under tp_ext/."""

    def __init__(self, root: Path, path: Path):
        self.path = path
        self.rel = path.relative_to(root).as_posix()
        parts = list(path.relative_to(root).with_suffix("").parts)
        self.is_package = parts[-1] == "__init__"
        if self.is_package:
            parts.pop()
        self.module = ".".join(parts)
        self.text = path.read_text(encoding="utf-8")
        self.error = None
        try:
            self.tree = ast.parse(self.text, filename=self.rel)
        except SyntaxError as e:
            self.tree = None
            self.error = f"{self.rel}:{e.lineno}: does not parse: {e.msg}"

    def segment(self, node: ast.AST) -> str:
        text = ast.get_source_segment(self.text, node) or ast.unparse(node)
        return " ".join(text.split())


def find_sources(root: Path) -> list[Source]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root / PACKAGE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                out.append(Source(root, Path(dirpath) / name))
    return out


def is_upper_floor(src: Source) -> bool:
    parts = src.rel.split("/")[1:]  # below tp_ext/
    if len(parts) == 1:
        return parts[0] in UPPER_FLOOR_FILES
    return parts[0] in UPPER_FLOOR_PACKAGES


# ---- rule 1: size ---------------------------------------------------------------------------


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every def / async def, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def check_size(src: Source) -> list[tuple[int, str]]:
    out = []
    lines = src.text.count("\n")
    if lines > MAX_FILE_LINES:
        out.append((0, f"{src.rel}: file of {lines} lines (limit {MAX_FILE_LINES})"))
    for name, node in functions(src.tree):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            out.append(
                (
                    node.lineno,
                    f"{src.rel}:{node.lineno}: function {name} of {length} lines"
                    f" (limit {MAX_FUNCTION_LINES})",
                )
            )
    return out


# ---- rule 2: probing ------------------------------------------------------------------------


def is_property(node: ast.AST) -> bool:
    for dec in node.decorator_list:
        name = dec.attr if isinstance(dec, ast.Attribute) else getattr(dec, "id", None)
        if name in ("property", "cached_property"):
            return True
    return False


def class_attributes(tree: ast.AST, class_name: str) -> set[str] | None:
    """The annotated fields and properties of the top-level class ``class_name``, or None."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            names = set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_property(
                    item
                ):
                    names.add(item.name)
            return names
    return None


def state_attributes(by_rel: dict[str, Source]) -> tuple[set[str], list[str]]:
    """The names of the parallel state's attributes, and the problems finding them."""
    names, problems = set(), []
    for rel, class_name in STATE_CLASSES:
        path = f"{PACKAGE}/{rel}"
        src = by_rel.get(path)
        found = class_attributes(src.tree, class_name) if src and src.tree else None
        if found is None:
            problems.append(f"{path}: class {class_name} not found (its attributes are unchecked)")
        else:
            names |= found
    return names, problems


def final_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def probe_reasons(call: ast.Call, attributes: set[str]) -> list[str]:
    reasons = []
    target = call.args[0]
    if final_name(target) in STATE_NAMES:
        reasons.append(f"on the parallel state ({final_name(target)})")
    elif isinstance(target, ast.Call) and final_name(target.func) in STATE_CALLS:
        reasons.append(f"on the parallel state ({final_name(target.func)}())")
    if len(call.args) > 1:
        attr = call.args[1]
        if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
            if attr.value in attributes:
                reasons.append(f"names a parallel-state attribute ({attr.value!r})")
    return reasons


def is_type_name(node: ast.AST) -> bool:
    """``type(x).__name__`` or ``x.__class__.__name__`` (``__qualname__``), maybe ``.lower()``."""
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in STR_WRAPPERS
    ):
        node = node.func.value
    if not (isinstance(node, ast.Attribute) and node.attr in NAME_ATTRS):
        return False
    owner = node.value
    if isinstance(owner, ast.Attribute) and owner.attr == "__class__":
        return True
    return (
        isinstance(owner, ast.Call)
        and isinstance(owner.func, ast.Name)
        and owner.func.id == "type"
        and len(owner.args) == 1
    )


def check_probing(src: Source, attributes: set[str], upper: bool) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(src.tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in PROBES
            and node.args
        ):
            reasons = probe_reasons(node, attributes)
            if reasons:
                why = f"{node.func.id} " + "; ".join(reasons)
                out.append((node.lineno, f"{src.rel}:{node.lineno}: {why}: {src.segment(node)}"))
        if not upper:
            continue
        if isinstance(node, ast.Compare) and any(
            is_type_name(x) for x in [node.left, *node.comparators]
        ):
            why = "class recognised by its name"
            out.append((node.lineno, f"{src.rel}:{node.lineno}: {why}: {src.segment(node)}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in NAME_TESTS
            and is_type_name(node.func.value)
        ):
            why = "class recognised by its name"
            out.append((node.lineno, f"{src.rel}:{node.lineno}: {why}: {src.segment(node)}"))
    return sorted(out)


# ---- rule 3: cycles -------------------------------------------------------------------------


def is_type_checking(test: ast.AST) -> bool:
    return final_name(test) == "TYPE_CHECKING"


def imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch runs
        else:
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(src: Source, node: ast.AST, modules: set[str]) -> list[str]:
    """The tp_ext modules one import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.level:
        package = src.module if src.is_package else src.module.rpartition(".")[0]
        parts = package.split(".")
        if node.level - 1 >= len(parts):
            return []
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        name = f"{base}.{node.module}" if node.module else base
    else:
        name = node.module
    out = []
    for alias in node.names:
        sub = f"{name}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif name in modules:
            out.append(name)
    return out


def import_graph(sources: list[Source]) -> dict[str, dict[str, str]]:
    """module -> {imported module: where the first such import is (file:line)}."""
    modules = {s.module for s in sources}
    graph = {s.module: {} for s in sources}
    for src in sources:
        if src.tree is None:
            continue
        for node in sorted(imports(src.tree), key=lambda n: n.lineno):
            for target in imported_modules(src, node, modules):
                if target != src.module:
                    graph[src.module].setdefault(target, f"{src.rel}:{node.lineno}")
    return graph


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def example_cycle(graph: dict[str, dict[str, str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    members = set(component)
    start = component[0]
    previous = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in previous:
                previous[child] = node
                queue.append(child)
    return [start]  # not reached for a strongly connected component


def check_cycles(sources: list[Source]) -> list[str]:
    graph = import_graph(sources)
    out = []
    for component in strongly_connected(graph):
        cycle = example_cycle(graph, component)
        where = ", ".join(graph[a][b] for a, b in zip(cycle, cycle[1:]))
        out.append(
            f"cycle of {len(component)} modules: {', '.join(component)};"
            f" e.g. {' -> '.join(cycle)} (imports at {where})"
        )
    return out


# ---- the report -----------------------------------------------------------------------------


def check(root: Path) -> dict[str, list[str]]:
    sources = find_sources(root)
    by_rel = {s.rel: s for s in sources}
    found = {key: [] for key, _ in RULES}
    parsed = [s for s in sources if s.tree is not None]
    for src in sources:
        if src.error:
            found["size"].append(src.error)
    attributes, problems = state_attributes(by_rel)
    found["probing"].extend(problems)
    for src in parsed:
        upper = is_upper_floor(src)
        if upper:
            found["size"].extend(line for _, line in check_size(src))
        names = upper and src.rel.split("/")[1] not in FOREIGN_CLASS_READERS
        found["probing"].extend(line for _, line in check_probing(src, attributes, names))
    found["cycles"] = check_cycles(parsed)
    return found


USAGE = "usage: check_structure.py [--root DIR]"


def parse_root(argv: list[str]) -> Path | None:
    """The tree to check: ``--root DIR`` / ``--root=DIR``, else this script's repository."""
    root = Path(__file__).resolve().parent.parent
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--root" and rest:
            root = Path(rest.pop(0))
        elif arg.startswith("--root="):
            root = Path(arg.partition("=")[2])
        else:
            return None
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        print(__doc__)
        return 0
    root = parse_root(argv)
    if root is None:
        print(USAGE, file=sys.stderr)
        return 2
    if not (root / PACKAGE).is_dir():
        print(f"check_structure: no {PACKAGE}/ under {root}", file=sys.stderr)
        return 2
    found = check(root)
    for key, heading in RULES:
        print(f"== {heading} ==")
        for line in found[key]:
            print(line)
        if not found[key]:
            print("none")
    total = sum(len(v) for v in found.values())
    counts = ", ".join(f"{key} {len(found[key])}" for key, _ in RULES)
    verdict = "FAILED" if total else "passed"
    print(f"check_structure: {verdict}: {total} violations ({counts})")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())

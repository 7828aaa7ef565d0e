"""scripts/check_structure.py, the structure guard: run on small fixture trees (``--root``) with
known violations, on a clean tree, and on this repository."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_structure.py"
HEADINGS = (
    "== rule 1: size in the upper floors (files <= 600 lines, functions <= 80 lines) ==",
    "== rule 2: no probing of the parallel state (getattr / hasattr, class names) ==",
    "== rule 3: no import cycles among tp_ext's modules ==",
)

MESH = """
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ParallelState:
    rank: int
    tp_grid: Optional[object] = None

    @property
    def tp_rank(self) -> int:
        return 0
"""

DIMS = """
import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    cp: int = 1

    @property
    def tp_size(self) -> int:
        return self.tp
"""


def function(name: str, lines: int, indent: str = "", decorator: str = "") -> str:
    """A def of exactly ``lines`` lines (the def line included, decorators not)."""
    body = [f"{indent}    x = 0"] * (lines - 2) + [f"{indent}    return x"]
    head = [f"{indent}@{decorator}"] if decorator else []
    return "\n".join([*head, f"{indent}def {name}():", *body]) + "\n"


def write(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def base_tree() -> dict:
    return {
        "tp_ext/__init__.py": "",
        "tp_ext/dims.py": DIMS,
        "tp_ext/distributed/__init__.py": "from tp_ext.distributed.mesh import ParallelState\n",
        # a name from the package's own __init__ would be an edge to it; a submodule is not
        "tp_ext/distributed/mesh.py": "from tp_ext.distributed import groups\n" + MESH,
        "tp_ext/distributed/groups.py": "X = 1\n",
    }


def run_guard(root=None):
    args = [sys.executable, str(SCRIPT)] + (["--root", str(root)] if root else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout.splitlines()


def violations(lines: list) -> dict:
    """The lines under each heading, headings and 'none' left out, and the summary."""
    out, current = {h: [] for h in HEADINGS}, None
    for line in lines[:-1]:
        if line in HEADINGS:
            current = line
        elif line != "none":
            out[current].append(line)
    return out


def test_fixture_violations(tmp_path):
    files = base_tree()
    files.update(
        {
            # 601 newlines: one over; 600 newlines: at the limit
            "tp_ext/cli/__init__.py": "",
            "tp_ext/cli/big.py": "x = 1\n" * 601,
            "tp_ext/cli/at_limit.py": "x = 1\n" * 600,
            "tp_ext/training/__init__.py": "",
            "tp_ext/training/funcs.py": function("long", 81)
            + function("exact", 80, decorator="staticmethod")
            + "\n\nclass Trainer:\n"
            + function("step", 81, indent="    ")
            + "\n\ndef outer():\n"
            + function("inner", 81, indent="    ")
            + "    return inner\n",
            # below the upper floors the size rule and the class-name test do not apply
            "tp_ext/layers/__init__.py": "",
            "tp_ext/layers/big.py": "x = 1\n" * 700 + function("long", 90),
            "tp_ext/layers/names.py": textwrap.dedent(
                """
                def f(m, self):
                    a = type(m).__name__ == "Linear2D"
                    return a, getattr(self.parallel, "anything")
                """
            ),
            "tp_ext/models/__init__.py": "",
            "tp_ext/models/probe.py": textwrap.dedent(
                """
                def build(model, parallel, m):
                    cp = getattr(parallel, "cp", 1)
                    if hasattr(model, "tp_grid"):
                        pass
                    two_d = type(m).__name__.endswith("2D")
                    ok = getattr(model, "config", None)  # not the parallel state's
                    return cp, two_d, ok, isinstance(m, int)
                """
            ),
            # a cycle through a function-level import (from-import of a submodule, relative)
            "tp_ext/pipeline/__init__.py": "",
            "tp_ext/pipeline/a.py": "from . import b\n\nX = 1\n",
            "tp_ext/pipeline/b.py": (
                "def f():\n    from tp_ext.pipeline.a import X\n\n    return X\n"
            ),
            # an import under TYPE_CHECKING does not count: no cycle c <-> d
            "tp_ext/generation/__init__.py": "",
            "tp_ext/generation/c.py": textwrap.dedent(
                """
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from tp_ext.generation.d import D
                """
            ),
            "tp_ext/generation/d.py": "import tp_ext.generation.c\n\nD = 1\n",
        }
    )
    code, lines = run_guard(write(tmp_path, files))
    assert code == 1, lines
    found = violations(lines)
    assert found[HEADINGS[0]] == [
        "tp_ext/cli/big.py: file of 601 lines (limit 600)",
        "tp_ext/training/funcs.py:1: function long of 81 lines (limit 80)",
        "tp_ext/training/funcs.py:166: function Trainer.step of 81 lines (limit 80)",
        # a nested function over 80 lines makes its outer one longer still: both reported
        "tp_ext/training/funcs.py:249: function outer of 83 lines (limit 80)",
        "tp_ext/training/funcs.py:250: function outer.inner of 81 lines (limit 80)",
    ]
    assert found[HEADINGS[1]] == [
        "tp_ext/layers/names.py:4: getattr on the parallel state (parallel):"
        ' getattr(self.parallel, "anything")',
        "tp_ext/models/probe.py:3: getattr on the parallel state (parallel);"
        " names a parallel-state attribute ('cp'): getattr(parallel, \"cp\", 1)",
        "tp_ext/models/probe.py:4: hasattr names a parallel-state attribute ('tp_grid'):"
        ' hasattr(model, "tp_grid")',
        'tp_ext/models/probe.py:6: class recognised by its name: type(m).__name__.endswith("2D")',
    ]
    assert found[HEADINGS[2]] == [
        "cycle of 2 modules: tp_ext.pipeline.a, tp_ext.pipeline.b;"
        " e.g. tp_ext.pipeline.a -> tp_ext.pipeline.b -> tp_ext.pipeline.a"
        " (imports at tp_ext/pipeline/a.py:1, tp_ext/pipeline/b.py:2)",
    ]
    assert lines[-1] == "check_structure: FAILED: 10 violations (size 5, probing 4, cycles 1)"


def test_larger_cycle_and_package_edges(tmp_path):
    files = base_tree()
    files.update(
        {
            # x -> y -> z -> x, and w outside it (w -> x only)
            "tp_ext/parallelize/__init__.py": "from tp_ext.parallelize.x import X\n",
            "tp_ext/parallelize/x.py": "import tp_ext.parallelize.y\n\nX = 1\n",
            "tp_ext/parallelize/y.py": "class C:\n    def m(self):\n"
            "        from .z import Z\n\n        return Z\n",
            "tp_ext/parallelize/z.py": "from tp_ext.parallelize import x\n\nZ = 1\n",
            "tp_ext/parallelize/w.py": "from tp_ext.parallelize.x import X\n",
            # a name the package's __init__ defines: an edge to the package itself
            "tp_ext/checkpoint/__init__.py": "from tp_ext.checkpoint.hf import save\n",
            "tp_ext/checkpoint/hf.py": "def save():\n    from tp_ext.checkpoint import NAME\n",
        }
    )
    code, lines = run_guard(write(tmp_path, files))
    assert code == 1, lines
    assert violations(lines)[HEADINGS[2]] == [
        "cycle of 2 modules: tp_ext.checkpoint, tp_ext.checkpoint.hf;"
        " e.g. tp_ext.checkpoint -> tp_ext.checkpoint.hf -> tp_ext.checkpoint"
        " (imports at tp_ext/checkpoint/__init__.py:1, tp_ext/checkpoint/hf.py:2)",
        "cycle of 3 modules: tp_ext.parallelize.x, tp_ext.parallelize.y, tp_ext.parallelize.z;"
        " e.g. tp_ext.parallelize.x -> tp_ext.parallelize.y -> tp_ext.parallelize.z"
        " -> tp_ext.parallelize.x (imports at tp_ext/parallelize/x.py:1,"
        " tp_ext/parallelize/y.py:3, tp_ext/parallelize/z.py:1)",
    ]
    assert lines[-1] == "check_structure: FAILED: 2 violations (size 0, probing 0, cycles 2)"


def test_missing_state_class_is_a_violation(tmp_path):
    files = base_tree()
    files["tp_ext/dims.py"] = "X = 1\n"
    code, lines = run_guard(write(tmp_path, files))
    assert code == 1, lines
    assert violations(lines)[HEADINGS[1]] == [
        "tp_ext/dims.py: class ParallelDims not found (its attributes are unchecked)"
    ]


def test_clean_fixture_passes(tmp_path):
    files = base_tree()
    files.update(
        {
            "tp_ext/cli/__init__.py": "",
            "tp_ext/cli/ok.py": function("exact", 80, decorator="staticmethod") + "x = 1\n" * 400,
            "tp_ext/models/__init__.py": "",
            "tp_ext/models/ok.py": textwrap.dedent(
                """
                from tp_ext.distributed import mesh


                def f(model, m):
                    name = type(m).__name__  # read, not compared
                    return getattr(model, "config", None), hasattr(m, "weight"), name, mesh
                """
            ),
        }
    )
    code, lines = run_guard(write(tmp_path, files))
    assert code == 0, lines
    assert lines == [
        HEADINGS[0],
        "none",
        HEADINGS[1],
        "none",
        HEADINGS[2],
        "none",
        "check_structure: passed: 0 violations (size 0, probing 0, cycles 0)",
    ]


def test_no_tree_is_an_error(tmp_path):
    code, lines = run_guard(tmp_path)
    assert code == 2


def test_real_repository_runs():
    code, lines = run_guard()  # default root: this repository
    assert code in (0, 1), lines
    for heading in HEADINGS:
        assert heading in lines
    assert lines[-1].startswith("check_structure: ")
    assert ("FAILED" in lines[-1]) == (code == 1)

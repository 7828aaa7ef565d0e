"""benchmarks/report.py: BENCHMARKS.md's tables rendered from benchmarks/results.csv (the newest
run of each command, one row per figure, targets met or not), and BENCHMARKS.md in sync with
the CSV."""

import csv
import os
import re
import subprocess
import sys

import pytest

from benchmarks import report
from benchmarks.common import COLUMNS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VM = "vm / AMD EPYC x2"
GPU_HOST = "vm / Intel(R) Xeon(R) Processor x4 of 16 + NVIDIA H200"
LARGE = "python benchmarks/bench_vs_transformers.py --shapes large --tp 2 --repeats 10"
BOTH = "python benchmarks/bench_vs_transformers.py --shapes large small --tp 2 --repeats 6"
QL = "qwen2-large-tp2"


# (day and time, commit, command, host, case, metric, value, baseline, ratio), in time order
RUNS = [
    # the oldest run of BOTH: its large figure is superseded by LARGE's newer run, its small ones
    # are the newest of their configurations
    ("27T10:00:00", "aaaaaaa", BOTH, VM, QL, "step_s", "0.6", "1", "0.6"),
    ("27T10:00:00", "aaaaaaa", BOTH, VM, "qwen2-small-tp2", "step_s", "0.035", "0.1", "0.35"),
    ("27T10:00:00", "aaaaaaa", BOTH, VM, "qwen2-small-tp2", "tp_ext_logits_rel_error", "7.81e-07"),
    # the same command and configuration on another host: kept beside the VM's
    ("28T02:53:00", "65c6b62", LARGE, GPU_HOST, QL, "step_s", "0.3", "0.25", "1.2"),
    # LARGE's first run: its "renamed" case is not in the newer run of the command, so it goes
    ("28T10:00:00", "bbbbbbb", LARGE, VM, QL, "step_s", "0.9", "1", "0.9"),
    ("28T10:00:00", "bbbbbbb", LARGE, VM, QL, "trainer_step_s", "0.85", "1", "0.85"),
    ("28T10:00:00", "bbbbbbb", LARGE, VM, "renamed-large-tp2", "step_s", "0.5", "1", "0.5"),
    # LARGE again, same commit a minute later: a new run (a configuration repeats)
    ("28T10:01:00", "bbbbbbb", LARGE, VM, QL, "step_s", "0.81", "1", "0.81"),
    ("28T10:01:00", "bbbbbbb", LARGE, VM, QL, "trainer_step_s", "0.79", "1", "0.79"),
    # LARGE's newest run
    ("28T22:31:25", "efcacbe", LARGE, VM, QL, "step_s", "0.541082", "0.70465", "0.767873"),
    ("28T22:31:25", "efcacbe", LARGE, VM, QL, "trainer_step_s", "0.52635", "0.70465", "0.746967"),
]


def _rows():
    for date, commit, command, machine, case, metric, value, *vs in RUNS:
        baseline, ratio = vs or ("", "")
        yield {
            "date": f"2026-11-{date}+00:00",
            "machine": machine,
            "torch": "2.13.0+cpu",
            "commit": commit,
            "benchmark": "vs_transformers",
            "case": case,
            "metric": metric,
            "value": value,
            "unit": "s" if vs else "",
            "baseline": baseline,
            "ratio": ratio,
            "command": command,
            "load": "2.00",
        }


EXPECTED = """\
Runs (the newest of each command):

- **A** `python benchmarks/bench_vs_transformers.py --shapes large --tp 2 --repeats 10`: \
2026-11-28 02:53 UTC, commit 65c6b62, vm / Intel(R) Xeon(R) Processor x4 of 16 + NVIDIA H200, \
torch 2.13.0+cpu, load average 2.00
- **B** `python benchmarks/bench_vs_transformers.py --shapes large --tp 2 --repeats 10`: \
2026-11-28 22:31 UTC, commit efcacbe, vm / AMD EPYC x2, torch 2.13.0+cpu, load average 2.00
- **C** `python benchmarks/bench_vs_transformers.py --shapes large small --tp 2 --repeats 6`: \
2026-11-27 10:00 UTC, commit aaaaaaa, vm / AMD EPYC x2, torch 2.13.0+cpu, load average 2.00

| configuration | metric | tp_ext | baseline | ratio | target | status | run | date | commit |
|---|---|---:|---:|---:|---|---|---|---|---|
| qwen2-large-tp2 | step_s | 0.3 s | 0.25 s | 1.2 | ratio <= 0.8 | not met | A \
| 2026-11-28 | 65c6b62 |
| qwen2-large-tp2 | step_s | 0.5411 s | 0.7046 s | 0.7679 | ratio <= 0.8 | met | B \
| 2026-11-28 | efcacbe |
| qwen2-large-tp2 | trainer_step_s | 0.5263 s | 0.7046 s | 0.747 | ratio <= 0.8 | met | B \
| 2026-11-28 | efcacbe |
| qwen2-small-tp2 | step_s | 0.035 s | 0.1 s | 0.35 | ratio <= 0.3 | not met | C \
| 2026-11-27 | aaaaaaa |
| qwen2-small-tp2 | tp_ext_logits_rel_error | 7.81e-07 |  |  |  |  | C | 2026-11-27 | aaaaaaa |"""


@pytest.fixture
def fixture_csv(tmp_path):
    path = tmp_path / "results.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(_rows())
    return str(path)


def test_the_fixture_has_the_real_header():
    with open(os.path.join(ROOT, "benchmarks", "results.csv"), newline="") as f:
        assert next(csv.reader(f)) == COLUMNS


def test_newest_run_of_each_command_one_row_per_figure(fixture_csv):
    blocks = report.render(fixture_csv)
    assert set(blocks) == {"bench_vs_transformers.py", "summary"}
    assert blocks["bench_vs_transformers.py"] == EXPECTED
    assert blocks["summary"].splitlines()[2] == (
        "| [`bench_vs_transformers.py`](#bench_vs_transformerspy) | 5 | 2 | 2 | 2026-11-28 |"
    )


def test_update_rewrites_only_between_the_markers_and_check_holds_them(fixture_csv, tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    prose = "# Benchmarks\n\nText that stays.\n\n"
    doc.write_text(
        prose
        + "<!-- results:begin summary -->\nold\n<!-- results:end summary -->\n\nMore text.\n\n"
        + "<!-- results:begin bench_vs_transformers.py -->\n| old | row |\n"
        + "<!-- results:end bench_vs_transformers.py -->\n"
        + "<!-- results:begin bench_gone.py -->\n<!-- results:end bench_gone.py -->\n"
    )
    args = ["--csv", fixture_csv]
    assert report.main(args + ["--check", str(doc)]) == 1
    assert report.main(args + ["--update", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(prose + "<!-- results:begin summary -->\n| script |")
    assert "\n\nMore text.\n\n" in text
    assert (
        f"<!-- results:begin bench_vs_transformers.py -->\n{EXPECTED}\n"
        "<!-- results:end bench_vs_transformers.py -->\n" in text
    )
    assert "<!-- results:begin bench_gone.py -->\nNo rows in benchmarks/results.csv.\n" in text
    assert report.main(args + ["--check", str(doc)]) == 0
    # a script of the CSV without a section of its own is an error, not a silent omission
    doc.write_text(prose)
    assert report.main(args + ["--check", str(doc)]) == 1


def test_targets():
    t = report.target_for("vs_transformers", "llama-large-tp2", "trainer_step_s")
    assert (t.text(), t.met({"ratio": "0.8"}), t.met({"ratio": "0.81"})) == (
        "ratio <= 0.8",
        True,
        False,
    )
    assert report.target_for("vs_transformers", "llama-large-tp2", "step_s_unknown") is None
    within = report.target_for(
        "planner_memory", "tp=2 pp=1 dp=1 8x1 seq", "peak bytes per rank (estimated vs measured)"
    )
    assert within.text() == "ratio within 1 ± 0.05"
    assert [within.met({"ratio": r}) for r in ("0.96", "1.04", "0.94", "")] == [
        True,
        True,
        False,
        None,
    ]
    for (benchmark, metric), targets in report.TARGETS.items():
        for pattern, target in targets:
            re.compile(pattern)
            assert target.op in ("<=", "<", ">=", "==", "within"), (benchmark, metric)


def test_benchmarks_md_is_what_the_csv_renders():
    out = subprocess.run(
        [sys.executable, "benchmarks/report.py", "--check", "BENCHMARKS.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "TP_EXT_RESULTS"},
    )
    assert out.returncode == 0, out.stderr


def test_benchmarks_md_has_no_figures_outside_the_tables():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    prose = report.MARKER.sub("", text)
    figures = re.findall(r"\S*\d\.\d+\S*|\S*\d ?%\S*|\b\d+(?:\.\d+)?x\b", prose)
    assert not figures, f"hand-typed figures outside the generated tables: {figures}"

"""BENCHMARKS.md's figure tables, rendered from benchmarks/results.csv.

The current figures: for each command of a script (on each kind of host), its newest run; where
several commands measured one configuration (benchmark, case, metric), the newest row of them.
One table row per figure, with the run that produced it (date, commit and, by its letter, the
exact command) and, where TARGETS has a target for it, whether the target is met.

    python benchmarks/report.py                         # print every block
    python benchmarks/report.py --update BENCHMARKS.md  # rewrite the blocks between the markers
    python benchmarks/report.py --check BENCHMARKS.md   # exit 1 if the file differs from the CSV

A block is the text between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->``,
NAME a script (``bench_kernels.py``) or ``summary``; nothing outside the markers is touched.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import RESULTS  # noqa: E402

MARKER = re.compile(r"<!-- results:begin (\S+) -->\n.*?<!-- results:end \1 -->", re.S)


@dataclass(frozen=True)
class Target:
    """``field`` (the CSV's ``ratio`` or ``value``) ``op`` ``bound``; op "within" means
    ``|field - 1| <= bound``."""

    op: str
    bound: float
    field: str = "ratio"

    def text(self) -> str:
        if self.op == "within":
            return f"{self.field} within 1 ± {self.bound:.3g}"
        return f"{self.field} {'=' if self.op == '==' else self.op} {self.bound:.3g}"

    def met(self, row: dict) -> bool | None:
        x = _float(row.get(self.field))
        if x is None:
            return None
        if self.op == "within":
            return abs(x - 1) <= self.bound + 1e-12
        if self.op == "==":
            return abs(x - self.bound) <= 1e-9 * max(1.0, abs(self.bound))
        return {"<=": x <= self.bound, "<": x < self.bound, ">=": x >= self.bound}[self.op]


ALL = r""  # every case
FASTER_1_3 = 1 / 1.3  # "1.3x faster"
# The targets, from the issues that asked for each benchmark: (benchmark, metric) -> the
# targets of its cases, the first whose regular expression matches the case (re.search).
TARGETS: dict[tuple[str, str], list[tuple[str, Target]]] = {
    # issue 5: RMSNorm and SwiGLU >= 2x faster than eager in a training step; the vocab-parallel
    # cross-entropy at most 0.25x of gathering the logits; tp_ext::linear faster than F.linear
    # in fp32, equal in bf16 (within 2%), no extra peak memory (within 1%)
    ("kernels", "fwd+bwd time"): [
        (r"^(rms_norm|swiglu) ", Target("<=", 0.5)),
        (r"^linear fp32", Target("<", 1.0)),
        (r"^linear bf16", Target("within", 0.02)),
    ],
    ("kernels", "fwd time"): [
        (r"^linear fp32", Target("<", 1.0)),
        (r"^linear bf16", Target("within", 0.02)),
    ],
    ("kernels", "fwd+bwd peak memory"): [
        (r"^cross_entropy", Target("<=", 0.25)),
        (r"^linear", Target("<=", 1.01)),
    ],
    # issue 5: the block at most 0.5x DTensor's step (small), 1.0x (large); Megatron's bytes
    ("block_vs_dtensor", "step time"): [
        (r"^small", Target("<=", 0.5)),
        (r"^large", Target("<=", 1.0)),
    ],
    ("block_vs_dtensor", "tp_ext bus bytes"): [(r"tp=\d+$", Target("==", 1.0))],
    # issue 14: a 3D step at most 0.8x torch-native 3D's, first-step losses within 1e-4
    ("3d_vs_torch_native", "step time"): [(ALL, Target("<=", 0.8))],
    ("3d_vs_torch_native", "first-step loss rel diff"): [(ALL, Target("<=", 1e-4, "value"))],
    # issue 16: SUMMA's bytes equal the analytic cost; less activation memory than 1D TP
    ("summa_linear", "bytes per rank (measured vs analytic)"): [(ALL, Target("==", 1.0))],
    ("summa_vs_1d", "activation bytes per rank"): [(ALL, Target("<", 1.0))],
    # issue 17: step times ranked alike (Spearman >= 0.8), peaks within 5%
    ("planner_step_time", "Spearman rank correlation (target >= 0.8)"): [
        (ALL, Target(">=", 0.8, "value"))
    ],
    ("planner_memory", "peak bytes per rank (estimated vs measured)"): [
        (ALL, Target("within", 0.05))
    ],
    # issue 18: final loss within 1% (int8) and 3% (1-bit) of uncompressed training
    ("compression_convergence", "final loss (mean of last 20 of 200 steps) vs fp32"): [
        (r"^int8", Target("<=", 1.01)),
        (r"^1bit", Target("<=", 1.03)),
    ],
    # issue 19: 1.3x faster with the overlap on a slow link; the TP MLP at most 0.7x (large)
    # and 0.3x (small) of DTensor TP's step
    ("overlap", "step s, overlapped vs unfused"): [(r"Mbit/s", Target("<=", FASTER_1_3))],
    ("overlap", "step s vs DTensor TP"): [
        (r"^MLP large", Target("<=", 0.7)),
        (r"^MLP small", Target("<=", 0.3)),
    ],
    # issue 22: the permutation ops at most 0.5x of eager, the layer 0.8x of torchtitan's EP
    ("moe", "fwd+bwd seconds"): [
        (r"^permute ops", Target("<=", 0.5)),
        (r"^MoE layer", Target("<=", 0.8)),
    ],
    # issue 35: at most 0.3x of transformers' native TP (small), 0.8x (large), 0.7x on a
    # 300 Mbit/s link
    ("vs_transformers", "step_s"): [
        (r"-300mbit$", Target("<=", 0.7)),
        (r"-small-tp\d+$", Target("<=", 0.3)),
        (r"-large-tp\d+(-overlap)?$", Target("<=", 0.8)),
    ],
    ("vs_transformers", "trainer_step_s"): [
        (r"-300mbit$", Target("<=", 0.7)),
        (r"-small-tp\d+$", Target("<=", 0.3)),
        (r"-large-tp\d+(-overlap)?$", Target("<=", 0.8)),
    ],
    # issue 36: cp=4 activations at most 0.3x of cp=1; ring overlap 1.3x faster on a slow link;
    # the bytes equal the analytic count
    ("context_parallel", "activation_bytes_per_rank"): [(r"-cp4-", Target("<=", 0.3))],
    ("context_parallel", "step_s_overlap_vs_not"): [(ALL, Target("<=", FASTER_1_3))],
    ("context_parallel", "bytes_sent_vs_analytic"): [(ALL, Target("==", 1.0))],
    ("context_parallel", "cp_bytes_all_ranks_vs_analytic"): [(ALL, Target("==", 1.0))],
    # issue 37: tokens per second >= 1.5x transformers' native TP; tokens equal the unsharded
    # model's
    ("generate", "tokens_per_s"): [(r"^tp\d+$", Target(">=", 1.5))],
    ("generate", "tp_ext_tokens_equal"): [(ALL, Target("==", 1.0, "value"))],
    ("generate", "tokens_equal"): [(ALL, Target("==", 1.0, "value"))],
    # issue 57: the serving engine >= 1.5x transformers' continuous batching's output tokens/s at
    # TP=2 on 2 cores (loopback), its p99 time to the first token no worse; TP=4 and the
    # throttled link are measured without a target
    ("serve", "output tokens/s"): [(r"^tp=2 rate=.* tp_ext$", Target(">=", 1.5))],
    ("serve", "ttft p99"): [(r"^tp=2 rate=.* tp_ext$", Target("<=", 1.0))],
    # issue 38: ZeRO's optimizer state 1/dp of DDP's; the bf16 sum's loss within 0.5% of fp32's
    ("zero", "optimizer_state_bytes_rank0"): [(r"^zero", Target("==", 0.5))],
    ("zero_bf16_gradient_sum", "final loss (mean of last 20 of 200 steps) vs fp32"): [
        (r"^bf16 .*mean of \d+ seeds$", Target("within", 0.005))
    ],
    # the GPU kernels: >= 0.85 of a device copy's bandwidth, never slower than torch.compile;
    # the layer >= 0.75 of the matmul rate; the cross-entropy's peak at most 0.25x
    ("gpu", "fwd tp_ext bytes/s vs copy"): [(ALL, Target(">=", 0.85))],
    ("gpu", "fwd+bwd tp_ext bytes/s vs copy"): [(ALL, Target(">=", 0.85))],
    ("gpu", "fwd time vs torch.compile"): [(ALL, Target("<=", 1.0))],
    ("gpu", "fwd+bwd time vs torch.compile"): [(ALL, Target("<=", 1.0))],
    ("gpu", "TFLOP/s"): [(ALL, Target(">=", 0.75))],
    ("gpu", "fwd+bwd peak memory vs gather + F.cross_entropy"): [(ALL, Target("<=", 0.25))],
}

# Commands whose rows are no longer current although no later run repeats the command itself.
RETIRED = {
    # its bf16 rows were relabelled per seed; --part engines and --part bf16 re-measured both parts
    "python benchmarks/bench_zero.py --steps 200 --repeats 5",
    # before the paged-attention op; re-measured at saturating rates (8 requests/s and all at once)
    "python benchmarks/bench_serve.py --tp 2 --rates 4 inf --requests 48",
}
# Series drawn by benchmarks/plot.py rather than read as figures: counted, not tabulated.
PLOT_ONLY = {"compression_loss_curve"}


def _float(s) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def _fmt(s: str) -> str:
    """A CSV number for a table: integers as written (thousands separated), others to 4
    significant digits; anything else as it is, with ``|`` escaped."""
    s = (s or "").strip()
    if re.fullmatch(r"-?\d+", s):
        return f"{int(s):,}"
    x = _float(s)
    if x is None or s.lower() in ("nan", "inf", "-inf", "infinity"):
        return s.replace("|", "\\|")
    return f"{x:.4g}"


def _cell(s: str) -> str:
    return (s or "").replace("|", "\\|")


def target_for(benchmark: str, case: str, metric: str) -> Target | None:
    for pattern, target in TARGETS.get((benchmark, metric), []):
        if re.search(pattern, case):
            return target
    return None


def host(machine: str) -> str:
    """The host a run had, whatever share of its cores the run was given: "vm / AMD EPYC x2"
    -> "2 cores", "... x4 of 16 + NVIDIA H200" -> "16 cores + NVIDIA H200"."""
    m = re.search(r" x(\d+)(?: of (\d+))?( \+ .*)?$", machine)
    if not m:
        return machine
    return f"{m.group(2) or m.group(1)} cores{m.group(3) or ''}"


def script_of(command: str) -> str:
    for word in command.split():
        if word.endswith(".py"):
            return os.path.basename(word)
    return command


def read(path: str = RESULTS) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def current(rows: list[dict]) -> list[dict]:
    """The current rows, in the CSV's order. A run is the rows one invocation of a command
    wrote (same command, machine, torch and commit, no (benchmark, case, metric) twice); of each
    command on each host only the newest run counts; of a configuration (benchmark, host, case,
    metric) measured by several commands, the newest row."""
    newest_run: dict[tuple, list[int]] = {}
    open_run: dict[tuple, tuple] = {}  # (command, host) -> (identity, keys, row indices)
    for i, r in enumerate(rows):
        if r["command"] in RETIRED:
            continue
        where = (r["command"], host(r["machine"]))
        ident = (r["machine"], r["torch"], r["commit"])
        key = (r["benchmark"], r["case"], r["metric"])
        run = open_run.get(where)
        if run is None or run[0] != ident or key in run[1]:
            run = (ident, set(), [])
            open_run[where] = run
            newest_run[where] = run[2]
        run[1].add(key)
        run[2].append(i)
    best: dict[tuple, int] = {}
    for indices in newest_run.values():
        for i in indices:
            r = rows[i]
            config = (r["benchmark"], host(r["machine"]), r["case"], r["metric"])
            if config not in best or r["date"] >= rows[best[config]]["date"]:
                best[config] = i
    return [rows[i] for i in sorted(best.values())]


def _letter(n: int) -> str:
    s = ""
    n += 1
    while n:
        n, rem = divmod(n - 1, 26)
        s = chr(65 + rem) + s
    return s


def _run_key(r: dict) -> tuple:
    return (r["command"], r["machine"], r["torch"], r["commit"])


def render_script(rows: list[dict]) -> str:
    """One script's block: the runs its current figures come from, then one row per figure."""
    if not rows:
        return "No rows in benchmarks/results.csv."
    runs: dict[tuple, dict] = {}
    for r in rows:
        run = runs.setdefault(_run_key(r), {"dates": [], "loads": []})
        run["dates"].append(r["date"])
        if r.get("load") and r["load"] not in run["loads"]:
            run["loads"].append(r["load"])
    order = sorted(runs, key=lambda k: (k[0], host(k[1]), min(runs[k]["dates"])))
    letters = {k: _letter(i) for i, k in enumerate(order)}
    out = ["Runs (the newest of each command):", ""]
    for k in order:
        date = min(runs[k]["dates"])
        load = "/".join(runs[k]["loads"]) or "unknown"
        out.append(
            f"- **{letters[k]}** `{k[0]}`: {date[:10]} {date[11:16]} UTC, commit {k[3]}, "
            f"{k[1]}, torch {k[2]}, load average {load}"
        )
    benchmarks = sorted({r["benchmark"] for r in rows})
    several = len(benchmarks) > 1
    head = ["configuration", "metric", "tp_ext", "baseline", "ratio", "target", "status"]
    head += ["run", "date", "commit"]
    if several:
        head.insert(0, "benchmark")
    numeric = {"tp_ext", "baseline", "ratio"}
    rule = "|" + "|".join("---:" if h in numeric else "---" for h in head) + "|"
    table = ["| " + " | ".join(head) + " |", rule]
    plotted = []
    for bench in benchmarks:
        sel = [r for r in rows if r["benchmark"] == bench]
        sel.sort(key=lambda r: order.index(_run_key(r)))  # stable: the CSV's order within a run
        if bench in PLOT_ONLY:
            used = sorted({letters[_run_key(r)] for r in sel})
            plotted.append(
                f"`{bench}`: {len(sel)} rows of run {', '.join(used)}, plotted in "
                f"`benchmarks/plots/{bench}.png`, not tabulated."
            )
            continue
        for r in sel:
            target = target_for(r["benchmark"], r["case"], r["metric"])
            met = target.met(r) if target else None
            unit = f" {r['unit']}" if r.get("unit") and r["unit"] != "ratio" else ""
            value = _fmt(r["value"])
            base = _fmt(r["baseline"])
            cells = [
                _cell(r["case"]),
                _cell(r["metric"]),
                value + (unit if _float(r["value"]) is not None else ""),
                base + (unit if base else ""),
                _fmt(r["ratio"]),
                target.text() if target else "",
                "" if met is None else ("met" if met else "not met"),
                letters[_run_key(r)],
                r["date"][:10],
                r["commit"],
            ]
            if several:
                cells.insert(0, bench)
            table.append("| " + " | ".join(cells) + " |")
    out += [""] + (table if len(table) > 2 else [])
    if plotted:
        out += [""] + plotted
    return "\n".join(out)


def render_summary(by_script: dict[str, list[dict]]) -> str:
    out = [
        "| script | figures | targets met | targets not met | newest run |",
        "|---|---:|---:|---:|---|",
    ]
    for script, rows in sorted(by_script.items()):
        rows = [r for r in rows if r["benchmark"] not in PLOT_ONLY]
        met = not_met = 0
        for r in rows:
            target = target_for(r["benchmark"], r["case"], r["metric"])
            ok = target.met(r) if target else None
            met += ok is True
            not_met += ok is False
        newest = max(r["date"] for r in rows)[:10] if rows else ""
        out.append(
            f"| [`{script}`](#{_anchor(script)}) | {len(rows)} | {met} | {not_met} | {newest} |"
        )
    return "\n".join(out)


def _anchor(script: str) -> str:
    """GitHub's anchor of the section heading "`bench_x.py`"."""
    return re.sub(r"[^a-z0-9_ -]", "", script.lower()).replace(" ", "-")


def render(path: str = RESULTS) -> dict[str, str]:
    """Every block's text, keyed by marker name: each script seen in the CSV, and "summary"."""
    by_script: dict[str, list[dict]] = {}
    for r in current(read(path)):
        by_script.setdefault(script_of(r["command"]), []).append(r)
    blocks = {script: render_script(rows) for script, rows in by_script.items()}
    blocks["summary"] = render_summary(by_script)
    return blocks


def update_text(doc: str, blocks: dict[str, str]) -> str:
    """``doc`` with each marked block replaced. A block without markers in ``doc`` is an error
    (a new script needs its section); markers of a script the CSV lacks get a note."""
    found = set(MARKER.findall(doc))
    missing = sorted(set(blocks) - found)
    if missing:
        raise ValueError(
            "no <!-- results:begin NAME --> ... <!-- results:end NAME --> markers for: "
            + ", ".join(missing)
        )

    def sub(m: re.Match) -> str:
        name = m.group(1)
        text = blocks.get(name, "No rows in benchmarks/results.csv.")
        return f"<!-- results:begin {name} -->\n{text}\n<!-- results:end {name} -->"

    return MARKER.sub(sub, doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=RESULTS)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--update", metavar="FILE", help="rewrite FILE's marked blocks")
    g.add_argument("--check", metavar="FILE", help="exit 1 if FILE's blocks differ from the CSV")
    a = p.parse_args(argv)
    blocks = render(a.csv)
    if not (a.update or a.check):
        for name, text in blocks.items():
            print(f"<!-- results:begin {name} -->\n{text}\n<!-- results:end {name} -->\n")
        return 0
    path = a.update or a.check
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    try:
        new = update_text(doc, blocks)
    except ValueError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 1
    if a.update:
        if new != doc:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        return 0
    if new == doc:
        return 0
    old_blocks = dict(m.group(1, 0) for m in MARKER.finditer(doc))
    new_blocks = dict(m.group(1, 0) for m in MARKER.finditer(new))
    stale = sorted(n for n in new_blocks if old_blocks.get(n) != new_blocks[n])
    print(
        f"{path} differs from what {a.csv} renders (blocks: {', '.join(stale)}); run "
        f"python benchmarks/report.py --update {path}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""PNG plots of the latest rows of benchmarks/results.csv, one per benchmark, into
benchmarks/plots/: bars of ratio = tp_ext / baseline per case and metric (the dashed line is 1;
lower is better, except for throughputs, whose unit ends in /s)."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import RESULTS, ROOT, read_rows  # noqa: E402


def _float(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=RESULTS)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "plots"))
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import RETIRED  # commands whose rows later runs replaced

    rows = [
        r
        for r in read_rows(a.csv)
        if _float(r["ratio"]) is not None and r.get("command") not in RETIRED
    ]
    os.makedirs(a.out, exist_ok=True)
    for bench in sorted({r["benchmark"] for r in rows}):
        sel = [r for r in rows if r["benchmark"] == bench]
        metrics = sorted({r["metric"] for r in sel})
        fig, axes = plt.subplots(
            len(metrics), 1, figsize=(10, 1.2 + 0.32 * len(sel) + 0.8 * len(metrics)), squeeze=False
        )
        for ax, metric in zip(axes[:, 0], metrics):
            mr = [r for r in sel if r["metric"] == metric]
            ratios = [_float(r["ratio"]) for r in mr]
            higher_is_better = mr[0]["unit"].endswith("/s")  # a throughput (MB/s, tokens/s)
            good = [(x >= 1) if higher_is_better else (x <= 1) for x in ratios]
            ax.barh(
                [r["case"] for r in mr],
                ratios,
                color=["tab:green" if g else "tab:red" for g in good],
            )
            ax.axvline(1.0, color="k", ls="--", lw=0.8)
            if max(ratios) / max(min(ratios), 1e-12) > 4:
                ax.set_xscale("log")
            better = "higher" if higher_is_better else "lower"
            ax.set_title(f"{bench}: {metric} (tp_ext / baseline, {better} is better)", fontsize=9)
            ax.tick_params(labelsize=7)
            for i, x in enumerate(ratios):
                ax.text(x, i, f" {x:.2f}", va="center", fontsize=7)
        fig.tight_layout()
        path = os.path.join(a.out, f"{bench}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()

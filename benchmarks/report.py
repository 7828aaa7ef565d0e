"""Markdown tables of the latest rows of benchmarks/results.csv. With ``--update FILE``, replaces
the text between the ``<!-- results:begin -->`` and ``<!-- results:end -->`` markers in FILE."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import RESULTS, read_rows  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _fmt(s):
    try:
        x = float(s)
    except (TypeError, ValueError):
        return s or ""
    return f"{x:.4g}" if abs(x) < 1e6 else f"{x:.4e}"


def tables(path=RESULTS) -> str:
    rows = read_rows(path)
    out = []
    for bench in sorted({r["benchmark"] for r in rows}):
        sel = [r for r in rows if r["benchmark"] == bench]
        out.append(f"### {bench}\n")
        for key in sorted({(r["command"], r["machine"], r["torch"], r["commit"]) for r in sel}):
            dates = sorted(
                r["date"]
                for r in sel
                if (r["command"], r["machine"], r["torch"], r["commit"]) == key
            )
            loads = sorted({r.get("load", "") for r in sel if r["command"] == key[0]})
            out.append(
                f"- `{key[0]}` — {key[1]}, torch {key[2]}, commit {key[3]}, "
                f"{dates[0]}, load average {'/'.join(loads)}"
            )
        out.append("\n| case | metric | tp_ext | baseline | ratio | unit |")
        out.append("|---|---|---:|---:|---:|---|")
        for r in sel:
            out.append(
                f"| {r['case']} | {r['metric']} | {_fmt(r['value'])} | "
                f"{_fmt(r['baseline'])} | {_fmt(r['ratio'])} | {r['unit']} |"
            )
        out.append("")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--csv", default=RESULTS)
    p.add_argument("--update", help="a markdown file with the begin/end markers")
    a = p.parse_args()
    text = tables(a.csv)
    if not a.update:
        print(text)
        return
    with open(a.update) as f:
        doc = f.read()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(a.update, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Summarize one regime run (benches/regime/regime.sh): per routing skew, one row per modelled
machine (and every expert in RAM), Picchio's prefill and decode tokens/s with each phase's wall
time over its floor (`bench`: max(bytes of the reads used / the disk bandwidth it measured,
compute)), the expert bytes read per decoded token, and llama.cpp in the same limits with the
ratios Picchio / llama.cpp. With several rounds (`regime.sh --rounds R`) each cell is the
median of the rounds with their range, and the ratios are those of the medians. Standard
library only.

Usage: summarize.py RESULTS_DIR
"""
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "anchor"))
from summarize import llama_figures  # noqa: E402  (benches/anchor/summarize.py)

RUN = re.compile(r"^picchio-s([0-9.]+)-(m(\d+)|ram)(-g([0-9.]+))?(-r\d+)?\.json$")
# The per-decoded-token line of a GPU run's report (CPU+GPU experts).
SPLIT = re.compile(r"per decoded token: experts ([0-9.]+) on the GPU, ([0-9.]+) on the CPU")
PLAN = re.compile(r"^plan_s([0-9.]+)_m(\d+) .*SHARE=([0-9.]+)")


def fail(msg):
    sys.exit(f"summarize: {msg}")


def picchio(path):
    try:
        j = json.loads(path.read_text())
        p, d = j["prefill"], j["decode"]
        return {
            "prefill": float(p["tokens_per_s"]),
            "prefill_floor": float(p["over_floor"]),
            "decode": float(d["tokens_per_s"]),
            "decode_floor": float(d["over_floor"]),
            "mb_per_token": float(d["bytes_read_per_token"]) / 1e6,
            "split": split(j.get("device_report")),
        }
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        fail(f"{path}: {e!r}")


def split(report):
    """(GPU, CPU) experts per decoded token from a GPU run's report lines, if any."""
    lines = report if isinstance(report, list) else [str(report or "")]
    for line in lines:
        m = SPLIT.search(str(line))
        if m:
            return float(m.group(1)), float(m.group(2))
    return None


def gb_read(path):
    """GB the whole process read from the file system (GNU time's blocks of 512 B), if recorded."""
    try:
        fields = dict(kv.split("=", 1) for kv in path.read_text().split())
        return int(fields["fs_read_blocks"]) * 512 / 1e9
    except (OSError, KeyError, ValueError):
        return None


def cell(values, fmt, suffix=""):
    """The median of `values`, with their range when there are several."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:{fmt}}{suffix}"
    return f"{med:{fmt}}{suffix} ({min(values):{fmt}}-{max(values):{fmt}})"


def main():
    if len(sys.argv) != 2:
        fail("usage: summarize.py RESULTS_DIR")
    out = Path(sys.argv[1])
    machine = (out / "machine.txt").read_text()
    shares = {(m.group(1), m.group(2)): float(m.group(3)) for m in map(PLAN.match, machine.splitlines()) if m}
    rows = {}
    for f in sorted(out.iterdir()):
        m = RUN.match(f.name)
        if not m:
            continue
        skew, gb, gpu = m.group(1), m.group(3), m.group(5)
        fig = picchio(f)
        fig["gb_read"] = gb_read(f.with_suffix(".time"))
        llama = out / re.sub(r"-g[0-9.]+", "", f.name.replace("picchio-", "llama-"))
        if llama.exists():
            fig["llama"] = llama_figures(llama)
            fig["llama"]["gb_read"] = gb_read(llama.with_suffix(".time"))
        rows.setdefault(skew, {}).setdefault((gb, gpu), []).append(fig)
    if not rows:
        fail(f"{out}: no picchio-*.json results")
    print(machine.strip().replace("\n", "  \n"))
    for skew in sorted(rows, key=float):
        print(f"\n**Routing skew {skew}** ({'uniform' if float(skew) == 0 else 'skewed'})\n")
        print("| machine | experts in RAM | experts in VRAM | rounds | Picchio prefill tok/s | over floor "
              "| decode tok/s | over floor | MB read / decoded token | experts / token GPU + CPU "
              "| llama.cpp prefill | decode | prefill ratio | decode ratio "
              "| GB read per run: Picchio / llama.cpp |")
        print("|---|---:|---:|---:|---|---|---|---|---:|---|---|---|---:|---:|---|")
        order = lambda r: (int(r[0][0]) if r[0][0] else 10**9, -float(r[0][1]) if r[0][1] else 1)  # noqa: E731
        for (gb, gpu), figs in sorted(rows[skew].items(), key=order):
            name = f"{gb} GB" if gb else "every expert in RAM"
            share = f"{shares.get((skew, gb), 0) * 100:.0f}%" if gb else "100%"
            vram = f"{float(gpu) * 100:.0f}% (CPU+GPU)" if gpu else "- (CPU only)"
            splits = [f["split"] for f in figs if f.get("split")]
            per_token = (f"{statistics.median(g for g, _ in splits):.1f} + {statistics.median(c for _, c in splits):.1f}"
                         if splits else "-")
            col = lambda k: [f[k] for f in figs]  # noqa: E731
            cells = [name, share, vram, str(len(figs)),
                     cell(col("prefill"), ".2f"), cell(col("prefill_floor"), ".2f", "x"),
                     cell(col("decode"), ".2f"), cell(col("decode_floor"), ".2f", "x"),
                     f"{statistics.median(col('mb_per_token')):.0f}", per_token]
            llamas = [f["llama"] for f in figs if "llama" in f]
            if llamas:
                lp, ld = [l["prefill"] for l in llamas], [l["decode"] for l in llamas]
                cells += [cell(lp, ".2f"), cell(ld, ".2f"),
                          f"{statistics.median(col('prefill')) / statistics.median(lp):.2f}x",
                          f"{statistics.median(col('decode')) / statistics.median(ld):.2f}x"]
            else:
                cells += ["-"] * 4
            reads = lambda xs: cell(xs, ".1f") if xs else "-"  # noqa: E731
            pic_gb = [f["gb_read"] for f in figs if f["gb_read"] is not None]
            lla_gb = [l["gb_read"] for l in llamas if l.get("gb_read") is not None]
            cells.append(f"{reads(pic_gb)} / {reads(lla_gb)}")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

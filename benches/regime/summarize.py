#!/usr/bin/env python3
"""Summarize one regime run (benches/regime/regime.sh): per routing skew, one row per modelled
machine (and every expert in RAM), Picchio's prefill and decode tokens/s with each phase's wall
time over its floor (`bench`: max(bytes of the reads used / the disk bandwidth it measured,
compute)), the expert bytes read per decoded token, and llama.cpp in the same limits with the
ratios Picchio / llama.cpp. Standard library only.

Usage: summarize.py RESULTS_DIR
"""
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "anchor"))
from summarize import llama_figures  # noqa: E402  (benches/anchor/summarize.py)

RUN = re.compile(r"^picchio-s([0-9.]+)-(m(\d+)|ram)\.json$")
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
        }
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        fail(f"{path}: {e!r}")


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
        skew, gb = m.group(1), m.group(3)
        fig = picchio(f)
        llama = out / f.name.replace("picchio-", "llama-")
        if llama.exists():
            fig["llama"] = llama_figures(llama)
        rows.setdefault(skew, []).append((int(gb) if gb else 10**9, gb, fig))
    if not rows:
        fail(f"{out}: no picchio-*.json results")
    print(machine.strip().replace("\n", "  \n"))
    for skew in sorted(rows, key=float):
        print(f"\n**Routing skew {skew}** ({'uniform' if float(skew) == 0 else 'skewed'})\n")
        print("| machine | experts in RAM | Picchio prefill tok/s (over floor) | decode tok/s (over floor) "
              "| MB read / decoded token | llama.cpp prefill | decode | prefill ratio | decode ratio |")
        print("|---|---:|---|---|---:|---:|---:|---:|---:|")
        for _, gb, fig in sorted(rows[skew], key=lambda r: r[0]):
            name = f"{gb} GB" if gb else "every expert in RAM"
            share = f"{shares.get((skew, gb), 0) * 100:.0f}%" if gb else "100%"
            l = fig.get("llama")
            cells = [name, share,
                     f"{fig['prefill']:.2f} ({fig['prefill_floor']:.2f}x)",
                     f"{fig['decode']:.2f} ({fig['decode_floor']:.2f}x)",
                     f"{fig['mb_per_token']:.0f}"]
            if l:
                cells += [f"{l['prefill']:.2f}", f"{l['decode']:.2f}",
                          f"{fig['prefill'] / l['prefill']:.2f}x", f"{fig['decode'] / l['decode']:.2f}x"]
            else:
                cells += ["-"] * 4
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

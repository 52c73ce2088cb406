#!/usr/bin/env python3
"""Summarize one anchor run: the table of prefill and decode tokens/s per engine and thread count.

Reads the raw files anchor.sh left in RESULTS_DIR (llama-t{T}-r{R}.json from `llama-bench -o json`,
picchio-{f32,int8}-t{T}-r{R}.json from `picchio bench --json`, machine.txt, commands.txt) and prints
a Markdown table: min / median / max over the rounds, and the ratio of the medians
Picchio / llama.cpp. For llama.cpp one round's figure is llama-bench's mean over its -r repetitions.
Standard library only.

Usage: summarize.py RESULTS_DIR
"""

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

FILE = re.compile(r"^(llama|picchio-(f32|int8))-t(\d+)-r(\d+)\.json$")


def fail(msg: str) -> None:
    sys.exit(f"summarize: {msg}")


def llama_figures(path: Path) -> dict:
    """prefill and decode tok/s of one llama-bench run (its pp and tg tests)."""
    try:
        tests = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: {e}")
    out = {}
    for t in tests:
        if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0:
            out["prefill"] = float(t["avg_ts"])
        elif t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0:
            out["decode"] = float(t["avg_ts"])
    if set(out) != {"prefill", "decode"}:
        fail(f"{path}: expected one pp and one tg test, found {[(t.get('n_prompt'), t.get('n_gen')) for t in tests]}")
    return out


def picchio_figures(path: Path) -> dict:
    """prefill and decode tok/s of one `picchio bench --json` run, and decode over its read floor."""
    try:
        j = json.loads(path.read_text())
        return {
            "prefill": float(j["prefill"]["tokens_per_s"]),
            "decode": float(j["decode"]["tokens_per_s"]),
            "over_read_floor": float(j["decode_over_read_floor"]),
            "machine": str(j.get("machine", "")),
        }
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        fail(f"{path}: {e!r}")


def spread(xs: list) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def ratio(a: list, b: list) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.median(a) / statistics.median(b):.2f}x"


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: summarize.py RESULTS_DIR")
    d = Path(sys.argv[1])
    # (engine, threads) -> metric -> [per-round values]
    runs = defaultdict(lambda: defaultdict(list))
    machines = {}  # Picchio's own description of the machine and kernel path, per mode
    for p in sorted(d.iterdir()):
        m = FILE.match(p.name)
        if not m:
            continue
        engine = "llama" if m.group(1) == "llama" else m.group(2)
        threads = int(m.group(3))
        figs = llama_figures(p) if engine == "llama" else picchio_figures(p)
        for k, v in figs.items():
            if k == "machine":
                machines[engine] = v
            else:
                runs[(engine, threads)][k].append(v)
    if not runs:
        fail(f"{d}: no result files")
    threads = sorted({t for _, t in runs}, reverse=True)
    has_int8 = any(e == "int8" for e, _ in runs)
    rounds = max(len(v["decode"]) for v in runs.values())

    machine = (d / "machine.txt").read_text() if (d / "machine.txt").exists() else ""
    m = re.search(r"\bprompt=(\d+) gen=(\d+)", machine)
    prefill_label, decode_label = (f"prefill-{m.group(1)}", f"decode ({m.group(2)})") if m else ("prefill", "decode")
    print(f"## Anchor run {d.name}\n")
    print("```")
    print(machine.rstrip())
    print("```\n")
    print(f"tokens/s, min / median / max over {rounds} round(s); ratio = Picchio median / llama.cpp median\n")
    head = "| threads | phase | llama.cpp | Picchio (f32 act.) | ratio |"
    rule = "|---|---|---|---|---|"
    if has_int8:
        head += " Picchio --int8-activations | ratio |"
        rule += "---|---|"
    print(head)
    print(rule)
    for t in threads:
        ll, f, q = runs[("llama", t)], runs[("f32", t)], runs[("int8", t)]
        for phase, label in (("prefill", prefill_label), ("decode", decode_label)):
            row = f"| {t} | {label} | {spread(ll[phase])} | {spread(f[phase])} | {ratio(f[phase], ll[phase])} |"
            if has_int8:
                row += f" {spread(q[phase])} | {ratio(q[phase], ll[phase])} |"
            print(row)
    print()
    for t in threads:
        f, q = runs[("f32", t)], runs[("int8", t)]
        line = f"- {t} thread(s): Picchio decode over its read floor (bench's decode_over_read_floor): {spread(f['over_read_floor'])}"
        if has_int8:
            line += f"; with --int8-activations {spread(q['over_read_floor'])}"
        print(line)
    for mode, desc in sorted(machines.items()):
        print(f"- Picchio ({mode} activations), one run's own description: {desc}")
    cmds = d / "commands.txt"
    if cmds.exists():
        print("\nCommands:\n")
        print("```")
        print(cmds.read_text().rstrip())
        print("```")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The full model's decode and prefill, extrapolated from a regime run of a few of its layers
(issue 19's 36-layer extrapolation). Standard library only.

Assumptions, the ones docs/perf.md states with every extrapolation table:
- every layer of the full model costs what the measured layers cost on average: the phase's
  wall time less its head time, and its floor (the needed reads over the disk's bandwidth),
  both scale by FULL / LAYERS;
- the head (and the embedding) runs once a token whatever the depth, so its time is added
  once, unscaled;
- the budgets scale with the layers (benches/regime/plan.py), so the hit rate, the bytes a
  layer reads and the disk's speed are those measured.

The wall time that is neither head nor a layer's (sampling, the disk's idle gaps) is scaled
with the layers too, which makes the extrapolation slightly pessimistic.

Usage: extrapolate.py RESULTS_DIR [--full-layers N]
  RESULTS_DIR is a directory regime.sh wrote (machine.txt and picchio-*.json); the layers the
  runs had are read from machine.txt, the full model's from it too unless --full-layers.
Prints one line per Picchio run with a disk phase (every-expert-in-RAM rows have no floor).
"""
import argparse
import re
import sys
from pathlib import Path

from runs import per_token_ms, picchio_runs


def fail(msg):
    sys.exit(f"extrapolate: {msg}")


def layers_of(results):
    """(layers present, full layers) from regime.sh's machine.txt."""
    try:
        text = (results / "machine.txt").read_text()
    except OSError as e:
        fail(f"{results}: {e}")
    m = re.search(r"layers=(\d+) of (\d+)", text)
    if not m:
        fail(f"{results}/machine.txt has no 'layers=N of M' line")
    return int(m.group(1)), int(m.group(2))


def phase_per_token(phase, scale):
    """The phase's (wall, floor) per token in ms at the full depth."""
    wall, head, floor = (per_token_ms(phase, k, "extrapolate") for k in ("seconds", "head_s", "floor_s"))
    return scale * (wall - head) + head, scale * floor


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--full-layers", type=int)
    a = ap.parse_args()
    layers, full = layers_of(a.results)
    full = a.full_layers or full
    if layers <= 0 or full < layers:
        fail(f"{full} full layers for runs of {layers}")
    scale = full / layers
    print(f"{layers} layers measured, extrapolated to {full}")
    for name, j in picchio_runs(a.results, "extrapolate"):
        dec, pre = j["decode"], j["prefill"]
        if dec.get("bytes_read", 0) == 0:
            continue  # every expert in RAM: no disk floor to extrapolate against
        dw, df = phase_per_token(dec, scale)
        pw, _ = phase_per_token(pre, scale)
        print(
            f"{name:<20} decode {1e3 / dw:.2f} tok/s, {dw / df:.2f}x over its floor; "
            f"prefill {1e3 / pw:.2f} tok/s  (measured: decode {dec['tokens_per_s']:.2f} tok/s "
            f"{dec['over_floor']:.2f}x, prefill {pre['tokens_per_s']:.2f} tok/s {pre['over_floor']:.2f}x)"
        )


if __name__ == "__main__":
    main()

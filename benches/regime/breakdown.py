#!/usr/bin/env python3
"""Where each Picchio run of a regime result spent its time, per token: the wall, the part with
a read in flight (the disk busy) and the part with none (idle: work the reads wait for or that
waits for nothing on the disk, such as the head), the head's and attention's own times, and
the speed of the reads while busy beside the floor's disk figure from the same process.
Standard library only.

It answers the question the "over floor" ratios raise: of a phase's distance to its floor, how
much is the disk reading more slowly than the floor's measurement (busy / floor) and how much
is the disk idle (wall / busy).

Usage: breakdown.py RESULTS_DIR
  RESULTS_DIR is a directory regime.sh wrote (picchio-*.json); one line per run and phase.
"""
import argparse
import json
import sys
from pathlib import Path


def fail(msg):
    sys.exit(f"breakdown: {msg}")


def per_token_ms(phase, key):
    """`phase[key]` (seconds over the phase) in ms per token."""
    return 1e3 * phase[key] / phase["tokens"]


def line(name, what, phase, floor_bw):
    if phase.get("tokens", 0) <= 0:
        fail(f"{name}: a {what} phase with no tokens")
    wall, busy, floor = (per_token_ms(phase, k) for k in ("seconds", "disk_busy_s", "floor_s"))
    head, attention = per_token_ms(phase, "head_s"), per_token_ms(phase, "attention_s")
    busy_bw = phase["disk_busy_bytes_per_s"] / 1e9
    return (
        f"{name:<16} {what:<7} {wall:7.1f} ms/token = busy {busy:6.1f} + idle {wall - busy:5.1f} "
        f"(head {head:4.1f}, attention {attention:5.1f});  floor {floor:6.1f}: {wall / floor:.2f}x "
        f"= busy/floor {busy / floor:.2f} x wall/busy {wall / busy:.2f};  "
        f"reads while busy {busy_bw:.2f} GB/s, floor's disk {floor_bw:.2f} GB/s"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    a = ap.parse_args()
    runs = sorted(a.results.glob("picchio-*.json"))
    if not runs:
        fail(f"no picchio-*.json in {a.results}")
    for f in runs:
        try:
            j = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            fail(f"{f}: {e}")
        name = f.stem[len("picchio-"):]
        floor_bw = j.get("disk_read_bandwidth_bytes_per_s", 0.0) / 1e9
        for what in ("prefill", "decode"):
            phase = j[what]
            if phase.get("bytes_read", 0) == 0 or phase.get("disk_busy_s", 0.0) <= 0.0:
                continue  # every expert in RAM: no reads, no floor
            print(line(name, what, phase, floor_bw))


if __name__ == "__main__":
    main()

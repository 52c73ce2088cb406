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
from pathlib import Path

from runs import per_token_ms, picchio_runs


def line(name, what, phase, floor_bw):
    wall, busy, floor, head, attention = (
        per_token_ms(phase, k, "breakdown") for k in ("seconds", "disk_busy_s", "floor_s", "head_s", "attention_s")
    )
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
    for name, j in picchio_runs(a.results, "breakdown"):
        floor_bw = j.get("disk_read_bandwidth_bytes_per_s", 0.0) / 1e9
        for what in ("prefill", "decode"):
            phase = j[what]
            if phase.get("bytes_read", 0) == 0 or phase.get("disk_busy_s", 0.0) <= 0.0:
                continue  # every expert in RAM: no reads, no floor
            print(line(name, what, phase, floor_bw))


if __name__ == "__main__":
    main()

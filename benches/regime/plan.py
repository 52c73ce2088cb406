#!/usr/bin/env python3
"""The budgets that model a machine of M GB running the whole model, scaled to the layers a
synthetic container holds (issue 19's regime benchmark). Standard library only.

A machine of M GB running the full model (FULL_LAYERS layers) keeps resident the dense
weights (embedding, head, every layer's attention and router) and a reserve for the OS and
everything else (RESERVE GB, Picchio's default), and gives the rest to the expert cache:

    share = (M - reserve - dense_full) / experts_full      (clamped to 0..1)

where dense_full and experts_full are computed from the container's manifest: the bytes of
its non-layer tensors plus FULL_LAYERS times the mean bytes of one layer's dense tensors, and
FULL_LAYERS x experts-per-layer x record bytes. The container's own cache budget is that
share of the experts it holds, and its memory cgroup the budget plus its own dense weights
plus SLACK GB (key/value cache, read buffers, the process: Picchio's peak RSS stays below
budget + dense weights, since only the embedding rows used are touched).

The cgroup is the memory both engines get. Picchio uses its budget and leaves the margin
unused; llama.cpp's page cache takes the margin as extra expert cache (at 16 GB on the 6-layer
120B, 1.5 GiB lets it hold about twice the experts Picchio's budget does). A margin of 0.5 GiB
was tried: llama.cpp then thrashes at 16 GB, and at 64 GB the cgroup reclaims Picchio's mapped
dense weights (prefill 2.9 tok/s against 36 in RAM), so it models neither engine fairly.

Usage: plan.py CONTAINER --full-layers 36 --machine-gb 16 [--reserve-gb 4] [--slack-gb 1.5]
Prints shell assignments: RAM_GB, CGROUP_BYTES, SHARE, EXPERTS_FULL_GB, DENSE_FULL_GB.
"""
import argparse
import json
import re
import sys
from pathlib import Path

GIB = 1 << 30
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def fail(msg):
    sys.exit(f"plan: {msg}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("container", type=Path)
    ap.add_argument("--full-layers", type=int, required=True)
    ap.add_argument("--machine-gb", type=float, required=True)
    ap.add_argument("--reserve-gb", type=float, default=4.0)
    ap.add_argument("--slack-gb", type=float, default=1.5)
    a = ap.parse_args()
    try:
        manifest = json.loads((a.container / "manifest.json").read_text())
        config = json.loads((a.container / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{a.container}: {e}")
    layers = int(config["num_hidden_layers"])
    if a.full_layers < layers:
        fail(f"--full-layers {a.full_layers} is less than the container's {layers} layers")
    if a.machine_gb <= 0:
        fail(f"--machine-gb {a.machine_gb} must be positive")
    fixed = per_layer = 0
    for t in manifest["tensors"]:
        size = sum(int(p["bytes"]) for p in t["parts"])
        if LAYER.match(t["name"]):
            per_layer += size
        else:
            fixed += size
    dense_present = fixed + per_layer
    dense_full = fixed + per_layer / layers * a.full_layers
    experts_present = Path(a.container / "experts.bin").stat().st_size
    experts_full = experts_present / layers * a.full_layers
    share = (a.machine_gb * 1e9 - a.reserve_gb * GIB - dense_full) / experts_full
    share = min(max(share, 0.0), 1.0)
    budget = share * experts_present
    cgroup = budget + dense_present + a.slack_gb * GIB
    print(f"RAM_GB={budget / GIB:.4f}")
    print(f"CGROUP_BYTES={int(cgroup)}")
    print(f"SHARE={share:.4f}")
    print(f"EXPERTS_FULL_GB={experts_full / 1e9:.2f}")
    print(f"DENSE_FULL_GB={dense_full / 1e9:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Hit rates of expert-cache policies on a model of `picchio bench --streams` traffic.

Replays the requests a bench run makes (each stream's prompt prefilled, its union of
experts per layer requested in groups, then decode steps in which every layer asks for the
union of the streams' top-k) through three policies with the same capacity:

- lru:       least recently used (`--cache-policy lru`),
- frequency: W-TinyLFU as src/experts/policy.rs implements it (`--cache-policy frequency`),
- optimal:   Belady's MIN, which evicts the expert needed furthest in the future: no online
             policy can hit more often, so its bytes per token bound what any cache can do.

Routing is modelled as independent draws per token and layer: uniform (what the synthetic
checkpoints do, `--skew 0`) or Zipf-skewed over a random per-layer order of experts
(`--skew S`: expert of popularity rank r drawn with weight 1/(1+r)^S). Or `--trace FILE`
replays the requests a real run made, one line per request: `D LAYER ID,ID,...` (other
lines are ignored); the decode steps are the requests after the last one larger than
top-k x streams. `--usage FILE` (an `expert-usage.json`) protects the learned hot set in the
online policies, as the cache does. Hit rates are counted over the decode steps only, as
`bench` counts them. Only the standard library.

    python3 benches/cache-sim/cache_sim.py --layers 24 --experts 32 --top-k 4 --capacity 324 \
        --streams 1,2,4,8 --skew 0 --record-mb 13.0
    python3 benches/cache-sim/cache_sim.py --trace trace4.txt --streams 4 --capacity 324 \
        --usage expert-usage.json
"""
import json
import argparse
import bisect
import random
from collections import OrderedDict


def model_trace(layers, experts, top_k, streams, prompt, gen, skew, seed):
    """[(phase, layer, sorted expert ids)] in the order a bench run requests them."""
    rng = random.Random(seed)
    weights = []
    for _ in range(layers):
        order = list(range(experts))
        rng.shuffle(order)
        w = [0.0] * experts
        for rank, e in enumerate(order):
            w[e] = 1.0 / (1 + rank) ** skew
        weights.append(w)

    def pick(layer):
        chosen = set()
        while len(chosen) < top_k:
            chosen.add(rng.choices(range(experts), weights[layer])[0])
        return chosen

    calls = []
    for _ in range(streams):
        for layer in range(layers):
            union = set()
            for _ in range(prompt):
                union |= pick(layer)
            calls.append(("prefill", layer, sorted(union)))
    for _ in range(gen):
        for layer in range(layers):
            union = set()
            for _ in range(streams):
                union |= pick(layer)
            calls.append(("decode", layer, sorted(union)))
    return calls


def read_trace(path, top_k, streams):
    """[(phase, layer, ids)] from a recorded trace."""
    calls = []
    for line in open(path):
        parts = line.split()
        if len(parts) == 3 and parts[0] == "D":
            calls.append(["prefill", int(parts[1]), [int(x) for x in parts[2].split(",")]])
    last_big = max((i for i, c in enumerate(calls) if len(c[2]) > top_k * streams), default=-1)
    for c in calls[last_big + 1:]:
        c[0] = "decode"
    return [tuple(c) for c in calls]


def hot_set(usage_path, experts, capacity):
    """The protected hot set the cache loads: the most used experts, at most half of it."""
    if not usage_path:
        return set()
    counts = json.load(open(usage_path))["counts"]
    ranked = sorted((-c, i) for i, c in enumerate(counts) if c > 0)
    return {(i // experts, i % experts) for _, i in ranked[: capacity // 2]}


class Lru:
    def __init__(self, capacity, hot=()):
        self.capacity, self.entries, self.hot = capacity - len(hot), OrderedDict(), set(hot)

    def request(self, layer, ids):
        keys = [(layer, e) for e in ids]
        hits = 0
        for k in keys:
            if k in self.hot:
                hits += 1
            elif k in self.entries:
                hits += 1
                self.entries.move_to_end(k)
            else:
                self.entries[k] = True
        pinned = set(keys)
        while len(self.entries) > self.capacity:
            victim = next((k for k in self.entries if k not in pinned), None)
            if victim is None:
                break
            del self.entries[victim]
        return hits


class Frequency:
    """W-TinyLFU as src/experts/policy.rs: window of capacity/16, counts halved every
    10 x capacity requests."""

    def __init__(self, capacity, hot=()):
        self.hot = set(hot)
        self.capacity = capacity - len(self.hot)
        self.window_cap = max(1, capacity // 16)
        self.window, self.main, self.counts = OrderedDict(), {}, {}
        self.sample, self.since_reset, self.clock = 10 * capacity, 0, 0

    def record(self, k):
        self.counts[k] = self.counts.get(k, 0) + 1
        self.since_reset += 1
        if self.since_reset >= self.sample:
            self.since_reset = 0
            self.counts = {key: c // 2 for key, c in self.counts.items() if c // 2}

    def request(self, layer, ids):
        self.clock += 1
        keys = [(layer, e) for e in ids]
        hits = 0
        for k in keys:
            self.record(k)
            if k in self.hot:
                hits += 1
            elif k in self.main:
                hits += 1
                self.main[k] = self.clock
            elif k in self.window:
                hits += 1
                self.window.move_to_end(k)
            else:
                self.window[k] = True
        pinned = set(keys)
        main_cap = self.capacity - self.window_cap
        while len(self.window) + len(self.main) > self.capacity:
            w = next((k for k in self.window if k not in pinned), None)
            mains = [k for k in self.main if k not in pinned]
            m = min(mains, key=lambda k: (self.counts.get(k, 0), self.main[k], k)) if mains else None
            if w is not None and len(self.window) > self.window_cap:
                del self.window[w]
                if len(self.main) < main_cap:
                    self.main[w] = self.clock
                elif m is not None and self.counts.get(w, 0) > self.counts.get(m, 0):
                    del self.main[m]
                    self.main[w] = self.clock
            elif m is not None:
                del self.main[m]
            elif w is not None:
                del self.window[w]
            else:
                break
        return hits


def optimal_hits(calls, capacity):
    """Belady's MIN over the whole trace: decode hits and decode requests."""
    uses = {}
    for i, (_, layer, ids) in enumerate(calls):
        for e in ids:
            uses.setdefault((layer, e), []).append(i)

    def next_use(k, i):
        u = uses[k]
        j = bisect.bisect_right(u, i)
        return u[j] if j < len(u) else float("inf")

    cache, hits, requests = set(), 0, 0
    for i, (phase, layer, ids) in enumerate(calls):
        keys = {(layer, e) for e in ids}
        if phase == "decode":
            hits += len(keys & cache)
            requests += len(keys)
        cache |= keys
        while len(cache) > capacity:
            cache.discard(max((k for k in cache if k not in keys), key=lambda k: next_use(k, i)))
    return hits, requests


def online_hits(calls, policy, group):
    hits = requests = 0
    for phase, layer, ids in calls:
        for start in range(0, len(ids), group):
            chunk = ids[start:start + group]
            h = policy.request(layer, chunk)
            if phase == "decode":
                hits += h
                requests += len(chunk)
    return hits, requests


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=324, help="experts the RAM cache holds")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--record-mb", type=float, default=13.0, help="MB read per expert miss")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", help="replay this recorded trace instead of the model")
    ap.add_argument("--usage", help="expert-usage.json whose hot set the online policies protect")
    a = ap.parse_args()
    hot = hot_set(a.usage, a.experts, a.capacity)
    # A forward pass asks for at most half the cache at once (ExpertSource::batch_limit).
    group = max(1, a.capacity // 2)
    source = f"trace {a.trace}" if a.trace else f"{a.layers} layers, skew {a.skew}"
    print(f"{source}: {a.experts} experts, top-{a.top_k}, cache {a.capacity}, hot set {len(hot)}")
    print("streams | requests/token | hit rate and MB read per token: lru | frequency | optimal")
    for n in [int(s) for s in a.streams.split(",")]:
        if a.trace:
            calls = read_trace(a.trace, a.top_k, n)
            decode_layers = sum(1 for c in calls if c[0] == "decode")
            layers = len({c[1] for c in calls})
            tokens = decode_layers // layers * n
        else:
            calls = model_trace(a.layers, a.experts, a.top_k, n, a.prompt, a.gen, a.skew, a.seed)
            tokens = a.gen * n
        row = []
        for name, (h, r) in [
            ("lru", online_hits(calls, Lru(a.capacity, hot), group)),
            ("frequency", online_hits(calls, Frequency(a.capacity, hot), group)),
            ("optimal", optimal_hits(calls, a.capacity)),
        ]:
            row.append(f"{name} {h / r:.3f} {(r - h) / tokens * a.record_mb:.0f} MB")
        reqs = online_hits(calls, Lru(a.capacity), group)[1] / tokens
        print(f"{n} | {reqs:.1f} | " + " | ".join(row))


if __name__ == "__main__":
    main()

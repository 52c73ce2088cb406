#!/usr/bin/env bash
# A/B of two Picchio builds (or settings) on one model, alternating run by run, so that both
# meet the same machine state: `picchio bench --prompt P --gen G --threads T --device cpu --json`
# per round and thread count, first A then B. Writes each run's JSON and log, the commands and a
# one-line summary per run (tokens/s and per-part times, decode over bench's read floor).
#
#   benches/anchor/ab.sh --a "BIN_OR_CMD" --b "BIN_OR_CMD" --model CONTAINER \
#       [--rounds 2] [--threads "2 1"] [--prompt 64] [--gen 16] [--out DIR] [-- BENCH_FLAGS...]
# (--out defaults to $TMPDIR/picchio-ab/<UTC time>, /tmp when TMPDIR is unset.)
#
# A command may carry environment settings, e.g. --b "env PICCHIO_KERNELS=avx2 target/release/picchio".
# Not run in CI: it is for the records of docs/perf.md.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
A="" B="" MODEL="" ROUNDS=2 THREADS="2 1" PROMPT=64 GEN=16 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --a) A=$2; shift 2 ;;
    --b) B=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --prompt) PROMPT=$2; shift 2 ;;
    --gen) GEN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --help|-h) usage 0 ;;
    --) shift; break ;;
    *) echo "ab.sh: unknown argument '$1'" >&2; usage 2 >&2 ;;
  esac
done
[ -n "$A" ] && [ -n "$B" ] && [ -n "$MODEL" ] || { echo "ab.sh: --a, --b and --model are required" >&2; exit 2; }
[ -e "$MODEL" ] || { echo "ab.sh: model '$MODEL' does not exist" >&2; exit 2; }
OUT=${OUT:-${TMPDIR:-/tmp}/picchio-ab/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
{ echo "A=$A"; echo "B=$B"; echo "model=$MODEL rounds=$ROUNDS threads=$THREADS prompt=$PROMPT gen=$GEN extra=$*"; } > "$OUT/commands.txt"

for r in $(seq 1 "$ROUNDS"); do
  for t in $THREADS; do
    for k in A B; do
      if [ "$k" = A ]; then cmd=$A; else cmd=$B; fi
      run="$OUT/$k-t$t-r$r"
      # shellcheck disable=SC2086 # the command is split on purpose (env settings, binary)
      $cmd bench -m "$MODEL" --prompt "$PROMPT" --gen "$GEN" --threads "$t" --device cpu --json "$@" \
        > "$run.json" 2> "$run.log"
      python3 - "$run.json" "$k" "$t" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); p = d["prefill"]; q = d["decode"]; n = max(q["tokens"], 1)
print(f"{sys.argv[2]} t{sys.argv[3]} r{sys.argv[4]}: prefill {p['tokens_per_s']:.2f} tok/s "
      f"(attn {p['attention_s']:.2f} s, experts {p['experts_s']:.2f} s) decode {q['tokens_per_s']:.2f} tok/s "
      f"(attn {q['attention_s'] / n * 1e3:.1f} ms, experts {q['experts_s'] / n * 1e3:.1f} ms, "
      f"head {q['head_s'] / n * 1e3:.1f} ms) read-floor x{d['decode_over_read_floor']:.2f} "
      f"read {d['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
PY
    done
  done
done | tee "$OUT/summary.txt"
echo "ab.sh: results in $OUT" >&2

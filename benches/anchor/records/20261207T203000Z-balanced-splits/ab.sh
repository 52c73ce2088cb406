#!/usr/bin/env bash
# A/B of the balanced row split and the one-product attention projections: build f261e73
# (before) against 1923617 (after), the synthetic 20B in RAM (picchio synth --shape
# gpt-oss-20b, converted with the defaults), 2 threads, alternating.
set -u
OUT=${OUT:-/work/ab-split/out}; mkdir -p $OUT
C=/work/big/c20b
for r in ${ROUNDS:-1 2 3 4}; do
  for v in before after; do
    case $v in before) BIN=/work/big/picchio-f261e73;; after) BIN=/work/big/picchio-1923617;; esac
    $BIN -q bench -m $C --prompt 64 --gen 32 --threads 2 --json --device cpu --no-routing > $OUT/$v-r$r.json 2>$OUT/$v-r$r.log
    python3 -c "
import json; d=json.load(open('$OUT/$v-r$r.json'))
p,q=d['prefill'],d['decode']
f=lambda ph,k: 1e3*ph[k]/ph['tokens']
print('$v r$r', 'prefill %.2f tok/s | decode %.2f tok/s, %.1f ms/token (attention %.1f, experts %.1f, head %.1f), %.2fx the read floor (%.1f ms)' % (p['tokens_per_s'], q['tokens_per_s'], f(q,'seconds'), f(q,'attention_s'), f(q,'experts_s'), f(q,'head_s'), d['decode_over_read_floor'], 1e3*d['decode_read_floor_s_per_token']))
"
  done
done

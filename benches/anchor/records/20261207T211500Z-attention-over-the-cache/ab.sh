#!/usr/bin/env bash
# A/B of the attention over the cache (heads grouped by key/value head, a head's positions
# contiguous in the cache, lane-parallel dot products): build 1923617 (before) against the
# change (after), the synthetic 20B in RAM, 2 threads, alternating; a 1024-token prompt and
# 32 decoded tokens after it, then one round of the 64-token prompt.
set -u
OUT=${OUT:-/work/ab-attn/out}; mkdir -p $OUT
C=/work/big/c20b
AFTER=${AFTER:?the build after}
run() { # name prompt gen round
  local v=$1 p=$2 g=$3 r=$4 BIN
  case $v in before) BIN=/work/big/picchio-1923617;; after) BIN=$AFTER;; esac
  $BIN -q bench -m $C --prompt $p --gen $g --threads 2 --json --device cpu --no-routing > $OUT/$v-p$p-r$r.json 2>$OUT/$v-p$p-r$r.log
  python3 -c "
import json; d=json.load(open('$OUT/$v-p$p-r$r.json'))
p,q=d['prefill'],d['decode']
f=lambda ph,k: 1e3*ph[k]/ph['tokens']
print('$v prompt $p r$r', 'prefill %.2f tok/s (attention %.1f s, experts %.1f s) | decode %.2f tok/s, %.1f ms/token (attention %.1f, experts %.1f, head %.1f)' % (p['tokens_per_s'], p['attention_s'], p['experts_s'], q['tokens_per_s'], f(q,'seconds'), f(q,'attention_s'), f(q,'experts_s'), f(q,'head_s')))
"
}
for r in 1 2 3; do for v in before after; do run $v 1024 32 $r; done; done
for v in before after; do run $v 64 32 1; done

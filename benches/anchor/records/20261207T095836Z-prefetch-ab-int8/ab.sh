#!/usr/bin/env bash
# A/B of two builds on the 20B, every expert in RAM: A=$A B=$B, extra bench flags in $FLAGS.
set -u
OUT=/work/big/ab/$(date -u +%Y%m%dT%H%M%SZ); mkdir -p $OUT
for r in 1 2; do
  for t in 2 1; do
    for k in A B; do
      if [ $k = A ]; then bin=$A; else bin=$B; fi
      $bin bench -m /work/big/c20b --prompt 64 --gen 16 --threads $t --device cpu --json ${FLAGS:-} > $OUT/$k-t$t-r$r.json 2> $OUT/$k-t$t-r$r.log
      python3 - $OUT/$k-t$t-r$r.json $k $t $r <<'PY'
import json,sys
d=json.load(open(sys.argv[1]));p=d['prefill'];q=d['decode']
print(f"{sys.argv[2]:2} t{sys.argv[3]} r{sys.argv[4]}: prefill {p['tokens_per_s']:.2f} tok/s (attn {p['attention_s']:.2f} s, experts {p['experts_s']:.2f} s) decode {q['tokens_per_s']:.2f} tok/s (attn {q['attention_s']/q['tokens']*1e3:.1f} ms, experts {q['experts_s']/q['tokens']*1e3:.1f} ms, head {q['head_s']/q['tokens']*1e3:.1f} ms) read-floor x{d['decode_over_read_floor']:.2f} read {d['read_bandwidth_bytes_per_s']/1e9:.1f} GB/s")
PY
    done
  done
done | tee $OUT/summary.txt
echo "A=$A B=$B FLAGS=${FLAGS:-}" >> $OUT/summary.txt

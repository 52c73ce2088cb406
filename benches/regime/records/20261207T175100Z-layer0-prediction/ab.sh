#!/usr/bin/env bash
# A/B of the layer-0 prediction from the embedding: build d3c6289 (before) against the change,
# the regime's 16 GB row on the 12-layer skewed container, in its cgroup, page cache dropped.
set -u
CG=/sys/fs/cgroup/memory/picchio-regime
mkdir -p $CG; echo 6285548373 > $CG/memory.limit_in_bytes
OUT=${OUT:-/work/ab-l0/out}; mkdir -p $OUT
C=/work/regime/c-gpt-oss-120b-l12-s1
old=$(cat /sys/block/vda/queue/read_ahead_kb); echo 128 > /sys/block/vda/queue/read_ahead_kb
for r in ${ROUNDS:-1 2 3}; do
  for v in before after; do
    case $v in before) BIN=/work/big/picchio-d3c6289;; after) BIN=/work/big/picchio-l0pred;; esac
    rm -f $C/expert-usage.json; sync; echo 3 > /proc/sys/vm/drop_caches
    ( echo $BASHPID > $CG/tasks; exec $BIN -q bench -m $C --prompt 64 --gen 16 --threads 2 --json --device cpu --ram-gb 2.6715 ) > $OUT/picchio-$v-r$r.json 2>$OUT/$v-r$r.log
    python3 -c "
import json; d=json.load(open('$OUT/picchio-$v-r$r.json'))
p,q=d['prefill'],d['decode']
f=lambda ph,k: 1e3*ph[k]/ph['tokens']
print('$v r$r', 'prefill %.2f tok/s %.2fx idle %.1f ms/tok' % (p['tokens_per_s'], p['over_floor'], f(p,'seconds')-f(p,'disk_busy_s')), '| decode %.2f tok/s %.2fx idle %.1f ms/tok busy %.2f GB/s pred %d/%d wasted-or-abandoned %d' % (q['tokens_per_s'], q['over_floor'], f(q,'seconds')-f(q,'disk_busy_s'), q['disk_busy_bytes_per_s']/1e9, q['predicted_right'], q['predicted'], q['prefetch_abandoned']+q['prefetch_wasted']), '| MB/tok %.0f | disk %.2f' % (q['bytes_read_per_token']/1e6, d['disk_read_bandwidth_bytes_per_s']/1e9))
"
  done
done
echo $old > /sys/block/vda/queue/read_ahead_kb

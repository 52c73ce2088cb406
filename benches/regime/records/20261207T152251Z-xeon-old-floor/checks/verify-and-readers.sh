#!/usr/bin/env bash
# A/B of the 16 GB row: default vs --no-verify-reads vs --io-threads 8, in the regime's cgroup.
set -u
CG=/sys/fs/cgroup/memory/picchio-regime
mkdir -p $CG; echo 4528024106 > $CG/memory.limit_in_bytes
OUT=/tmp/ab16; mkdir -p $OUT
BIN=/work/big/picchio-fa6dc07; C=/work/regime/c-gpt-oss-120b-l6-s0
old=$(cat /sys/block/vda/queue/read_ahead_kb); echo 128 > /sys/block/vda/queue/read_ahead_kb
for r in 1 2; do
  for v in default noverify io8 io2; do
    case $v in default) extra="";; noverify) extra="--no-verify-reads";; io8) extra="--io-threads 8";; io2) extra="--io-threads 2";; esac
    rm -f $C/expert-usage.json; sync; echo 3 > /proc/sys/vm/drop_caches
    ( echo $BASHPID > $CG/tasks; exec $BIN -q bench -m $C --prompt 64 --gen 16 --threads 2 --json --device cpu --ram-gb 1.3358 $extra ) > $OUT/$v-r$r.json 2>$OUT/$v-r$r.log
    python3 -c "
import json; d=json.load(open('$OUT/$v-r$r.json'))
p,q=d['prefill'],d['decode']
print('$v r$r', 'prefill %.2f tok/s %.2fx busy %.2f GB/s check %.2f s' % (p['tokens_per_s'], p['over_floor'], p['disk_busy_bytes_per_s']/1e9, p['check_s']), '| decode %.2f %.2fx busy %.2f GB/s inflight %.2f' % (q['tokens_per_s'], q['over_floor'], q['disk_busy_bytes_per_s']/1e9, q.get('reads_in_flight',0)), '| disk %.2f/%.2f' % (d['disk_read_bandwidth_before_bytes_per_s']/1e9, d['disk_read_bandwidth_after_bytes_per_s']/1e9))
"
  done
done
echo $old > /sys/block/vda/queue/read_ahead_kb

#!/usr/bin/env bash
# The 16 GB row with and without the memory cgroup's limit (same --ram-gb).
set -u
CG=/sys/fs/cgroup/memory/picchio-regime
mkdir -p $CG; echo 4528024106 > $CG/memory.limit_in_bytes
OUT=/tmp/ab16b; mkdir -p $OUT
BIN=/work/big/picchio-fa6dc07; C=/work/regime/c-gpt-oss-120b-l6-s0
old=$(cat /sys/block/vda/queue/read_ahead_kb); echo 128 > /sys/block/vda/queue/read_ahead_kb
for r in 1 2; do
  for v in cgroup free; do
    rm -f $C/expert-usage.json; sync; echo 3 > /proc/sys/vm/drop_caches
    if [ $v = cgroup ]; then
      ( echo $BASHPID > $CG/tasks; exec $BIN -q bench -m $C --prompt 64 --gen 16 --threads 2 --json --device cpu --ram-gb 1.3358 ) > $OUT/$v-r$r.json 2>$OUT/$v-r$r.log
      grep -E "^(total_cache|total_rss|hierarchical_memory_limit|total_pgmajfault) " $CG/memory.stat | tr '\n' ' '; echo; cat $CG/memory.max_usage_in_bytes; echo 0 > $CG/memory.max_usage_in_bytes
    else
      $BIN -q bench -m $C --prompt 64 --gen 16 --threads 2 --json --device cpu --ram-gb 1.3358 > $OUT/$v-r$r.json 2>$OUT/$v-r$r.log
    fi
    python3 -c "
import json; d=json.load(open('$OUT/$v-r$r.json'))
p,q=d['prefill'],d['decode']
print('$v r$r', 'prefill %.2f tok/s %.2fx busy %.2f GB/s | decode %.2f %.2fx busy %.2f GB/s' % (p['tokens_per_s'], p['over_floor'], p['disk_busy_bytes_per_s']/1e9, q['tokens_per_s'], q['over_floor'], q['disk_busy_bytes_per_s']/1e9), '| disk %.2f/%.2f' % (d['disk_read_bandwidth_before_bytes_per_s']/1e9, d['disk_read_bandwidth_after_bytes_per_s']/1e9), 'rss %.2f GB' % (d['peak_rss_bytes']/1e9))
"
  done
done
echo $old > /sys/block/vda/queue/read_ahead_kb

#!/usr/bin/env bash
# The regime of issue 19 as a benchmark: GPT-OSS-120B's per-layer shape on machines of 16, 32 and
# 64 GB, modelled by a synthetic container of a few of its layers with the RAM budget and a memory
# cgroup scaled to the layers present (benches/regime/plan.py), page cache dropped before every
# run, Picchio against its floors and, with --llama, llama.cpp in the same limits. Uniform and
# skewed routing (picchio synth --routing-skew). Needs root (cgroups, drop_caches). Not run in CI:
# it is for the records in docs/perf.md. See benches/regime/README.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PICCHIO=""
WORK="${REGIME_WORK:-/work/regime}"
SHAPE="gpt-oss-120b"
FULL_LAYERS=36
LAYERS=6
MACHINES="16 32 64"
SKEWS="0 1"
PROMPT=64
GEN=16
THREADS=2
ROUNDS=1
LLAMA=0
ANCHOR_WORK="${ANCHOR_WORK:-/work/anchor}"
READ_AHEAD_KB=""
IN_RAM=1
SLACK_GB=1.5
DROP_CHECKPOINT=0
GPU_VRAM=""
EXTRA_PICCHIO=()

usage() {
  cat <<EOF
usage: $0 --picchio BIN [options]

  --picchio BIN        the picchio binary to measure (it also makes the synthetic checkpoints)
  --work DIR           checkpoints, containers and results (default \$REGIME_WORK or /work/regime);
                       what exists is reused
  --shape NAME         gpt-oss-120b (default, 36 layers) or gpt-oss-20b (24): the full model modelled
  --layers N           layers of the synthetic model (default 6)
  --machines "M ..."   machine sizes in GB to model (default "16 32 64")
  --skews "S ..."      routing skews, 0 = uniform (default "0 1"; docs/perf.md "Skewed synthetic routing")
  --prompt N           prompt tokens (default 64)
  --gen N              decoded tokens (default 16)
  --threads T          threads (default 2)
  --rounds R           rounds (default 1): every row runs R times, interleaved (Picchio, llama.cpp,
                       next machine, ...), and the table gives the median and range of each figure
  --llama              also run llama.cpp's llama-bench in the same limits (benches/anchor/anchor.sh
                       --prepare-only builds it and the GGUF in \$ANCHOR_WORK, default /work/anchor)
  --read-ahead-kb K    set the disk's read-ahead for the runs (restored afterwards); the value in
                       force is recorded either way
  --no-in-ram          skip the every-expert-in-RAM row
  --slack-gb G         working margin of the memory cgroup above Picchio's budget and dense
                       weights (default 1.5; plan.py says why)
  --drop-checkpoint    delete each synthetic checkpoint once its container (and GGUF) exist, to
                       save disk (a later run reuses the container and GGUF)
  --gpu-vram "F ..."   also run every machine's row on the GPU (CPU+GPU experts, --device gpu) with
                       VRAM for these fractions of the container's experts (e.g. "0.33 0.1"); the
                       adapter is whatever wgpu finds (WGPU_BACKEND picks the API; lavapipe on a
                       machine without a GPU)
  --picchio-arg ARG    one more argument for picchio bench (repeatable)
EOF
  exit 2
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --picchio) PICCHIO="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --machines) MACHINES="$2"; shift 2 ;;
    --skews) SKEWS="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --gen) GEN="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --llama) LLAMA=1; shift ;;
    --read-ahead-kb) READ_AHEAD_KB="$2"; shift 2 ;;
    --no-in-ram) IN_RAM=0; shift ;;
    --slack-gb) SLACK_GB="$2"; shift 2 ;;
    --drop-checkpoint) DROP_CHECKPOINT=1; shift ;;
    --gpu-vram) GPU_VRAM="$2"; shift 2 ;;
    --picchio-arg) EXTRA_PICCHIO+=("$2"); shift 2 ;;
    -h|--help) usage ;;
    *) echo "regime: unknown argument '$1'" >&2; usage ;;
  esac
done

die() { echo "regime: $*" >&2; exit 1; }
log() { echo "[regime $(date -u +%H:%M:%S)] $*" >&2; }

[[ -n "$PICCHIO" && -x "$PICCHIO" ]] || die "--picchio: '$PICCHIO' is not an executable"
case "$SHAPE" in
  gpt-oss-120b) FULL_LAYERS=36 ;;
  gpt-oss-20b) FULL_LAYERS=24 ;;
  *) die "--shape: '$SHAPE' is not gpt-oss-120b or gpt-oss-20b" ;;
esac
PICCHIO="$(cd "$(dirname "$PICCHIO")" && pwd)/$(basename "$PICCHIO")"
for n in "$LAYERS" "$PROMPT" "$GEN" "$THREADS"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "'$n' is not a positive integer"
done
(( LAYERS <= FULL_LAYERS )) || die "--layers $LAYERS: the $SHAPE has $FULL_LAYERS layers"
[[ "$SLACK_GB" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--slack-gb: '$SLACK_GB' is not a size in GB"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds: '$ROUNDS' is not a count >= 1"
for m in $MACHINES; do [[ "$m" =~ ^[1-9][0-9]*$ ]] || die "--machines: '$m' is not a size in GB"; done
for s in $SKEWS; do [[ "$s" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--skews: '$s' is not a number >= 0"; done
for f in $GPU_VRAM; do [[ "$f" =~ ^0?\.[0-9]+$|^1(\.0+)?$ ]] || die "--gpu-vram: '$f' is not a fraction in (0, 1]"; done
[[ -z "$READ_AHEAD_KB" || "$READ_AHEAD_KB" =~ ^[0-9]+$ ]] || die "--read-ahead-kb: '$READ_AHEAD_KB' is not a size"
[[ "$(id -u)" == 0 ]] || die "needs root: memory cgroups and dropping the page cache"

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"

# ---- the memory cgroup (v2, else v1) ----------------------------------------------------------------
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  CG=/sys/fs/cgroup/picchio-regime
  mkdir -p "$CG"
  cg_limit() { echo "$1" >"$CG/memory.max"; echo 0 >"$CG/memory.swap.max" 2>/dev/null || true; }
  cg_enter() { echo "$BASHPID" >"$CG/cgroup.procs"; }
else
  CG=/sys/fs/cgroup/memory/picchio-regime
  mkdir -p "$CG"
  cg_limit() { echo "$1" >"$CG/memory.limit_in_bytes"; }
  cg_enter() { echo "$BASHPID" >"$CG/tasks"; }
fi
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# ---- the disk's read-ahead (the value in force is part of every record) ---------------------------
DEV="$(basename "$(findmnt -no SOURCE --target "$WORK" | sed 's#\[.*##')")"
RA_FILE="/sys/class/block/$DEV/queue/read_ahead_kb"
if [[ ! -f "$RA_FILE" ]]; then # a partition: the queue belongs to its disk
  RA_FILE="$(dirname "$(readlink -f "/sys/class/block/$DEV")")/queue/read_ahead_kb"
fi
RA_BEFORE="$(cat "$RA_FILE" 2>/dev/null || echo unknown)"
if [[ -n "$READ_AHEAD_KB" ]]; then
  [[ -w "$RA_FILE" ]] || die "cannot set read-ahead: $RA_FILE is not writable"
  echo "$READ_AHEAD_KB" >"$RA_FILE"
  trap 'echo "$RA_BEFORE" >"$RA_FILE"' EXIT
fi
RA_NOW="$(cat "$RA_FILE" 2>/dev/null || echo unknown)"

# llama-bench of anchor.sh's native build (build/llama.cpp-VERSION), never one of its other
# instruction sets (build/llama.cpp-VERSION-avx2, which models an older machine).
native_llama_bench() {
  ls "$ANCHOR_WORK"/build/llama.cpp-*/bin/llama-bench 2>/dev/null \
    | grep -E '/llama\.cpp-[0-9.]+/bin/llama-bench$' | head -n1 || true
}

# ---- checkpoints and containers -------------------------------------------------------------------
prepare() { # skew -> sets SYNTH, CONTAINER, GGUF
  local s="$1"
  SYNTH="$WORK/synth-$SHAPE-l$LAYERS-s$s"
  CONTAINER="$WORK/c-$SHAPE-l$LAYERS-s$s"
  GGUF=""
  [[ "$LLAMA" == 1 ]] && GGUF="$ANCHOR_WORK/$(basename "$SYNTH")-mxfp4-bf16.gguf"
  # Everything already made from this checkpoint: nothing to synthesize.
  if [[ -f "$CONTAINER/.regime-ok" ]] && [[ -z "$GGUF" || ( -f "$GGUF.done" && -f "$GGUF" && -n "$LLAMA_BENCH" ) ]]; then
    return
  fi
  if [[ ! -f "$SYNTH/.regime-ok" ]]; then
    log "picchio synth --shape $SHAPE --layers $LAYERS --routing-skew $s -> $SYNTH"
    rm -rf "$SYNTH"
    "$PICCHIO" -q synth "$SYNTH" --shape "$SHAPE" --layers "$LAYERS" --routing-skew "$s"
    touch "$SYNTH/.regime-ok"
  fi
  if [[ ! -f "$CONTAINER/.regime-ok" ]]; then
    log "picchio convert -> $CONTAINER"
    rm -rf "$CONTAINER"
    "$PICCHIO" -q convert "$SYNTH" "$CONTAINER"
    touch "$CONTAINER/.regime-ok"
  fi
  if [[ "$LLAMA" == 1 ]]; then
    log "llama.cpp and the GGUF (benches/anchor/anchor.sh --prepare-only)"
    "$HERE/../anchor/anchor.sh" --prepare-only --synth "$SYNTH" --work "$ANCHOR_WORK" >&2
    [[ -f "$GGUF" ]] || die "anchor.sh made no $GGUF"
    LLAMA_BENCH="$(native_llama_bench)"
  fi
  if [[ "$DROP_CHECKPOINT" == 1 ]]; then
    log "dropping the checkpoint $SYNTH (--drop-checkpoint)"
    rm -rf "$SYNTH"
  fi
}

STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$WORK/results/$STAMP"
mkdir -p "$OUT"
LLAMA_BENCH="$(native_llama_bench)"
{
  echo "date_utc=$STAMP"
  echo "cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n1)"
  # "AMD EPYC" names Zen 4 and Zen 5 alike (and a VM can move between them): the family says which.
  echo "cpu_family=$(lscpu | sed -n 's/^CPU family:[[:space:]]*//p' | head -n1) cpu_model=$(lscpu | sed -n 's/^Model:[[:space:]]*//p' | head -n1)"
  echo "cores=$(nproc)"
  echo "mem=$(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
  echo "disk=$DEV read_ahead_kb=$RA_NOW (before the run: $RA_BEFORE)"
  echo "picchio=$PICCHIO"
  echo "shape=$SHAPE layers=$LAYERS of $FULL_LAYERS machines=$MACHINES skews=$SKEWS"
  echo "prompt=$PROMPT gen=$GEN threads=$THREADS rounds=$ROUNDS cgroup_margin_gb=$SLACK_GB"
  echo "hot_set=none (every Picchio run starts without a learned hot set: expert-usage.json is removed first)"
} >"$OUT/machine.txt"
: >"$OUT/commands.txt"

# What the whole process did (GNU time): blocks read from the file system (512 B, direct reads
# included), major page faults, peak RSS in KiB, wall seconds.
TIME_FORMAT="fs_read_blocks=%I major_faults=%F max_rss_kib=%M wall_s=%e"
[[ -x /usr/bin/time ]] || die "needs GNU time (/usr/bin/time) to count the bytes each engine reads"

# One measured command, after dropping the page cache, in the cgroup when a limit is given.
measure() { # name limit-bytes|"" command...
  local name="$1" limit="$2"
  shift 2
  echo "[$name] limit=${limit:-none} $*" >>"$OUT/commands.txt"
  # Every run starts from the same state: no hot set learned by the run before it.
  rm -f "$CONTAINER/expert-usage.json"
  drop_caches
  if [[ -n "$limit" ]]; then
    cg_limit "$limit"
    ( cg_enter; exec /usr/bin/time -f "$TIME_FORMAT" -o "$OUT/$name.time" "$@" ) >"$OUT/$name.json" 2>"$OUT/$name.log" \
      || die "$name failed: $OUT/$name.log"
  else
    /usr/bin/time -f "$TIME_FORMAT" -o "$OUT/$name.time" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log" \
      || die "$name failed: $OUT/$name.log"
  fi
}

for s in $SKEWS; do
  prepare "$s"
  echo "container_s$s=$CONTAINER" >>"$OUT/machine.txt"
  pic=("$PICCHIO" -q bench -m "$CONTAINER" --prompt "$PROMPT" --gen "$GEN" --threads "$THREADS" --json)
  pic+=("${EXTRA_PICCHIO[@]}")
  lla=()
  if [[ -n "$GGUF" ]]; then
    [[ -x "$LLAMA_BENCH" ]] || die "no llama-bench under $ANCHOR_WORK/build"
    echo "llama_bench=$LLAMA_BENCH gguf_s$s=$GGUF" >>"$OUT/machine.txt"
    lla=("$LLAMA_BENCH" -m "$GGUF" -p "$PROMPT" -n "$GEN" -t "$THREADS" -r 1 --repack 0 -o json)
  fi
  for m in $MACHINES; do
    plan="$(python3 "$HERE/plan.py" "$CONTAINER" --full-layers "$FULL_LAYERS" --machine-gb "$m" --slack-gb "$SLACK_GB")" \
      || die "plan.py failed for $CONTAINER"
    eval "$plan"
    echo "plan_s${s}_m$m $(echo $plan)" >>"$OUT/machine.txt"
    eval "RAM_GB_m$m=$RAM_GB CGROUP_m$m=$CGROUP_BYTES"
  done
  EXPERTS_GB="$(python3 -c 'import os,sys; print(f"{os.path.getsize(sys.argv[1]) / 2**30:.4f}")' "$CONTAINER/experts.bin")"
  DENSE_BYTES="$(stat -c %s "$CONTAINER/dense.bin")"
  SOFTWARE_GPU=0
  if [[ -n "$GPU_VRAM" ]]; then
    adapter="$("$PICCHIO" -q devices 2>/dev/null | head -n 3 || true)"
    if grep -qi "llvmpipe\|lavapipe\|swiftshader\|cpu" <<<"$adapter"; then SOFTWARE_GPU=1; fi
    echo "gpu_adapter=$(echo $adapter) software=$SOFTWARE_GPU" >>"$OUT/machine.txt"
  fi
  for r in $(seq 1 "$ROUNDS"); do
    for m in $MACHINES; do
      eval "RAM_GB=\$RAM_GB_m$m CGROUP_BYTES=\$CGROUP_m$m"
      log "round $r, skew $s, $m GB machine: --ram-gb $RAM_GB, cgroup $((CGROUP_BYTES >> 20)) MiB"
      measure "picchio-s$s-m$m-r$r" "$CGROUP_BYTES" "${pic[@]}" --device cpu --ram-gb "$RAM_GB"
      if [[ ${#lla[@]} -gt 0 ]]; then measure "llama-s$s-m$m-r$r" "$CGROUP_BYTES" "${lla[@]}"; fi
      for f in $GPU_VRAM; do
        vram="$(python3 -c 'import sys; print(f"{float(sys.argv[1]) * float(sys.argv[2]):.4f}")' "$f" "$EXPERTS_GB")"
        # A software adapter's VRAM is this process's memory: the cgroup grows by the expert
        # slots and the GPU's copy of the dense weights, so the host keeps the same budget.
        limit="$CGROUP_BYTES"
        if [[ "$SOFTWARE_GPU" == 1 ]]; then
          limit="$(python3 -c 'import sys; print(int(sys.argv[1]) + int(float(sys.argv[2]) * 2**30) + int(sys.argv[3]))' \
            "$CGROUP_BYTES" "$vram" "$DENSE_BYTES")"
        fi
        log "round $r, skew $s, $m GB machine, CPU+GPU experts: --vram-gb $vram ($f of the experts), cgroup $((limit >> 20)) MiB"
        measure "picchio-s$s-m$m-g$f-r$r" "$limit" "${pic[@]}" --ram-gb "$RAM_GB" \
          --device gpu --vram-gb "$vram" --stats
      done
    done
    if [[ "$IN_RAM" == 1 ]]; then
      log "round $r, skew $s, every expert in RAM (no cgroup)"
      measure "picchio-s$s-ram-r$r" "" "${pic[@]}" --device cpu
      if [[ ${#lla[@]} -gt 0 ]]; then measure "llama-s$s-ram-r$r" "" "${lla[@]}"; fi
    fi
  done
done

python3 "$HERE/summarize.py" "$OUT" | tee "$OUT/table.md"
log "raw results in $OUT"

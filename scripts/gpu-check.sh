#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and no Rust toolchain (nor network), from a binary
# and test executables built beforehand, run the GPU tests, `picchio devices`, the kernel
# microbenchmark (`picchio bench-gpu`) and `picchio bench --device gpu` on a synthetic
# GPT-OSS-20B (every expert resident, also with an f16 key/value cache, with --verify, and
# with --vram-gb holding a third and a tenth of the experts: CPU+GPU experts, and for
# contrast uploads of missing experts; and the CPU alone), writing summary.md and the raw
# outputs into an output directory.
#
# Usage:
#   scripts/gpu-check.sh --prepare DIR [--small]   # here (after the builds below): pack into DIR
#   DIR/gpu-check.sh [--small] [OUT]               # there: run from the pack (OUT default $OUT)
#   scripts/gpu-check.sh [--small] [--root ROOT] [--tests DIR] [OUT]   # run from a built tree
#
# Build first (here):
#   cargo build --release
#   cargo test --release --no-run --test gpu_translate --test gpu_kernels --test gpu_fused --test gpu_sampling \
#       --test gpu_parity --test gpu_slots --test gpu_qwen3 --test gpu_cli --test gpu_split
#
# For the device machine's carry (ignored paths only, 64 MiB): --prepare target/gpu-pack, then
# carry target/gpu-pack.tar.xz (38 MB with the binary and the 7 GPU test executables, measured at 529ae7f)
# and run: mkdir -p /tmp/p && tar -C /tmp/p -xf target/gpu-pack.tar.xz && /tmp/p/gpu-check.sh "$OUT"
#
# --small: small shapes everywhere (bench-gpu --quick, a 2-layer synthetic of hidden 256) to
# prove the script on a software adapter (lavapipe) in a few minutes; the full run takes the
# real 20B shape and needs about 30 GB of disk and a GPU with about 16 GB.
#
# The test executables have their build tree's path compiled in (CARGO_MANIFEST_DIR for the
# fixtures, CARGO_BIN_EXE_picchio for the binary). The pack records that path and mirrors the
# tree's fixtures/ and target/release/ under DIR/root; on the GPU machine, when the path does
# not exist, the script links it to DIR/root (creating its parent directories).
set -uo pipefail

small=0
prepare=""
root=""
tests=""
out="${OUT:-}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
while [ $# -gt 0 ]; do
    case "$1" in
        --small) small=1 ;;
        --prepare) prepare="$2"; shift ;;
        --root) root="$2"; shift ;;
        --tests) tests="$2"; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
        *) out="$1" ;;
    esac
    shift
done

GPU_TESTS="gpu_translate gpu_kernels gpu_fused gpu_sampling gpu_parity gpu_slots gpu_qwen3 gpu_cli gpu_split"

# The newest executable of test $1 under $2 (cargo names them NAME-HASH).
newest_test() {
    ls -t "$2"/"$1"-* 2>/dev/null | grep -E "/$1-[0-9a-f]{16}$" | head -n 1
}

if [ -n "$prepare" ]; then
    src="$(cd "$here/.." && pwd)"
    target="${CARGO_TARGET_DIR:-$src/target}"
    [ -x "$target/release/picchio" ] || { echo "gpu-check: build first: cargo build --release" >&2; exit 1; }
    mkdir -p "$prepare/root/target/release/deps" || exit 1
    echo "$src" > "$prepare/build-root"
    [ "$target" = "$src/target" ] || echo "gpu-check: warning: CARGO_TARGET_DIR is not $src/target; tests look for the binary at $target/release/picchio" >&2
    echo "$target" > "$prepare/build-target"
    cp -r "$src/fixtures" "$prepare/root/" || exit 1
    strip -o "$prepare/root/target/release/picchio" "$target/release/picchio" || exit 1
    for t in $GPU_TESTS; do
        exe="$(newest_test "$t" "$target/release/deps")"
        if [ -z "$exe" ]; then
            echo "gpu-check: no test executable for $t (cargo test --release --no-run --test $t)" >&2
            continue
        fi
        strip -o "$prepare/root/target/release/deps/$(basename "$exe")" "$exe" || exit 1
    done
    cp "$0" "$prepare/gpu-check.sh"
    git -C "$src" rev-parse HEAD > "$prepare/commit" 2>/dev/null || echo unknown > "$prepare/commit"
    # One compressed file for the carry (tar and xz or gzip are all it needs there).
    if command -v xz >/dev/null; then
        tar -C "$prepare" -cJf "$prepare.tar.xz" . && packed="$prepare.tar.xz"
    else
        tar -C "$prepare" -czf "$prepare.tar.gz" . && packed="$prepare.tar.gz"
    fi
    du -sh "$prepare" "$packed"
    echo "carry $packed (or $prepare), then: mkdir -p P && tar -C P -xf $(basename "$packed") && P/gpu-check.sh [--small] \"\$OUT\""
    exit 0
fi

# Where the binary and the tests are: the pack around this script, or a built tree.
if [ -z "$root" ] && [ -f "$here/build-root" ]; then
    build_root="$(cat "$here/build-root")"
    build_target="$(cat "$here/build-target")"
    if [ ! -e "$build_root/fixtures" ]; then
        mkdir -p "$(dirname "$build_root")" && ln -sfn "$here/root" "$build_root" \
            || echo "gpu-check: cannot link $build_root to the pack; the test executables will not find their fixtures" >&2
    fi
    if [ ! -e "$build_target/release/picchio" ]; then
        mkdir -p "$(dirname "$build_target")" && ln -sfn "$here/root/target" "$build_target" 2>/dev/null
    fi
    root="$here/root"
    commit="$(cat "$here/commit")"
else
    root="${root:-$(cd "$here/.." && pwd)}"
    commit="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
fi
target="${CARGO_TARGET_DIR:-$root/target}"
[ -f "$here/build-root" ] && target="$root/target"
bin="$target/release/picchio"
tests="${tests:-$target/release/deps}"
[ -x "$bin" ] || { echo "gpu-check: no binary at $bin" >&2; exit 1; }
[ -n "$out" ] || { echo "gpu-check: give an output directory (or set OUT)" >&2; exit 2; }
mkdir -p "$out" || exit 1
out="$(cd "$out" && pwd)"
work="${GPU_CHECK_WORK:-$(mktemp -d)}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
export PICCHIO_REQUIRE_GPU=1
start=$(date +%s)
summary="$out/summary.md"
status=0

elapsed() { echo $(( $(date +%s) - start )); }
# run NAME TIMEOUT CMD...: stdout to NAME.out, stderr to NAME.err, a summary line.
run() {
    local name="$1" limit="$2"; shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.out" 2> "$out/$name.err"
    local rc=$?
    local secs=$(( $(date +%s) - t0 ))
    [ $rc -eq 0 ] || status=1
    echo "| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc$([ $rc -eq 124 ] && echo ', timed out'))") | ${secs} s | \`$(echo "$*" | sed "s|$root/||g; s|$work/||g" | cut -c1-160)\` |" >> "$summary"
    return $rc
}

{
    echo "# GPU check"
    echo
    echo "- commit: $commit"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- host: $(uname -srm); $(nproc) cores; $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB RAM"}')"
    echo "- mode: $([ $small = 1 ] && echo 'SMALL shapes (--small): a check of the path, not GPT-OSS-20B' || echo 'GPT-OSS-20B shapes')"
    echo
    echo "| step | result | time | command |"
    echo "|---|---|---|---|"
} > "$summary"

run devices 60 "$bin" devices

for t in $GPU_TESTS; do
    exe="$(newest_test "$t" "$tests")"
    if [ -z "$exe" ]; then
        echo "| test $t | MISSING | | not in $tests |" >> "$summary"
        status=1
        continue
    fi
    run "test-$t" 240 "$exe" --test-threads 2
done

if [ $small = 1 ]; then
    run bench-gpu 300 "$bin" bench-gpu --quick --ctx 1024,8192 --reps 5 --json
    synth=(synth --shape tiny --layers 2 --hidden 256 --experts 8 --top-k 4)
    bench=(--prompt 16 --gen 8)
else
    run bench-gpu 300 "$bin" bench-gpu --layers 24 --ctx 1024,8192 --reps 50 --json
    synth=(synth --shape gpt-oss-20b)
    bench=(--prompt 64 --gen 32)
fi

# A synthetic checkpoint, converted once into the cache by the first bench.
model="$work/synth"
cache="$work/cache"
if [ ! -e "$model/config.json" ]; then
    run synth 300 "$bin" "${synth[@]}" "$model"
fi
common=(bench -m "$model" --cache-dir "$cache" --device gpu "${bench[@]}")
run bench-resident 600 "$bin" "${common[@]}" --json
run bench-resident-kvf16 600 "$bin" "${common[@]}" --kv-cache f16 --json
run bench-verify 600 "$bin" "${common[@]}" --verify --no-routing
experts_bytes=$(find "$cache" -name experts.bin -printf '%s\n' 2>/dev/null | head -n 1)
if [ -n "$experts_bytes" ]; then
    for part in 3 10; do
        gib=$(awk -v b="$experts_bytes" -v p="$part" 'BEGIN { printf "%.9f", b / p / 1073741824 }')
        run "bench-vram-1of$part" 600 "$bin" "${common[@]}" --vram-gb "$gib" --json
        run "bench-vram-1of$part-upload" 600 "$bin" "${common[@]}" --vram-gb "$gib" --expert-misses upload --json
    done
    # The CPU alone, for CPU+GPU experts to beat at every budget.
    run bench-cpu 600 "$bin" bench -m "$model" --cache-dir "$cache" --device cpu "${bench[@]}" --json
else
    echo "| bench --vram-gb | SKIPPED | | no converted experts.bin under the cache |" >> "$summary"
    status=1
fi

# The figures, from the raw outputs.
{
    echo
    echo "## Kernels (bench-gpu)"
    echo
    if command -v python3 >/dev/null; then
        python3 - "$out/bench-gpu.out" <<'EOF' || echo "(bench-gpu output not readable; see bench-gpu.out)"
import json, sys
d = json.load(open(sys.argv[1]))
r = d["report"]
print(f"{d['machine']}; clock: {d['clock_description']}; quick: {d['quick']}; layers {r['shape']['layers']}")
print()
print("| case | format | calls | us/call | MB/call | GB/s | copy GB/s | ratio |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for c in r["cases"]:
    print(f"| {c['case']} | {c['format']} | {c['kernel']['calls']} | {c['kernel']['seconds_per_call']*1e6:.1f} | "
          f"{c['bytes']/1e6:.2f} | {c['kernel_bytes_per_s']/1e9:.3g} | {c['copy_bytes_per_s']/1e9:.3g} | {c['ratio']:.3g} |")
EOF
    else
        echo "(no python3 here: see bench-gpu.out)"
    fi
    echo
    echo "## Decode (bench --device gpu)"
    echo
    if command -v python3 >/dev/null; then
        python3 - "$out" <<'EOF' || true
import json, os, sys
out = sys.argv[1]
import re
split = re.compile(r"per decoded token: (experts .*)")
print("| run | decode tok/s | prefill tok/s | dispatches/token | per layer | submissions/token | waits/token | bytes read back/token |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
runs = ["bench-resident", "bench-resident-kvf16", "bench-vram-1of3", "bench-vram-1of3-upload",
        "bench-vram-1of10", "bench-vram-1of10-upload", "bench-cpu"]
lines = []
for name in runs:
    try:
        d = json.load(open(os.path.join(out, name + ".out")))
    except Exception as e:
        print(f"| {name} | not readable ({type(e).__name__}) | | | | | | |")
        continue
    c = d.get("device_decode") or {}
    g = lambda k: c.get(k, float("nan"))
    print(f"| {name} | {d['decode']['tokens_per_s']:.2f} | {d['prefill']['tokens_per_s']:.2f} | {g('dispatches_per_token'):.1f} | "
          f"{g('dispatches_per_layer'):.1f} | {g('submissions_per_token'):.2f} | {g('readbacks_per_token'):.2f} | {g('readback_bytes_per_token'):.0f} |")
    report = d.get("device_report") or []
    for line in report if isinstance(report, list) else [str(report)]:
        m = split.search(str(line))
        if m:
            lines.append(f"- {name}: {m.group(1)}")
if lines:
    print()
    print("Per decoded token, experts on each side (CPU+GPU experts, or uploads):")
    print()
    print("\n".join(lines))
EOF
    fi
    echo
    echo "verify: $(grep -h '^verify:' "$out/bench-verify.out" "$out/bench-verify.err" 2>/dev/null | head -n 1)"
    echo
    echo "total: $(elapsed) s; raw outputs beside this file (NAME.out, NAME.err)"
} >> "$summary"
cat "$summary"
exit $status

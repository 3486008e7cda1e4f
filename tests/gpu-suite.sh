#!/usr/bin/env bash
# The GPU suite: every `tests/tests/gpu*.rs` test binary (built only with `--features cuda`, so
# `cargo test --workspace` never runs them), built on this machine and run on a machine with an
# NVIDIA GPU (the H200: CUDA 13, no Rust toolchain). Its last line is `N passed, M failed`.
#
#   tests/gpu-suite.sh stage [TEST...]   here, from the repository root: builds the gpu* test
#                                        binaries of one GPU (release, cuda; or only the TESTs
#                                        named) and stages them, stripped and xz-compressed, with
#                                        this script in .gpu/suite/ (git-ignored); gpu_two (two
#                                        GPUs, NCCL) only when named: `stage gpu_two` for a
#                                        two-GPU machine
#   bash .gpu/suite/gpu-suite.sh run     on the GPU machine, from the repository root with .gpu/
#                                        carried along: runs every staged binary one test at a time
#                                        and prints a table, then `N passed, M failed`
#   bash .gpu/suite-K/gpu-suite.sh run   the same for part K: `stage` also splits the binaries into
#                                        parts .gpu/suite-1, -2, ... (hard links) that each fit the
#                                        device tool's carry (64 MB) beside the tracked tree, so
#                                        each part is one call (`carry: [".gpu/suite-K"]`)
#
# The tests read the fixtures from tests/fixtures/ ($DEEPINFER_FIXTURES overrides the root). Logs
# go to $GPU_SUITE_LOGS (default $OUT/gpu-suite when $OUT is set, else /tmp/gpu-suite).
# `run` exports DEEPINFER_CUDA_POISON=1 (unless set): every output the CUDA code allocates
# uninitialised (no zero fill) starts as 0xFF bytes, NaN in every float type, so an element a
# kernel forgets to write fails its test.
# GPU_SUITE_PROFILE=dev stages unoptimised binaries (a quick check of the staging; the suite's
# numbers come from the default, release).
set -euo pipefail

stage() {
  local tests=("$@")
  if [ ${#tests[@]} -eq 0 ]; then
    for f in tests/tests/gpu*.rs; do
      [ "$f" = tests/tests/gpu_two.rs ] || tests+=("$(basename "$f" .rs)")
    done
  fi
  local args=()
  for t in "${tests[@]}"; do args+=(--test "$t"); done
  rm -rf .gpu/suite
  mkdir -p .gpu/suite/bin
  local exes
  exes=$(cargo test --locked -p deepinfer-tests --profile "${GPU_SUITE_PROFILE:-release}" \
    --features cuda --no-run "${args[@]}" \
    --message-format=json-render-diagnostics \
    | grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//')
  [ -n "$exes" ] || { echo "gpu-suite: the build produced no test binary" >&2; exit 1; }
  for exe in $exes; do
    local name
    name=$(basename "$exe" | sed -E 's/-[0-9a-f]{16}$//')
    strip -o ".gpu/suite/bin/$name" "$exe"
    xz -T2 -6 ".gpu/suite/bin/$name"
  done
  cp "$0" .gpu/suite/gpu-suite.sh
  ls -s --block-size=K .gpu/suite/bin
  du -sh .gpu/suite | sed 's/^/gpu-suite: staged /'
  split_parts
}

# .gpu/suite's binaries in parts .gpu/suite-K, first fit by size, largest first, each at most
# 64 MB less the tracked files and 2 MiB (what a device call carries besides; a carry of 66.7 MB
# in all was refused, 62.4 MB taken).
split_parts() {
  local tracked budget
  tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{ s += $1 } END { print s + 0 }')
  budget=$((64 * 1000 * 1000 - tracked - 2 * 1024 * 1024))
  rm -rf .gpu/suite-[0-9]*
  local used=() f size k placed
  for f in $(ls -S .gpu/suite/bin/*.xz); do
    size=$(stat -c %s "$f")
    placed=0
    for k in "${!used[@]}"; do
      if [ $((used[k] + size)) -le "$budget" ]; then placed=1; break; fi
    done
    if [ "$placed" -eq 0 ]; then k=${#used[@]}; used[k]=0; fi
    used[k]=$((used[k] + size))
    mkdir -p ".gpu/suite-$((k + 1))/bin"
    ln -f "$f" ".gpu/suite-$((k + 1))/bin/"
    cp .gpu/suite/gpu-suite.sh ".gpu/suite-$((k + 1))/gpu-suite.sh"
  done
  for k in "${!used[@]}"; do
    echo "gpu-suite: part .gpu/suite-$((k + 1)): $(ls .gpu/suite-$((k + 1))/bin | sed 's/\.xz$//' | tr '\n' ' ')($((used[k] / 1024)) KiB)"
  done
}

run() {
  local dir bins logs
  dir=$(cd "$(dirname "$0")" && pwd)
  bins=/tmp/gpu-suite-bin
  logs=${GPU_SUITE_LOGS:-${OUT:+$OUT/gpu-suite}}
  logs=${logs:-/tmp/gpu-suite}
  mkdir -p "$bins" "$logs"
  export DEEPINFER_FIXTURES=${DEEPINFER_FIXTURES:-$PWD/tests/fixtures}
  # Poisoned: outputs allocated uninitialised start as 0xFF bytes (NaN), so an unwritten element
  # fails the bitwise tests (DEEPINFER_CUDA_POISON=0 in the environment turns it off).
  export DEEPINFER_CUDA_POISON=${DEEPINFER_CUDA_POISON:-1}
  [ -f "$DEEPINFER_FIXTURES/v41/v41-tiny/config.json" ] \
    || { echo "gpu-suite: no fixtures at $DEEPINFER_FIXTURES (run from the repository root)" >&2; exit 2; }
  # The CUDA libraries: NVRTC needs $CUDA_HOME/include; cudarc looks for libnccl.so, the pip
  # package ships only libnccl.so.2; NVLink multicast stays off.
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  local nv
  nv=$(python3 -c 'import nvidia,os;print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  [ -n "$nv" ] && [ -e "$nv/nccl/lib/libnccl.so.2" ] && ln -sf "$nv/nccl/lib/libnccl.so.2" "$bins/libnccl.so"
  export LD_LIBRARY_PATH=$bins:$CUDA_HOME/lib64:/usr/local/nvidia/lib64${nv:+:$nv/cu13/lib:$nv/nccl/lib}:${LD_LIBRARY_PATH:-}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  local passed=0 failed=0 table=""
  for packed in "$dir"/bin/*.xz; do
    local name exe log p f rc
    name=$(basename "$packed" .xz)
    exe="$bins/$name"
    log="$logs/$name.log"
    xz -dc "$packed" > "$exe" && chmod +x "$exe"
    local started=$SECONDS
    rc=0
    "$exe" --test-threads=1 > "$log" 2>&1 || rc=$?
    # libtest: "test result: FAILED. 3 passed; 2 failed; 0 ignored; ..."
    p=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' "$log" | tail -1)
    f=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' "$log" | tail -1)
    i=$(sed -n 's/^test result: .* \([0-9]*\) ignored;.*/\1/p' "$log" | tail -1)
    if [ -z "$p" ]; then p=0; f=1; fi              # no summary: the binary crashed or did not start
    if [ "${i:-0}" -gt 0 ]; then f=$((f + i)); fi  # an ignored GPU test did not run: a failure
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f))
    table+=$(printf '%-18s %4d passed %4d failed %5ds' "$name" "$p" "$f" $((SECONDS - started)))$'\n'
    grep -E '^test .* FAILED$|panicked at' "$log" | head -20 || true
  done
  printf '%s' "$table"
  echo "logs: $logs"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n 2,17p "$0"; exit 2 ;;
esac

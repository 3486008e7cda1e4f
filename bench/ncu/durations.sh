#!/usr/bin/env bash
# ncu's duration of every kernel of `device_bench --numerics fast --sections block --quick`, for
# each staged executable named (.gpu/bin/NAME, or .gpu/*/NAME.xz unpacked there first): one pass,
# no replay (gpu__time_duration only), the CSV gzipped to $OUT/ncu_NAME.csv.gz. On the GPU
# machine, from the repository root; read it with bench/ncu/steps.py. NCU_S bounds each run.
# BENCH_ARGS replaces the bench's arguments after `--numerics fast` (e.g. "--sections block" for
# the 1024-token prefill); LAUNCHES stops profiling after that many kernels (the run goes on).
set -u
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "durations.sh: no ncu on this machine" >&2; exit 2; }
for name in "$@"; do
  bash "$(dirname "$0")/unpack.sh" "$name" || exit 2
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "${NCU_S:-200}" "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    ${LAUNCHES:+--launch-count "$LAUNCHES"} --log-file "$OUT/ncu_$name.csv" \
    bash .gpu/run.sh "$name" --numerics fast ${BENCH_ARGS:---sections block --quick} \
    > "$OUT/ncu_$name.out" 2>&1
  echo "$name: rc $? in $((SECONDS - start)) s, $(grep -c gpu__time_duration "$OUT/ncu_$name.csv" 2>/dev/null) kernels"
  gzip -f "$OUT/ncu_$name.csv"
done

#!/usr/bin/env bash
# ncu's source-level profile (SASS stall samples and instruction counts) of the kernels named by
# the regex $KERNELS in `device_bench --numerics fast --sections block --quick` of the staged
# executable $1: the $COUNT launches of those kernels after the first $SKIP (bench/ncu/steps.py
# --ordinal finds where a decode step starts). BENCH_ARGS replaces the arguments after
# `--numerics fast`, as in durations.sh ("--sections block": the first launches are the
# 1024-token warm-up prefill's). To $OUT: details.txt.gz (every section) and
# source.csv.gz (per SASS instruction), read with bench/ncu/source.py. On the GPU machine, from
# the repository root.
set -u
name=$1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "source.sh: no ncu on this machine" >&2; exit 2; }
bash "$(dirname "$0")/unpack.sh" "$name" || exit 2
timeout "${NCU_S:-300}" "$NCU" --clock-control none -k "regex:^(${KERNELS})\$" --launch-skip "${SKIP:-0}" \
  --launch-count "${COUNT:-16}" --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section WarpStateStats --section SourceCounters --section SchedulerStats --warp-sampling-interval 0 \
  -o /tmp/ncu-source bash .gpu/run.sh "$name" --numerics fast ${BENCH_ARGS:---sections block --quick} > "$OUT/source_run.txt" 2>&1
echo "ncu rc $? at $SECONDS s"
"$NCU" --import /tmp/ncu-source.ncu-rep --page details > "$OUT/details.txt" 2>&1
"$NCU" --import /tmp/ncu-source.ncu-rep --page source --csv --print-source sass > "$OUT/source.csv" 2> "$OUT/source.err"
gzip -f "$OUT/details.txt" "$OUT/source.csv"

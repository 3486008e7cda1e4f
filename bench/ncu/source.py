#!/usr/bin/env python3
"""source.py SOURCE.csv[.gz] ORDINAL [TOP]: kernel ORDINAL (0 = the first profiled launch) of
source.sh's per-SASS-instruction CSV: its totals, then its TOP instructions by stall samples
(index, samples, warp instructions executed, the SASS), in program order."""
import csv
import gzip
import io
import sys


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    path, ordinal = argv[1], int(argv[2])
    top = int(argv[3]) if len(argv) > 3 else 40
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        blocks = f.read().split('"Kernel Name",')[1:]
    name, rest = blocks[ordinal].split("\n", 1)
    rows = list(csv.DictReader(io.StringIO(rest)))
    number = lambda s: float(s) if s not in ("-", "") else 0.0
    samples = [number(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    executed = [number(r["Instructions Executed"]) for r in rows]
    print(f"{name.strip(',')}: {len(rows)} instructions, {sum(samples):.0f} samples, "
          f"{sum(executed):.0f} warp instructions executed")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:top]):
        print(f"{i:5d} {samples[i]:6.0f} {executed[i]:8.0f}  {rows[i]['Source'].strip()[:90]}")


if __name__ == "__main__":
    main(sys.argv)

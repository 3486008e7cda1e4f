#!/usr/bin/env python3
"""Reads durations.sh's CSVs: a quick block run's kernels cut into steps, each ending at a
`sample_rows` launch (the first step holds the prefills and the first decode step).

  steps.py A.csv.gz                 every step's kernel count and summed µs, then the B = 1 and
                                    B = 8 decode steps kernel by kernel (the second and the last step)
  steps.py A.csv.gz B.csv.gz        the same steps of both side by side (same launches, other kernels)
  steps.py A.csv.gz --ordinal REGEX where the launches of kernels matching REGEX stand at the start
                                    of the B = 1 step: source.sh's SKIP and COUNT for them
  steps.py --step N A.csv.gz [B...] step N's kernels summed by name (launches, µs), runs side by
                                    side, each prefill a step of its own (prefill_start): with
                                    durations.sh's BENCH_ARGS="--sections block" LAUNCHES=420,
                                    step 1 is a 1024-token prefill (0: its warm-up)
"""
import csv
import gzip
import re
import sys


def kernels(path):
    """(name, µs, grid) of every launch, in order."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = csv.DictReader(line for line in f if line.startswith('"'))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        return [(r["Kernel Name"].split("(")[0], float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]],
                 r["Grid Size"]) for r in rows if r["Metric Name"] == "gpu__time_duration.sum"]


def prefill_start(name, grid):
    """A prefill's first launch: the gather of its tokens' hyper streams, a (5, rows, 1) grid over
    more than one row (the head's gather of the prompt's last row has one)."""
    dims = grid.strip("()").split(", ")
    return name.startswith("gather_ptrs") and len(dims) == 3 and dims[0] == "5" and int(dims[1]) > 1


def steps(launches, prefills=False):
    """Steps, each ending at a `sample_rows` launch; with `prefills` (a run of prefills, which
    sample nothing) also before each prefill_start."""
    out, start = [], 0
    for i, (name, _, grid) in enumerate(launches):
        if prefills and prefill_start(name, grid) and i > start:
            out.append(launches[start:i])
            start = i
        if name.startswith("sample_rows"):
            out.append(launches[start:i + 1])
            start = i + 1
    if prefills and start < len(launches):
        out.append(launches[start:])  # the last, cut off by the profile's launch count
    return out


def by_name(argv):
    """`--step N A [B ...]`: step N of each run, its kernels summed by name."""
    index, runs = int(argv[2]), [steps(kernels(path), prefills=True) for path in argv[3:]]
    sums = []
    for run in runs:
        total = {}
        for name, us, _ in run[index]:
            launches, time = total.get(name, (0, 0.0))
            total[name] = (launches + 1, time + us)
        sums.append(total)
    for name in sorted(set().union(*sums), key=lambda n: -sums[0].get(n, (0, 0.0))[1]):
        print(f"{name[:40]:40s}" + "".join(f"{t.get(name, (0, 0))[0]:4d}{t.get(name, (0, 0.0))[1]:10.1f}" for t in sums))
    print(f"{'all kernels':40s}" + "".join(f"{sum(v[0] for v in t.values()):4d}{sum(v[1] for v in t.values()):10.1f}"
                                           for t in sums))


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    if argv[1] == "--step":
        by_name(argv)
        return
    a = steps(kernels(argv[1]))
    if len(argv) == 4 and argv[2] == "--ordinal":
        pattern = re.compile(argv[3])
        flat = [k for s in a for k in s]
        matched = [i for i, k in enumerate(flat) if pattern.search(k[0])]
        first_b1 = len(a[0])  # the B = 1 step starts after the first step
        skip = sum(1 for i in matched if i < first_b1)
        count = sum(1 for k in a[1] if pattern.search(k[0]))
        print(f"SKIP={skip} COUNT={count}")
        return
    b = steps(kernels(argv[2])) if len(argv) > 2 else None
    print(" ".join(f"{len(s)}:{sum(k[1] for k in s):.0f}" for s in a))
    for label, index in (("B = 1", 1), ("B = 8", -1)):
        x = a[index]
        y = b[index] if b else None
        print(f"\n{label}: {len(x)} kernels, {sum(k[1] for k in x):.1f} us"
              + (f" | {len(y)} kernels, {sum(k[1] for k in y):.1f} us" if y else ""))
        for i, k in enumerate(x):
            line = f"{i:3d} {k[0][:36]:36s} {k[2]:12s} {k[1]:8.2f}"
            if y and i < len(y):
                line += f"  {y[i][1]:8.2f}" + ("" if y[i][0] == k[0] else f"  ({y[i][0][:30]})")
            print(line)


if __name__ == "__main__":
    main(sys.argv)

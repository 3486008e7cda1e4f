#!/usr/bin/env python3
"""Reads durations.sh's CSVs: a quick block run's kernels cut into steps, each ending at a
`sample_rows` launch (the first step holds the prefills and the first decode step).

  steps.py A.csv.gz                 every step's kernel count and summed µs, then the B = 1 and
                                    B = 8 decode steps kernel by kernel (the second and the last step)
  steps.py A.csv.gz B.csv.gz        the same steps of both side by side (same launches, other kernels)
  steps.py A.csv.gz --ordinal REGEX where the launches of kernels matching REGEX stand at the start
                                    of the B = 1 step: source.sh's SKIP and COUNT for them
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


def steps(launches):
    out, start = [], 0
    for i, (name, _, _) in enumerate(launches):
        if name.startswith("sample_rows"):
            out.append(launches[start:i + 1])
            start = i + 1
    return out


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
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

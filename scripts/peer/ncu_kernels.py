#!/usr/bin/env python3
"""Per-kernel device time and DRAM bytes from an `ncu --csv --page raw` dump
(metrics gpu__time_duration.sum, dram__bytes_read.sum, launch__grid_size):
one line per kernel name and grid, slowest total first.

    ncu_kernels.py DUMP.csv
"""
import collections
import csv
import sys


def number(s):
    return float(s.replace(",", ""))


def main(path):
    lines = [l for l in open(path) if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    if len(rows) < 2:
        sys.exit(f"{path}: no kernels")
    units = rows[0]
    if units.get("gpu__time_duration.sum") != "ns" or units.get("dram__bytes_read.sum") != "byte":
        sys.exit(f"{path}: unexpected units {units.get('gpu__time_duration.sum')}, {units.get('dram__bytes_read.sum')}")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows[1:]:
        key = f'{r["Kernel Name"][:48]} (grid {r["launch__grid_size"]})'
        a = agg[key]
        a[0] += 1
        a[1] += number(r["gpu__time_duration.sum"])
        a[2] += number(r["dram__bytes_read.sum"])
    total = sum(a[1] for a in agg.values())
    print(f"{len(rows) - 1} kernels, {total / 1e3:.1f} µs of device time")
    print(f"{'count':>5} {'µs each':>8} {'MB read':>8} {'GB/s':>6}  kernel")
    for key, (n, ns, b) in sorted(agg.items(), key=lambda t: -t[1][1]):
        print(f"{n:5d} {ns / n / 1e3:8.2f} {b / n / 1e6:8.2f} {b / ns:6.0f}  {key}")


if __name__ == "__main__":
    main(sys.argv[1])

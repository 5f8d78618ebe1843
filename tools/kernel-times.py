#!/usr/bin/env python3
"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log by kernel name (device-side time only,
no launch gaps): where one decode step's GPU time goes. Usage: kernel-times.py NCU_CSV [STEPS]"""
import csv
import sys
from collections import defaultdict

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
header = rows[0]
name_i, metric_i, value_i = header.index("Kernel Name"), header.index("Metric Name"), header.index("Metric Value")
steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
total, calls, by = 0.0, defaultdict(int), defaultdict(float)
for r in rows[1:]:
    if r[metric_i] != "gpu__time_duration.sum":
        continue
    name = r[name_i].split("(")[0].split("<")[0].replace("void ", "")
    ns = float(r[value_i].replace(",", ""))
    by[name] += ns
    calls[name] += 1
    total += ns
print(f"{total / steps / 1e3:.1f} us of kernel time per step, {sum(calls.values()) / steps:.0f} kernels per step")
for name, ns in sorted(by.items(), key=lambda x: -x[1]):
    print(f"  {name:<44} {calls[name] / steps:6.0f} calls {ns / steps / 1e3:9.1f} us {100 * ns / total:5.1f}%")

#!/usr/bin/env python3
"""Where a kernel's critical time goes block by block: for every launch of KERNEL (a name from the
timeline, e.g. moe_down) in the last N decode steps of a NIBBLE_TIMELINE file (tools/timeline.py),
the blocks' end times from the launch's release, grouped by how many of the launch's blocks shared
the block's SM, as percentiles (µs). Shows whether a grid's tail is its doubly-loaded SMs.

Usage: tools/timeline_blocks.py FILE KERNEL [--steps N]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import launches_of, load, release  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("kernel")
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    recs, names = load(a.file)
    recs = recs[recs["end"] > 0]
    launches = launches_of(recs, names)
    embeds = [i for i, (n, _) in enumerate(launches) if n == "embed"]
    first = embeds[-a.steps - 1] if len(embeds) > a.steps else 0
    by_share, ends_all = {}, []
    for name, r in launches[first:]:
        if name != a.kernel:
            continue
        t0 = release(r)
        sms, counts = np.unique(r["sm"], return_counts=True)
        share = dict(zip(sms.tolist(), counts.tolist()))
        for rec in r:
            end = (int(rec["end"]) - t0) / 1e3
            by_share.setdefault(share[int(rec["sm"])], []).append(end)
            ends_all.append(end)
    if not ends_all:
        sys.exit(f"no launches of {a.kernel}")
    print(f"{a.kernel}: block end after the launch's release, µs (percentiles 10 / 50 / 90 / max)\n")
    print("| blocks on the SM | blocks | p10 | p50 | p90 | max |")
    print("|---:|---:|---:|---:|---:|---:|")
    for share in sorted(by_share):
        e = np.array(by_share[share])
        print(f"| {share} | {len(e)} | {np.percentile(e, 10):.2f} | {np.percentile(e, 50):.2f} | "
              f"{np.percentile(e, 90):.2f} | {e.max():.2f} |")
    e = np.array(ends_all)
    print(f"| all | {len(e)} | {np.percentile(e, 10):.2f} | {np.percentile(e, 50):.2f} | "
          f"{np.percentile(e, 90):.2f} | {e.max():.2f} |")


if __name__ == "__main__":
    main()

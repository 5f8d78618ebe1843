#!/usr/bin/env python3
"""Reads the in-kernel timeline of a decode run (NIBBLE_TIMELINE=<file> with a build configured
with -DNIBBLE_TIMELINE=ON, see src/kernels/timeline.cuh) and prints where a decode step's time goes
with the overlap PDL gives, which a CUPTI trace (serialised) cannot show:

  per kernel launch: release (the earliest block's PDL wait returning, i.e. its predecessor done),
  critical = last block's end - release, gap = the next launch's release - this launch's end
  (the kernel boundary), lead = release - first block's start (how early the grid was resident),
  late = last block's wait - release (blocks that were not resident when released), and the
  median block's time from its wait to its inner mark and to its end.

Usage: tools/timeline.py FILE [--steps N] [--keep OUT] [--spread]
  --steps N: the last N complete decode steps (default 16); --keep OUT: also write those steps'
  records to OUT in the same format (a file small enough to bring back from the device);
  --spread: also, per kernel and predecessor, how its blocks spread from its release: the boundary
  (release - the predecessor's last block end), the share of blocks that started before that end,
  and percentiles of the blocks' wait, mark and end, with the last block's (which sets the
  critical time).
"""
import argparse
import sys
import warnings

import numpy as np

REC = np.dtype([("kernel", "<u2"), ("sm", "<u2"), ("block", "<u4"), ("blocks", "<u4"), ("reserved", "<u4"),
                ("entry", "<u8"), ("waited", "<u8"), ("mark", "<u8"), ("end", "<u8")])


def load(path):
    with open(path, "rb") as f:
        header = f.readline().decode().split()
        if not header or header[0] != "nibble-timeline":
            sys.exit(f"{path}: not a nibble timeline")
        fields = dict(h.split("=", 1) for h in header[2:])
        if int(fields["record_bytes"]) != REC.itemsize:
            sys.exit(f"{path}: records of {fields['record_bytes']} bytes, this tool reads {REC.itemsize}")
        recs = np.frombuffer(f.read(), dtype=REC)
    return recs, fields["names"].split(",")


def keep(path, launches, names):
    recs = np.concatenate([r for _, r in launches])
    with open(path, "wb") as f:
        f.write(f"nibble-timeline 1 record_bytes={REC.itemsize} count={len(recs)} names={','.join(names)}\n".encode())
        f.write(recs.tobytes())


def release(r):
    """A launch's release: its earliest block's PDL wait returning, or start without a wait."""
    return int(r["waited"][r["waited"] > 0].min()) if (r["waited"] > 0).any() else int(r["entry"].min())


def waits(r):
    """Each block's PDL wait returning, or its start for a kernel without one (ns, int64)."""
    return np.where(r["waited"] > 0, r["waited"], r["entry"]).astype(np.int64)


def launches_of(recs, names):
    """Groups records into launches. Kernels overlap under PDL (a grid may start before its
    predecessor ends), so a launch is not a run of one kernel in time: in order of the blocks'
    start, each kernel's records fill its current launch until it holds the grid's block count
    (a kernel never overlaps its own next launch). Blocks that exit before recording (the
    attention's unused splits) leave a launch short; it is closed when the kernel's next launch
    starts a block index it already has. Launches are listed by their release (the earliest
    block's PDL wait returning, or start for a kernel without one)."""
    recs = recs[np.argsort(recs["entry"], kind="stable")]
    groups, current = [], {}
    for i in range(len(recs)):
        k, b = int(recs["kernel"][i]), int(recs["block"][i])
        g = current.get(k)
        if g is None or b in g[1]:
            g = ([], set())
            groups.append(g)
            current[k] = g
        g[0].append(i)
        g[1].add(b)
        if len(g[1]) == int(recs["blocks"][i]):
            del current[k]
    launches = [recs[np.array(idx)] for idx, _ in groups]
    launches.sort(key=release)
    return [(names[r["kernel"][0]], r) for r in launches]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--keep")
    ap.add_argument("--spread", action="store_true")
    a = ap.parse_args()
    recs, names = load(a.file)
    recs = recs[recs["end"] > 0]
    stamps = np.concatenate([recs["entry"], recs["end"]])
    diffs = np.diff(np.unique(stamps))
    print(f"{len(recs)} block records; smallest step between timer values: {diffs.min() if len(diffs) else 0} ns")

    launches = launches_of(recs, names)
    embeds = [i for i, (n, r) in enumerate(launches) if n == "embed"]
    if len(embeds) < 2:
        sys.exit("fewer than two decode steps in the file")
    steps = list(zip(embeds[:-1], embeds[1:]))[-a.steps:]
    if a.keep:
        keep(a.keep, launches[steps[0][0]:steps[-1][1] + 1], names)
    rows, step_ms = {}, []
    for s0, s1 in steps:
        seq = launches[s0:s1]
        step_ms.append((release(launches[s1][1]) - release(seq[0][1])) / 1e6)
        prev = "step start"
        for j, (name, r) in enumerate(seq):
            t0 = release(r)
            end = int(r["end"].max())
            nxt = release(launches[s0 + j + 1][1])
            label = f"{name} [{len(r)} blocks] after {prev}"
            prev = name
            waited = waits(r)
            marks = r["mark"].astype(np.int64)
            e = rows.setdefault(label, {"n": 0, "lead": [], "crit": [], "gap": [], "late": [], "blk": [], "mark": []})
            e["n"] += 1
            e["lead"].append(t0 - int(r["entry"].min()))
            e["crit"].append(end - t0)
            e["gap"].append(nxt - end)
            e["late"].append(int(waited.max()) - t0)
            e["blk"].append(float(np.median(r["end"].astype(np.int64) - waited)))
            if (marks > 0).any():
                e["mark"].append(float(np.median(marks[marks > 0] - waited[marks > 0])))
    n_steps = len(steps)
    print(f"{n_steps} decode steps, {np.mean(step_ms) * 1e3:.1f} µs each (release of the first launch to the next step's)\n")
    print("| launch | per step | critical µs | gap µs | lead µs | late µs | block: wait->mark µs | block: wait->end µs | µs per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    total = 0.0
    for label, e in sorted(rows.items(), key=lambda kv: -(np.mean(kv[1]["crit"]) + np.mean(kv[1]["gap"])) * kv[1]["n"]):
        per_step = e["n"] / n_steps
        share = (np.mean(e["crit"]) + np.mean(e["gap"])) * per_step / 1e3
        total += share
        mark = f"{np.mean(e['mark']) / 1e3:.2f}" if e["mark"] else ""
        print(f"| {label} | {per_step:.0f} | {np.mean(e['crit']) / 1e3:.2f} | {np.mean(e['gap']) / 1e3:.2f} | "
              f"{np.mean(e['lead']) / 1e3:.2f} | {np.mean(e['late']) / 1e3:.2f} | {mark} | "
              f"{np.mean(e['blk']) / 1e3:.2f} | {share:.1f} |")
    print(f"\nsum of (critical + gap) per step: {total:.1f} µs")
    if a.spread:
        spread(launches, steps)


def spread(launches, steps):
    """Per kernel and predecessor, µs from the launch's release, means over the steps' launches."""
    rows = {}
    for s0, s1 in steps:
        for j in range(s0, s1):
            name, r = launches[j]
            prev_name, prev = launches[j - 1] if j > s0 else ("step start", None)
            t0 = release(r)
            waited = waits(r) - t0
            end = r["end"].astype(np.int64) - t0
            marks = r["mark"].astype(np.int64)
            mark = marks[marks > 0] - t0
            last = int(np.argmax(end))
            prev_end = int(prev["end"].max()) if prev is not None else t0
            e = rows.setdefault(f"{name} [{len(r)} blocks] after {prev_name}", [])
            pct = lambda v: np.percentile(v, [50, 90, 100]) if len(v) else np.full(3, np.nan)
            e.append(np.concatenate([[t0 - prev_end, np.mean(r["entry"].astype(np.int64) < prev_end)], pct(waited),
                                     pct(mark), pct(end),
                                     [waited[last], marks[last] - t0 if marks[last] > 0 else np.nan, end[last]]]))
    print("\n| launch | boundary µs | started before it | wait p50 / p90 / max | mark p50 / p90 / max | "
          "end p50 / p90 / max | last block: wait / mark / end |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, e in rows.items():
        with warnings.catch_warnings():  # columns a kernel has no marks for stay nan
            warnings.simplefilter("ignore", RuntimeWarning)
            v = np.nanmean(np.array(e), axis=0)
        us = lambda i: "/".join(f"{x / 1e3:.2f}" for x in v[i:i + 3])
        print(f"| {label} | {v[0] / 1e3:.2f} | {v[1]:.0%} | {us(2)} | {us(5)} | {us(8)} | {us(11)} |")


if __name__ == "__main__":
    main()

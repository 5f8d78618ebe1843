#!/usr/bin/env python3
"""Tests of tools/timeline.py on synthetic records (run by tools/test): launches that overlap in
time are told apart by their grids' block counts, a launch whose blocks did not all record is
closed by the kernel's next launch, --keep writes a file the tool reads back, and --spread's boundary, share and percentiles."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeline  # noqa: E402

NAMES = ["embed", "gemv", "router"]


def records(rows):
    """rows: (kernel, block, blocks, entry, waited, end)."""
    r = np.zeros(len(rows), dtype=timeline.REC)
    for i, (k, b, n, entry, waited, end) in enumerate(rows):
        r[i]["kernel"], r[i]["block"], r[i]["blocks"] = k, b, n
        r[i]["entry"], r[i]["waited"], r[i]["end"] = entry, waited, end
    return r


class LaunchesOf(unittest.TestCase):
    def test_overlapping_kernels_are_told_apart(self):
        # gemv (3 blocks) runs while router (2 blocks, no wait) starts between its blocks, then
        # gemv's next launch: in start order the kernels alternate, yet there are 3 launches.
        recs = records([
            (1, 0, 3, 100, 200, 500), (2, 0, 2, 150, 0, 600), (1, 1, 3, 160, 210, 510),
            (2, 1, 2, 170, 0, 620), (1, 2, 3, 180, 220, 520),
            (1, 0, 3, 550, 700, 900), (1, 1, 3, 560, 705, 905), (1, 2, 3, 570, 710, 910),
        ])
        got = [(name, sorted(r["block"].tolist())) for name, r in timeline.launches_of(recs, NAMES)]
        self.assertEqual(got, [("router", [0, 1]), ("gemv", [0, 1, 2]), ("gemv", [0, 1, 2])])

    def test_a_short_launch_is_closed_by_the_next(self):
        # Block 1 of the first launch exited before recording (an unused attention split).
        recs = records([(1, 0, 3, 100, 200, 300), (1, 2, 3, 110, 210, 310),
                        (1, 0, 3, 400, 500, 600), (1, 1, 3, 410, 505, 610), (1, 2, 3, 420, 510, 620)])
        got = [sorted(r["block"].tolist()) for _, r in timeline.launches_of(recs, NAMES)]
        self.assertEqual(got, [[0, 2], [0, 1, 2]])

    def test_keep_round_trip(self):
        recs = records([(0, 0, 1, 10, 0, 20), (1, 0, 1, 30, 40, 50)])
        launches = timeline.launches_of(recs, NAMES)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "kept.bin")
            timeline.keep(path, launches, NAMES)
            back, names = timeline.load(path)
        self.assertEqual(names, NAMES)
        self.assertEqual(back.tobytes(), np.concatenate([r for _, r in launches]).tobytes())


class Spread(unittest.TestCase):
    def test_boundary_share_and_percentiles(self):
        # One step: embed (ends at 1000 ns), then gemv's two blocks, one started before embed ended;
        # the next step's embed closes it.
        recs = records([(0, 0, 1, 0, 0, 1000), (1, 0, 2, 500, 1300, 3000), (1, 1, 2, 1200, 1400, 3200),
                        (0, 0, 1, 4000, 0, 4100)])
        recs["mark"][1], recs["mark"][2] = 1500, 1600
        launches = timeline.launches_of(recs, NAMES)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            timeline.spread(launches, [(0, 2)])
        # release 1300 (the first wait), 300 ns after embed's end; waits 0 / 100, marks 200 / 300,
        # ends 1700 / 1900 after it; the last block is block 1.
        self.assertIn("| gemv [2 blocks] after embed | 0.30 | 50% | 0.05/0.09/0.10 | 0.25/0.29/0.30 | "
                      "1.80/1.88/1.90 | 0.10/0.30/1.90 |", out.getvalue())


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""Where the expert GEMVs' time goes, block by block (a DSV3_TRACE=1 DSV3_TRACE_BLOCKS=1 build of
kernels_tcgemv.cu; dsv3_cuda_bench with DSV3_CUDA_TRACE=file).

Every block of tcv_moe_kernel leaves two records: (start, expert known) with marker line
61000 + 10 stage and (activations staged, end) with 61001 + 10 stage; their y field is the block's
expert slot (shared slices first, whatever order launch_slot gives blockIdx.y). The wait end W of
each launch comes from its block (0, 0)'s ordinary record (the kernel's PDL wait, same grid).
Printed per stage, medians over the launches of the last section, in microseconds from W: when the blocks started, when routed blocks knew their
expert, when blocks had staged their activations, and when they ended (the last end is the
stage's completion). By SM (the records' z field): the median end of blocks whose SM held one,
two or three of the launch's blocks, and how many SMs did (sms_0 is not printed: 132 less the rest).

  scripts/trace_blocks.py trace.txt [--shared N]   (N shared slices, default 2)
"""
import argparse
import statistics

from trace_report import sections


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    ap = argparse.ArgumentParser(description="per-block times of the expert GEMVs in a kernel trace")
    ap.add_argument("trace")
    ap.add_argument("--shared", type=int, default=2, help="shared expert slices (slots before the routed ones)")
    a = ap.parse_args()
    shared = a.shared
    sec = sections(a.trace)[-1]
    recs = sorted(sec["recs"])  # ticket order
    blocks = {0: [], 1: []}  # stage -> [(y, start, known, staged, end)]
    by_ticket = {r[0]: r for r in recs}
    for r in recs:
        line = r[4]
        if line in (61000, 61010):
            b = by_ticket.get(r[0] + 1)
            if not b or b[4] != line + 1:
                continue
            blocks[(line - 61000) // 10].append((r[6], r[1], r[2], b[1], b[2], r[7]))
    # The kernels' own wait records (block 0): grid 22x8-like, line not a marker, z = 1.
    waits = [(r[2], r[5], r[6]) for r in recs if r[4] < 60000 and r[7] == 1 and r[5] > 0]
    print(f"== {sec['label']}")
    for stage in (0, 1):
        bl = sorted(blocks[stage], key=lambda b: b[1])
        if not bl:
            continue
        launches, cur = [], [bl[0]]
        for b in bl[1:]:
            if b[1] - cur[-1][1] > 25000:
                launches.append(cur)
                cur = []
            cur.append(b)
        launches.append(cur)
        rows = {k: [] for k in ("start", "known_routed", "staged_shared", "staged_routed", "end_min", "end_med",
                                "end_p90", "end_max", "end_med_sm1", "end_med_sm2", "end_med_sm3", "sms_1",
                                "sms_2", "sms_3", "blocks")}
        for L in launches:
            first = min(b[1] for b in L)
            ny = max(b[0] for b in L) + 1
            w = [t for t, gx, gy in waits if t >= first and gy == ny]
            if not w:
                continue
            W = min(w)
            us = lambda t: (t - W) / 1000.0
            routed = [b for b in L if b[0] >= shared]
            sh = [b for b in L if b[0] < shared]
            ends = [us(b[4]) for b in L]
            rows["start"].append(statistics.median(us(b[1]) for b in L))
            if routed:
                rows["known_routed"].append(statistics.median(us(b[2]) for b in routed))
                rows["staged_routed"].append(statistics.median(us(b[3]) for b in routed))
            if sh:
                rows["staged_shared"].append(statistics.median(us(b[3]) for b in sh))
            rows["end_min"].append(min(ends))
            rows["end_med"].append(statistics.median(ends))
            rows["end_p90"].append(pct(ends, 0.9))
            rows["end_max"].append(max(ends))
            rows["blocks"].append(len(L))
            # By how many of the launch's blocks shared the block's SM (the z field: %smid).
            per_sm = {}
            for b in L:
                per_sm[b[5]] = per_sm.get(b[5], 0) + 1
            for k in (1, 2, 3):
                e = [us(b[4]) for b in L if per_sm[b[5]] == k]
                if e:
                    rows[f"end_med_sm{k}"].append(statistics.median(e))
                rows[f"sms_{k}"].append(sum(1 for v in per_sm.values() if v == k))
        print(f"stage {stage}: {len(rows['blocks'])} launches, {statistics.median(rows['blocks']):.0f} blocks each; "
              "medians over launches, us from the wait end")
        for k, v in rows.items():
            if v and k != "blocks":
                print(f"  {k:14s} {statistics.median(v):8.2f}")
        print("  (end_med_smK: blocks on an SM that held K of the launch's blocks; sms_K: such SMs)")


if __name__ == "__main__":
    main()

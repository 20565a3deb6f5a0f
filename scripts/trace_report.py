#!/usr/bin/env python3
"""Summarise a DSV3_TRACE=1 kernel trace (dsv3_cuda_bench with DSV3_CUDA_TRACE=file).

Each record is one kernel's block (0,0,0): when it reached its PDL wait and when the wait ended
(or a point inside a kernel: one time, shown as "point"; a kernel's chain then runs to it).
A wait ends once every earlier kernel has finished, so the difference between consecutive wait
ends is what each kernel costs inside the recorded chain ("chain"), and wait end minus arrival
is how early it was launched ("lead"; ~0 means its launch was on the critical path).

  scripts/trace_report.py trace.txt [--seq N]   (--seq: also print N kernels of one step in order)
"""
import re
import statistics
import sys


def sections(path):
    out, cur = [], None
    for line in open(path):
        if line.startswith("# ticket"):
            continue
        if line.startswith("# units:"):
            cur["units"] = dict(u.split("=", 1) for u in line[8:].split())
            continue
        if line.startswith("# "):
            cur = {"label": line[2:].strip(), "recs": [], "units": {}}
            out.append(cur)
            continue
        cur["recs"].append([int(x) for x in line.split()])
    return out


def unit_name(units, u):
    n = units.get(str(u), str(u))
    m = re.search(r"(kernels_\w+|trace)\.(cu|cudafe)", n)
    return m.group(1) if m else n


def report(sec, nseq):
    recs, units = sec["recs"], sec["units"]
    # A step starts with the kernel that follows the longest wait for a launch (the host's work
    # between steps); every record of that kernel (unit, line, grid) starts one.
    gaps = [recs[i + 1][1] - recs[i][2] for i in range(len(recs) - 1)]
    if not gaps:
        return
    first = recs[gaps.index(max(gaps)) + 1][3:]
    steps, cur = [], []
    for r in recs:
        if r[3:] == first and cur:
            steps.append(cur)
            cur = []
        cur.append(r)
    steps.append(cur)
    # Points inside kernels (grid 0) go where their time puts them.
    steps = [sorted(st, key=lambda r: r[2]) for st in steps]
    steps = steps[1:-1] if len(steps) > 3 else steps  # the first and last may be cut
    if not steps:
        return
    n_mode = statistics.mode(len(s) for s in steps)
    steps = [s for s in steps if len(s) == n_mode]
    print(f"== {sec['label']}: {len(steps)} steps of {n_mode} kernels")
    keys = [f"{unit_name(units, r[3])}:{r[4]} " + (f"grid {r[5]}x{r[6]}x{r[7]}" if r[5] else "point")
            for r in steps[0]]
    chain = [[s[j + 1][2] - s[j][2] for s in steps] for j in range(n_mode - 1)]
    lead = [[s[j][2] - s[j][1] for s in steps] for j in range(n_mode)]
    med = [statistics.median(c) for c in chain]
    span = statistics.median(s[-1][2] - s[0][2] for s in steps)
    print(f"first wait end to last wait end: {span / 1000:.1f} us (median over steps)")
    agg = {}
    for j, k in enumerate(keys[:-1]):
        a = agg.setdefault(k, [0.0, 0, 0.0])
        a[0] += med[j]
        a[1] += 1
        a[2] += statistics.median(lead[j])
    print(f"{'kernel (unit:line of its wait, grid)':52s} {'per step us':>11s} {'n':>4s} {'each us':>8s} {'lead us':>8s}")
    for k, (tot, n, ld) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:52s} {tot / 1000:11.1f} {n:4d} {tot / n / 1000:8.2f} {ld / n / 1000:8.2f}")
    if nseq:
        j0 = max(0, n_mode // 2 - nseq // 2)
        print(f"-- kernels {j0}..{j0 + nseq} of a step: chain us, lead us (medians)")
        for j in range(j0, min(n_mode - 1, j0 + nseq)):
            print(f"  {j:4d} {keys[j]:52s} {med[j] / 1000:7.2f} {statistics.median(lead[j]) / 1000:7.2f}")


def main():
    args = sys.argv[1:]
    nseq = 0
    if "--seq" in args:
        i = args.index("--seq")
        nseq = int(args[i + 1])
        del args[i:i + 2]
    for sec in sections(args[0]):
        report(sec, nseq)


if __name__ == "__main__":
    main()

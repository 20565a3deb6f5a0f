#!/usr/bin/env python3
"""A/B table of dsv3_cuda_bench runs under several settings (scripts/cuda_device_run.sh ENV_AB).

Reads a log of sections, each opened by a line "== ... setting <S> round <R>" and followed by the
benchmark's lines; every line with "tok/s" is keyed by the words before its number (dtype, mode,
batch, variant). Prints, per key, each setting's min / median / max tok/s over its rounds and the
median's ratio to the first setting's.

  scripts/ab_table.py env_ab.log
"""
import re
import statistics
import sys

HEAD = re.compile(r"== .*setting (.+) round (\d+)\s*$")  # (searched: a killed run leaves no newline)
RATE = re.compile(r"^(.*?)\s+([0-9]+(?:\.[0-9]+)?) tok/s")


def parse(lines):
    """{key: {setting: [tok/s, ...]}} and the settings in order of first appearance."""
    table, settings, cur = {}, [], None
    for line in lines:
        m = HEAD.search(line.rstrip("\n"))
        if m:
            cur = m.group(1).strip()
            if cur not in settings:
                settings.append(cur)
            continue
        m = RATE.match(line)
        if cur is None or not m:
            continue
        key = " ".join(m.group(1).split())
        table.setdefault(key, {}).setdefault(cur, []).append(float(m.group(2)))
    return table, settings


def render(table, settings):
    out = []
    for key, by in table.items():
        out.append(key)
        base = statistics.median(by[settings[0]]) if settings and settings[0] in by else None
        for s in settings:
            v = by.get(s)
            if not v:
                continue
            med = statistics.median(v)
            ratio = f"  x{med / base:.3f}" if base else ""
            out.append(f"  {min(v):9.1f} {med:9.1f} {max(v):9.1f}  (n={len(v)}){ratio}  {s}")
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    try:
        with open(argv[1], encoding="utf-8") as f:
            table, settings = parse(f)
    except OSError as e:
        sys.stderr.write(f"ab_table: cannot read {argv[1]}: {e.strerror}\n")
        return 1
    if not table:
        sys.stderr.write(f"ab_table: no 'setting ... round ...' sections with tok/s lines in {argv[1]}\n")
        return 1
    print(render(table, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

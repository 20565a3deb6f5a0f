# Per-kernel times of one step from `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,...`:
# python3 ncu_sum.py FILE.csv [first last]  -- totals by kernel and grid; with first/last, those launches in order.
import collections, csv, re, sys

rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, rows = rows[0], rows[1:]
k = {}
for r in rows:
    d = dict(zip(head, r))
    e = k.setdefault(int(d["ID"]), {"name": d["Kernel Name"], "grid": d["Grid Size"]})
    e[d["Metric Name"]] = float(d["Metric Value"].replace(",", ""))
def name(e):
    return re.sub(r"\(.*", "", e["name"]).replace("unnamed>::", "")[:58] + " " + e["grid"]
if len(sys.argv) > 3:
    for i in range(int(sys.argv[2]), int(sys.argv[3])):
        e = k[i]
        t = e["gpu__time_duration.sum"] / 1000
        print(f"{i:4d} {t:8.2f} us {e['dram__bytes_read.sum'] / 1e6 / t:5.2f} TB/s read  {name(e)}")
    sys.exit()
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for e in k.values():
    a = agg[name(e)]
    a[0] += 1
    a[1] += e["gpu__time_duration.sum"] / 1000
    a[2] += e["dram__bytes_read.sum"] / 1e6
print(f"{len(k)} kernels, {sum(a[1] for a in agg.values()):.1f} us in all")
for n, (c, t, b) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{t:9.1f} us {c:4d} x {t / c:7.2f} us {b / t:5.2f} TB/s read  {n}")

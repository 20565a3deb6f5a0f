#!/usr/bin/env bash
# Serving through HTTP against the same load without it, on one checkpoint. For each concurrency C:
#   1. `dsv3 bench --model DIR --concurrency C` (the scheduler in-process, no HTTP);
#   2. `dsv3 serve --model DIR --max-seqs C`, warmed up with a few short requests, then driven by
#      `dsv3 bench-serve --concurrency C` over loopback with the same prompts (the same seed: the
#      offline bench draws level C's prompts with seed 1 + C);
# and prints the ratio of their output tokens/s. Reports (JSON) and server logs go to OUT_DIR.
#
#   bench/serve_vs_offline.sh DSV3_BINARY MODEL_DIR OUT_DIR [C ...]      (default C: 64 256)
# Environment: DEVICE (cpu or cuda, default cuda), INPUT_LEN (512), OUTPUT_LEN (256), REQUESTS (per
# level, default 2 x C), PORT (8321).
set -u
[ $# -ge 3 ] || { sed -n 2,12p "$0"; exit 2; }
DSV3=$1 MODEL=$2 OUT=$3
shift 3
LEVELS=${*:-64 256}
DEVICE=${DEVICE:-cuda} IN=${INPUT_LEN:-512} OUTL=${OUTPUT_LEN:-256} PORT=${PORT:-8321}
mkdir -p "$OUT"
dev=(--device "$DEVICE"); [ "$DEVICE" = cpu ] && dev=()
srv_dev=(--backend "$DEVICE")
ctx=$((IN + OUTL + 1))
field() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); r=r[0] if isinstance(r,list) else r; print(r$2)" "$1"; }
rc=0
printf '%-6s %14s %14s %7s %12s %12s\n' C "offline tok/s" "HTTP tok/s" ratio "TTFT p50 off" "TTFT p50 http" | tee "$OUT/table.txt"
for c in $LEVELS; do
  R=${REQUESTS:-$((2 * c))}
  "$DSV3" bench --model "$MODEL" "${dev[@]}" --concurrency "$c" --requests "$R" --input-len "$IN" --output-len "$OUTL" \
    --seed 1 --json > "$OUT/offline_c$c.json" 2> "$OUT/offline_c$c.err" || { echo "offline C=$c failed"; rc=1; continue; }
  "$DSV3" serve --model "$MODEL" "${srv_dev[@]}" --port "$PORT" --max-seqs "$c" --max-model-len "$ctx" \
    > "$OUT/serve_c$c.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 600); do  # up to 5 minutes to load
    grep -q "listening on" "$OUT/serve_c$c.log" 2>/dev/null && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.5
  done
  url=http://127.0.0.1:$PORT
  "$DSV3" bench-serve --url "$url" --concurrency "$c" --requests "$((c < 4 ? c : 4))" --input-len "$IN" --output-len 4 \
    --seed 7 > "$OUT/warmup_c$c.log" 2>&1
  "$DSV3" bench-serve --url "$url" --concurrency "$c" --requests "$R" --input-len "$IN" --output-len "$OUTL" \
    --seed "$((1 + c))" --json > "$OUT/http_c$c.json" 2> "$OUT/http_c$c.err" || rc=1
  kill -TERM $spid; wait $spid
  off=$(field "$OUT/offline_c$c.json" '["output_throughput"]') http=$(field "$OUT/http_c$c.json" '["output_throughput"]')
  t_off=$(field "$OUT/offline_c$c.json" '["ttft"]["p50_ms"]') t_http=$(field "$OUT/http_c$c.json" '["ttft"]["p50_ms"]')
  printf '%-6s %14.0f %14.0f %7.3f %12.0f %12.0f\n' "$c" "$off" "$http" "$(python3 -c "print($http / $off)")" \
    "$t_off" "$t_http" | tee -a "$OUT/table.txt"
done
exit $rc

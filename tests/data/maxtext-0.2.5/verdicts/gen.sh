#!/usr/bin/env bash
# Regenerates verdicts.tsv: MaxText 0.2.5's explicit-mode verdict for every row of rows.txt, one MaxText
# process per row, sequentially (the peer's verdict.py; about 10 s a row).
#   MAXTEXT_VENV (default /opt/maxtext-venv), PEER (default ../shared/peers/maxtext relative to the repo root)
# Usage: tests/data/maxtext-0.2.5/verdicts/gen.sh [ROW_ID...]   (default: all rows); writes json/<id>.json then verdicts.tsv
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MAXTEXT_VENV:-/opt/maxtext-venv}"
PEER="${PEER:-$HERE/../../../../../shared/peers/maxtext}"
CPU="hardware=cpu skip_jax_distributed_system=true dtype=float32 megablox=false jax_cache_dir= sharding_tolerance=0.3 enable_checkpointing=false dataset_type=synthetic shard_mode=explicit"
mkdir -p "$HERE/json"
grep -v '^[#@]' "$HERE/rows.txt" | while read -r id n model keys; do
  [ -n "$id" ] || continue
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$id"; then continue; fi
  m="$(sed -n "s/^@$model //p" "$HERE/rows.txt")"
  echo "== $id $n $model $keys"
  # shellcheck disable=SC2086
  "$VENV/bin/python" "$PEER/verdict.py" "$n" "$HERE/json/$id.json" $CPU $m $keys </dev/null 2>/dev/null | tail -1 || true
done
"$VENV/bin/python" "$HERE/table.py" "$HERE"

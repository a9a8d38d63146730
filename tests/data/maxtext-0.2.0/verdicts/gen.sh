#!/usr/bin/env bash
# Regenerates verdicts.tsv: MaxText 0.2.0's (with JAX 0.8.1) explicit-mode verdict for every row of rows.txt,
# one MaxText process per row, sequentially (the peer's releases/verdict_compat.py: verdict.py made to work
# with the package layouts of 0.1.0-0.2.4; about 10-60 s a row).
#   MAXTEXT_VENV (default /opt/maxtext-venv-0.2.0, built by
#     ../shared/peers/maxtext/releases/setup_release.sh 0.2.0 0.8.1 2025-12-17 /opt/maxtext-venv-0.2.0),
#   PEER (default ../shared/peers/maxtext relative to the repo root)
# Usage: tests/data/maxtext-0.2.0/verdicts/gen.sh [ROW_ID...]   (default: all rows); writes json/<id>.json then verdicts.tsv
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MAXTEXT_VENV:-/opt/maxtext-venv-0.2.0}"
PEER="${PEER:-$HERE/../../../../../shared/peers/maxtext}"
CPU="hardware=cpu skip_jax_distributed_system=true dtype=float32 megablox=false jax_cache_dir= sharding_tolerance=0.3 enable_checkpointing=false dataset_type=synthetic shard_mode=explicit"
mkdir -p "$HERE/json"
grep -v '^[#@]' "$HERE/rows.txt" | while read -r id n model keys; do
  [ -n "$id" ] || continue
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$id"; then continue; fi
  m="$(sed -n "s/^@$model //p" "$HERE/rows.txt")"
  # 0.2.0's attention=autoselected takes the GPU Pallas flash kernel for sequences of 128 and more on
  # any non-TPU platform (layers/attention_op.py apply_attention, lines 918-937), which cannot run on CPU;
  # 0.2.5's takes the dot-product path on CPU. Rows without an attention key run the dot-product path.
  case " $keys " in *" attention="*) att= ;; *) att=attention=dot_product ;; esac
  echo "== $id $n $model $keys $att"
  # shellcheck disable=SC2086
  nice "$VENV/bin/python" "$PEER/releases/verdict_compat.py" "$n" "$HERE/json/$id.json" $CPU $m $keys $att </dev/null 2>/dev/null | tail -1 || true
done
"$VENV/bin/python" "$HERE/table.py" "$HERE" 0.2.0 attention=dot_product

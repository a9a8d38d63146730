#!/bin/bash
# MaxText 0.2.1 on JAX 0.8.1 (venv: setup_release.sh 0.2.1 0.8.1 2026-03-24 /opt/maxtext-venv-0.2.1): the seed rows 0.2.0 fails (Z03, Z05, Z06) and the two it traces (Z02, Z04)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
R=$HERE/../rows.txt
PEER="${PEER:-$HERE/../../../../../../shared/peers/maxtext}"
CPU="hardware=cpu skip_jax_distributed_system=true dtype=float32 megablox=false jax_cache_dir= sharding_tolerance=0.3 enable_checkpointing=false dataset_type=synthetic shard_mode=explicit attention=dot_product"

for id in Z03 Z05 Z06 Z02 Z04; do
  line=$(grep "^$id " $R); set -- $line; n=$2; model=$3; shift 3
  m="$(sed -n "s/^@$model //p" $R)"
  echo "== $id $n $model $*"
  nice /opt/maxtext-venv-0.2.1/bin/python $PEER/releases/verdict_compat.py $n $HERE/$id.json $CPU $m "$@" </dev/null 2>/dev/null | tail -1
done
echo done-0.2.1

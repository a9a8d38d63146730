#!/usr/bin/env bash
# Regenerates MaxText 0.2.0's sharding dumps (the seeds' release, JAX 0.8.1) of three configurations on
# forced CPU devices with dump_compat.py beside this file (the peer's dump.py made to work with 0.2.0's
# Linen train state; abstract: get_shaped_inputs, no compile).  0.2.0's attention=autoselected picks the GPU
# Pallas flash kernel on CPU (layers/attention_op.py), which fails for MLA, so DeepSeek runs with
# attention=dot_product (the train state's shardings do not depend on it).  Sequential, ~15-60 s each.
# Usage: gen.sh [ds]   (ds: only the two DeepSeek dumps)
#   MAXTEXT_VENV (default /opt/maxtext-venv-0.2.0, made by the peer's releases/setup_release.sh 0.2.0 0.8.1 2025-12-17)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MAXTEXT_VENV:-/opt/maxtext-venv-0.2.0}"
run() { # <model> <dir> <num_devices> keys...
  local model="$1" dir="$2" n="$3"; shift 3
  local out="$HERE/$model/$dir"
  rm -rf "${out:?}"; mkdir -p "$out"
  "$VENV/bin/python" "$HERE/dump_compat.py" "num_devices=$n" "output_dir=$out" "model_name=$model" "$@" </dev/null >/dev/null 2>&1
  rm -f "$out/input_shardings.json"; rm -rf "$out/maxtext_out"
  ls "$out"
}
# a Llama (llama2 block) with tensor parallelism: 0.2.0's names of the attention and embedding dims
[ "${1:-}" = ds ] || run llama3.1-8b cpu-8/ici_fsdp_parallelism=4_ici_tensor_parallelism=2 8 ici_fsdp_parallelism=4 ici_tensor_parallelism=2
# DeepSeek-V3 (3 layers) with expert parallelism: the MoE's names and the gate bias (a Param in 0.2.0's Linen state)
run deepseek3-tiny cpu-8/layers_3_ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 ici_fsdp_parallelism=4 ici_expert_parallelism=2 attention=dot_product
# seed 000's FSDP2+TP2 in explicit mode at the verdict table's test size (row Z02 of ../verdicts)
run deepseek3-tiny cpu-4/seed000_fsdp2_tp2_explicit 4 override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 vocab_size=512 max_target_length=128 per_device_batch_size=1 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 sparse_matmul=true attention=dot_product shard_mode=explicit

#!/usr/bin/env bash
# Regenerates MaxText 0.2.0's losses (the seeds' release, JAX 0.8.1) from shardsim's parameters and tokens,
# as ../../maxtext-0.2.5/losses/gen.sh does for 0.2.5, with peer_loss.py beside this file (0.2.5's made to
# work with 0.2.0's Linen train.py).  Per case: shardsim (maxtext_release=0.2.0) trains one step at
# learning_rate=1e-2 from its own init and saves the parameters; MaxText 0.2.0 then trains `steps=2` at
# learning_rate=1e-3 on the case's mesh from them on shardsim's synthetic tokens.  The _lb cases check
# 0.2.0's load-balance loss (its density not divided by num_experts_per_tok).
#   SHARDSIM (default build/shardsim from the repo root), MAXTEXT_VENV (default /opt/maxtext-venv-0.2.0)
# Usage: tests/data/maxtext-0.2.0/losses/gen.sh [CASE...]   (default: all)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../../.." && pwd)"
SHARDSIM="${SHARDSIM:-$ROOT/build/shardsim}"
VENV="${MAXTEXT_VENV:-/opt/maxtext-venv-0.2.0}"
# a small Llama 2 (GQA 4:2); attention=dot_product as 0.2.0's autoselected attention takes a GPU kernel on CPU
LLAMA="model_name=llama2-7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=128 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 attention=dot_product"
# deepseek3-tiny with 3 layers (one dense, two MoE: MLA, the sparse routed MoE with its gate bias as 0.2.0
# stores it, an nnx.Param); XLA:CPU cannot compile the sparse path's ragged all-to-all, so no expert axis
DEEPSEEK="model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 vocab_size=256 max_target_length=32 per_device_batch_size=2 attention=dot_product"
# a small Mixtral (4 experts, top-2) on the dense path (sparse_matmul=false), which runs the expert axis on CPU
MIXTRAL="model_name=mixtral-8x7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=96 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 attention=dot_product"
# <case> <devices> <model keys and mesh>
CASES=(
"llama/fsdp2_tensor2|4|$LLAMA ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"deepseek/fsdp2_tensor2|4|$DEEPSEEK ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
# the sparse path's load-balance loss is computed inside its shard_map on each device's rows (one batch
# shard's value on a batch-sharded mesh, as in 0.2.5), so this case does not shard the batch
"deepseek/tensor4_lb|4|$DEEPSEEK ici_tensor_parallelism=4 load_balance_loss_weight=0.01"
"mixtral/dense_fsdp2_expert2_lb|4|$MIXTRAL ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01"
)
for c in "${CASES[@]}"; do
  IFS='|' read -r name n keys <<<"$c"
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2086
  "$SHARDSIM" train $keys maxtext_release=0.2.0 hardware=cpu steps=1 learning_rate=1e-2 enable_checkpointing=true checkpoint_dir="$tmp" >/dev/null
  mkdir -p "$(dirname "$HERE/$name")"
  # shellcheck disable=SC2086
  nice "$VENV/bin/python" "$HERE/peer_loss.py" "$tmp/step_0.safetensors" "$HERE/$name.json" "num_devices=$n" $keys steps=2 learning_rate=1e-3 </dev/null 2>"$tmp/err" | grep peer-loss || { tail -5 "$tmp/err"; rm -rf "$tmp"; exit 1; }
  rm -rf "$tmp"
done

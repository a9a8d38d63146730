#!/usr/bin/env bash
# Regenerates MaxText 0.2.5's losses from shardsim's parameters and tokens (peer_loss.py beside this
# file), one MaxText process at a time.  Per case: shardsim trains one step of the model at
# learning_rate=1e-2 from its own init and saves the parameters (step_0.safetensors: parameters that are
# not an init, norms' scales included); MaxText then trains `steps=2` at learning_rate=1e-3 on the case's
# mesh from those parameters on shardsim's synthetic tokens, and <case>.json gets its per-step
# learning/loss.  tests/test_models_<family>.c repeats the shardsim side and compares.
#   SHARDSIM (default build/shardsim from the repo root), MAXTEXT_VENV (default /opt/maxtext-venv)
# Usage: tests/data/maxtext-0.2.5/losses/gen.sh [CASE...]   (default: all)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../../.." && pwd)"
SHARDSIM="${SHARDSIM:-$ROOT/build/shardsim}"
VENV="${MAXTEXT_VENV:-/opt/maxtext-venv}"
# a small dense Qwen3 (query/key norms, GQA 4:2): the qwen3-0.6b file with test-sized dims
QWEN3="model_name=qwen3-0.6b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=128 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2"
# a small Mistral (GQA 4:2, untied logits as mistral-7b): the mistral-7b file with test-sized dims
MISTRAL="model_name=mistral-7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=128 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2"
# a small Mixtral (4 experts, top-2, GQA 4:2; the experts' width is mlp_dim, as RoutedMoE reads it).
# XLA:CPU cannot compile the sparse path's ragged all-to-all ("HLO opcode `ragged-all-to-all` is not
# supported by XLA:CPU ThunkEmitter"), so the sparse cases keep the expert axis at 1 and the expert
# axis is measured on the dense path.
MIXTRAL="model_name=mixtral-8x7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=96 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4"
# a small Qwen3 MoE (4 experts, top-2, query/key norms, GQA 4:2, norm_topk_prob as the model file):
# the qwen3-30b-a3b file with test-sized dims; base_mlp_dim differs from base_moe_mlp_dim, which
# MaxText's config check settles for qwen3_moe by taking moe_mlp_dim (the experts' width either way)
QWEN3MOE="model_name=qwen3-30b-a3b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=48 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 num_experts_per_tok=2"
# a small gpt-oss (4 experts, top-2, GQA 4:2, 4 layers: two scanned blocks of a local_sliding layer with a
# window of 8 and a global one; attention biases and sinks, gate and expert biases, the clamped GLU and
# YaRN as the gpt-oss-20b file sets them).  MaxText 0.2.5 refuses gpt_oss with shard_mode=explicit
# (configs/types.py), so every case is auto.
GPTOSS="model_name=gpt-oss-20b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=48 base_moe_mlp_dim=48 base_num_decoder_layers=4 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 num_experts_per_tok=2 sliding_window_size=8"
# a small Gemma 3 (GQA 4:2, query/key norms, post norms, GeGLU, tied logits through attend_on_embedding's
# bfloat16 table): the gemma3-4b file with test-sized dims; 8 layers are one scanned block of six (five
# local, one global) and a layers_remainder of two local layers; the window (8) is shorter than the
# sequence (32), so the local layers mask
GEMMA3="model_name=gemma3-4b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=128 base_num_decoder_layers=8 vocab_size=256 max_target_length=32 per_device_batch_size=2 sliding_window_size=8"
# <case> <devices> <model keys and mesh>
CASES=(
"qwen3/untied_fsdp2_tensor2|4|$QWEN3 logits_via_embedding=false ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"qwen3/untied_data2_fsdp2_explicit|4|$QWEN3 logits_via_embedding=false ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit"
"qwen3/tied_fsdp2_tensor2|4|$QWEN3 ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"mistral/fsdp2_tensor2|4|$MISTRAL ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"mistral/data2_fsdp2_explicit|4|$MISTRAL ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit"
"mixtral/sparse_fsdp2_tensor2|4|$MIXTRAL ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"mixtral/sparse_data2_fsdp2_explicit|4|$MIXTRAL ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit"
"mixtral/dense_fsdp2_expert2_lb_norm|4|$MIXTRAL ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01 norm_topk_prob=true"
"mixtral/sparse_fsdp2_tensor2_lb|4|$MIXTRAL ici_fsdp_parallelism=2 ici_tensor_parallelism=2 load_balance_loss_weight=0.01"
"qwen3_moe/sparse_fsdp2_tensor2|4|$QWEN3MOE ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"qwen3_moe/sparse_data2_fsdp2_explicit|4|$QWEN3MOE ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit"
"qwen3_moe/dense_fsdp2_expert2_lb|4|$QWEN3MOE ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01"
"gpt_oss/sparse_fsdp2_tensor2|4|$GPTOSS ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"gpt_oss/sparse_data2_fsdp2|4|$GPTOSS ici_data_parallelism=2 ici_fsdp_parallelism=2"
"gpt_oss/dense_fsdp2_expert2_lb|4|$GPTOSS ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01"
"gpt_oss/sparse_context2_fsdp2|4|$GPTOSS ici_context_parallelism=2 ici_fsdp_parallelism=2"
"gemma3/fsdp2_tensor2|4|$GEMMA3 ici_fsdp_parallelism=2 ici_tensor_parallelism=2"
"gemma3/data2_fsdp2_explicit|4|$GEMMA3 ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit"
"gemma3/context2_fsdp2|4|$GEMMA3 ici_context_parallelism=2 ici_fsdp_parallelism=2"
)
for c in "${CASES[@]}"; do
  IFS='|' read -r name n keys <<<"$c"
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then continue; fi
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2086
  "$SHARDSIM" train $keys hardware=cpu steps=1 learning_rate=1e-2 enable_checkpointing=true checkpoint_dir="$tmp" >/dev/null
  mkdir -p "$(dirname "$HERE/$name")"
  # shellcheck disable=SC2086
  nice "$VENV/bin/python" "$HERE/peer_loss.py" "$tmp/step_0.safetensors" "$HERE/$name.json" "num_devices=$n" $keys steps=2 learning_rate=1e-3 </dev/null 2>/dev/null | grep peer-loss
  rm -rf "$tmp"
done

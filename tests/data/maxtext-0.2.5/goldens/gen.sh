#!/usr/bin/env bash
# Regenerates MaxText 0.2.5's sharding dumps of deepseek2-16b for the four configurations of the older
# goldens (tests/data/maxtext/goldens, MaxText e591f30c on TPU topologies), and of a 3-layer
# deepseek3-tiny (the MoEBiasVar gate bias: layers first, no optimizer state, which deepseek2-16b,
# without a routing bias, does not show), on forced CPU devices with the peer's dump.sh (abstract:
# get_shaped_inputs, no compile).  Sequential, ~10-60 s each.
#   MAXTEXT_VENV (default /opt/maxtext-venv), PEER (default ../shared/peers/maxtext from the repo root)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER="${PEER:-$HERE/../../../../../shared/peers/maxtext}"
run() { # <dir> <num_devices> keys...   (MODEL: model_name, default deepseek2-16b)
  local dir="$1" n="$2" model="${MODEL:-deepseek2-16b}"; shift 2
  local out="$HERE/$model/$dir"
  rm -rf "${out:?}"; mkdir -p "$out"
  "$PEER/dump.sh" "num_devices=$n" "output_dir=$out" "model_name=$model" "$@" </dev/null >/dev/null 2>&1
  ls "$out"
}
run cpu-16/rule_default 16
run cpu-16/rule_pure-fsdp 16 custom_mesh_and_rule=pure-fsdp
run cpu-8/rule_ep-as-cp_ici_fsdp_parallelism=-1_ici_expert_parallelism=2 8 custom_mesh_and_rule=ep-as-cp ici_fsdp_parallelism=-1 ici_expert_parallelism=2
run cpu-8/rule_shard-exp-on-fsdp_ici_fsdp_parallelism=-1_ici_expert_parallelism=2 8 custom_mesh_and_rule=shard-exp-on-fsdp ici_fsdp_parallelism=-1 ici_expert_parallelism=2
MODEL=deepseek3-tiny run cpu-8/layers_3_ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 ici_fsdp_parallelism=4 ici_expert_parallelism=2
MODEL=deepseek3-tiny run cpu-8/layers_3_mtp_1_ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 ici_fsdp_parallelism=4 ici_expert_parallelism=2 mtp_num_layers=1
# model files of 0.2.5 beyond the six (configs/models): a Llama 3.1 (llama2 block) with tensor
# parallelism, and kimi-k2-1t (deepseek block) with expert parallelism
MODEL=llama3.1-8b run cpu-8/ici_fsdp_parallelism=4_ici_tensor_parallelism=2 8 ici_fsdp_parallelism=4 ici_tensor_parallelism=2
MODEL=kimi-k2-1t run cpu-8/ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 ici_fsdp_parallelism=4 ici_expert_parallelism=2
# the qwen3 block (dense Qwen3: query/key norms): qwen3-8b (untied logits) with tensor parallelism,
# qwen3-0.6b (tied logits) on fsdp
MODEL=qwen3-8b run cpu-8/ici_fsdp_parallelism=4_ici_tensor_parallelism=2 8 ici_fsdp_parallelism=4 ici_tensor_parallelism=2
MODEL=qwen3-0.6b run cpu-8/ici_fsdp_parallelism=8 8 ici_fsdp_parallelism=8
# the mistral block (Llama's layer, MLP intermediate on activation_norm_length) with tensor
# parallelism, and the mixtral block (its MoE: softmax top-2 of 8, no shared experts) with expert
# parallelism, the sparse path (mixtral-8x7b) and the dense path (mixtral-8x22b, sparse_matmul=false)
MODEL=mistral-7b run cpu-8/ici_fsdp_parallelism=4_ici_tensor_parallelism=2 8 ici_fsdp_parallelism=4 ici_tensor_parallelism=2
MODEL=mixtral-8x7b run cpu-8/ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 ici_fsdp_parallelism=4 ici_expert_parallelism=2
MODEL=mixtral-8x22b run cpu-8/ici_fsdp_parallelism=2_ici_tensor_parallelism=2_ici_expert_parallelism=2_sparse_matmul=false 8 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false
# the qwen3_moe block (Qwen3's attention with query/key norms, RoutedMoE moe_block of width
# moe_mlp_dim, softmax top-8 of 128 with norm_topk_prob) with expert parallelism, the sparse path
# (qwen3-30b-a3b) and the dense path with tensor parallelism (qwen3-235b-a22b, sparse_matmul=false)
MODEL=qwen3-30b-a3b run cpu-8/ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 ici_fsdp_parallelism=4 ici_expert_parallelism=2
MODEL=qwen3-235b-a22b run cpu-8/ici_fsdp_parallelism=2_ici_tensor_parallelism=2_ici_expert_parallelism=2_sparse_matmul=false 8 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false
# the gpt_oss block (layers_0 local sliding and layers_1 global scanned together; attention biases and
# sinks, gate and expert biases) with expert parallelism on the sparse path
MODEL=gpt-oss-20b run cpu-8/ici_fsdp_parallelism=4_ici_expert_parallelism=2 8 ici_fsdp_parallelism=4 ici_expert_parallelism=2
# the gemma3 block (blocks of six layers, five local and one global, scanned as layers.layers_0..5, and
# layers_remainder: 34 layers are 5 blocks and a remainder of 4) with tensor parallelism
MODEL=gemma3-4b run cpu-8/ici_fsdp_parallelism=4_ici_tensor_parallelism=2 8 ici_fsdp_parallelism=4 ici_tensor_parallelism=2

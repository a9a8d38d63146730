#!/usr/bin/env bash
# Same behaviour before and after a change that must not change behaviour (a refactor):
# runs a fixed set of configurations with two shardsim binaries and compares, byte for byte,
# everything they print and write except wall-clock figures (step times, tokens/s, trace
# timestamps, elapsed seconds): losses, gradient norms, memory and traffic tables, run.json,
# metrics.json, the CSVs, the sharding dumps, the trace's events and the verdicts.
#
#   bench/same-behaviour.sh OLD_SHARDSIM NEW_SHARDSIM [WORKDIR]
#
# Needs jq.  Exit 0 when every configuration matches, 1 naming each difference.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OLD_SHARDSIM NEW_SHARDSIM [WORKDIR]" >&2; exit 2
fi
old=$(readlink -f "$1"); new=$(readlink -f "$2")
root=$(cd "$(dirname "$0")/.." && pwd)
work=${3:-$(mktemp -d /tmp/same-behaviour.XXXXXX)}
command -v jq >/dev/null || { echo "$0: jq is needed (apt-get install jq)" >&2; exit 2; }
for b in "$old" "$new"; do [ -x "$b" ] || { echo "$0: $b is not an executable" >&2; exit 2; }; done

# name | arguments (run from the repository root; output_dir=out is added for train)
cases=(
"llama-fsdp-tp|train configs/small.yml ici_fsdp_parallelism=4 ici_tensor_parallelism=2 steps=4"
"llama-explicit|train configs/small.yml ici_data_parallelism=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 shard_mode=explicit steps=3"
"llama-remat-minimal|train configs/small.yml ici_fsdp_parallelism=2 ici_tensor_parallelism=2 remat_policy=minimal steps=3"
"llama-ga-zero1|train configs/small.yml ici_data_parallelism=4 shard_optimizer_over_data=true gradient_accumulation_steps=2 steps=3"
"llama-muon|train configs/small.yml ici_fsdp_parallelism=4 opt_type=muon steps=3"
"llama-pipeline|train configs/small.yml ici_pipeline_parallelism=2 ici_fsdp_parallelism=2 num_pipeline_microbatches=4 steps=3"
"llama-context|train configs/small.yml ici_context_parallelism=2 ici_fsdp_parallelism=2 steps=3"
"ds-ep|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 vocab_size=512 max_target_length=128 per_device_batch_size=1 ici_fsdp_parallelism=4 ici_expert_parallelism=2 steps=3"
"ds-epascp|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 first_num_dense_layers=1 vocab_size=256 max_target_length=64 custom_mesh_and_rule=ep-as-cp ici_fsdp_parallelism=2 ici_expert_parallelism=2 sharding_tolerance=0.3 steps=2"
"ds-dense-moe|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 first_num_dense_layers=1 vocab_size=256 max_target_length=64 sparse_matmul=false ici_fsdp_parallelism=2 ici_tensor_parallelism=2 steps=2"
"ds-mtp-explicit|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 first_num_dense_layers=1 vocab_size=256 max_target_length=64 mtp_num_layers=1 mtp_loss_scaling_factor=0.1 shard_mode=explicit ici_fsdp_parallelism=2 steps=2"
"ds-batchsplit|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 first_num_dense_layers=1 vocab_size=256 max_target_length=64 use_batch_split_schedule=true batch_split_factor=2 ici_fsdp_parallelism=2 ici_expert_parallelism=2 steps=2"
"ds-batchsplit-run|train model_name=deepseek3-671b-batchsplit override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=64 base_moe_mlp_dim=32 base_num_decoder_layers=5 first_num_dense_layers=1 vocab_size=256 num_experts=8 num_experts_per_tok=2 n_routing_groups=4 topk_routing_group=2 q_lora_rank=16 kv_lora_rank=16 qk_nope_head_dim=16 qk_rope_head_dim=8 v_head_dim=16 max_target_length=32 batch_split_factor=2 sharding_tolerance=1 dtype=bfloat16 per_device_batch_size=2 ici_fsdp_parallelism=2 ici_expert_parallelism=2 steps=2"
"ds-ring|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=2 first_num_dense_layers=1 vocab_size=256 max_target_length=64 use_ring_of_experts=true ici_expert_parallelism=4 steps=2"
"ds-pipeline|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=4 first_num_dense_layers=2 vocab_size=256 max_target_length=64 ici_pipeline_parallelism=2 ici_expert_parallelism=2 num_pipeline_microbatches=2 steps=2"
"mixtral-sparse-lb|train model_name=mixtral-8x7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=96 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 load_balance_loss_weight=0.01 steps=2"
"mixtral-explicit-minimal|train model_name=mixtral-8x7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=96 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit remat_policy=minimal steps=2"
"mixtral-dense-ep|train model_name=mixtral-8x7b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=96 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01 norm_topk_prob=true steps=2"
"qwen3moe-sparse-explicit|train model_name=qwen3-30b-a3b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=48 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 num_experts_per_tok=2 ici_data_parallelism=2 ici_fsdp_parallelism=2 shard_mode=explicit steps=2"
"qwen3moe-dense-lb|train model_name=qwen3-30b-a3b override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=96 base_moe_mlp_dim=48 base_num_decoder_layers=2 vocab_size=256 max_target_length=32 per_device_batch_size=2 num_experts=4 num_experts_per_tok=2 ici_fsdp_parallelism=2 ici_expert_parallelism=2 sparse_matmul=false load_balance_loss_weight=0.01 remat_policy=full steps=2"
"dump-mixtral|dump model_name=mixtral-8x7b num_devices=8 ici_fsdp_parallelism=4 ici_expert_parallelism=2"
"llama7b-dry|train model_name=llama2-7b dry_run=true ici_fsdp_parallelism=64 ici_tensor_parallelism=4 per_device_batch_size=1 steps=1"
"llama7b-dry-v5p|train model_name=llama2-7b dry_run=true compile_topology=v5p-8 compile_topology_num_slices=1 ici_fsdp_parallelism=4 per_device_batch_size=2 steps=1"
"ds671-dry|train model_name=deepseek3-671b dry_run=true ici_fsdp_parallelism=32 ici_expert_parallelism=8 per_device_batch_size=1 steps=1"
"ds16-dry-muon|train model_name=deepseek2-16b dry_run=true compile_topology=v5p-16 compile_topology_num_slices=1 ici_fsdp_parallelism=8 opt_type=muon per_device_batch_size=1 steps=1"
"llama-dry-ga-zero1-v5p|train configs/small.yml ici_data_parallelism=4 shard_optimizer_over_data=true gradient_accumulation_steps=5 dry_run=true hardware_profile=v5p steps=1"
"ds-dry-ga6-v5p|train model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=3 first_num_dense_layers=1 vocab_size=512 max_target_length=128 per_device_batch_size=1 ici_fsdp_parallelism=4 ici_expert_parallelism=2 dry_run=true hardware_profile=v5p gradient_accumulation_steps=6 steps=1"
"parity-llama|parity configs/small.yml per_device_batch_size=8 steps=3 learning_rate=3e-4 configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=8;ici_fsdp_parallelism=4 ici_tensor_parallelism=2 shard_mode=explicit"
"dump-ds16|dump model_name=deepseek2-16b num_devices=8 ici_fsdp_parallelism=-1 ici_expert_parallelism=2 custom_mesh_and_rule=ep-as-cp dtype=bfloat16"
"explain|explain mesh=data=2,fsdp=2,tensor=2 shape=8,16 from=P(('data','fsdp'),None) to=P(None,'tensor')"
"models|models"
"refused|train configs/small.yml ici_fsdp_parallelism=3"
)

# Wall-clock figures masked; everything else compared as is.
norm_text() {
  sed -E -e "s#$root/##g" \
         -e 's/^( +[0-9]+ +[-0-9.e+]+ +[-0-9.e+]+ +[-0-9.e+]+ +[-0-9.e+]+) +[0-9.]+ +([0-9]+|-) /\1 T T /' \
         -e 's/(measured on device [0-9]+: )[0-9.]+%/\1T%/' \
         -e 's/[0-9]+(\.[0-9]+)? ?(s|ms) (of CPU|wall|elapsed)/T \3/g' \
         -e 's/(took|in) [0-9]+(\.[0-9]+)? ?s\b/\1 T s/g'
}
norm_json() {
  jq -S 'walk(if type == "object" then
            with_entries(if (.key | test("^(time|time_s|tokens_per_s|ts|dur|wall_s|elapsed_s|cpu_s|step_time_s|seconds)$"))
                         then .value = "T" else . end)
          else . end)' "$1" 2>/dev/null || cat "$1"
}

run_one() { # binary dir args...
  local bin=$1 dir=$2; shift 2
  mkdir -p "$dir"
  local args=("$@")
  case "${args[0]}" in train|parity|dump) args+=("output_dir=$dir/out") ;; esac
  (cd "$root" && "$bin" "${args[@]}") >"$dir/stdout" 2>"$dir/stderr"
  echo $? >"$dir/rc"
  sed -i "s#$dir#DIR#g;s#$work/old#W#g;s#$work/new#W#g" "$dir/stdout" "$dir/stderr"
}

fail=0
for c in "${cases[@]}"; do
  name=${c%%|*}; argstr=${c#*|}
  # split on spaces except inside configs=... (which runs to the end of the line)
  pre=${argstr%%configs=*}
  read -r -a args <<<"$pre"
  if [ "$pre" != "$argstr" ]; then args+=("configs=${argstr#*configs=}"); fi
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    rm -rf "$work/$side/$name"
    run_one "$bin" "$work/$side/$name" "${args[@]}"
  done
  a=$work/old/$name; b=$work/new/$name; bad=""
  cmp -s "$a/rc" "$b/rc" || bad="$bad rc($(cat $a/rc)->$(cat $b/rc))"
  for s in stdout stderr; do
    cmp -s <(norm_text <"$a/$s") <(norm_text <"$b/$s") || bad="$bad $s"
  done
  if [ -d "$a/out" ] || [ -d "$b/out" ]; then
    for f in $( (ls "$a/out" 2>/dev/null; ls "$b/out" 2>/dev/null) | sort -u); do
      case $f in
        report.html) continue ;;  # embeds the JSON compared below, with its timings
        *.json) cmp -s <(norm_json "$a/out/$f" | sed "s#$a#DIR#g;s#$b#DIR#g;s#$root/##g") \
                       <(norm_json "$b/out/$f" | sed "s#$a#DIR#g;s#$b#DIR#g;s#$root/##g") || bad="$bad $f" ;;
        *) cmp -s "$a/out/$f" "$b/out/$f" || bad="$bad $f" ;;
      esac
    done
  fi
  if [ -n "$bad" ]; then echo "DIFFERENT $name:$bad"; fail=1; else echo "same      $name (rc $(cat $a/rc))"; fi
done
echo "work directory: $work"
exit $fail

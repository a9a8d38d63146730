/* pipeline.c — pipeline parallelism (MaxText's NNXPipeline): the config
 * rules and the schedule's arithmetic.  The pipelined decoder stack on the
 * tape is pipeline_run.c's.
 */
#include "models/core/pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/optimizer.h"

/* ------------------------------------------------------------ config */

static sim_status get_i64(const cfg_config *cfg, const char *key, int64_t *out)
{
    long long v;
    SIM_TRY(cfg_get_int(cfg, key, &v));
    *out = v;
    return SIM_OK;
}

static sim_status get_flag(const cfg_config *cfg, const char *key, bool *out)
{
    int v;
    SIM_TRY(cfg_get_bool(cfg, key, &v));
    *out = v != 0;
    return SIM_OK;
}

static bool cfg_str_set(const cfg_config *cfg, const char *key)
{
    const char *s = NULL;
    return cfg_find(cfg, key) && cfg_get_str(cfg, key, &s) == SIM_OK && s && *s;
}

sim_status model_pipe_from_config(const cfg_config *cfg, const mesh_shape *mesh, int64_t decoder_layers, int64_t batch,
                                  model_pipe *p)
{
    memset(p, 0, sizeof *p);
    p->stage_axis = mesh_shape_axis_index(mesh, "stage");
    p->stages = p->stage_axis >= 0 ? mesh->sizes[p->stage_axis] : 1;
    p->on = p->stages > 1;
    int64_t ppl, L, R, M;
    bool delay;
    SIM_TRY(get_i64(cfg, "pipeline_parallel_layers", &ppl));
    SIM_TRY(get_i64(cfg, "num_layers_per_pipeline_stage", &L));
    SIM_TRY(get_i64(cfg, "num_pipeline_repeats", &R));
    SIM_TRY(get_i64(cfg, "num_pipeline_microbatches", &M));
    SIM_TRY(get_flag(cfg, "pipeline_delay_activation_forwarding", &delay));
    SIM_TRY(get_flag(cfg, "pipeline_fsdp_ag_once", &p->ag_once));
    SIM_TRY(get_flag(cfg, "pipeline_fsdp_ag_per_repeat", &p->ag_per_repeat));
    const int64_t S = p->stages;
    p->delay = delay ? 2 : 1;
    if (!p->on) { /* MaxText reads these keys only when stages > 1 */
        p->layers_per_stage = L;
        p->repeats = 1;
        p->microbatches = 1;
        p->layers = decoder_layers;
        p->micro_rows = batch;
        return SIM_OK;
    }
    /* pipeline_parallel_layers (types.py: -1 = every decoder layer of the stack) */
    if (ppl == -1) ppl = decoder_layers;
    if (ppl < 1 || ppl > decoder_layers)
        return sim_err(SIM_ERR_INPUT,
                       "pipeline_parallel_layers=%lld: must be -1 (all %lld decoder layers) or between 1 and %lld",
                       (long long)ppl, (long long)decoder_layers, (long long)decoder_layers);
    if (ppl != decoder_layers)
        return sim_err(SIM_ERR_INPUT,
                       "pipeline_parallel_layers=%lld < %lld decoder layers: running the remaining layers outside the "
                       "pipeline is not implemented yet; set pipeline_parallel_layers=-1",
                       (long long)ppl, (long long)decoder_layers);
    if (L < 1)
        return sim_err(SIM_ERR_INPUT, "num_layers_per_pipeline_stage=%lld: must be at least 1 (e.g. 1)", (long long)L);
    if (R == -1) {
        if (ppl % (S * L))
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_parallel_layers=%lld is not divisible by stages (ici x dcn "
                           "pipeline_parallelism = %lld) x num_layers_per_pipeline_stage=%lld; choose "
                           "num_layers_per_pipeline_stage dividing %lld (e.g. 1) or a stage count dividing it",
                           (long long)ppl, (long long)S, (long long)L, (long long)(ppl / S > 0 ? ppl / S : 1));
        R = ppl / (S * L);
    }
    if (R < 1 || S * R * L != ppl)
        return sim_err(SIM_ERR_INPUT,
                       "num_pipeline_repeats=%lld x stages %lld x num_layers_per_pipeline_stage=%lld must equal "
                       "pipeline_parallel_layers=%lld; set num_pipeline_repeats=-1 to derive it",
                       (long long)R, (long long)S, (long long)L, (long long)ppl);
    if (M == -1) M = delay ? 2 * S : S;
    if (M < 1 || M % S)
        return sim_err(SIM_ERR_INPUT,
                       "num_pipeline_microbatches=%lld must be a positive multiple of the %lld pipeline stages "
                       "(e.g. %lld, or -1 for the default)",
                       (long long)M, (long long)S, (long long)(2 * S));
    if (batch % M)
        return sim_err(SIM_ERR_INPUT,
                       "the global batch of %lld rows (per_device_batch_size x devices) is not divisible by "
                       "num_pipeline_microbatches=%lld; choose a divisor of %lld that is a multiple of %lld",
                       (long long)batch, (long long)M, (long long)batch, (long long)S);
    p->layers_per_stage = L;
    p->repeats = R;
    p->microbatches = M;
    p->layers = ppl;
    p->micro_rows = batch / M;
    p->circ_storage = R > 1 && M > S * p->delay;
    /* features of MaxText's pipeline that are not implemented: refused, never approximated */
    if (delay && M < 2 * S)
        return sim_err(SIM_ERR_INPUT,
                       "pipeline_delay_activation_forwarding=true needs num_pipeline_microbatches >= 2 x stages = "
                       "%lld (got %lld); raise num_pipeline_microbatches or set the delay to false",
                       (long long)(2 * S), (long long)M);
    if (p->ag_per_repeat) {
        /* types.py's conditions for the weight prefetch, with MaxText's messages */
        if (R <= 1)
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_fsdp_ag_per_repeat=true: Pipeline weight prefetching only supports circular "
                           "pipeline (num_pipeline_repeats=%lld); use more decoder layers than stages x "
                           "num_layers_per_pipeline_stage, or set pipeline_fsdp_ag_per_repeat=false",
                           (long long)R);
        if (L != 1)
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_fsdp_ag_per_repeat=true: Pipeline weight prefetching currently only supports one "
                           "layer per pipeline stage (num_layers_per_pipeline_stage=%lld); set it to 1",
                           (long long)L);
        if (delay)
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_fsdp_ag_per_repeat=true: Pipeline weight prefetching does not support pipeline "
                           "delay; set pipeline_delay_activation_forwarding=false");
        /* MaxText prefetches, at the start of repeat r, each stage's weights of its repeat at iteration
         * r*M + 1 and selects them when the stage's repeat equals stage 0's.  With S >= 3 stages s >= 2
         * are still in repeat r-1 at r*M + 1, so they later run repeat r with repeat r-1's weights
         * (maxtext-facts-2 §C, unverified on hardware): refused rather than guessed */
        if (S > 2)
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_fsdp_ag_per_repeat=true with %lld pipeline stages: MaxText's prefetch of repeat "
                           "r's weights at iteration r*M+1 gives stages >= 2 the previous repeat's weights for part "
                           "of each repeat, which shardsim does not reproduce; use 2 stages, "
                           "pipeline_fsdp_ag_once=true or the default per-iteration gather",
                           (long long)S);
        int ex = mesh_shape_axis_index(mesh, "expert");
        if (ex >= 0 && mesh->sizes[ex] > 1)
            return sim_err(SIM_ERR_INPUT,
                           "pipeline_fsdp_ag_per_repeat=true with ici/dcn_expert_parallelism=%lld: MaxText's gather "
                           "of 'expert' (kept for MoeBlock_0 leaves, order-dependent) is not simulated; set "
                           "expert parallelism to 1 or use pipeline_fsdp_ag_once=true",
                           (long long)mesh->sizes[ex]);
        /* NNXCircularPipeline never reads pipeline_fsdp_ag_once: the prefetch replaces it */
        p->ag_once = false;
    }
    static const char *const unset_strs[] = {"checkpoint_dir", "load_parameters_path", "load_full_state_path"};
    for (int i = 0; i < 3; i++)
        if (cfg_str_set(cfg, unset_strs[i]))
            return sim_err(SIM_ERR_INPUT,
                           "%s with pipeline parallelism (stages=%lld): checkpoints of stage-held layers are not "
                           "implemented yet; unset %s or set ici_pipeline_parallelism=1",
                           unset_strs[i], (long long)S, unset_strs[i]);
    if (cfg_find(cfg, "opt_type")) {
        const char *ot = NULL;
        SIM_TRY(cfg_get_str(cfg, "opt_type", &ot));
        const model_optimizer *row = model_optimizer_find(ot);
        if (row && row->pipeline_refused)
            return sim_err(SIM_ERR_INPUT, "opt_type=%s with pipeline parallelism (stages=%lld) %s", row->name,
                           (long long)S, row->pipeline_refused);
    }
    /* gradient_accumulation_steps: each accumulation microbatch runs a whole pipeline schedule (its own
     * bubbles, and with pipeline_fsdp_ag_once its own gather), as MaxText's GA scan wraps the step.
     * shard_optimizer_over_data: nothing pipeline-specific in MaxText (model_pipe_zero1_spec) */
    return SIM_OK;
}

int64_t model_pipe_iterations(const model_pipe *p) { return p->microbatches * p->repeats + p->delay * (p->stages - 1); }

void model_pipe_ids(const model_pipe *p, int64_t i, int64_t s, int64_t *micro, int64_t *repeat)
{
    int64_t k = i - p->delay * s;
    if (k < 0) k = 0;
    *micro = k % p->microbatches;
    *repeat = k / p->microbatches;
}

bool model_pipe_is_bubble(const model_pipe *p, int64_t i, int64_t s)
{
    int64_t k = i - p->delay * s;
    return k < 0 || k >= p->microbatches * p->repeats;
}

int64_t model_pipe_layer_stage(const model_pipe *p, int64_t l) { return (l / p->layers_per_stage) % p->stages; }

int model_pipe_ppermutes_per_iteration(const model_pipe *p) { return p->circ_storage ? 3 : 2; }

double model_pipe_bubble_fraction(const model_pipe *p)
{
    double bub = (double)(p->delay * (p->stages - 1));
    return bub / ((double)(p->microbatches * p->repeats) + bub);
}

void model_pipe_describe(const model_pipe *p, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "pipeline: stages S=%lld, repeats R=%lld%s, microbatches M=%lld of %lld rows, layers/stage L=%lld, "
             "iterations %lld, bubble fraction (S-1)/(R*M+S-1) = %.3f, weights gathered %s",
             (long long)p->stages, (long long)p->repeats, p->repeats > 1 ? " (circular)" : "",
             (long long)p->microbatches, (long long)p->micro_rows, (long long)p->layers_per_stage,
             (long long)model_pipe_iterations(p), model_pipe_bubble_fraction(p),
             p->ag_once         ? "once per step (pipeline_fsdp_ag_once)"
             : p->ag_per_repeat ? "once per repeat, two repeats kept (pipeline_fsdp_ag_per_repeat)"
                                : "per iteration");
}

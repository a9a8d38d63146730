/* test_models_wire.c — weight gathers and parameter-gradient reductions in
 * the dtype the hardware profile's compiler moves them (configs/hardware/,
 * weight_gather_dtype / gradient_reduction_dtype).
 *
 * A tiny Llama under dtype=bfloat16, weight_dtype=float32, one step, every
 * figure against a formula derived here from the parameter shapes and
 * shardings (n_fsdp: the elements of the fsdp-sharded weights one device
 * holds; k = 2 devices on fsdp, so a gather or reduce-scatter moves
 * (k-1) x n_fsdp elements):
 *   - no profile (XLA:CPU's behaviour): weight all-gathers and gradient
 *     reduce-scatters move 4 bytes an element (float32, weight_dtype);
 *   - hardware_profile=v5p (XLA:TPU casts the shard first and reduces in
 *     dtype): both move 2 bytes an element;
 *   - hardware_profile=h100 (XLA:GPU's CollectiveQuantizer moves the
 *     narrowing cast before all-gathers only): gathers 2, reductions 4;
 *   - dtype=float32 under v5p: nothing narrows, 4 and 4;
 *   - the embedding table is left out: under the TPU profiles it is not
 *     gathered at all (embedding_lookup: all_to_all; test_models_xla_rules);
 *   - every weight gather and gradient record carries that dtype, the
 *     stored parameters, gradients and Adam moments stay float32, and the
 *     losses are the same bits (numerics stay float32);
 *   - ZeRO-1: the gradients' reduction over data halves under v5p, the
 *     gather of the updated float32 parameters stays float32;
 *   - pipeline_fsdp_ag_once: the stage's gathered layers are held (memory)
 *     and moved in the gather dtype, their reduce-scatter in the reduction
 *     dtype: held layers x layer elements x bytes.
 * A gradient reduction counts as the reduce-scatter it stands for: under the
 * TPU profiles the model's gradients split on their last dim (emb 16, a few
 * elements a device) stay all-reduces of twice the bytes
 * (gradient_lane_scatter_max_all_reduce), counted at half. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "models/core/train.h"
#include "sim/arena.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama-mha.yml: 2 layers of width 16, 2 heads of 8, MLP 32 */
static const char *const TINY[] = {TINY_LLAMA_MHA_YML};
enum { NTINY = sizeof TINY / sizeof TINY[0], NDEV = 4 };

typedef struct {
    double loss;
    uint64_t n_fsdp;             /* elements of the fsdp-sharded parameters on a device */
    uint64_t n_params;           /* elements of every parameter on a device */
    uint64_t params, grads, opt; /* arena bytes by category at their peaks (device 0) */
    uint64_t ag, rs;             /* forward fsdp all-gathers, gradient reduce-scatters (device 0) */
    int ag_calls, rs_calls;
    int bad_dtype; /* weight gathers / gradient records not in the expected dtype */
} figures;

/* Whether a gradient record's tag names a parameter that fsdp shards. */
static bool fsdp_param(const model_def *def, int fsdp, const char *tag)
{
    for (int i = 0; i < def->nparams; i++)
        if ((mesh_spec_dim_axes(&def->spec[i]) & (1u << fsdp)) && strstr(tag, def->defs[i].path)) return true;
    return false;
}

/* The bytes of a gradient reduction as the reduce-scatter it stands for: a TPU profile keeps the
 * reduce-scatters of gradients split on their last dim to a few elements as all-reduces (twice the
 * bytes; gradient_lane_scatter_max_all_reduce, test_models_xla_rules), which this tiny model's are. */
static uint64_t as_scatter(const sim_record *x)
{
    return x->op == SIM_OP_ALL_REDUCE ? x->bytes_sent / 2 : x->op == SIM_OP_REDUCE_SCATTER ? x->bytes_sent : 0;
}

static void run(const char *dtype, const char *profile, sim_dtype want_gather, sim_dtype want_reduce, figures *f)
{
    char dt[64], hp[64];
    snprintf(dt, sizeof dt, "dtype=%s", dtype);
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    const char *words[] = {dt, "weight_dtype=float32", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, profile ? 5 : 4, NDEV, 1);
    model_run_train(&r, false);
    memset(f, 0, sizeof *f);
    f->loss = r.job.stats[0].loss;
    int fsdp = mesh_shape_axis_index(&r.def->mesh, "fsdp");
    for (int i = 0; i < r.def->nparams; i++) {
        uint64_t e = model_run_shard_elems(r.def, i, NULL);
        uint32_t axes = mesh_spec_dim_axes(&r.def->spec[i]);
        f->n_params += e;
        if ((axes & (1u << fsdp)) && !strstr(r.def->defs[i].path, "token_embedder")) f->n_fsdp += e;
    }
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    f->params = st.peak_by[SIM_MEM_PARAMS];
    f->grads = st.peak_by[SIM_MEM_GRADS];
    f->opt = st.peak_by[SIM_MEM_OPTIMIZER];
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        bool on_fsdp = x->axes.n == 1 && x->axes.axis[0] == fsdp;
        bool grad = !strncmp(x->tag, "grad/", 5);
        if (strstr(x->tag, "token_embedder")) continue; /* the table's lookup, gathered or not by the profile */
        /* every other fsdp all-gather of this model is a weight's (the activations shard on data/fsdp rows) */
        if (x->op == SIM_OP_ALL_GATHER && on_fsdp) {
            f->bad_dtype += x->dtype != want_gather;
            if (x->phase == SIM_PHASE_FORWARD) f->ag += x->bytes_sent, f->ag_calls++;
        }
        if (grad) {
            f->bad_dtype += x->dtype != want_reduce;
            if (x->op == SIM_OP_REDUCE_SCATTER && on_fsdp) f->rs += x->bytes_sent, f->rs_calls++;
            /* under a TPU profile the gradients split on their last dim (emb 16 over fsdp: 8 elements a
             * device, gradient_lane_scatter_max_all_reduce) stay all-reduces: twice the bytes of the
             * reduce-scatter they stand for */
            if (x->op == SIM_OP_ALL_REDUCE && on_fsdp && fsdp_param(r.def, fsdp, x->tag))
                f->rs += x->bytes_sent / 2, f->rs_calls++;
        }
    }
    model_run_close(&r);
}

static void test_fsdp_gathers_and_reductions(void **state)
{
    (void)state;
    figures c, t, g, t32;
    run("bfloat16", NULL, SIM_F32, SIM_F32, &c);
    run("bfloat16", "v5p", SIM_BF16, SIM_BF16, &t);
    run("bfloat16", "h100", SIM_BF16, SIM_F32, &g);
    run("float32", "v5p", SIM_F32, SIM_F32, &t32);
    assert_true(c.n_fsdp > 0 && c.ag_calls > 0 && c.rs_calls > 0);
    const figures *all[] = {&c, &t, &g, &t32};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(all[i]->bad_dtype, 0);
        assert_int_equal(all[i]->n_fsdp, c.n_fsdp);
        /* the stored state stays float32: parameters, gradients, both Adam moments */
        assert_int_equal(all[i]->params, 4 * c.n_params);
        assert_int_equal(all[i]->grads, 4 * c.n_params);
        assert_int_equal(all[i]->opt, 2 * 4 * c.n_params);
        assert_int_equal(all[i]->ag_calls, c.ag_calls);
        assert_int_equal(all[i]->rs_calls, c.rs_calls);
        assert_true(all[i]->loss == c.loss); /* numerics stay float32 */
    }
    /* (k-1) x n_fsdp elements at the rule's bytes per element, k = 2 */
    assert_int_equal(c.ag, 4 * c.n_fsdp);
    assert_int_equal(c.rs, 4 * c.n_fsdp);
    assert_int_equal(t.ag, 2 * c.n_fsdp);
    assert_int_equal(t.rs, 2 * c.n_fsdp);
    assert_int_equal(g.ag, 2 * c.n_fsdp);
    assert_int_equal(g.rs, 4 * c.n_fsdp);
    assert_int_equal(t32.ag, 4 * c.n_fsdp);
    assert_int_equal(t32.rs, 4 * c.n_fsdp);
}

/* ZeRO-1 (data=2, no accumulation): the pending gradient sums reduce over data in the reduction dtype
 * (XLA:TPU: bfloat16, MaxText 0.2.5's ZeRO-1 step compiled for v5p-8), the updated float32 parameters
 * are gathered as stored (float32) under any profile */
static void zero1_bytes(const char *profile, uint64_t *grads, uint64_t *params, int *bad)
{
    const char *words[] = {"dtype=bfloat16",         "weight_dtype=float32",     "ici_data_parallelism=2",
                           "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2", "shard_optimizer_over_data=true",
                           "hardware_profile=v5p"};
    model_run r;
    model_run_open(&r, TINY, NTINY, 8, words, profile ? 7 : 6, NDEV, 1);
    model_run_train(&r, false);
    *grads = *params = 0;
    *bad = 0;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        if (!strncmp(rec[i].tag, "zero1/grads/", 12)) {
            *grads += as_scatter(&rec[i]);
            *bad += rec[i].dtype != (profile ? SIM_BF16 : SIM_F32);
        }
        if (!strncmp(rec[i].tag, "zero1/params/", 13)) {
            *params += rec[i].bytes_sent;
            *bad += rec[i].dtype != SIM_F32;
        }
    }
    model_run_close(&r);
}

static void test_zero1(void **state)
{
    (void)state;
    uint64_t gc, pc, gt, pt;
    int bc, bt;
    zero1_bytes(NULL, &gc, &pc, &bc);
    zero1_bytes("v5p", &gt, &pt, &bt);
    assert_true(gc > 0 && pc > 0);
    assert_int_equal(bc + bt, 0);
    assert_int_equal(gt * 2, gc); /* the same elements at 2 bytes instead of 4 */
    assert_int_equal(pt, pc);
}

/* An unknown profile is refused when the model is defined, naming the key and the valid names. */
static void test_unknown_profile(void **state)
{
    (void)state;
    const char *words[] = {"hardware_profile=v9z", "ici_fsdp_parallelism=4"};
    model_run_expect_refused(TINY, NTINY, 4, words, 2, NDEV, "hardware_profile=v9z", "v5p");
}

/* pipeline_fsdp_ag_once (stage=2 fsdp=2, 8 layers, M=4): each device holds 4 layers gathered over
 * fsdp for the whole loop; under v5p they are held and moved in bfloat16 */
/* tests/data/tiny-llama.yml with 8 layers over 2 stages of 2-way fsdp, bfloat16 compute over float32 weights,
 * the stages' weights gathered once per step */
static const char *const PIPE[] = {TINY_LLAMA_YML,
                                   "base_num_decoder_layers=8",
                                   "dtype=bfloat16",
                                   "weight_dtype=float32",
                                   "ici_pipeline_parallelism=2",
                                   "ici_fsdp_parallelism=2",
                                   "num_pipeline_microbatches=4",
                                   "pipeline_fsdp_ag_once=true"};
enum { NPIPE = sizeof PIPE / sizeof PIPE[0] };

typedef struct {
    uint64_t layer_fsdp;  /* elements of one layer's fsdp-sharded weights, unsharded (the gathered copy) */
    uint64_t table;       /* elements of the embedding table when fsdp shards it (gathered for the lookup) */
    uint64_t ag, rs, act; /* device 0: ag_once's gathers and gradient reduce-scatters; activations at peak */
    int ag_calls;
} pipe_figures;

static void run_pipe(const char *profile, pipe_figures *f)
{
    const char *extra[] = {"hardware_profile=v5p"};
    model_run r;
    model_run_open(&r, PIPE, NPIPE, 8, extra, profile ? 1 : 0, NDEV, 1);
    model_run_train(&r, false);
    memset(f, 0, sizeof *f);
    int fsdp = mesh_shape_axis_index(&r.def->mesh, "fsdp");
    for (int i = 0; i < r.def->nparams; i++) {
        const model_param_def *pd = &r.def->defs[i];
        if (!(mesh_spec_dim_axes(&r.def->spec[i]) & (1u << fsdp))) continue;
        uint64_t e = 1;
        for (int q = 0; q < pd->rank; q++)
            if (q != pd->scan_dim) e *= (uint64_t)pd->shape[q];
        if (pd->scan_dim >= 0) f->layer_fsdp += e;
        else if (strstr(pd->path, "token_embedder")) f->table = e;
    }
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        if (!strcmp(rec[i].tag, "pipeline/fsdp_ag_once") && rec[i].op == SIM_OP_ALL_GATHER)
            f->ag += rec[i].bytes_sent, f->ag_calls++;
        if (!strcmp(rec[i].tag, "pipeline/fsdp_ag_once (grad)")) f->rs += as_scatter(&rec[i]);
    }
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    f->act = st.peak_by[SIM_MEM_ACTIVATIONS];
    model_run_close(&r);
}

static void test_pipeline_ag_once(void **state)
{
    (void)state;
    pipe_figures c, t;
    run_pipe(NULL, &c);
    run_pipe("v5p", &t);
    const uint64_t held = 4; /* 8 layers over 2 stages, R = 4 repeats of one layer per stage */
    assert_true(c.layer_fsdp > 0 && c.ag_calls > 0);
    assert_int_equal(t.ag_calls, c.ag_calls);
    /* each held layer's fsdp-sharded weights: half gathered in (k-1)/k = 1/2 */
    assert_int_equal(c.ag, held * c.layer_fsdp / 2 * 4);
    assert_int_equal(t.ag, held * c.layer_fsdp / 2 * 2);
    assert_int_equal(c.rs, held * c.layer_fsdp / 2 * 4);
    assert_int_equal(t.rs, held * c.layer_fsdp / 2 * 2);
    /* the gathered copies live through the loop among the activations: 2 bytes an element fewer; so
     * does the embedding table's float32 copy without the profile, while under v5p the table is not
     * gathered (embedding_lookup: all_to_all) and the int32 ids of the fsdp group are held instead:
     * 8 rows over stage and fsdp, gathered over fsdp, 4 x 16 */
    assert_true(c.table > 0);
    assert_int_equal(c.act - t.act, held * c.layer_fsdp * 2 + c.table * 4 - 4 * 16 * 4);
}

/* pipeline_fsdp_ag_per_repeat (stage=2 fsdp=2, 4 layers, R = 2): each repeat's layer gathered and its
 * gradient reduce-scattered in the profile's dtypes: half the bytes of the float32 run, same calls */
static void per_repeat(const char *profile, uint64_t *ag, uint64_t *rs, int *calls, int *bad)
{
    const char *words[] = {"base_emb_dim=16",
                           "base_num_query_heads=4",
                           "base_num_kv_heads=2",
                           "head_dim=8",
                           "base_mlp_dim=24",
                           "base_num_decoder_layers=4",
                           "vocab_size=64",
                           "max_target_length=16",
                           "dtype=bfloat16",
                           "weight_dtype=float32",
                           "ici_pipeline_parallelism=2",
                           "ici_fsdp_parallelism=2",
                           "pipeline_fsdp_ag_per_repeat=true",
                           "num_pipeline_microbatches=4",
                           "hardware_profile=v5p"};
    model_run r;
    model_run_open(&r, words, profile ? 15 : 14, 8, NULL, 0, NDEV, 1);
    model_run_train(&r, false);
    *ag = *rs = 0;
    *calls = *bad = 0;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        bool g = !strcmp(rec[i].tag, "pipeline/fsdp_ag_per_repeat"),
             q = !strcmp(rec[i].tag, "pipeline/fsdp_ag_per_repeat (grad)");
        if (g && rec[i].op == SIM_OP_ALL_GATHER) *ag += rec[i].bytes_sent, (*calls)++;
        if (q) *rs += as_scatter(&rec[i]);
        if (g || q) *bad += rec[i].dtype != (profile ? SIM_BF16 : SIM_F32);
    }
    model_run_close(&r);
}

static void test_pipeline_per_repeat(void **state)
{
    (void)state;
    uint64_t agc, rsc, agt, rst;
    int cc, ct, bc, bt;
    per_repeat(NULL, &agc, &rsc, &cc, &bc);
    per_repeat("v5p", &agt, &rst, &ct, &bt);
    assert_true(agc > 0 && rsc > 0 && cc > 0);
    assert_int_equal(bc + bt, 0);
    assert_int_equal(ct, cc);
    assert_int_equal(2 * agt, agc);
    assert_int_equal(2 * rst, rsc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fsdp_gathers_and_reductions),
        cmocka_unit_test(test_unknown_profile),
        cmocka_unit_test(test_zero1),
        cmocka_unit_test(test_pipeline_ag_once),
        cmocka_unit_test(test_pipeline_per_repeat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_models_bytes.c — bytes in MaxText's dtypes.
 *
 * One step of a tiny Llama on fsdp=2 x tensor=2 under dtype=bfloat16 and
 * dtype=float32 (and weight_dtype=bfloat16), every figure against a formula
 * derived here from the parameter shapes and shardings:
 *   - parameters, gradients and the two Adam moments hold
 *     local elements x sizeof(weight_dtype) each;
 *   - the forward all-gathers over fsdp are the fsdp-sharded weights, moved
 *     in weight_dtype: (k-1) x local elements x sizeof(weight_dtype) (XLA
 *     gathers the operand of DenseGeneral's cast: MaxText 0.2.5's compiled
 *     step shows f32 all-gathers under dtype=bfloat16);
 *   - the gradient reduce-scatters over fsdp move the same bytes;
 *   - every record's bytes follow the header formulas at its counted dtype:
 *     weight_dtype for weights and their gradients and in the optimizer,
 *     float32 where MaxText computes in float32 (RMSNorm statistics, the
 *     float32 logits' loss sums, the loss, the global norm), `dtype` for the
 *     rest (activations);
 *   - cast_logits_to_fp32=false leaves the loss sums in dtype, and
 *     logits_dot_in_fp32 makes them float32 again;
 *   - ZeRO-1 with accumulation holds its gradients in dtype (MaxText casts
 *     the parameters before the accumulation loop);
 *   - Muon's Newton-Schulz collectives move weight_dtype.
 * The losses do not depend on the dtypes (the simulator computes in float32). */
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
static const char *const FSDP_TENSOR[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
static const char *const ZERO1_GA[] = {"ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
                                       "shard_optimizer_over_data=true", "gradient_accumulation_steps=2"};

/* Elements of parameter i on one device under `spec`: its elements over the sizes of the mesh axes the spec uses. */
static uint64_t local_elems(const model_def *def, int i, const mesh_spec *spec, int *fsdp_k)
{
    int fsdp = mesh_shape_axis_index(&def->mesh, "fsdp");
    *fsdp_k = (mesh_spec_dim_axes(spec) >> fsdp) & 1u ? def->mesh.sizes[fsdp] : 1;
    return model_run_shard_elems(def, i, spec);
}

/* Bytes one device sends for a record, by the collectives' formulas, at `es` bytes an element. */
static uint64_t formula(const sim_record *r, uint64_t es)
{
    uint64_t k = (uint64_t)r->group_size, n = r->elements;
    switch (r->op) {
    case SIM_OP_ALL_GATHER: return (k - 1) * n * es;
    case SIM_OP_REDUCE_SCATTER:
    case SIM_OP_ALL_TO_ALL: return (k - 1) * n / k * es;
    case SIM_OP_ALL_REDUCE: return k > 1 && n % k == 0 ? 2 * (k - 1) * n / k * es : r->bytes_sent; /* uneven: see sim */
    default: return r->bytes_sent;
    }
}

/* Collectives MaxText computes in float32: RMSNorm's sums of squares (an all-reduce in a norm layer,
 * forward or recomputed, and its backward sum; the norm's output and the input's gradient are in
 * dtype), the global norm, and with float32 logits the loss sums and the loss mean. */
static bool float32_record(const sim_record *r, bool logits_f32)
{
    if (r->op == SIM_OP_ALL_REDUCE && strstr(r->tag, "norm") && strncmp(r->tag, "grad/", 5) &&
        strncmp(r->tag, "optimizer/", 10))
        return true;
    if (strstr(r->tag, "optimizer/grad_norm")) return true;
    return logits_f32 && (strstr(r->tag, "cross_entropy") || strstr(r->tag, "loss/mean"));
}

typedef struct {
    double loss;
    uint64_t params, grads, opt;        /* arena bytes by category (device 0, at their peaks) */
    uint64_t fwd_fsdp_ag, bwd_grad_rs;  /* record bytes (device 0) */
    uint64_t logits_ag_es;              /* bytes per element of the logits kernel's fsdp gather */
    uint64_t want_params, want_fsdp_ag; /* the formulas at 1 byte an element */
    uint64_t want_opt;                  /* elements of one optimizer moment on a device */
    int bad_records;                    /* records whose bytes or dtype break the formula */
    uint64_t leftover;                  /* activation, temporary and comm bytes live after the step */
    int ndata;                          /* size of the data axis */
    int optimizer_records;              /* collectives of the optimizer phase */
    uint64_t act, peak;                 /* saved activations at their peak; the total peak */
} figures;

static void run_on(const char *const *mesh, int nmesh, int rows, const char *dtype, const char *weight_dtype,
                   const char *extra, uint64_t act_es, figures *f)
{
    char dt[64], wdt[64];
    snprintf(dt, sizeof dt, "dtype=%s", dtype);
    snprintf(wdt, sizeof wdt, "weight_dtype=%s", weight_dtype);
    const char *words[10] = {dt, wdt};
    int nw = 2;
    for (int i = 0; i < nmesh; i++) words[nw++] = mesh[i];
    char ex[2][64];
    if (extra) { /* one or two words */
        int k = sscanf(extra, "%63s %63s", ex[0], ex[1]);
        for (int i = 0; i < k; i++) words[nw++] = ex[i];
    }
    model_run r;
    model_run_open(&r, TINY, NTINY, rows, words, nw, NDEV, 1);
    model_run_train(&r, false);
    memset(f, 0, sizeof *f);
    f->loss = r.job.stats[0].loss;
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    f->params = st.peak_by[SIM_MEM_PARAMS];
    f->grads = st.peak_by[SIM_MEM_GRADS];
    f->opt = st.peak_by[SIM_MEM_OPTIMIZER];
    f->act = st.peak_by[SIM_MEM_ACTIVATIONS];
    f->peak = st.peak;
    /* every counted allocation was released with the bytes it was counted with */
    f->leftover = st.live_by[SIM_MEM_ACTIVATIONS] + st.live_by[SIM_MEM_TEMP] + st.live_by[SIM_MEM_COMM];
    for (int i = 0; i < r.def->nparams; i++) {
        int k;
        uint64_t e = local_elems(r.def, i, &r.def->spec[i], &k);
        int kz;
        f->want_opt += local_elems(r.def, i, &r.def->opt_spec[i], &kz); /* ZeRO-1 adds 'data' */
        f->want_params += e;
        f->want_fsdp_ag += (uint64_t)(k - 1) * e;
    }
    int fsdp = mesh_shape_axis_index(&r.def->mesh, "fsdp");
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    f->ndata = mesh_shape_axis_index(&r.def->mesh, "data") >= 0
                   ? r.def->mesh.sizes[mesh_shape_axis_index(&r.def->mesh, "data")]
                   : 1;
    /* float32 logits: cast_logits_to_fp32 (the default) or logits_dot_in_fp32 */
    bool logits_f32 =
        !(extra && strstr(extra, "cast_logits_to_fp32=false")) || (extra && strstr(extra, "logits_dot_in_fp32=true"));
    sim_dtype wdtype = strcmp(weight_dtype, "float32") ? SIM_BF16 : SIM_F32;
    bool zero1_ga = mesh == ZERO1_GA;
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        bool on_fsdp = x->axes.n == 1 && x->axes.axis[0] == fsdp;
        uint64_t es = sim_dtype_size(x->dtype);
        sim_dtype want = act_es == 4 ? SIM_F32 : SIM_BF16;
        /* weights (every fsdp all-gather here), their gradients and the optimizer: weight_dtype */
        if ((x->op == SIM_OP_ALL_GATHER && on_fsdp) || !strncmp(x->tag, "grad/", 5) || x->phase == SIM_PHASE_OPTIMIZER)
            want = wdtype;
        /* ZeRO-1 with accumulation: parameters cast to dtype before their gather, gradients in dtype */
        if (zero1_ga && (!strncmp(x->tag, "grad/", 5) || !strncmp(x->tag, "zero1/", 6)))
            want = act_es == 4 ? SIM_F32 : SIM_BF16;
        if (float32_record(x, logits_f32)) want = SIM_F32;
        if (x->dtype != want) {
            print_message("record %s %s: %s\n", sim_op_name(x->op), x->tag, sim_dtype_name(x->dtype));
            f->bad_records++;
        }
        if (x->bytes_sent != formula(x, es)) f->bad_records++;
        f->optimizer_records += x->phase == SIM_PHASE_OPTIMIZER;
        if (x->op == SIM_OP_ALL_GATHER && x->phase == SIM_PHASE_FORWARD && on_fsdp) {
            f->fwd_fsdp_ag += x->bytes_sent;
            if (strstr(x->tag, "logits_dense")) f->logits_ag_es = es;
        }
        if (x->op == SIM_OP_REDUCE_SCATTER && x->phase == SIM_PHASE_BACKWARD && on_fsdp && !strncmp(x->tag, "grad/", 5))
            f->bwd_grad_rs += x->bytes_sent;
    }
    model_run_close(&r);
}

static void run(const char *dtype, const char *weight_dtype, const char *extra, uint64_t act_es, figures *f)
{
    run_on(FSDP_TENSOR, 2, 4, dtype, weight_dtype, extra, act_es, f);
}

static void test_bf16_vs_f32(void **state)
{
    (void)state;
    figures b, s, w;
    run("bfloat16", "float32", NULL, 2, &b);
    run("float32", "float32", NULL, 4, &s);
    run("bfloat16", "bfloat16", NULL, 2, &w);
    assert_true(b.want_params > 0 && b.want_fsdp_ag > 0);
    /* weight_dtype: parameters, gradients, the two Adam moments */
    assert_int_equal(b.params, 4 * b.want_params);
    assert_int_equal(b.grads, 4 * b.want_params);
    assert_int_equal(b.opt, 2 * 4 * b.want_params);
    assert_int_equal(b.want_opt, b.want_params);
    assert_int_equal(s.params, 4 * s.want_params);
    assert_int_equal(w.params, 2 * w.want_params);
    assert_int_equal(w.grads, 2 * w.want_params);
    assert_int_equal(w.opt, 2 * 2 * w.want_params);
    /* weight_dtype on the wire too: gathered before the cast, gradients reduced after the cast back */
    assert_int_equal(b.fwd_fsdp_ag, 4 * b.want_fsdp_ag);
    assert_int_equal(s.fwd_fsdp_ag, 4 * s.want_fsdp_ag);
    assert_int_equal(w.fwd_fsdp_ag, 2 * w.want_fsdp_ag);
    assert_int_equal(b.bwd_grad_rs, 4 * b.want_fsdp_ag);
    assert_int_equal(s.bwd_grad_rs, 4 * s.want_fsdp_ag);
    assert_int_equal(w.bwd_grad_rs, 2 * w.want_fsdp_ag);
    assert_int_equal(b.logits_ag_es, 4);
    assert_int_equal(b.bad_records, 0);
    assert_int_equal(s.bad_records, 0);
    assert_int_equal(w.bad_records, 0);
    assert_int_equal(b.leftover + s.leftover + w.leftover, 0);
    /* activations: dtype halves them (a few float32 statistics and the float32 logits aside) */
    assert_true(b.act < s.act && 2 * b.act > s.act);
    /* numerics stay float32 */
    assert_true(b.loss == s.loss && b.loss == w.loss);
}

static void test_logits_fp32(void **state)
{
    (void)state;
    /* without cast_logits_to_fp32 the logits and the loss sums stay in dtype, and the peak falls by
     * the logits' two bytes an element at least; logits_dot_in_fp32 brings float32 back (the
     * record rules of run_on check each collective's dtype) */
    figures b, c, l;
    run("bfloat16", "float32", NULL, 2, &b);
    run("bfloat16", "float32", "cast_logits_to_fp32=false", 2, &c);
    run("bfloat16", "float32", "cast_logits_to_fp32=false logits_dot_in_fp32=true", 2, &l);
    assert_int_equal(b.bad_records + c.bad_records + l.bad_records, 0);
    assert_int_equal(c.leftover + l.leftover, 0);
    assert_true(c.peak < b.peak);
    assert_int_equal(l.peak, b.peak);
    assert_true(l.loss == b.loss && c.loss == b.loss);
}

static void test_muon_optimizer_phase(void **state)
{
    (void)state;
    /* Muon's Newton-Schulz collectives (phase optimizer) follow the weights' sharding and move
     * weight_dtype (float32) under dtype=bfloat16; the run's other records keep their rules */
    figures m;
    run("bfloat16", "float32", "opt_type=muon", 2, &m);
    assert_true(m.optimizer_records > 1);
    assert_int_equal(m.bad_records, 0);
    assert_int_equal(m.leftover, 0);
}

static void test_zero1_accumulation(void **state)
{
    (void)state;
    /* ZeRO-1 with accumulation casts the parameters to dtype before the loop, so every gradient
     * buffer (the sinks, the stacked optimizer-layout gradients) holds dtype: half the bytes of the
     * float32 run; the Adam moments, sharded over data (k = 2), stay in weight_dtype in both */
    figures z, f;
    run_on(ZERO1_GA, 5, 8, "bfloat16", "float32", NULL, 2, &z);
    run_on(ZERO1_GA, 5, 8, "float32", "float32", NULL, 4, &f);
    assert_int_equal(z.ndata, 2);
    assert_true(z.grads > 0);
    assert_int_equal(2 * z.grads, f.grads);
    assert_true(z.want_opt < z.want_params);
    assert_int_equal(z.opt, 2 * 4 * z.want_opt);
    assert_int_equal(f.opt, z.opt);
    assert_int_equal(z.bad_records + f.bad_records, 0);
    assert_int_equal(z.leftover + f.leftover, 0);
    assert_true(z.loss == f.loss);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero1_accumulation),
        cmocka_unit_test(test_muon_optimizer_phase),
        cmocka_unit_test(test_bf16_vs_f32),
        cmocka_unit_test(test_logits_fp32),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

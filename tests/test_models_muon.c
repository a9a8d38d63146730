/* test_models_muon.c — opt_type=muon (models/optimizers/muon.h):
 *   - keys: the defaults of MaxText's base.yml, consistent RMS, and the
 *     refusals (pipelining, ZeRO-1, maxtext_muon, all-to-all);
 *   - classification of every Llama and DeepSeek parameter against the
 *     dimension numbers of facts-2 §A.2 (written out here by path);
 *   - the Newton–Schulz collectives of one leaf on 8 devices against the
 *     measured table of facts-2 §A.4 (kinds, counts and sizes; dry run);
 *   - the sharded update (momentum, Nesterov, Newton–Schulz, scale, weight
 *     decay, schedule; AdamW fallback with Nesterov) of a matrix leaf, an
 *     expert leaf and a norm scale, over two steps, against a float64
 *     reference computed here from the formulas;
 *   - parity over 5 steps (loss and every gradient, rtol 1e-4) against one
 *     device: Llama fsdp=8 and fsdp=4 tensor=2, DeepSeek fsdp=8 and fsdp=4
 *     expert=2 under the base rules and shard-exp-on-fsdp, auto and explicit;
 *   - a small DeepSeek's optimizer-phase bytes: none for the routed expert
 *     weights under shard-exp-on-fsdp with fsdp=4 expert=2, some under the
 *     base rules; the dense MLP weights' per-step counts as in §A.4;
 *   - the sharding dump's optimizer state in MaxText 0.2.5's Muon layout;
 *   - dry run: the optimizer's collectives equal a real run's, call for call. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/artifacts.h"
#include "models/optimizers/muon.h"
#include "models/core/train.h"
#include "sim/collectives.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* ------------------------------------------------------------ helpers */

static cfg_config *load_cfg(int n, const char *const *ovr)
{
    cfg_config *cfg;
    if (cfg_load_argv("configs/base.yml", n, ovr, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    return cfg;
}

static uint64_t lcg = 12345;
static float rnd(void)
{
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(lcg >> 11) / 9007199254740992.0 - 0.5);
}

/* The muon settings (and configs/muon.yml rules) of the base config with opt_type=muon. */
static model_muon_cfg muon_cfg(void)
{
    const char *a[] = {"opt_type=muon"};
    cfg_config *cfg = load_cfg(1, a);
    model_optim_cfg o;
    if (model_optim_from_config(cfg, &o) != SIM_OK) fail_msg("optim: %s", sim_errmsg());
    cfg_free(cfg);
    return *model_muon_cfg_of(&o);
}

/* ------------------------------------------------------------ keys */

static void test_keys(void **state)
{
    (void)state;
    const char *a[] = {"opt_type=muon"};
    cfg_config *cfg = load_cfg(1, a);
    model_optim_cfg o;
    assert_int_equal(model_optim_from_config(cfg, &o), SIM_OK);
    cfg_free(cfg);
    assert_int_equal(o.type, MODEL_OPT_MUON);
    assert_true(model_muon_cfg_of(&o)->beta == 0.95);
    assert_true(model_muon_cfg_of(&o)->weight_decay == 0.0);
    assert_false(model_muon_cfg_of(&o)->consistent_rms_on);
    assert_true(model_muon_cfg_of(&o)->include_routers);
    assert_true(o.eps == 1e-8);
    const char *b[] = {"opt_type=muon", "muon_consistent_rms=0.2", "muon_beta=0.9", "muon_weight_decay=0.01"};
    cfg = load_cfg(4, b);
    assert_int_equal(model_optim_from_config(cfg, &o), SIM_OK);
    cfg_free(cfg);
    assert_true(model_muon_cfg_of(&o)->consistent_rms_on && model_muon_cfg_of(&o)->consistent_rms == 0.2);
    assert_true(model_muon_cfg_of(&o)->beta == 0.9 && model_muon_cfg_of(&o)->weight_decay == 0.01);
    static const char *const bad[][2] = {
        {"ici_pipeline_parallelism=2", "ici_pipeline_parallelism"},
        {"dcn_pipeline_parallelism=2", "dcn_pipeline_parallelism"},
        {"shard_optimizer_over_data=true", "ZeRO-1"},
        {"muon_type=maxtext_muon", "muon_type=optax_muon"},
        {"muon_use_all_to_all=true", "muon_use_all_to_all=false"},
        {"muon_beta=1.0", "muon_beta"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        /* set the value behind the loader's back: the key contract may refuse pipelining and ZeRO-1 on
         * their own today, and Muon must still refuse them once they are simulated */
        cfg = load_cfg(1, a);
        char key[64];
        snprintf(key, sizeof key, "%s", bad[i][0]);
        char *eq = strchr(key, '=');
        *eq = '\0';
        cfg_entry *en = NULL;
        for (int k = 0; k < cfg->n; k++)
            if (!strcmp(cfg->entries[k].key, key)) en = &cfg->entries[k];
        assert_non_null(en);
        free(en->value.text);
        en->value.text = strdup(eq + 1);
        assert_int_equal(model_optim_from_config(cfg, &o), SIM_ERR_INPUT);
        if (!strstr(sim_errmsg(), bad[i][1]) || !strstr(sim_errmsg(), "muon"))
            fail_msg("%s: message '%s' lacks '%s'", bad[i][0], sim_errmsg(), bad[i][1]);
        cfg_free(cfg);
    }
    /* the classification rules are data: a configs directory without muon.yml is an error that says so */
    model_muon_rules rules;
    assert_int_equal(model_muon_rules_load("/nonexistent-shardsim-configs", &rules) == SIM_OK, 0);
    assert_non_null(strstr(sim_errmsg(), "muon.yml"));
    assert_int_equal(model_muon_rules_load("configs", &rules), SIM_OK);
    assert_int_equal(rules.n[MODEL_MUON_MOE_BLOCKS], 5);
    assert_int_equal(rules.n_red[MODEL_MUON_DIMS_OUT], 2);
    /* the same keys are fine with AdamW (they only matter to Muon) */
    const char *d[] = {"muon_type=maxtext_muon"};
    cfg = load_cfg(1, d);
    assert_int_equal(model_optim_from_config(cfg, &o), SIM_OK);
    cfg_free(cfg);
}

/* ------------------------------------------------------------ classification */

typedef struct {
    const char *suffix; /* path suffix */
    int nr, no;         /* -1: AdamW */
    int red[2], out[2]; /* as MaxText writes them (negative allowed) */
} want_dims;

static void check_model_dims(const char *model, bool routers, const want_dims *w, int nw)
{
    const char *ovr[] = {model, "opt_type=muon", routers ? "muon_include_routers=true" : "muon_include_routers=false"};
    cfg_config *cfg = load_cfg(3, ovr);
    model_def *def = calloc(1, sizeof *def);
    if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("model: %s", sim_errmsg());
    assert_true(def->opt == model_optimizer_find("muon"));
    int seen = 0;
    for (int i = 0; i < def->nparams; i++) {
        const model_param_def *pd = &def->defs[i];
        const want_dims *hit = NULL;
        for (int k = 0; k < nw; k++) {
            size_t lp = strlen(pd->path), ls = strlen(w[k].suffix);
            if (lp >= ls && !strcmp(pd->path + lp - ls, w[k].suffix)) hit = &w[k];
        }
        if (!hit) fail_msg("no expectation for %s", pd->path);
        seen++;
        const model_muon_dims *d = model_muon_dims_of(&def->opt_param[i]);
        if (hit->nr < 0) {
            if (d->muon) fail_msg("%s: expected AdamW", pd->path);
            continue;
        }
        if (!d->muon) fail_msg("%s: expected Muon", pd->path);
        assert_int_equal(d->n_red, hit->nr);
        assert_int_equal(d->n_out, hit->no);
        for (int k = 0; k < hit->nr; k++) assert_int_equal(d->red[k], (hit->red[k] + pd->rank) % pd->rank);
        for (int k = 0; k < hit->no; k++) assert_int_equal(d->out[k], (hit->out[k] + pd->rank) % pd->rank);
    }
    assert_int_equal(seen, def->nparams);
    model_def_free(def);
    free(def);
    cfg_free(cfg);
}

static void test_classify(void **state)
{
    (void)state;
    /* facts-2 §A.2: Llama2 scanned */
    static const want_dims llama[] = {
        {"token_embedder.embedding", -1, -1, {0}, {0}},
        {"logits_dense.kernel", -1, -1, {0}, {0}},
        {"decoder_norm.scale", -1, -1, {0}, {0}},
        {"pre_self_attention_layer_norm.scale", -1, -1, {0}, {0}},
        {"post_self_attention_layer_norm.scale", -1, -1, {0}, {0}},
        {"self_attention.query.kernel", 1, 2, {0}, {-2, -1}},
        {"self_attention.key.kernel", 1, 2, {0}, {-2, -1}},
        {"self_attention.value.kernel", 1, 2, {0}, {-2, -1}},
        {"self_attention.out.kernel", 2, 1, {0, -2}, {-1}},
        {"mlp.wi_0.kernel", 1, 1, {0}, {-1}},
        {"mlp.wi_1.kernel", 1, 1, {0}, {-1}},
        {"mlp.wo.kernel", 1, 1, {0}, {-1}},
    };
    check_model_dims("model_name=llama2-7b", true, llama, sizeof llama / sizeof llama[0]);
    /* the DeepSeek-V3 table of §A.2 (MLA, dense and MoE layers) */
    static const want_dims ds[] = {
        {"token_embedder.embedding", -1, -1, {0}, {0}},
        {"logits_dense.kernel", -1, -1, {0}, {0}},
        {"norm.scale", -1, -1, {0}, {0}},
        {"gate.bias", -1, -1, {0}, {0}},
        {"wq_a.kernel", 1, 1, {0}, {-1}},
        {"wq_b.kernel", 1, 2, {0}, {-2, -1}},
        {"wkv_a.kernel", 1, 1, {0}, {-1}},
        {"wkv_b.kernel", 1, 2, {0}, {-2, -1}},
        {"self_attention.out.kernel", 2, 1, {0, -2}, {-1}},
        {"mlp.wi_0.kernel", 1, 1, {0}, {-1}},
        {"mlp.wi_1.kernel", 1, 1, {0}, {-1}},
        {"mlp.wo.kernel", 1, 1, {0}, {-1}},
        {"gate.kernel", 1, 1, {0}, {-1}},
        {"MoeBlock_0.wi_0", 1, 1, {-2}, {-1}},
        {"MoeBlock_0.wi_1", 1, 1, {-2}, {-1}},
        {"MoeBlock_0.wo", 1, 1, {-2}, {-1}},
        {"shared_experts.wi_0.kernel", 1, 1, {0}, {-1}},
        {"shared_experts.wi_1.kernel", 1, 1, {0}, {-1}},
        {"shared_experts.wo.kernel", 1, 1, {0}, {-1}},
    };
    check_model_dims("model_name=deepseek3-671b", true, ds, sizeof ds / sizeof ds[0]);
    /* muon_include_routers=false puts the router on AdamW */
    want_dims noroute[sizeof ds / sizeof ds[0]];
    memcpy(noroute, ds, sizeof ds);
    noroute[12].nr = noroute[12].no = -1;
    check_model_dims("model_name=deepseek3-671b", false, noroute, sizeof ds / sizeof ds[0]);
    /* scale: sqrt(max(1, O/R)); the §A.2 column: wq_b 1536 x 24576 -> 4, routed wo 2048 x 7168 -> 1.871 */
    model_muon_cfg c = muon_cfg();
    model_param_def wqb = {.path = "params.decoder.moe_layers.self_attention.wq_b.kernel",
                           .rank = 4,
                           .shape = {1536, 58, 128, 192},
                           .scan_dim = 1};
    model_muon_dims dd;
    model_muon_classify(&c, &wqb, &dd);
    assert_true(fabsf(model_muon_scale(&c, &wqb, &dd) - 4.0f) == 0.0f);
    model_param_def rwo = {.path = "params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wo",
                           .rank = 4,
                           .shape = {256, 58, 2048, 7168},
                           .scan_dim = 1};
    model_muon_classify(&c, &rwo, &dd);
    assert_true(fabs(model_muon_scale(&c, &rwo, &dd) - sqrt(7168.0 / 2048.0)) < 1e-6);
    c.consistent_rms_on = true;
    c.consistent_rms = 0.2;
    assert_true(fabs(model_muon_scale(&c, &rwo, &dd) - 0.2 * sqrt(7168.0)) < 1e-4);
}

/* ------------------------------------------------------------ one leaf: collectives and float64 */

typedef struct {
    const mesh_shape *mesh;
    model_param_def def;
    model_muon_dims dims;
    const char *spec;
    const float *in; /* global, or NULL (dry) */
    float *out;      /* global result */
    const sim_record *rec;
    size_t nrec;
    sim_record recs[64];
} leaf_job;

static sim_status leaf_device(sim_device *dev, void *arg)
{
    leaf_job *j = arg;
    mesh_spec s;
    SIM_TRY(mesh_spec_parse(j->spec, j->mesh, &s));
    mesh_array x;
    SIM_TRY(mesh_array_new(dev, j->mesh, "leaf", j->def.rank, j->def.shape, &s, SIM_F32, SIM_MEM_TEMP, &x));
    if (j->in) mesh_array_load_global(dev, j->mesh, &x, j->in);
    mesh_ctx c = {.dev = dev, .mesh = j->mesh, .mode = MESH_MODE_EXPLICIT, .drop_size_one = true, .layer = ""};
    sim_device_set_phase(dev, SIM_PHASE_OPTIMIZER);
    SIM_TRY(model_muon_orthogonalize(&c, &j->dims, 1e-8, "leaf", NULL, false, false, &x));
    if (!mesh_spec_equal(&x.spec, &s)) return sim_err(SIM_ERR_CHECK, "the leaf changed its spec");
    if (j->in) SIM_TRY(mesh_array_store_global(dev, j->mesh, &x, j->out));
    mesh_array_free(dev, &x);
    if (sim_device_id(dev) == 0) {
        size_t n;
        const sim_record *r = sim_device_records(dev, &n);
        j->nrec = n < 64 ? n : 64;
        if (j->nrec) memcpy(j->recs, r, j->nrec * sizeof *r); /* no records: r may be NULL */
    }
    return SIM_OK;
}

static void leaf_def(leaf_job *j, const char *path, int rank, const int64_t *shape)
{
    memset(&j->def, 0, sizeof j->def);
    snprintf(j->def.path, sizeof j->def.path, "%s", path);
    j->def.rank = rank;
    memcpy(j->def.shape, shape, (size_t)rank * sizeof *shape);
    j->def.scan_dim = rank > 2 ? 1 : -1;
    model_muon_cfg c = muon_cfg();
    model_muon_classify(&c, &j->def, &j->dims);
    assert_true(j->dims.muon);
}

static const char *const AXN[] = {"expert", "fsdp"};

typedef struct {
    const char *label;
    int expert, fsdp;
    const char *path;
    int rank;
    int64_t shape[4];
    const char *spec;
    int n_ar, n_ag;      /* all-reduces and all-gathers in the step */
    uint64_t gram_elems; /* elements of one Gram all-reduce (0: none) */
    uint64_t norm_elems; /* elements of the norm all-reduce (0: none) */
    uint64_t ag_out[3];  /* output elements of the three all-gathers of a step */
} table_row;

/* facts-2 §A.4, measured with jax 0.10.2 + optax 0.2.8 on 8 CPU devices */
static const table_row TABLE[] = {
    {"MoE, fsdp=8",
     1,
     8,
     "x.MoeBlock_0.wi_0",
     4,
     {16, 4, 256, 128},
     "P(None, None, 'fsdp', None)",
     6,
     0,
     64 * 128 * 128,
     64,
     {0}},
    {"MoE shard-exp-on-fsdp, fsdp=8",
     1,
     8,
     "x.MoeBlock_0.wi_0",
     4,
     {16, 4, 256, 128},
     "P('fsdp', None, None, None)",
     0,
     0,
     0,
     0,
     {0}},
    {"MoE, expert=2 fsdp=4",
     2,
     4,
     "x.MoeBlock_0.wi_0",
     4,
     {16, 4, 256, 128},
     "P('expert', None, 'fsdp', None)",
     6,
     0,
     32 * 128 * 128,
     32,
     {0}},
    {"MoE shard-exp-on-fsdp, expert=2 fsdp=4",
     2,
     4,
     "x.MoeBlock_0.wi_0",
     4,
     {16, 4, 256, 128},
     "P(('expert', 'fsdp'), None, None, None)",
     0,
     0,
     0,
     0,
     {0}},
    {"dense wi, fsdp=8",
     1,
     8,
     "x.mlp.wi_0.kernel",
     3,
     {256, 4, 1024},
     "P('fsdp', None, None)",
     1,
     15,
     0,
     4,
     {4 * 1024 * 256, 4 * 256 * 1024, 4 * 256 * 256}},
    {"dense wo, fsdp=8",
     1,
     8,
     "x.mlp.wo.kernel",
     3,
     {1024, 4, 256},
     "P(None, None, 'fsdp')",
     1,
     15,
     0,
     4,
     {4 * 1024 * 256, 4 * 256 * 1024, 4 * 256 * 256}},
};

static void test_ns_collectives_table(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof TABLE / sizeof TABLE[0]; i++) {
        const table_row *t = &TABLE[i];
        mesh_shape m;
        int sizes[2] = {t->expert, t->fsdp};
        m = helper_mesh(2, AXN, sizes);
        static leaf_job j;
        memset(&j, 0, sizeof j);
        j.mesh = &m;
        j.spec = t->spec;
        leaf_def(&j, t->path, t->rank, t->shape);
        sim_machine *mach = helper_machine(&m, true);
        if (sim_machine_run(mach, leaf_device, &j) != SIM_OK) fail_msg("%s: %s", t->label, sim_errmsg());
        sim_machine_free(mach);
        int ar = 0, ag = 0, other = 0, norm = 0, gram = 0;
        uint64_t ag_out[3] = {0};
        for (size_t r = 0; r < j.nrec; r++) {
            const sim_record *x = &j.recs[r];
            if (!x->implicit) fail_msg("%s: %s is not an implicit (partitioner) collective", t->label, x->tag);
            if (x->phase != SIM_PHASE_OPTIMIZER) fail_msg("%s: %s outside phase optimizer", t->label, x->tag);
            if (x->op == SIM_OP_ALL_REDUCE) {
                ar++;
                if (x->elements == t->norm_elems && strstr(x->tag, "ns_norm")) norm++;
                else if (x->elements == t->gram_elems && strstr(x->tag, "ns_gram")) gram++;
                else fail_msg("%s: all-reduce %s of %llu elements", t->label, x->tag, (unsigned long long)x->elements);
            } else if (x->op == SIM_OP_ALL_GATHER) {
                uint64_t out = x->elements * (uint64_t)x->group_size;
                if (ag < 3) ag_out[ag] = out;
                else if (out != ag_out[ag % 3])
                    fail_msg("%s: all-gather %d outputs %llu elements", t->label, ag, (unsigned long long)out);
                ag++;
            } else {
                other++;
            }
        }
        if (ar != t->n_ar || ag != t->n_ag || other)
            fail_msg("%s: %d all-reduces, %d all-gathers, %d others; expected %d, %d, 0", t->label, ar, ag, other,
                     t->n_ar, t->n_ag);
        if (t->n_ar) assert_int_equal(norm, 1);
        if (t->gram_elems) assert_int_equal(gram, 5);
        if (t->n_ag) { /* the same three tensors as the table (X^T, X, A), in some order */
            uint64_t want[3], got[3];
            memcpy(want, t->ag_out, sizeof want);
            memcpy(got, ag_out, sizeof got);
            uint64_t ws = 0, gs = 0, wm = 0, gm = 0;
            for (int k = 0; k < 3; k++) ws += want[k], gs += got[k], wm += want[k] * want[k], gm += got[k] * got[k];
            if (ws != gs || wm != gm)
                fail_msg("%s: all-gather outputs %llu %llu %llu", t->label, (unsigned long long)got[0],
                         (unsigned long long)got[1], (unsigned long long)got[2]);
        }
    }
}

/* float64 Newton–Schulz of one [rows, cols] matrix given by strides into x */
static void ns_ref(double *x, int64_t R, int64_t O)
{
    /* work on Y = X or X^T so that Y is [m, n] with m <= n */
    bool tr = R > O;
    int64_t m = tr ? O : R, n = tr ? R : O;
    double *y = malloc((size_t)(m * n) * sizeof *y), *a = malloc((size_t)(m * m) * sizeof *a),
           *b = malloc((size_t)(m * m) * sizeof *b), *t = malloc((size_t)(m * n) * sizeof *t);
    for (int64_t i = 0; i < m; i++)
        for (int64_t k = 0; k < n; k++) y[i * n + k] = tr ? x[k * O + i] : x[i * O + k];
    double f = 0;
    for (int64_t i = 0; i < m * n; i++) f += y[i] * y[i];
    f = sqrt(f) + 1e-8;
    for (int64_t i = 0; i < m * n; i++) y[i] /= f;
    for (int s = 0; s < 5; s++) {
        for (int64_t i = 0; i < m; i++)
            for (int64_t k = 0; k < m; k++) {
                double acc = 0;
                for (int64_t c = 0; c < n; c++) acc += y[i * n + c] * y[k * n + c];
                a[i * m + k] = acc;
            }
        for (int64_t i = 0; i < m; i++)
            for (int64_t k = 0; k < m; k++) {
                double acc = 0;
                for (int64_t c = 0; c < m; c++) acc += a[i * m + c] * a[c * m + k];
                b[i * m + k] = -4.7750 * a[i * m + k] + 2.0315 * acc;
            }
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < n; c++) {
                double acc = 0;
                for (int64_t k = 0; k < m; k++) acc += b[i * m + k] * y[k * n + c];
                t[i * n + c] = 3.4445 * y[i * n + c] + acc;
            }
        memcpy(y, t, (size_t)(m * n) * sizeof *y);
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t k = 0; k < n; k++) {
            if (tr) x[k * O + i] = y[i * n + k];
            else x[i * O + k] = y[i * n + k];
        }
    free(y), free(a), free(b), free(t);
}

/* The NS reference of a leaf laid out [batch..., R, O] with R, O the last
 * two dims (all the leaves of the float64 tests are). */
static void leaf_ref(double *x, int rank, const int64_t *shape)
{
    int64_t B = 1;
    for (int d = 0; d < rank - 2; d++) B *= shape[d];
    int64_t R = shape[rank - 2], O = shape[rank - 1];
    for (int64_t b = 0; b < B; b++) ns_ref(x + b * R * O, R, O);
}

static double rel_err(const float *a, const double *ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += (a[i] - ref[i]) * (a[i] - ref[i]), den += ref[i] * ref[i];
    return sqrt(num / den);
}

static void test_ns_float64(void **state)
{
    (void)state;
    typedef struct {
        const char *path;
        int rank;
        int64_t shape[4];
        int expert, fsdp;
        const char *spec;
    } ncase;
    static const ncase cases[] = {
        /* one matrix with R > O (optax transposes), sharded on the long and on the short dim */
        {"x.w.kernel", 2, {40, 24}, 1, 1, "P(None, None)"},
        {"x.w.kernel", 2, {40, 24}, 1, 8, "P('fsdp', None)"},
        {"x.w.kernel", 2, {40, 24}, 1, 8, "P(None, 'fsdp')"},
        /* an expert leaf [E, L, emb, mlp]: (-2), (-1) */
        {"x.MoeBlock_0.wo", 4, {8, 2, 16, 32}, 1, 1, "P(None, None, None, None)"},
        {"x.MoeBlock_0.wo", 4, {8, 2, 16, 32}, 1, 8, "P(None, None, 'fsdp', None)"},
        {"x.MoeBlock_0.wo", 4, {8, 2, 16, 32}, 2, 4, "P(('expert', 'fsdp'), None, None, None)"},
        {"x.MoeBlock_0.wo", 4, {8, 2, 16, 32}, 2, 4, "P('expert', None, None, 'fsdp')"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const ncase *c = &cases[i];
        mesh_shape m;
        int sizes[2] = {c->expert, c->fsdp};
        m = helper_mesh(2, AXN, sizes);
        static leaf_job j;
        memset(&j, 0, sizeof j);
        j.mesh = &m;
        j.spec = c->spec;
        leaf_def(&j, c->path, c->rank, c->shape);
        int64_t n = 1;
        for (int d = 0; d < c->rank; d++) n *= c->shape[d];
        float *in = malloc((size_t)n * sizeof *in);
        double *ref = malloc((size_t)n * sizeof *ref);
        for (int64_t e = 0; e < n; e++) in[e] = rnd(), ref[e] = in[e];
        j.in = in;
        j.out = calloc((size_t)n, sizeof(float));
        sim_machine *mach = helper_machine(&m, false);
        if (sim_machine_run(mach, leaf_device, &j) != SIM_OK) fail_msg("%s: %s", c->spec, sim_errmsg());
        sim_machine_free(mach);
        leaf_ref(ref, c->rank, c->shape);
        double e = rel_err(j.out, ref, n);
        if (!(e < 2e-5)) fail_msg("%s %s: relative error %.3g against float64", c->path, c->spec, e);
        free(in), free(ref), free(j.out);
    }
}

/* ------------------------------------------------------------ the whole update, float64 */

typedef struct {
    const mesh_shape *mesh;
    model_optim_cfg opt;
    int np;
    model_param_def defs[3];
    const char *specs[3];
    model_muon_dims dims[3];
    float *w[3], *g[2][3]; /* global, layer-major (scan dim moved out, as the device stores it) */
} upd_job;

static sim_status upd_device(sim_device *dev, void *arg)
{
    upd_job *j = arg;
    model_param p[3];
    memset(p, 0, sizeof p);
    for (int i = 0; i < j->np; i++) {
        p[i].def = j->defs[i];
        SIM_TRY(mesh_spec_parse(j->specs[i], j->mesh, &p[i].spec));
        p[i].n_layers = p[i].def.scan_dim >= 0 ? (int)p[i].def.shape[p[i].def.scan_dim] : 1;
        int rank;
        int64_t shape[MESH_SPEC_MAX_RANK];
        mesh_spec ls;
        model_param_layer_shape(&p[i], &rank, shape);
        model_param_layer_spec(&p[i], &ls);
        int64_t le = 1;
        for (int d = 0; d < rank; d++) le *= shape[d];
        p[i].n_slots = 2;
        mesh_array **b[4] = {&p[i].w, &p[i].g, &p[i].slot[0], &p[i].slot[1]};
        for (int k = 0; k < 4; k++) {
            *b[k] = calloc((size_t)p[i].n_layers, sizeof(mesh_array));
            for (int l = 0; l < p[i].n_layers; l++)
                SIM_TRY(mesh_array_new(dev, j->mesh, p[i].def.path, rank, shape, &ls, SIM_F32, SIM_MEM_PARAMS,
                                       &(*b[k])[l]));
        }
        for (int l = 0; l < p[i].n_layers; l++) mesh_array_load_global(dev, j->mesh, &p[i].w[l], j->w[i] + l * le);
    }
    mesh_ctx c = {.dev = dev, .mesh = j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = ""};
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < j->np; i++) {
            int64_t le = (int64_t)p[i].w[0].shape[0];
            for (int d = 1; d < p[i].w[0].rank; d++) le *= p[i].w[0].shape[d];
            for (int l = 0; l < p[i].n_layers; l++)
                mesh_array_load_global(dev, j->mesh, &p[i].g[l], j->g[s][i] + l * le);
        }
        SIM_TRY(model_muon_update(&c, &j->opt, j->dims, p, j->np, s, 0.5));
    }
    for (int i = 0; i < j->np; i++) {
        int64_t le = (int64_t)p[i].w[0].shape[0];
        for (int d = 1; d < p[i].w[0].rank; d++) le *= p[i].w[0].shape[d];
        for (int l = 0; l < p[i].n_layers; l++)
            SIM_TRY(mesh_array_store_global(dev, j->mesh, &p[i].w[l], j->w[i] + l * le));
        mesh_array *b[4] = {p[i].w, p[i].g, p[i].slot[0], p[i].slot[1]};
        for (int k = 0; k < 4; k++) {
            for (int l = 0; l < p[i].n_layers; l++) mesh_array_free(dev, &b[k][l]);
            free(b[k]);
        }
    }
    return SIM_OK;
}

/* layer-major [L][rest] <-> stacked [d0][L][rest'] for scan_dim 1 */
static void to_stacked(const double *lm, double *st, const int64_t *shape, int rank)
{
    int64_t L = shape[1], d0 = shape[0], inner = 1;
    for (int d = 2; d < rank; d++) inner *= shape[d];
    for (int64_t l = 0; l < L; l++)
        for (int64_t a = 0; a < d0; a++)
            for (int64_t k = 0; k < inner; k++) st[(a * L + l) * inner + k] = lm[(l * d0 + a) * inner + k];
}

static void from_stacked(const double *st, double *lm, const int64_t *shape, int rank)
{
    int64_t L = shape[1], d0 = shape[0], inner = 1;
    for (int d = 2; d < rank; d++) inner *= shape[d];
    for (int64_t l = 0; l < L; l++)
        for (int64_t a = 0; a < d0; a++)
            for (int64_t k = 0; k < inner; k++) lm[(l * d0 + a) * inner + k] = st[(a * L + l) * inner + k];
}

static void test_update_float64(void **state)
{
    (void)state;
    const char *ovr[] = {"opt_type=muon",
                         "learning_rate=0.02",
                         "steps=10",
                         "warmup_steps_fraction=0.2",
                         "muon_weight_decay=0.05",
                         "gradient_clipping_threshold=0.25"};
    cfg_config *cfg = load_cfg(6, ovr);
    static upd_job j;
    memset(&j, 0, sizeof j);
    assert_int_equal(model_optim_from_config(cfg, &j.opt), SIM_OK);
    cfg_free(cfg);
    mesh_shape m;
    int sizes[2] = {2, 4};
    m = helper_mesh(2, AXN, sizes);
    j.mesh = &m;
    j.np = 3;
    /* a dense matrix leaf [emb 32, L 2, mlp 24]: (0), (-1); an expert leaf [E 4, L 2, 16, 8]: (-2), (-1);
     * a norm scale [16, L 2] on the AdamW fallback */
    model_param_def d0 = {
        .path = "params.decoder.layers.mlp.wi_0.kernel", .rank = 3, .shape = {32, 2, 24}, .scan_dim = 1};
    model_param_def d1 = {
        .path = "params.decoder.layers.MoeBlock_0.wo", .rank = 4, .shape = {4, 2, 16, 8}, .scan_dim = 1};
    model_param_def d2 = {.path = "params.decoder.layers.pre_self_attention_layer_norm.scale",
                          .rank = 2,
                          .shape = {16, 2},
                          .scan_dim = 1};
    j.defs[0] = d0, j.defs[1] = d1, j.defs[2] = d2;
    j.specs[0] = "P('fsdp', None, 'expert')";
    j.specs[1] = "P('expert', None, 'fsdp', None)";
    j.specs[2] = "P('fsdp', None)";
    for (int i = 0; i < 3; i++) model_muon_classify(model_muon_cfg_of(&j.opt), &j.defs[i], &j.dims[i]);
    assert_true(j.dims[0].muon && j.dims[1].muon && !j.dims[2].muon);
    int64_t n[3];
    double *w64[3], *w0[3], *g64[2][3];
    for (int i = 0; i < 3; i++) {
        n[i] = 1;
        for (int d = 0; d < j.defs[i].rank; d++) n[i] *= j.defs[i].shape[d];
        j.w[i] = malloc((size_t)n[i] * sizeof(float));
        w64[i] = malloc((size_t)n[i] * sizeof(double));
        w0[i] = malloc((size_t)n[i] * sizeof(double));
        for (int64_t e = 0; e < n[i]; e++) j.w[i][e] = rnd(), w64[i][e] = w0[i][e] = j.w[i][e];
        for (int s = 0; s < 2; s++) {
            j.g[s][i] = malloc((size_t)n[i] * sizeof(float));
            g64[s][i] = malloc((size_t)n[i] * sizeof(double));
            for (int64_t e = 0; e < n[i]; e++) j.g[s][i][e] = rnd() * 0.1f, g64[s][i][e] = j.g[s][i][e];
        }
    }
    sim_machine *mach = helper_machine(&m, false);
    if (sim_machine_run(mach, upd_device, &j) != SIM_OK) fail_msg("update: %s", sim_errmsg());
    sim_machine_free(mach);
    /* float64 reference: clip by 0.25 / 0.5, schedule lr(s): W = 2 warmup steps (lr * s / 1), then cosine */
    const double lr = 0.02, beta = 0.95, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd_m = 0.05, wd_a = 0.1;
    const double lrs[2] = {0.0, lr};
    const double clipf = 0.25 / 0.5;
    double *mu[3], *nu = calloc((size_t)n[2], sizeof(double));
    for (int i = 0; i < 3; i++) mu[i] = calloc((size_t)n[i], sizeof(double));
    for (int s = 0; s < 2; s++) {
        double t = s + 1;
        for (int i = 0; i < 2; i++) { /* Muon leaves, layer-major like the device */
            double *mh = malloc((size_t)n[i] * sizeof(double)), *st = malloc((size_t)n[i] * sizeof(double));
            for (int64_t e = 0; e < n[i]; e++) {
                double g = g64[s][i][e] * clipf;
                mu[i][e] = (1 - beta) * g + beta * mu[i][e];
                mh[e] = beta * mu[i][e] / (1 - pow(beta, t + 1)) + (1 - beta) * g / (1 - pow(beta, t));
            }
            to_stacked(mh, st, j.defs[i].shape, j.defs[i].rank);
            if (i == 0) { /* [32, 2, 24]: batch is the layer dim, in the middle: do each layer's [32, 24] */
                double *mat = malloc(32 * 24 * sizeof(double));
                for (int l = 0; l < 2; l++) {
                    for (int a = 0; a < 32; a++)
                        for (int c = 0; c < 24; c++) mat[a * 24 + c] = st[(a * 2 + l) * 24 + c];
                    ns_ref(mat, 32, 24);
                    for (int a = 0; a < 32; a++)
                        for (int c = 0; c < 24; c++) st[(a * 2 + l) * 24 + c] = mat[a * 24 + c];
                }
                free(mat);
            } else {
                leaf_ref(st, 4, j.defs[i].shape);
            }
            from_stacked(st, mh, j.defs[i].shape, j.defs[i].rank);
            double R = i == 0 ? 32 : 16, O = i == 0 ? 24 : 8, scale = sqrt(fmax(1.0, O / R));
            for (int64_t e = 0; e < n[i]; e++) w64[i][e] -= lrs[s] * (scale * mh[e] + wd_m * w64[i][e]);
            free(mh), free(st);
        }
        for (int64_t e = 0; e < n[2]; e++) { /* NAdamW */
            double g = g64[s][2][e] * clipf;
            mu[2][e] = (1 - b1) * g + b1 * mu[2][e];
            nu[e] = (1 - b2) * g * g + b2 * nu[e];
            double mh = b1 * mu[2][e] / (1 - pow(b1, t + 1)) + (1 - b1) * g / (1 - pow(b1, t));
            double u = mh / (sqrt(nu[e] / (1 - pow(b2, t))) + eps) + wd_a * w64[2][e];
            w64[2][e] -= lrs[s] * u;
        }
    }
    for (int i = 0; i < 3; i++) {
        /* compare the change of the weights (the weights alone would hide an error in a small update) */
        double num = 0, den = 0;
        for (int64_t k = 0; k < n[i]; k++) {
            double dg = (double)j.w[i][k] - w0[i][k], dr = w64[i][k] - w0[i][k];
            num += (dg - dr) * (dg - dr), den += dr * dr;
        }
        if (!(den > 1e-8 * n[i])) fail_msg("%s: the reference update is empty", j.defs[i].path);
        double e = sqrt(num / den);
        if (!(e < 1e-4)) fail_msg("%s: update differs from float64 by %.3g", j.defs[i].path, e);
        free(j.w[i]), free(w64[i]), free(w0[i]), free(mu[i]);
        for (int s = 0; s < 2; s++) free(j.g[s][i]), free(g64[s][i]);
    }
    free(nu);
}

/* ------------------------------------------------------------ parity over 5 steps */

enum { STEPS = 5, ROWS = 8 };

/* tests/data/tiny-llama.yml, trained by Muon */
static const char *const LLAMA[] = {TINY_LLAMA_YML,       "model_name=default",      "init_weights_seed=7",
                                    "learning_rate=2e-2", "warmup_steps_fraction=0", "opt_type=muon"};

/* tests/data/tiny-deepseek.yml: 1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora */
static const char *const DEEPSEEK[] = {TINY_DEEPSEEK_YML, "init_weights_seed=5", "learning_rate=2e-2",
                                       "warmup_steps_fraction=0", "opt_type=muon"};

/* Trains STEPS steps of base + extra on `devices` devices with Muon, keeping every step's gradients. */
static void train_run(model_run *r, const char *const *base, int nbase, const char *const *extra, int n_extra,
                      int devices)
{
    model_run_open(r, base, nbase, ROWS, extra, n_extra, devices, STEPS);
    assert_int_equal(r->job.opt.type, MODEL_OPT_MUON);
    model_run_train(r, true);
}

/* Optimizer-phase bytes sent per device (max over devices) and calls on device 0 of the
 * collectives whose tag contains `part`, in step `step`. */
static uint64_t opt_bytes(sim_machine *m, const char *part, int step, int *ag0, int *ar0, int *other0)
{
    uint64_t worst = 0;
    *ag0 = *ar0 = *other0 = 0;
    for (int d = 0; d < sim_machine_num_devices(m); d++) {
        size_t n;
        const sim_record *r = sim_device_records(sim_machine_device(m, d), &n);
        uint64_t sum = 0;
        for (size_t i = 0; i < n; i++) {
            if (r[i].phase != SIM_PHASE_OPTIMIZER || r[i].step != step || !strstr(r[i].tag, part)) continue;
            sum += r[i].bytes_sent;
            if (d == 0) {
                if (r[i].op == SIM_OP_ALL_GATHER) (*ag0)++;
                else if (r[i].op == SIM_OP_ALL_REDUCE) (*ar0)++;
                else (*other0)++;
            }
        }
        if (sum > worst) worst = sum;
    }
    return worst;
}

static void test_parity_llama(void **state)
{
    (void)state;
    enum { NL = sizeof LLAMA / sizeof LLAMA[0] };
    model_run ref;
    train_run(&ref, LLAMA, NL, NULL, 0, 1);
    assert_true(ref.job.stats[0].loss - ref.job.stats[STEPS - 1].loss > 0.05); /* Muon trains */
    static const char *const meshes[2][2] = {{"ici_fsdp_parallelism=8", NULL},
                                             {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"}};
    for (int mi = 0; mi < 2; mi++)
        for (int mode = 0; mode < 2; mode++) {
            const char *x[3];
            int n = 0;
            x[n++] = meshes[mi][0];
            if (meshes[mi][1]) x[n++] = meshes[mi][1];
            x[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            model_run r;
            train_run(&r, LLAMA, NL, x, n, 8);
            char what[128];
            snprintf(what, sizeof what, "llama %s %s %s", x[0], n == 3 ? x[1] : "", x[n - 1]);
            model_run_compare(what, &r, &ref, STEPS);
            if (mi == 0 && mode == 0) { /* determinism: the same configuration gives the same bits */
                model_run again;
                train_run(&again, LLAMA, NL, x, n, 8);
                for (int s = 0; s < STEPS; s++) {
                    assert_true(again.job.stats[s].loss == r.job.stats[s].loss);
                    for (int i = 0; i < r.def->nparams; i++)
                        assert_memory_equal(
                            again.job.step_grads[s].g[i], r.job.step_grads[s].g[i],
                            (size_t)(r.job.step_grads[s].layer_elems[i] * r.job.step_grads[s].n_layers[i]) *
                                sizeof(float));
                }
                model_run_close(&again);
            }
            model_run_close(&r);
        }
    model_run_close(&ref);
}

static void test_parity_deepseek(void **state)
{
    (void)state;
    enum { ND = sizeof DEEPSEEK / sizeof DEEPSEEK[0] };
    model_run ref;
    train_run(&ref, DEEPSEEK, ND, NULL, 0, 1);
    assert_true(ref.job.stats[0].loss - ref.job.stats[STEPS - 1].loss > 0.05);
    static const char *const meshes[2][2] = {{"ici_fsdp_parallelism=8", NULL},
                                             {"ici_fsdp_parallelism=4", "ici_expert_parallelism=2"}};
    uint64_t expert_bytes[2] = {0, 0};
    for (int mi = 0; mi < 2; mi++)
        for (int rules = 0; rules < 2; rules++)
            for (int mode = 0; mode < 2; mode++) {
                const char *x[4];
                int n = 0;
                x[n++] = meshes[mi][0];
                if (meshes[mi][1]) x[n++] = meshes[mi][1];
                if (rules) x[n++] = "custom_mesh_and_rule=shard-exp-on-fsdp";
                x[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
                model_run r;
                train_run(&r, DEEPSEEK, ND, x, n, 8);
                char what[160];
                snprintf(what, sizeof what, "deepseek %s %s %s %s", meshes[mi][0], meshes[mi][1] ? meshes[mi][1] : "",
                         rules ? "shard-exp-on-fsdp" : "base rules", x[n - 1]);
                model_run_compare(what, &r, &ref, STEPS);
                int ag, ar, other;
                if (mi == 1 && mode == 0) /* the routed experts' Newton-Schulz traffic, every step alike */
                    for (int s = 0; s < STEPS; s++) {
                        uint64_t b = opt_bytes(r.m, "MoeBlock_0.w", s, &ag, &ar, &other);
                        if (s == 0) expert_bytes[rules] = b;
                        assert_true(b == expert_bytes[rules]);
                    }
                if (mi == 0 && rules == 0 && mode == 0) {
                    /* §A.4 dense wi / wo on fsdp=8: per step 15 all-gathers and one all-reduce (the norms) */
                    static const char *const dense[3] = {"dense_layers.mlp.wi_0.kernel/",
                                                         "dense_layers.mlp.wi_1.kernel/",
                                                         "dense_layers.mlp.wo.kernel/"};
                    for (int k = 0; k < 3; k++) {
                        uint64_t b = opt_bytes(r.m, dense[k], STEPS - 1, &ag, &ar, &other);
                        if (ag != 15 || ar != 1 || other || !b)
                            fail_msg("%s: %d all-gathers, %d all-reduces, %d others per step; expected 15, 1, 0",
                                     dense[k], ag, ar, other);
                    }
                }
                model_run_close(&r);
            }
    /* seed 001's claim: shard-exp-on-fsdp leaves the experts' Newton-Schulz local */
    if (expert_bytes[1] != 0)
        fail_msg("shard-exp-on-fsdp: the routed experts still send %llu optimizer bytes per step",
                 (unsigned long long)expert_bytes[1]);
    if (expert_bytes[0] == 0) fail_msg("base rules: the routed experts' Newton-Schulz moved no bytes");
    model_run_close(&ref);
}

/* ------------------------------------------------------------ the sharding dump's optimizer state */

/* MaxText 0.2.5's train state with opt_type=muon (its NNX dump of a small Llama on 8 devices,
 * peers/maxtext/dump.sh, written in the Linen key style of the goldens): optax's partition
 * state, AdamW leaves under ['adam'] (count, mu, nu, the schedule's count at [2]), Muon leaves
 * under ['muon'] (count, mu, ns_coeffs of shape [3], the schedule's count at [3]). */
static void test_dump_layout(void **state)
{
    (void)state;
    const char *ovr[] = {"opt_type=muon",   "base_num_decoder_layers=2", "ici_fsdp_parallelism=8",
                         "base_emb_dim=64", "base_mlp_dim=128",          "vocab_size=128"};
    cfg_config *cfg = load_cfg(6, ovr);
    model_def *def = calloc(1, sizeof *def);
    if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("model: %s", sim_errmsg());
    cli_dump_param p[MODEL_MAX_PARAMS];
    memset(p, 0, sizeof p);
    int nadam = 0, nmuon = 0;
    for (int i = 0; i < def->nparams; i++) {
        p[i].path = def->defs[i].path;
        p[i].rank = def->defs[i].rank;
        memcpy(p[i].shape, def->defs[i].shape, sizeof p[i].shape);
        for (int d = 0; d < p[i].rank; d++) p[i].logical[d] = def->defs[i].logical[d];
        p[i].spec = def->unpruned[i];
        p[i].opt = def->opt;
        p[i].branch = model_muon_dims_of(&def->opt_param[i])->muon ? 1 : -1;
        if (model_muon_dims_of(&def->opt_param[i])->muon) nmuon++;
        else nadam++;
    }
    assert_int_equal(nadam, 5); /* embedding, logits, decoder norm, two layer norms */
    assert_int_equal(nmuon, 7); /* query, key, value, out, wi_0, wi_1, wo */
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    assert_int_equal(cli_dump_named(f, &def->mesh, p, def->nparams, CLI_DUMP_TRAIN_STATE), SIM_OK);
    fclose(f);
    static const char *const want[] = {
        "\".opt_state/.inner_states/['adam']/.inner_state/[0]/.count\"",
        "\".opt_state/.inner_states/['adam']/.inner_state/[0]/.mu/['params']/['token_embedder']/['embedding']\"",
        "\".opt_state/.inner_states/['adam']/.inner_state/[0]/.nu/['params']/['decoder']/['decoder_norm']/['scale']\"",
        "\".opt_state/.inner_states/['adam']/.inner_state/[2]/.count\"",
        "\".opt_state/.inner_states/['muon']/.inner_state/[0]/.count\"",
        "\".opt_state/.inner_states/['muon']/.inner_state/[0]/.mu/['params']/['decoder']/['layers']/['mlp']/['wo']/"
        "['kernel']\"",
        "\".opt_state/.inner_states/['muon']/.inner_state/[0]/.ns_coeffs\"",
        "\".opt_state/.inner_states/['muon']/.inner_state/[3]/.count\"",
    };
    const char *at = out;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) { /* present, in JAX tree order */
        const char *hit = strstr(at, want[i]);
        if (!hit) fail_msg("dump lacks %s (or it is out of order)", want[i]);
        at = hit;
    }
    /* Muon leaves have no nu, AdamW leaves no Muon momentum, nothing of AdamW's own layout */
    assert_null(strstr(out, "['muon']/.inner_state/[0]/.nu"));
    assert_null(strstr(out, "['muon']/.inner_state/[0]/.mu/['params']/['token_embedder']"));
    assert_null(strstr(out, "\".opt_state/[0]/.mu"));
    int entries = 0;
    for (const char *q = out; (q = strstr(q, "\"partition_spec\"")); q++) entries++;
    assert_int_equal(entries, 1 + 12 + (1 + 2 * nadam + 1) + (1 + nmuon + 1 + 1));
    const char *ns = strstr(out, ".ns_coeffs\"");
    assert_non_null(strstr(ns, "\"shape\": [\n      3\n    ]"));
    free(out);
    model_def_free(def);
    free(def);
    cfg_free(cfg);
}

/* Dry run: the optimizer's collectives (every Newton-Schulz op) equal a real run's, call for call. */
static void test_dry_equals_real(void **state)
{
    (void)state;
    enum { ND = sizeof DEEPSEEK / sizeof DEEPSEEK[0] };
    const char *x[2][3] = {{"ici_fsdp_parallelism=4", "ici_expert_parallelism=2", "dry_run=false"},
                           {"ici_fsdp_parallelism=4", "ici_expert_parallelism=2", "dry_run=true"}};
    cfg_config *cfgs[2];
    model_def *defs[2];
    sim_machine *ms[2];
    model_data data[2];
    model_train_job jobs[2];
    for (int k = 0; k < 2; k++) {
        const char *argv[64];
        int n = 0;
        for (int i = 0; i < ND; i++) argv[n++] = DEEPSEEK[i];
        argv[n++] = "steps=1";
        argv[n++] = "per_device_batch_size=1";
        for (int i = 0; i < 3; i++) argv[n++] = x[k][i];
        cfgs[k] = load_cfg(n, argv);
        defs[k] = calloc(1, sizeof *defs[k]);
        if (model_def_from_config(cfgs[k], defs[k]) != SIM_OK) fail_msg("model: %s", sim_errmsg());
        memset(&jobs[k], 0, sizeof jobs[k]);
        if (model_data_from_config(cfgs[k], &data[k]) != SIM_OK) fail_msg("data: %s", sim_errmsg());
        if (model_optim_from_config(cfgs[k], &jobs[k].opt) != SIM_OK) fail_msg("optim: %s", sim_errmsg());
        jobs[k].def = defs[k];
        jobs[k].data = &data[k];
        jobs[k].steps = 1;
        jobs[k].stats = calloc(1, sizeof *jobs[k].stats);
        assert_int_equal(model_machine_new(defs[k], 0, false, &ms[k]), SIM_OK);
        if (model_train(&jobs[k], ms[k]) != SIM_OK) fail_msg("train: %s", sim_errmsg());
    }
    for (int d = 0; d < sim_machine_num_devices(ms[0]); d++) {
        size_t n[2];
        const sim_record *r[2];
        int nopt[2] = {0, 0};
        for (int k = 0; k < 2; k++) r[k] = sim_device_records(sim_machine_device(ms[k], d), &n[k]);
        size_t i = 0, j = 0;
        for (;;) { /* walk the optimizer-phase records of both in order */
            while (i < n[0] && r[0][i].phase != SIM_PHASE_OPTIMIZER) i++;
            while (j < n[1] && r[1][j].phase != SIM_PHASE_OPTIMIZER) j++;
            if (i == n[0] || j == n[1]) break;
            if (r[0][i].op != r[1][j].op || r[0][i].elements != r[1][j].elements ||
                r[0][i].bytes_sent != r[1][j].bytes_sent || strcmp(r[0][i].tag, r[1][j].tag))
                fail_msg("device %d: real %s %s %llu B vs dry %s %s %llu B", d, sim_op_name(r[0][i].op), r[0][i].tag,
                         (unsigned long long)r[0][i].bytes_sent, sim_op_name(r[1][j].op), r[1][j].tag,
                         (unsigned long long)r[1][j].bytes_sent);
            nopt[0]++, nopt[1]++, i++, j++;
        }
        assert_true(i == n[0] || j == n[1]);
        while (i < n[0]) assert_true(r[0][i++].phase != SIM_PHASE_OPTIMIZER);
        while (j < n[1]) assert_true(r[1][j++].phase != SIM_PHASE_OPTIMIZER);
        assert_true(nopt[0] > 50); /* the Newton-Schulz collectives are there */
    }
    for (int k = 0; k < 2; k++) {
        free(jobs[k].stats);
        sim_machine_free(ms[k]);
        model_data_close(&data[k]);
        model_def_free(defs[k]);
        free(defs[k]);
        cfg_free(cfgs[k]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_classify),
        cmocka_unit_test(test_ns_collectives_table),
        cmocka_unit_test(test_ns_float64),
        cmocka_unit_test(test_update_float64),
        cmocka_unit_test(test_dump_layout),
        cmocka_unit_test(test_parity_llama),
        cmocka_unit_test(test_parity_deepseek),
        cmocka_unit_test(test_dry_equals_real),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

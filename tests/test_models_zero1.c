/* test_models_zero1.c — ZeRO-1 (shard_optimizer_over_data) and gradient
 * accumulation (gradient_accumulation_steps) on small shapes:
 *   - MaxText's optimizer-state spec rule (sharding.add_data_to_sharding) on
 *     hand-made specs;
 *   - parity over 5 steps (loss and every gradient of every step, rtol 1e-4)
 *     with the 1-device run of the same rows per step, auto and explicit:
 *     Llama data=4 and data=2 tensor=2 with ZeRO-1, G=4 microbatches against
 *     one batch of four times the rows, the combinations; DeepSeek with
 *     expert parallelism, ZeRO-1 and accumulation;
 *   - traffic: ZeRO-1 all-gathers (k-1)/k of the parameter bytes over 'data'
 *     before the step and reduce-scatters as much of the gradients after it
 *     (no all-reduce left); accumulation all-reduces the gradients over
 *     'data' once per microbatch (where XLA leaves MaxText's reduction),
 *     and ZeRO-1 + accumulation gathers the parameters once per step;
 *   - memory: the optimizer bytes per device fall by the data factor;
 *   - dry run: the same traffic and memory as a real run;
 *   - checkpoints written from the ZeRO-1 layout hold the 1-device values;
 *   - the combinations MaxText refuses are refused, naming the keys. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/json.h"
#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed, a rate large enough to move, no warm-up and the z-loss */
static const char *const LLAMA[] = {TINY_LLAMA_YML, "init_weights_seed=3", "learning_rate=1e-2",
                                    "warmup_steps_fraction=0.0", "z_loss_multiplier=0.001"};

/* tests/data/tiny-deepseek.yml (1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora) with the MoE
 * parity knobs of tests/data/moe-training.yml */
static const char *const DEEPSEEK[] = {TINY_DEEPSEEK_YML, MOE_TRAINING_YML};
enum { ROWS = 8, STEPS = 5 };

static sim_status load_model(bool deepseek, const char *const *extra, int n_extra, int devices, int ga, long long steps,
                             cfg_config **cfg, model_def **def)
{
    const char *argv[80];
    int argc = 0;
    const char *const *base = deepseek ? DEEPSEEK : LLAMA;
    int nb = deepseek ? (int)(sizeof DEEPSEEK / sizeof *DEEPSEEK) : (int)(sizeof LLAMA / sizeof *LLAMA);
    for (int i = 0; i < nb; i++) argv[argc++] = base[i];
    /* ROWS rows per step whatever the mesh and the microbatches */
    char pdbs[64], st[32], g[48];
    snprintf(pdbs, sizeof pdbs, "per_device_batch_size=%g", (double)ROWS / (devices * ga));
    snprintf(st, sizeof st, "steps=%lld", steps);
    snprintf(g, sizeof g, "gradient_accumulation_steps=%d", ga);
    argv[argc++] = pdbs;
    argv[argc++] = st;
    argv[argc++] = g;
    for (int i = 0; i < n_extra; i++) argv[argc++] = extra[i];
    SIM_TRY(cfg_load_argv("configs/base.yml", argc, argv, cfg));
    *def = calloc(1, sizeof **def);
    sim_status s = model_def_from_config(*cfg, *def);
    if (s != SIM_OK) {
        free(*def);
        *def = NULL;
    }
    return s;
}

static void open_run(model_run *r, bool deepseek, const char *const *extra, int n_extra, int devices, int ga,
                     long long steps)
{
    cfg_config *cfg = NULL;
    model_def *def = NULL;
    if (load_model(deepseek, extra, n_extra, devices, ga, steps, &cfg, &def) != SIM_OK)
        fail_msg("model: %s", sim_errmsg());
    assert_int_equal(def->mesh.num_devices, devices);
    assert_int_equal(def->d.batch * def->d.ga, ROWS);
    model_run_start(r, cfg, def, steps);
}

static uint64_t param_bytes(const model_def *def, int i)
{
    uint64_t b = 4;
    for (int d = 0; d < def->defs[i].rank; d++) b *= (uint64_t)def->defs[i].shape[d];
    return b;
}

/* Whether ZeRO-1 shards parameter i of the tiny Llama, derived by hand from
 * MaxText's rule and the base rules: every kernel and the embedding has a dim
 * free of 'tensor' whose size divides by 2 and by 4; a norm scale's first dim
 * ('norm') is on 'tensor', which blocks it only when tensor > 1: then a layer
 * norm takes 'data' on its layers dim (2 layers, data = 2 in these tests) and
 * decoder_norm, having no other dim, stays whole. */
static bool zero1_sharded(const model_def *def, int i)
{
    const char *path = def->defs[i].path;
    int tensor = def->mesh.sizes[mesh_shape_axis_index(&def->mesh, "tensor")];
    return tensor == 1 || !strstr(path, "decoder_norm");
}

/* ------------------------------------------------------------ the spec rule */

static void test_zero1_spec_rule(void **state)
{
    (void)state;
    const char *argv[] = {"ici_data_parallelism=4", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2"};
    cfg_config *cfg;
    assert_int_equal(cfg_load_argv("configs/base.yml", 3, argv, &cfg), SIM_OK);
    mesh_shape m;
    assert_int_equal(mesh_shape_from_config(cfg, &m), SIM_OK);
    cfg_free(cfg);
    mesh_spec in, out, want;
    int64_t shape[3] = {8, 6, 16};
    /* dim 0 carries 'tensor' (skipped), dim 1: 6 % 4 != 0 (skipped), dim 2: ('data', 'expert') */
    assert_int_equal(mesh_spec_parse("P(('tensor', 'autoregressive'), None, 'expert')", &m, &in), SIM_OK);
    model_zero1_spec(&m, 3, shape, &in, &out);
    assert_int_equal(mesh_spec_parse("P(('tensor', 'autoregressive'), None, ('data', 'expert'))", &m, &want), SIM_OK);
    assert_true(mesh_spec_equal(&out, &want));
    /* 'tensor' (of size 2) blocks its dim even where the per-shard size divides (8 / 2 = 4) */
    int64_t shape2[2] = {8, 12};
    assert_int_equal(mesh_spec_parse("P('tensor', None)", &m, &in), SIM_OK);
    model_zero1_spec(&m, 2, shape2, &in, &out);
    assert_int_equal(mesh_spec_parse("P('tensor', 'data')", &m, &want), SIM_OK);
    assert_true(mesh_spec_equal(&out, &want));
    /* the per-shard size decides: 8 over ('stage') of size 1 is 8, divisible by 4 */
    assert_int_equal(mesh_spec_parse("P('stage', None)", &m, &in), SIM_OK);
    model_zero1_spec(&m, 2, shape2, &in, &out);
    assert_int_equal(mesh_spec_parse("P(('data', 'stage'), None)", &m, &want), SIM_OK);
    assert_true(mesh_spec_equal(&out, &want));
    /* 'data' already used: unchanged */
    assert_int_equal(mesh_spec_parse("P(None, 'data')", &m, &in), SIM_OK);
    model_zero1_spec(&m, 2, shape2, &in, &out);
    assert_true(mesh_spec_equal(&out, &in));
    /* no dim qualifies (2 and 6 do not divide by 4): unchanged */
    int64_t shape3[2] = {2, 6};
    assert_int_equal(mesh_spec_parse("P(None, None)", &m, &in), SIM_OK);
    model_zero1_spec(&m, 2, shape3, &in, &out);
    assert_true(mesh_spec_equal(&out, &in));
    /* a 'tensor' of size 1 does not block its dim (MaxText 0.2.5 removes size-1 axes first) */
    const char *argv1[] = {"ici_data_parallelism=4", "ici_fsdp_parallelism=1"};
    assert_int_equal(cfg_load_argv("configs/base.yml", 2, argv1, &cfg), SIM_OK);
    assert_int_equal(mesh_shape_from_config(cfg, &m), SIM_OK);
    cfg_free(cfg);
    assert_int_equal(mesh_spec_parse("P(('tensor', 'autoregressive'), None)", &m, &in), SIM_OK);
    model_zero1_spec(&m, 2, shape2, &in, &out);
    assert_int_equal(mesh_spec_parse("P(('data', 'tensor', 'autoregressive'), None)", &m, &want), SIM_OK);
    assert_true(mesh_spec_equal(&out, &want));
}

/* ------------------------------------------------------------ MaxText's own layouts */

/* tests/data/maxtext/zero1/<case>.json: the Adam mu shardings MaxText 0.2.5
 * gives these configurations (its sharding dump, run on CPU devices) against
 * the optimizer specs of the model definition. */
static void check_zero1_golden(const char *file)
{
    const char *env = getenv("SHARDSIM_REFERENCE");
    char path[1024];
    snprintf(path, sizeof path, "%s/maxtext/zero1/%s", env && *env ? env : "tests/data", file);
    cfg_json *g = NULL;
    if (cfg_json_read_file(path, &g) != SIM_OK) fail_msg("%s", sim_errmsg());
    const cfg_json *args = cfg_json_get(g, "args"), *mu = cfg_json_get(g, "mu");
    assert_non_null(args);
    assert_non_null(mu);
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", args->str);
    const char *argv[64];
    int argc = 0;
    char *save = NULL;
    for (char *w = strtok_r(buf, " ", &save); w && argc < 64; w = strtok_r(NULL, " ", &save)) argv[argc++] = w;
    cfg_config *cfg;
    if (cfg_load_argv("configs/base.yml", argc, argv, &cfg) != SIM_OK) fail_msg("%s: %s", file, sim_errmsg());
    model_def *def = calloc(1, sizeof *def);
    if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("%s: %s", file, sim_errmsg());
    assert_true(mu->n > 10);
    for (int k = 0; k < mu->n; k++) {
        char name[256];
        snprintf(name, sizeof name, "params.%s", mu->keys[k]);
        int i = -1;
        for (int j = 0; j < def->nparams; j++)
            if (!strcmp(def->defs[j].path, name)) i = j;
        if (i < 0) fail_msg("%s: MaxText's '%s' is not a parameter of the model", file, name);
        mesh_spec want;
        if (mesh_spec_from_json(cfg_json_get(&mu->items[k], "partition_spec"), &def->mesh, name, &want) != SIM_OK)
            fail_msg("%s", sim_errmsg());
        mesh_spec got = def->opt_spec[i];
        assert_int_equal(got.rank, def->defs[i].rank);
        /* MaxText's spec may be shorter than the rank (trailing None omitted) */
        mesh_spec fitted;
        assert_int_equal(mesh_spec_fit_rank(&want, got.rank, name, &fitted), SIM_OK);
        if (!mesh_spec_equal(&got, &fitted)) {
            char a[256], b[256];
            mesh_spec_format(&got, &def->mesh, a, sizeof a);
            mesh_spec_format(&fitted, &def->mesh, b, sizeof b);
            fail_msg("%s: mu of %s: shardsim %s, MaxText %s", file, name, a, b);
        }
    }
    model_def_free(def);
    free(def);
    cfg_free(cfg);
    cfg_json_free(g);
}

static void test_zero1_layouts_equal_maxtext(void **state)
{
    (void)state;
    check_zero1_golden("llama2-7b_data4_tensor2.json");
    check_zero1_golden("deepseek3-tiny_data2_expert2.json");
}

/* ------------------------------------------------------------ microbatches */

static void test_microbatch_rows_strided(void **state)
{
    (void)state;
    enum { G = 3, R = 4, T = 2 };
    int32_t step[G * R * T], mb[R * T];
    for (int i = 0; i < G * R * T; i++) step[i] = i;
    for (int g = 0; g < G; g++) {
        model_microbatch_rows(step, R, T, G, g, mb);
        /* MaxText: reshape [R*G] -> [R, G], swap: microbatch g, row j = step row j*G + g */
        for (int j = 0; j < R; j++)
            for (int t = 0; t < T; t++) assert_int_equal(mb[j * T + t], (j * G + g) * T + t);
    }
}

/* ------------------------------------------------------------ parity over 5 steps */

typedef struct {
    const char *label;
    const char *flags[5];
    int devices, ga;
    const char *explicit_err; /* MaxText 0.2.5 cannot trace it in explicit mode: its failing op */
} zcase;

/* dot-product attention (T < 128) with the sequence sharded: MaxText 0.2.5's explicit-mode trace
 * fails (tests/data/maxtext-0.2.5/verdicts); its parity is checked in auto mode */
#define QK_ERR "MaxText 0.2.5 fails here too: layers/attention_op.py:qk_product"

static void compare(const char *what, const model_run *a, const model_run *ref)
{
    for (int s = 0; s < STEPS; s++) {
        double l = a->job.stats[s].loss, lr = ref->job.stats[s].loss;
        if (fabs(l - lr) > 1e-4 * fabs(lr)) fail_msg("%s step %d: loss %.7f vs %.7f", what, s, l, lr);
        for (int i = 0; i < a->def->nparams; i++) {
            const model_grads *g = &a->job.step_grads[s], *gr = &ref->job.step_grads[s];
            double e = model_rel_norm_diff(g->g[i], gr->g[i], g->layer_elems[i] * g->n_layers[i]);
            if (!(e <= 1e-4)) fail_msg("%s step %d: gradient of %s differs by %.3g", what, s, a->def->defs[i].path, e);
        }
    }
}

static void parity(bool deepseek, const zcase *cases, int n)
{
    model_run ref;
    open_run(&ref, deepseek, NULL, 0, 1, 1, STEPS);
    model_run_train(&ref, true);
    /* the loss moves: parity over steps that compare nothing would be empty */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.02);
    for (int c = 0; c < n; c++)
        for (int mode = 0; mode < 2; mode++) {
            const char *extra[8];
            int k = 0;
            for (int f = 0; f < 5 && cases[c].flags[f]; f++) extra[k++] = cases[c].flags[f];
            extra[k++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            char what[160];
            snprintf(what, sizeof what, "%s %s", cases[c].label, extra[k - 1]);
            model_run r;
            open_run(&r, deepseek, extra, k, cases[c].devices, cases[c].ga, STEPS);
            if (mode && cases[c].explicit_err) {
                sim_status st = model_train(&r.job, r.m);
                if (st != SIM_ERR_SHARDING || !strstr(sim_errmsg(), cases[c].explicit_err))
                    fail_msg("%s: expected a sharding error naming '%s', got status %d", what, cases[c].explicit_err,
                             (int)st);
                model_run_close(&r);
                continue;
            }
            model_run_train(&r, true);
            compare(what, &r, &ref);
            model_run_close(&r);
        }
    model_run_close(&ref);
}

#define ZERO1 "shard_optimizer_over_data=true"
#define NOFSDP "ici_fsdp_parallelism=1"

static void test_parity_llama(void **state)
{
    (void)state;
    static const zcase cases[] = {
        {"data=4 ZeRO-1", {"ici_data_parallelism=4", NOFSDP, ZERO1}, 4, 1, NULL},
        {"data=2 tensor=2 ZeRO-1", {"ici_data_parallelism=2", "ici_tensor_parallelism=2", NOFSDP, ZERO1}, 4, 1, NULL},
        {"1 device G=4", {NOFSDP}, 1, 4, NULL},
        {"data=2 G=4", {"ici_data_parallelism=2", NOFSDP}, 2, 4, NULL},
        {"fsdp=2 tensor=2 G=2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 4, 2, NULL},
        {"data=2 tensor=2 ZeRO-1 G=2",
         {"ici_data_parallelism=2", "ici_tensor_parallelism=2", NOFSDP, ZERO1},
         4,
         2,
         NULL},
        /* per_device_batch_size 0.5: each microbatch loads 8 rows and trains its first 4, rows
         * {g, 2+g, 4+g, 6+g} of the step: the same 8 rows; load-balanced context parallelism */
        {"fsdp=2 context=2 tensor=2 G=2",
         {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"},
         8,
         2,
         QK_ERR},
    };
    parity(false, cases, (int)(sizeof cases / sizeof *cases));
}

static void test_parity_deepseek(void **state)
{
    (void)state;
    static const zcase cases[] = {
        {"data=2 expert=2 ZeRO-1", {"ici_data_parallelism=2", "ici_expert_parallelism=2", NOFSDP, ZERO1}, 4, 1, NULL},
        {"data=2 expert=2 G=2", {"ici_data_parallelism=2", "ici_expert_parallelism=2", NOFSDP}, 4, 2, NULL},
        {"data=2 expert=2 ZeRO-1 G=2",
         {"ici_data_parallelism=2", "ici_expert_parallelism=2", NOFSDP, ZERO1},
         4,
         2,
         NULL},
    };
    parity(true, cases, (int)(sizeof cases / sizeof *cases));
}

/* ------------------------------------------------------------ traffic */

typedef struct {
    uint64_t bytes, calls;
} sum_t;

/* Device d's records of one op over exactly the 'data' axis, one phase, a tag prefix (or any). */
static sum_t data_records(const model_run *r, int d, sim_op op, sim_phase ph, const char *prefix)
{
    int data = mesh_shape_axis_index(&r->def->mesh, "data");
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r->m, d), &n);
    sum_t s = {0, 0};
    for (size_t i = 0; i < n; i++)
        if (rec[i].op == op && rec[i].phase == ph && rec[i].axes.n == 1 && rec[i].axes.axis[0] == data &&
            (!prefix || !strncmp(rec[i].tag, prefix, strlen(prefix)))) {
            s.bytes += rec[i].bytes_sent;
            s.calls++;
        }
    return s;
}

static void test_traffic_zero1_data(void **state)
{
    (void)state;
    enum { K = 4, NSTEPS = 2 };
    const char *extra[] = {"ici_data_parallelism=4", NOFSDP, ZERO1};
    model_run r;
    open_run(&r, false, extra, 3, K, 1, NSTEPS);
    model_run_train(&r, false);
    /* pure data parallelism: every parameter is whole on a device; the step gathers
     * (K-1)/K of each sharded one and reduce-scatters (K-1)/K of its gradient; the
     * unsharded ones (the norm scales) keep data parallelism's all-reduce, 2(K-1)/K */
    uint64_t sharded = 0, kept = 0;
    int nsharded = 0;
    for (int i = 0; i < r.def->nparams; i++) {
        if (zero1_sharded(r.def, i)) sharded += param_bytes(r.def, i), nsharded++;
        else kept += param_bytes(r.def, i);
    }
    assert_int_equal(nsharded, r.def->nparams);
    for (int d = 0; d < K; d++) {
        sum_t ag = data_records(&r, d, SIM_OP_ALL_GATHER, SIM_PHASE_FORWARD, "zero1/params/");
        sum_t rs = data_records(&r, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, "zero1/grads/");
        assert_int_equal(ag.bytes, NSTEPS * sharded * (K - 1) / K);
        assert_int_equal(rs.bytes, NSTEPS * sharded * (K - 1) / K);
        /* one reshard per stacked parameter per step (its per-layer arrays travel together) */
        assert_int_equal(ag.calls, NSTEPS * nsharded);
        assert_int_equal(rs.calls, NSTEPS * nsharded);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, NULL).bytes,
                         NSTEPS * kept * 2 * (K - 1) / K);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, "zero1/grads/").bytes,
                         NSTEPS * kept * 2 * (K - 1) / K);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_GATHER, SIM_PHASE_BACKWARD, NULL).bytes, 0);
    }
    model_run_close(&r);
}

static void test_traffic_zero1_tensor(void **state)
{
    (void)state;
    enum { K = 2 };
    const char *extra[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2", NOFSDP, ZERO1};
    model_run r;
    open_run(&r, false, extra, 4, 4, 1, 1);
    model_run_train(&r, false);
    /* a parameter of n bytes split over s devices by its own spec ('tensor' here) holds
     * n/s per device; ZeRO-1 gathers and reduce-scatters (K-1)/K of that over 'data' */
    uint64_t want = 0, kept = 0;
    for (int i = 0; i < r.def->nparams; i++) {
        uint64_t shards = 1;
        uint32_t ax = mesh_spec_dim_axes(&r.def->spec[i]);
        for (int a = 0; a < r.def->mesh.n_axes; a++)
            if (ax & (1u << a)) shards *= (uint64_t)r.def->mesh.sizes[a];
        if (zero1_sharded(r.def, i)) want += param_bytes(r.def, i) / shards * (K - 1) / K;
        else kept += param_bytes(r.def, i) / shards * 2 * (K - 1) / K;
    }
    for (int d = 0; d < 4; d++) {
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_GATHER, SIM_PHASE_FORWARD, "zero1/params/").bytes, want);
        assert_int_equal(data_records(&r, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, "zero1/grads/").bytes, want);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, NULL).bytes, kept);
    }
    model_run_close(&r);
}

/* DeepSeek data=2 expert=2: MaxText prepends 'data' to dims already on 'expert'
 * (('data', 'expert'), layouts checked against MaxText above); the data-axis
 * traffic is still one all-gather and one reduce-scatter of (K-1)/K of each
 * such parameter's local bytes, the blocks changing hands in a ppermute. */
static void test_traffic_zero1_expert(void **state)
{
    (void)state;
    enum { K = 2 };
    const char *extra[] = {"ici_data_parallelism=2", "ici_expert_parallelism=2", NOFSDP, ZERO1};
    model_run r;
    open_run(&r, true, extra, 4, 4, 1, 1);
    model_run_train(&r, false);
    int data = mesh_shape_axis_index(&r.def->mesh, "data");
    uint64_t want = 0;
    int on_expert = 0;
    for (int i = 0; i < r.def->nparams; i++) {
        if (!(mesh_spec_dim_axes(&r.def->opt_spec[i]) & (1u << data))) continue;
        uint64_t shards = 1;
        uint32_t ax = mesh_spec_dim_axes(&r.def->spec[i]);
        for (int a = 0; a < r.def->mesh.n_axes; a++)
            if (ax & (1u << a)) shards *= (uint64_t)r.def->mesh.sizes[a];
        on_expert += shards > 1;
        want += param_bytes(r.def, i) / shards * (K - 1) / K;
    }
    assert_true(on_expert > 0);
    for (int d = 0; d < 4; d++) {
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_GATHER, SIM_PHASE_FORWARD, "zero1/params/").bytes, want);
        assert_int_equal(data_records(&r, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, "zero1/grads/").bytes, want);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, NULL).bytes, 0);
    }
    model_run_close(&r);
}

static void test_traffic_accumulation(void **state)
{
    (void)state;
    enum { K = 2, G = 4 };
    /* without ZeRO-1: every microbatch all-reduces its gradients over data, 2(K-1)/K of all bytes */
    const char *plain[] = {"ici_data_parallelism=2", NOFSDP};
    model_run r;
    open_run(&r, false, plain, 2, K, G, 1);
    model_run_train(&r, false);
    uint64_t all = model_param_bytes(r.def);
    for (int d = 0; d < K; d++) {
        sum_t ar = data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, "grad/");
        assert_int_equal(ar.bytes, G * all * 2 * (K - 1) / K);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, NULL).bytes, ar.bytes);
    }
    model_run_close(&r);
    /* with ZeRO-1: the parameters are gathered once per step, not per microbatch; the
     * gradients are all-reduced per microbatch into MaxText's carry (the parameters'
     * layout), then sliced into the optimizer layout without traffic */
    const char *zero1[] = {"ici_data_parallelism=2", NOFSDP, ZERO1};
    open_run(&r, false, zero1, 3, K, G, 1);
    model_run_train(&r, false);
    /* MaxText casts the parameters to dtype (bfloat16: 2 of 4 bytes) before this gather and the
     * loop, so the gather and the per-microbatch gradients move dtype (maxtext-facts-2 §D) */
    uint64_t sharded = 0;
    int nsharded = 0;
    for (int i = 0; i < r.def->nparams; i++)
        if (zero1_sharded(r.def, i)) sharded += param_bytes(r.def, i) / 2, nsharded++;
    for (int d = 0; d < K; d++) {
        sum_t ag = data_records(&r, d, SIM_OP_ALL_GATHER, SIM_PHASE_FORWARD, "zero1/params/");
        assert_int_equal(ag.bytes, sharded * (K - 1) / K);
        assert_int_equal(ag.calls, nsharded);
        assert_int_equal(data_records(&r, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, "grad/").bytes,
                         G * all / 2 * 2 * (K - 1) / K);
        assert_int_equal(data_records(&r, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, NULL).bytes, 0);
    }
    model_run_close(&r);
}

/* ------------------------------------------------------------ memory */

static void optimizer_bytes(bool zero1, uint64_t *opt, uint64_t *params, uint64_t *total, uint64_t *kept)
{
    const char *extra[] = {"ici_data_parallelism=4", NOFSDP, zero1 ? ZERO1 : "shard_optimizer_over_data=false"};
    model_run r;
    open_run(&r, false, extra, 3, 4, 1, 1);
    model_run_train(&r, false);
    *total = model_param_bytes(r.def);
    *kept = 0;
    for (int i = 0; i < r.def->nparams; i++)
        if (!zero1_sharded(r.def, i)) *kept += param_bytes(r.def, i);
    for (int d = 0; d < 4; d++) {
        sim_arena_stats s;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, d)), &s);
        if (d > 0) {
            assert_int_equal(s.at_peak_by[SIM_MEM_OPTIMIZER], *opt);
            assert_int_equal(s.at_peak_by[SIM_MEM_PARAMS], *params);
        }
        *opt = s.at_peak_by[SIM_MEM_OPTIMIZER];
        *params = s.at_peak_by[SIM_MEM_PARAMS];
    }
    model_run_close(&r);
}

static void test_memory_zero1(void **state)
{
    (void)state;
    uint64_t opt0, par0, opt1, par1, total, kept;
    optimizer_bytes(false, &opt0, &par0, &total, &kept);
    optimizer_bytes(true, &opt1, &par1, &total, &kept);
    assert_int_equal(kept, 0);
    /* Adam's two moments: 2 x every parameter byte, then a quarter of it on data=4 */
    assert_int_equal(opt0, 2 * total);
    assert_int_equal(opt1, 2 * total / 4);
    /* the stored quarter of the parameters joins the gathered working copy */
    assert_int_equal(par0, total);
    assert_int_equal(par1, total + total / 4);
}

/* ------------------------------------------------------------ dry run */

static void test_dry_run_matches_real(void **state)
{
    (void)state;
    const char *real[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2", NOFSDP, ZERO1};
    const char *dry[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2", NOFSDP, ZERO1, "dry_run=true"};
    model_run a, b;
    open_run(&a, false, real, 4, 4, 2, 1);
    open_run(&b, false, dry, 5, 4, 2, 1);
    model_run_train(&a, false);
    model_run_train(&b, false);
    model_run_expect_same_records("dry run", &a, &b, 4, 0);
    model_run_close(&a);
    model_run_close(&b);
}

static void test_checkpoint_from_zero1_layout(void **state)
{
    (void)state;
    char dir[2][64];
    const char *zero1[] = {"ici_data_parallelism=4", NOFSDP, ZERO1};
    for (int k = 0; k < 2; k++) {
        snprintf(dir[k], sizeof dir[k], "/tmp/shardsim_zero1_ck_%d_%d", (int)getpid(), k);
        model_run r;
        open_run(&r, false, zero1, k ? 3 : 0, k ? 4 : 1, 1, 2);
        r.job.checkpoint_dir = dir[k];
        r.job.checkpoint_period = 2;
        model_run_train(&r, false);
        model_run_close(&r);
    }
    /* the same header (names, dtypes, shapes, offsets: every entry but __metadata__, whose
     * checksums follow the values) and the same values, parameters and moments */
    char p0[128], p1[128];
    snprintf(p0, sizeof p0, "%s/step_1.safetensors", dir[0]); /* after the last of 2 steps */
    snprintf(p1, sizeof p1, "%s/step_1.safetensors", dir[1]);
    size_t n0, n1;
    char *a = helper_read_file(p0, &n0), *b = helper_read_file(p1, &n1);
    assert_int_equal(n0, n1);
    uint64_t hl;
    memcpy(&hl, a, 8);
    uint64_t hl1;
    memcpy(&hl1, b, 8);
    assert_int_equal(hl, hl1);
    cfg_json *ha = NULL, *hb = NULL;
    assert_int_equal(cfg_json_parse((const char *)a + 8, hl, p0, &ha), SIM_OK);
    assert_int_equal(cfg_json_parse((const char *)b + 8, hl, p1, &hb), SIM_OK);
    assert_int_equal(ha->n, hb->n);
    for (int i = 0; i < ha->n; i++) {
        assert_string_equal(ha->keys[i], hb->keys[i]);
        if (strcmp(ha->keys[i], "__metadata__")) assert_true(cfg_json_equal(&ha->items[i], &hb->items[i]));
    }
    cfg_json_free(ha);
    cfg_json_free(hb);
    const float *x = (const float *)((const char *)a + 8 + hl), *y = (const float *)((const char *)b + 8 + hl);
    int64_t nf = ((int64_t)n0 - 8 - (int64_t)hl) / 4;
    assert_true(nf > 0);
    assert_true(model_rel_norm_diff(y, x, nf) < 1e-5);
    free(a);
    free(b);
    /* and a ZeRO-1 run starts from it (load_parameters_path) as a 1-device run does */
    double loss[2];
    for (int k = 0; k < 2; k++) {
        model_run r;
        open_run(&r, false, zero1, k ? 3 : 0, k ? 4 : 1, 1, 2);
        r.job.load_path = p0;
        model_run_train(&r, false);
        loss[k] = r.job.stats[1].loss;
        model_run_close(&r);
    }
    assert_true(fabs(loss[1] - loss[0]) <= 1e-5 * fabs(loss[0]));
    for (int k = 0; k < 2; k++) {
        char f[160];
        for (int s = 0; s <= 1; s++) {
            snprintf(f, sizeof f, "%s/step_%d.safetensors", dir[k], s);
            unlink(f);
        }
        rmdir(dir[k]);
    }
}

/* ------------------------------------------------------------ refusals */

static void refused(const char *const *extra, int n, int devices, const char *const *words, int nw)
{
    cfg_config *cfg = NULL;
    model_def *def = NULL;
    sim_status s = load_model(false, extra, n, devices, 1, 1, &cfg, &def);
    assert_int_equal(s, SIM_ERR_INPUT);
    for (int i = 0; i < nw; i++)
        if (!strstr(sim_errmsg(), words[i])) fail_msg("'%s' missing from: %s", words[i], sim_errmsg());
    assert_null(def);
    cfg_free(cfg);
}

static void test_refusals(void **state)
{
    (void)state;
    const char *fsdp[] = {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", ZERO1};
    const char *fsdp_w[] = {"shard_optimizer_over_data", "FSDP", "ici_fsdp_parallelism", "size of 2"};
    refused(fsdp, 3, 4, fsdp_w, 4);
    const char *sgd[] = {"ici_data_parallelism=2", NOFSDP, ZERO1, "opt_type=sgd"};
    const char *sgd_w[] = {"shard_optimizer_over_data", "opt_type=sgd", "adamw"};
    refused(sgd, 4, 2, sgd_w, 3);
    const char *ga[] = {NOFSDP, "gradient_accumulation_steps=0"};
    const char *ga_w[] = {"gradient_accumulation_steps=0", "1 <= gradient_accumulation_steps"};
    refused(ga, 2, 1, ga_w, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zero1_spec_rule),
        cmocka_unit_test(test_zero1_layouts_equal_maxtext),
        cmocka_unit_test(test_microbatch_rows_strided),
        cmocka_unit_test(test_parity_llama),
        cmocka_unit_test(test_parity_deepseek),
        cmocka_unit_test(test_traffic_zero1_data),
        cmocka_unit_test(test_traffic_zero1_tensor),
        cmocka_unit_test(test_traffic_zero1_expert),
        cmocka_unit_test(test_traffic_accumulation),
        cmocka_unit_test(test_memory_zero1),
        cmocka_unit_test(test_dry_run_matches_real),
        cmocka_unit_test(test_checkpoint_from_zero1_layout),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

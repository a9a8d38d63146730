/* test_models_train.c — the training loop on small shapes:
 *   - parity over 5 steps (losses and every gradient of every step) with the
 *     1-device run on the meshes below, in auto and explicit mode;
 *   - traffic: pure FSDP reduce-scatters (k-1)/k of the fsdp-sharded
 *     parameter bytes per step; pure data parallelism all-reduces
 *     2(k-1)/k of all parameter bytes per step;
 *   - dry run: the same traffic and peak memory as a real run; with
 *     gradient accumulation every microbatch after the second adds the same
 *     collectives and leaves every device's peak as it was (what the host
 *     memory check's two-microbatch dry step and the dry-run ceiling rely on);
 *   - the synthetic loss falls;
 *   - an explicit-mode constraint that does not hold is an error naming the
 *     layer and both specs, and auto mode reshards it (implicit). */
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

#include "mesh/ad.h"
#include "models/core/train.h"
#include "sim/arena.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed, a rate large enough to move, no warm-up and the z-loss */
static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=3", "learning_rate=1e-2",
                                   "warmup_steps_fraction=0.0", "z_loss_multiplier=0.001"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8 };

static void open_run(model_run *r, const char *const *extra, int n_extra, int devices, long long steps)
{
    model_run_open(r, TINY, NTINY, ROWS, extra, n_extra, devices, steps);
}

/* ------------------------------------------------------------ parity over 5 steps */

typedef struct {
    const char *label;
    const char *flags[4];
    const char *explicit_err; /* MaxText 0.2.5 cannot trace it in explicit mode: the error expected */
} mesh_case;

/* The explicit-mode failures are MaxText 0.2.5's (tests/data/maxtext-0.2.5/verdicts): dot-product
 * attention (T = 16 < 128) with the sequence sharded, and the layer scan's carry with
 * tensor_sequence; their parity is checked in auto mode. */
#define QK_ERR "MaxText 0.2.5 fails here too: layers/attention_op.py:qk_product"
#define CARRY_ERR "MaxText 0.2.5 fails here too: layers/nnx_decoders.py:_apply_layers_sequentially"

static const mesh_case MESHES[] = {
    {"data=8", {"ici_data_parallelism=8", "ici_fsdp_parallelism=1"}, NULL},
    {"fsdp=8", {"ici_fsdp_parallelism=8"}, NULL},
    {"fsdp=4 tensor=2", {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"}, NULL},
    {"data=2 fsdp=2 tensor=2", {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, NULL},
    {"fsdp=2 context=2 tensor=2",
     {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"},
     QK_ERR},
    {"tensor_sequence=2 fsdp=4", {"ici_tensor_sequence_parallelism=2", "ici_fsdp_parallelism=4"}, CARRY_ERR},
    {"fsdp_transpose=2 fsdp=4", {"ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=4"}, NULL},
    /* remat_policy=none over unscanned layers keeps every activation instead of recomputing layers
     * (over scanned ones MaxText's none is full remat): same numbers */
    {"fsdp=4 tensor=2 remat none unscanned",
     {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "remat_policy=none", "scan_layers=false"},
     NULL},
};

static void test_parity_five_steps(void **state)
{
    (void)state;
    enum { STEPS = 5 };
    model_run ref;
    open_run(&ref, NULL, 0, 1, STEPS);
    model_run_train(&ref, true);
    /* the loss moves: parity over steps that compare nothing would be empty */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.05);
    for (size_t mi = 0; mi < sizeof MESHES / sizeof MESHES[0]; mi++)
        for (int mode = 0; mode < 2; mode++) {
            const char *extra[6];
            int n = 0;
            for (int f = 0; f < 4 && MESHES[mi].flags[f]; f++) extra[n++] = MESHES[mi].flags[f];
            extra[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            model_run r;
            open_run(&r, extra, n, 8, STEPS);
            if (mode && MESHES[mi].explicit_err) {
                assert_int_equal(model_train(&r.job, r.m), SIM_ERR_SHARDING);
                if (!strstr(sim_errmsg(), MESHES[mi].explicit_err))
                    fail_msg("%s explicit: expected '%s', got: %s", MESHES[mi].label, MESHES[mi].explicit_err,
                             sim_errmsg());
                model_run_close(&r);
                continue;
            }
            model_run_train(&r, true);
            for (int s = 0; s < STEPS; s++) {
                double l = r.job.stats[s].loss, lr = ref.job.stats[s].loss;
                if (fabs(l - lr) > 1e-4 * fabs(lr))
                    fail_msg("%s %s step %d: loss %.7f vs %.7f", MESHES[mi].label, extra[n - 1], s, l, lr);
                for (int i = 0; i < r.def->nparams; i++) {
                    const model_grads *g = &r.job.step_grads[s], *gr = &ref.job.step_grads[s];
                    double e = model_rel_norm_diff(g->g[i], gr->g[i], g->layer_elems[i] * g->n_layers[i]);
                    if (e > 1e-4)
                        fail_msg("%s %s step %d: gradient of %s differs by %.3g", MESHES[mi].label, extra[n - 1], s,
                                 r.def->defs[i].path, e);
                }
            }
            model_run_close(&r);
        }
    model_run_close(&ref);
}

/* ------------------------------------------------------------ traffic formulas */

/* A parameter's bytes in weight_dtype (float32): its gradient is reduced in it (MaxText's compiled
 * step casts the bfloat16 product's gradient back before the reduction). */
static uint64_t param_bytes(const model_def *def, int i)
{
    uint64_t b = 4;
    for (int d = 0; d < def->defs[i].rank; d++) b *= (uint64_t)def->defs[i].shape[d];
    return b;
}

static void test_traffic_pure_fsdp(void **state)
{
    (void)state;
    const char *extra[] = {"ici_fsdp_parallelism=8"};
    model_run r;
    open_run(&r, extra, 1, 8, 1);
    model_run_train(&r, false);
    int fsdp = mesh_shape_axis_index(&r.def->mesh, "fsdp");
    uint64_t sharded = 0;
    for (int i = 0; i < r.def->nparams; i++)
        if (mesh_spec_dim_axes(&r.def->spec[i]) & (1u << fsdp)) sharded += param_bytes(r.def, i);
    assert_true(sharded > 0);
    for (int d = 0; d < 8; d++) {
        /* every backward reduce-scatter is a gradient landing on its fsdp-sharded parameter */
        helper_sum rs = helper_sum_records(r.m, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, NULL);
        helper_sum grad = helper_sum_records(r.m, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, "grad/");
        assert_int_equal(rs.bytes, grad.bytes);
        assert_int_equal(rs.bytes, sharded * 7 / 8);
    }
    model_run_close(&r);
}

static void test_traffic_pure_data(void **state)
{
    (void)state;
    const char *extra[] = {"ici_data_parallelism=8", "ici_fsdp_parallelism=1"};
    model_run r;
    open_run(&r, extra, 2, 8, 1);
    model_run_train(&r, false);
    uint64_t all = model_param_bytes(r.def);
    for (int d = 0; d < 8; d++) {
        helper_sum ar = helper_sum_records(r.m, d, SIM_OP_ALL_REDUCE, SIM_PHASE_BACKWARD, NULL);
        /* 2(k-1)/k of every parameter byte, k = 8 (each gradient's size divides by 8 here) */
        assert_int_equal(ar.bytes, all * 2 * 7 / 8);
        /* and nothing else moves in backward */
        assert_int_equal(helper_sum_records(r.m, d, SIM_OP_ALL_GATHER, SIM_PHASE_BACKWARD, NULL).bytes, 0);
        assert_int_equal(helper_sum_records(r.m, d, SIM_OP_REDUCE_SCATTER, SIM_PHASE_BACKWARD, NULL).bytes, 0);
    }
    model_run_close(&r);
}

/* ------------------------------------------------------------ dry run */

static void test_dry_run_matches_real(void **state)
{
    (void)state;
    const char *real[] = {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"};
    const char *dry[] = {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2",
                         "dry_run=true"};
    model_run a, b;
    open_run(&a, real, 3, 8, 1);
    open_run(&b, dry, 4, 8, 1);
    model_run_train(&a, false);
    model_run_train(&b, false);
    model_run_expect_same_records("dry run", &a, &b, 8, 0);
    model_run_close(&a);
    model_run_close(&b);
}

/* ------------------------------------------------------------ learning */

static void test_loss_falls(void **state)
{
    (void)state;
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    model_run r;
    open_run(&r, extra, 2, 4, 25);
    model_run_train(&r, false);
    double first = r.job.stats[0].loss, last = r.job.stats[24].loss;
    if (!(last < 0.6 * first)) fail_msg("loss %.4f -> %.4f did not fall", first, last);
    model_run_close(&r);
}

/* ------------------------------------------------------------ constraints */

typedef struct {
    mesh_shape mesh;
    mesh_mode mode;
    sim_status st;
    char msg[1024];
    uint64_t implicit_bytes;
} cons_job;

static sim_status cons_device(sim_device *dev, void *arg)
{
    cons_job *j = arg;
    mesh_ctx ctx = {
        .dev = dev, .mesh = &j->mesh, .mode = j->mode, .drop_size_one = true, .layer = "decoder/layers_0/mlp"};
    mesh_tape *t = mesh_tape_new(&ctx, false);
    mesh_spec have, want;
    SIM_TRY(mesh_spec_parse("P('fsdp', None)", &j->mesh, &have));
    SIM_TRY(mesh_spec_parse("P(None, 'fsdp')", &j->mesh, &want));
    mesh_var *x = mesh_tape_var(t), *y;
    int64_t shape[2] = {8, 8};
    SIM_TRY(mesh_array_new(dev, &j->mesh, "x", 2, shape, &have, SIM_F32, SIM_MEM_ACTIVATIONS, &x->val));
    sim_status st = mesh_ad_constraint(t, x, &want, "wo_input", &y);
    if (sim_device_id(dev) == 0) {
        j->st = st;
        snprintf(j->msg, sizeof j->msg, "%s", st ? sim_errmsg() : "");
        size_t n;
        const sim_record *r = sim_device_records(dev, &n);
        for (size_t i = 0; i < n; i++)
            if (r[i].implicit) j->implicit_bytes += r[i].bytes_sent;
    }
    mesh_tape_free(t);
    return SIM_OK;
}

static void test_constraint_mismatch(void **state)
{
    (void)state;
    const char *names[] = {"fsdp"};
    int sizes[] = {4};
    for (int mode = 0; mode < 2; mode++) {
        cons_job j;
        memset(&j, 0, sizeof j);
        assert_int_equal(mesh_shape_init(&j.mesh, 1, names, sizes), SIM_OK);
        j.mode = mode ? MESH_MODE_EXPLICIT : MESH_MODE_AUTO;
        sim_machine *m = helper_machine(&j.mesh, false);
        assert_int_equal(sim_machine_run(m, cons_device, &j), SIM_OK);
        if (mode) {
            assert_int_equal(j.st, SIM_ERR_SHARDING);
            assert_non_null(strstr(j.msg, "decoder/layers_0/mlp"));
            assert_non_null(strstr(j.msg, "P('fsdp', None)"));
            assert_non_null(strstr(j.msg, "P(None, 'fsdp')"));
            assert_int_equal(j.implicit_bytes, 0);
        } else {
            assert_int_equal(j.st, SIM_OK);
            /* the all-to-all that moves fsdp from dim 0 to dim 1: (k-1)/k of a 2x8 float32 block */
            assert_int_equal(j.implicit_bytes, 3 * (2 * 8 * 4) / 4);
        }
        sim_machine_free(m);
    }
}

/* A checkpoint saved under fsdp=4 (after step 0) restores under data=2
 * tensor=2 with another init seed: the first loss equals the one of the same
 * file loaded under the saving mesh. */
static void test_checkpoint_across_meshes(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_ckpt_XXXXXX";
    assert_non_null(mkdtemp(dir));
    const char *save[] = {"ici_fsdp_parallelism=4"};
    model_run a;
    open_run(&a, save, 1, 4, 2);
    a.job.checkpoint_dir = dir;
    a.job.checkpoint_period = 1;
    model_run_train(&a, false);
    char path[256];
    snprintf(path, sizeof path, "%s/step_0.safetensors", dir);
    const char *load[] = {"ici_data_parallelism=2", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
                          "init_weights_seed=99"};
    model_run b;
    open_run(&b, load, 4, 4, 1);
    b.job.load_path = path;
    model_run_train(&b, false);
    model_run a2;
    open_run(&a2, save, 1, 4, 1);
    a2.job.load_path = path;
    model_run_train(&a2, false);
    double la = a2.job.stats[0].loss, lb = b.job.stats[0].loss;
    if (fabs(la - lb) > 1e-5 * fabs(la)) fail_msg("restored loss %.7f, saved run %.7f", lb, la);
    /* without the checkpoint the other seed gives another loss: the load did something */
    model_run c;
    open_run(&c, load, 4, 4, 1);
    model_run_train(&c, false);
    assert_true(fabs(c.job.stats[0].loss - la) > 1e-4);
    model_run_close(&a);
    model_run_close(&a2);
    model_run_close(&b);
    model_run_close(&c);
    for (int s = 0; s <= 1; s++) {
        snprintf(path, sizeof path, "%s/step_%d.safetensors", dir, s);
        assert_int_equal(unlink(path), 0);
    }
    rmdir(dir);
}

/* dataset_type=text: a byte-tokenised file trains, and the loss falls. */
static void test_text_dataset(void **state)
{
    (void)state;
    char path[] = "/tmp/shardsim_text_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    for (int i = 0; i < 400; i++) fprintf(f, "the quick brown fox jumps over the lazy dog %d. ", i % 7);
    fclose(f);
    char ds[300];
    snprintf(ds, sizeof ds, "dataset_path=%s", path);
    const char *extra[] = {"ici_fsdp_parallelism=2", "dataset_type=text", ds, "vocab_size=256"};
    model_run r;
    open_run(&r, extra, 4, 2, 20);
    model_run_train(&r, false);
    double first = r.job.stats[0].loss, last = r.job.stats[19].loss;
    if (!(last < 0.7 * first)) fail_msg("text loss %.4f -> %.4f did not fall", first, last);
    model_run_close(&r);
    unlink(path);
}

/* ------------------------------------------------------------ microbatches repeat */

typedef struct {
    uint64_t bytes, calls; /* all collectives of the device */
    size_t peak, at_peak_by[SIM_NMEM];
} ga_figures;

static void dry_run_ga(int ga, ga_figures *f)
{
    char word[64];
    snprintf(word, sizeof word, "gradient_accumulation_steps=%d", ga);
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "dry_run=true", word};
    model_run r;
    open_run(&r, extra, 4, 4, 1);
    model_run_train(&r, false);
    for (int d = 0; d < 4; d++) {
        /* the records as read back: a dry run's repeated microbatches expanded (sim_walk) */
        sim_walk w;
        sim_walk_device(&w, sim_machine_device(r.m, d));
        memset(&f[d], 0, sizeof f[d]);
        for (const sim_record *x; (x = sim_walk_next_record(&w));) f[d].bytes += x->bytes_sent, f[d].calls++;
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, d)), &as);
        f[d].peak = as.peak;
        memcpy(f[d].at_peak_by, as.at_peak_by, sizeof f[d].at_peak_by);
    }
    model_run_close(&r);
}

static void test_dry_run_microbatches_repeat(void **state)
{
    (void)state;
    ga_figures g2[4], g3[4], g5[4];
    dry_run_ga(2, g2);
    dry_run_ga(3, g3);
    dry_run_ga(5, g5);
    for (int d = 0; d < 4; d++) {
        assert_true(g3[d].calls > g2[d].calls);
        /* each microbatch after the second: the same calls and bytes */
        assert_int_equal(g5[d].calls - g2[d].calls, 3 * (g3[d].calls - g2[d].calls));
        assert_int_equal(g5[d].bytes - g2[d].bytes, 3 * (g3[d].bytes - g2[d].bytes));
        /* and the same peak, made of the same categories */
        assert_int_equal(g3[d].peak, g2[d].peak);
        assert_int_equal(g5[d].peak, g2[d].peak);
        assert_memory_equal(g5[d].at_peak_by, g2[d].at_peak_by, sizeof g2[d].at_peak_by);
    }
}

/* A dry run's microbatches are bounded (each one is simulated); a real run's are not. */
static void test_dry_run_microbatch_ceiling(void **state)
{
    (void)state;
    char word[64];
    snprintf(word, sizeof word, "gradient_accumulation_steps=%d", MODEL_DRY_RUN_MAX_GA + 1);
    const char *extra[] = {"dry_run=true", word};
    model_run_expect_refused(TINY, NTINY, ROWS, extra, 2, 1, "gradient_accumulation_steps", "dry_run=true");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity_five_steps),
        cmocka_unit_test(test_traffic_pure_fsdp),
        cmocka_unit_test(test_traffic_pure_data),
        cmocka_unit_test(test_dry_run_matches_real),
        cmocka_unit_test(test_loss_falls),
        cmocka_unit_test(test_constraint_mismatch),
        cmocka_unit_test(test_dry_run_microbatches_repeat),
        cmocka_unit_test(test_dry_run_microbatch_ceiling),
        cmocka_unit_test(test_checkpoint_across_meshes),
        cmocka_unit_test(test_text_dataset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

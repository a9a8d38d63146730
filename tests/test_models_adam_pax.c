/* test_models_adam_pax.c — opt_type=adam_pax (models/optimizers/adam_pax.c), MaxText 0.2.5's
 * adam_pax (maxtext/optimizers/optimizers.py):
 *   - three updates of two small parameters (one excluded from weight decay by adamw_mask, the
 *     first update clipped) against a float64 reference written here from optimizers.py: the
 *     parameters and both slots (the stored mu and nu are the bias-corrected moving averages,
 *     which tells adam_pax from optax.adamw), on 1 device and sharded over 2 (bitwise equal);
 *   - parity across meshes: a tiny Llama trained 4 steps on 1 device, fsdp=4, fsdp=2 tensor=2 (auto
 *     and explicit) and ZeRO-1 over data=4: losses, gradients and final parameters;
 *   - the train-state dump (named_shardings.json of `shardsim dump`): optax's ScaleByAdamState
 *     un-chained (.opt_state/.count, .mu/..., .nu/...), the moments sharded as the parameters. */
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

#include "cli/cli.h"
#include "config/json.h"
#include "models/optimizers/optim.h"
#include "tests/model_run.h"

static cfg_config *load_cfg(int n, const char *const *ovr)
{
    cfg_args a = {NULL, NULL, NULL, 0, ovr, n};
    cfg_config *cfg;
    if (cfg_load(&a, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    return cfg;
}

/* ------------------------------------------------------------ one update against float64 */

enum { NP = 2, STEPS_REF = 3, MAXEL = 48 };

/* eps outside the root and eps_root inside it large enough that swapping them shows */
static const char *const REF_CFG[] = {
    "opt_type=adam_pax",
    "learning_rate=0.01",
    "warmup_steps_fraction=0.0",
    "learning_rate_final_fraction=0.1",
    "steps=3",
    "adam_b1=0.9",
    "adam_b2=0.95",
    "adam_eps=1e-3",
    "adam_eps_root=1e-4",
    "adam_weight_decay=0.1",
    "gradient_clipping_threshold=1.0",
    "adamw_mask=['.*norm.*']",
};

typedef struct {
    const mesh_shape *mesh;
    const char *spec[NP];
    model_param_def defs[NP];
    model_optim_cfg o;
    model_opt_param pp[NP];
    float g[STEPS_REF][NP][MAXEL], w0[NP][MAXEL];
    double norm[STEPS_REF];
    float out[3][NP][MAXEL]; /* after the last update: w, mu, nu (global, layer-major) */
} ref_job;

static int64_t nel(const model_param_def *d)
{
    int64_t n = 1;
    for (int i = 0; i < d->rank; i++) n *= d->shape[i];
    return n;
}

static sim_status ref_device(sim_device *dev, void *arg)
{
    ref_job *j = arg;
    model_param p[NP];
    memset(p, 0, sizeof p);
    for (int i = 0; i < NP; i++) {
        p[i].def = j->defs[i];
        SIM_TRY(mesh_spec_parse(j->spec[i], j->mesh, &p[i].spec));
        p[i].n_layers = p[i].def.scan_dim >= 0 ? (int)p[i].def.shape[p[i].def.scan_dim] : 1;
        p[i].n_slots = 2;
        int rank;
        int64_t shape[MESH_SPEC_MAX_RANK];
        mesh_spec ls;
        model_param_layer_shape(&p[i], &rank, shape);
        model_param_layer_spec(&p[i], &ls);
        mesh_array **b[4] = {&p[i].w, &p[i].g, &p[i].slot[0], &p[i].slot[1]};
        for (int k = 0; k < 4; k++) {
            *b[k] = calloc((size_t)p[i].n_layers, sizeof(mesh_array));
            for (int l = 0; l < p[i].n_layers; l++)
                SIM_TRY(mesh_array_new(dev, j->mesh, p[i].def.path, rank, shape, &ls, SIM_F32,
                                       k < 2 ? SIM_MEM_PARAMS : SIM_MEM_OPTIMIZER, &(*b[k])[l]));
        }
        int64_t le = nel(&p[i].def) / p[i].n_layers;
        for (int l = 0; l < p[i].n_layers; l++) mesh_array_load_global(dev, j->mesh, &p[i].w[l], j->w0[i] + l * le);
    }
    mesh_ctx c = {.dev = dev, .mesh = j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = ""};
    for (int s = 0; s < STEPS_REF; s++) {
        for (int i = 0; i < NP; i++) {
            int64_t le = nel(&p[i].def) / p[i].n_layers;
            for (int l = 0; l < p[i].n_layers; l++)
                mesh_array_load_global(dev, j->mesh, &p[i].g[l], j->g[s][i] + l * le);
        }
        SIM_TRY(model_opt_update(&c, &j->o, j->pp, p, NP, s, j->norm[s]));
    }
    for (int i = 0; i < NP; i++) {
        int64_t le = nel(&p[i].def) / p[i].n_layers;
        mesh_array *b[4] = {p[i].w, p[i].slot[0], p[i].slot[1], p[i].g};
        for (int k = 0; k < 4; k++) {
            for (int l = 0; l < p[i].n_layers; l++) {
                if (k < 3) SIM_TRY(mesh_array_store_global(dev, j->mesh, &b[k][l], j->out[k][i] + l * le));
                mesh_array_free(dev, &b[k][l]);
            }
            free(b[k]);
        }
    }
    return SIM_OK;
}

static void run_ref_job(ref_job *j, int n_axes, const char *const *names, const int *sizes)
{
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, n_axes, names, sizes), SIM_OK);
    sim_mesh_desc md;
    assert_int_equal(mesh_shape_to_sim(&m, &md), SIM_OK);
    sim_machine *mach;
    sim_machine_opts mo = {0};
    assert_int_equal(sim_machine_new(&md, &mo, &mach), SIM_OK);
    j->mesh = &m;
    if (sim_machine_run(mach, ref_device, j) != SIM_OK) fail_msg("%s", sim_errmsg());
    sim_machine_free(mach);
    j->mesh = NULL;
}

/* optimizers.py adam_pax, written out in float64 for every element */
static double decay_at(double beta, int s) { return beta * (1.0 - pow(beta, s)) / (1.0 - pow(beta, s + 1)); }

static void test_update_reference(void **state)
{
    (void)state;
    cfg_config *cfg = load_cfg((int)(sizeof REF_CFG / sizeof *REF_CFG), REF_CFG);
    ref_job *j = calloc(1, sizeof *j);
    if (model_optim_from_config(cfg, &j->o) != SIM_OK) fail_msg("optim: %s", sim_errmsg());
    assert_ptr_equal(j->o.row, model_optimizer_find("adam_pax"));
    /* a scanned kernel [6, 2, 4] (2 layers at dim 1) and a norm scale [8] */
    model_param_def k = {.path = "params.decoder.layers.mlp.wi_0.kernel", .rank = 3, .shape = {6, 2, 4}, .scan_dim = 1};
    model_param_def nrm = {.path = "params.decoder.decoder_norm.scale", .rank = 1, .shape = {8}, .scan_dim = -1};
    j->defs[0] = k, j->defs[1] = nrm;
    const model_optimizer *row;
    if (model_opt_define(cfg, j->defs, NP, &row, j->pp) != SIM_OK) fail_msg("define: %s", sim_errmsg());
    cfg_free(cfg);
    assert_ptr_equal(row, j->o.row);
    assert_int_equal(j->pp[0].n_slots, 2);
    assert_true(j->pp[0].decay);  /* "decoder/layers/mlp/wi_0/kernel" matches no pattern */
    assert_false(j->pp[1].decay); /* "decoder/decoder_norm/scale" matches '.*norm.*' */
    assert_string_equal(row->slot[0], "mu");
    assert_string_equal(row->slot[1], "nu");
    /* values: a fixed LCG; the second and third gradients are small, so only the first is clipped */
    uint32_t r = 7;
    for (int i = 0; i < NP; i++)
        for (int64_t e = 0; e < nel(&j->defs[i]); e++) {
            r = r * 1664525u + 1013904223u;
            j->w0[i][e] = (float)((int)(r >> 9) % 2001 - 1000) / 1000.0f;
            for (int s = 0; s < STEPS_REF; s++) {
                r = r * 1664525u + 1013904223u;
                j->g[s][i][e] = (float)((int)(r >> 9) % 2001 - 1000) / (s ? 20000.0f : 500.0f);
            }
        }
    for (int s = 0; s < STEPS_REF; s++) {
        double sum = 0;
        for (int i = 0; i < NP; i++)
            for (int64_t e = 0; e < nel(&j->defs[i]); e++) sum += (double)j->g[s][i][e] * j->g[s][i][e];
        j->norm[s] = sqrt(sum);
    }
    assert_true(j->norm[0] > 1.0 && j->norm[1] < 1.0 && j->norm[2] < 1.0);

    /* the reference: lr(s) of the cosine schedule with no warmup over S = 3 steps (p = s / 2) */
    double w[NP][MAXEL], mu[NP][MAXEL] = {{0}}, nu[NP][MAXEL] = {{0}};
    for (int i = 0; i < NP; i++)
        for (int64_t e = 0; e < nel(&j->defs[i]); e++) w[i][e] = j->w0[i][e];
    for (int s = 0; s < STEPS_REF; s++) {
        double lr = 0.001 + (0.01 - 0.001) * 0.5 * (1.0 + cos(M_PI * s / 2.0));
        double scale = j->norm[s] >= 1.0 ? 1.0 / j->norm[s] : 1.0, d1 = decay_at(0.9, s), d2 = decay_at(0.95, s);
        for (int i = 0; i < NP; i++)
            for (int64_t e = 0; e < nel(&j->defs[i]); e++) {
                double g = j->g[s][i][e] * scale;
                mu[i][e] = (1 - d1) * g + d1 * mu[i][e];
                nu[i][e] = (1 - d2) * g * g + d2 * nu[i][e];
                double u = mu[i][e] / (sqrt(nu[i][e] + 1e-4) + 1e-3);
                if (i == 0) u += 0.1 * w[i][e]; /* the norm scale is masked out */
                w[i][e] -= lr * u;
            }
    }
    /* on one device, then each parameter split over 2 */
    static const char *const names[] = {"fsdp"};
    const int one[] = {1}, two[] = {2};
    float first[3][NP][MAXEL];
    for (int mi = 0; mi < 2; mi++) {
        j->spec[0] = mi ? "P('fsdp', None, None)" : "P()";
        j->spec[1] = mi ? "P('fsdp')" : "P()";
        memset(j->out, 0, sizeof j->out);
        run_ref_job(j, 1, names, mi ? two : one);
        if (mi) {
            assert_memory_equal(j->out, first, sizeof first); /* elementwise: the same bits on any mesh */
            continue;
        }
        memcpy(first, j->out, sizeof first);
        /* the values are given and read back layer-major (as a device stores a scanned parameter): the
         * update is elementwise, so element e of the reference is element e there */
        for (int i = 0; i < NP; i++) {
            double big[3] = {0, 0, 0}; /* float32 rounding, relative to the slot's largest value */
            for (int64_t e = 0; e < nel(&j->defs[i]); e++) {
                big[1] = fmax(big[1], fabs(mu[i][e]));
                big[2] = fmax(big[2], fabs(nu[i][e]));
            }
            for (int64_t e = 0; e < nel(&j->defs[i]); e++) {
                const double want[3] = {w[i][e], mu[i][e], nu[i][e]};
                for (int x = 0; x < 3; x++) {
                    double got = j->out[x][i][e], tol = x == 0 ? 2e-7 : 1e-6 * fabs(want[x]) + 1e-6 * big[x];
                    if (!(fabs(got - want[x]) <= tol))
                        fail_msg("%s element %lld: %s %.9g, float64 reference %.9g", j->defs[i].path, (long long)e,
                                 x == 0   ? "parameter"
                                 : x == 1 ? "mu"
                                          : "nu",
                                 got, want[x]);
                }
            }
        }
    }
    free(j);
}

/* ------------------------------------------------------------ parity across meshes */

static const char *const TINY[] = {
    "base_emb_dim=16",     "base_num_query_heads=4",    "base_num_kv_heads=2",
    "head_dim=8",          "base_mlp_dim=24",           "base_num_decoder_layers=2",
    "vocab_size=64",       "max_target_length=16",      "init_weights_seed=3",
    "learning_rate=1e-2",  "warmup_steps_fraction=0.0", "opt_type=adam_pax",
    "adamw_mask=['norm']", "adam_weight_decay=0.1",
};
enum { ROWS = 8, STEPS = 4 };

static void open_train(model_run *r, const char *const *extra, int n, int devices)
{
    model_run_open(r, TINY, (int)(sizeof TINY / sizeof *TINY), ROWS, extra, n, devices, STEPS);
    assert_int_equal(r->job.opt.type, MODEL_OPT_ADAM_PAX);
    r->job.final_params = calloc(1, sizeof *r->job.final_params);
    model_run_train(r, true);
}

static void close_train(model_run *r)
{
    model_grads_free(r->job.final_params);
    free(r->job.final_params);
    r->job.final_params = NULL;
    model_run_close(r);
}

static void test_parity(void **state)
{
    (void)state;
    model_run ref;
    const char *none[] = {"ici_fsdp_parallelism=1"};
    open_train(&ref, none, 1, 1);
    /* the loss moves, and the decay mask matters: the norm scales are left out of the decay */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.02);
    static const struct {
        const char *label, *flags[4];
        int devices;
    } cases[] = {
        {"fsdp=4", {"ici_fsdp_parallelism=4"}, 4},
        {"fsdp=2 tensor=2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 4},
        {"data=4 ZeRO-1", {"ici_data_parallelism=4", "ici_fsdp_parallelism=1", "shard_optimizer_over_data=true"}, 4},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int mode = 0; mode < 2; mode++) {
            const char *extra[6];
            int k = 0;
            for (int f = 0; f < 4 && cases[c].flags[f]; f++) extra[k++] = cases[c].flags[f];
            extra[k++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            char what[128];
            snprintf(what, sizeof what, "%s %s", cases[c].label, extra[k - 1]);
            model_run r;
            open_train(&r, extra, k, cases[c].devices);
            model_run_compare(what, &r, &ref, STEPS);
            const model_grads *a = r.job.final_params, *b = ref.job.final_params;
            for (int i = 0; i < r.def->nparams; i++) {
                double e = model_rel_norm_diff(a->g[i], b->g[i], a->layer_elems[i] * a->n_layers[i]);
                if (!(e <= 1e-5)) fail_msg("%s: final %s differs by %.3g", what, r.def->defs[i].path, e);
            }
            close_train(&r);
        }
    close_train(&ref);
}

/* ------------------------------------------------------------ the train-state dump */

/* "params.decoder.norm.scale" -> "/['decoder']/['norm']/['scale']" */
static void rel_key(const char *path, char *buf, size_t cap)
{
    size_t n = 0;
    for (const char *s = path + strlen("params."); *s && n + 8 < cap;) {
        size_t len = strcspn(s, ".");
        n += (size_t)snprintf(buf + n, cap - n, "/['%.*s']", (int)len, s);
        s += len + (s[len] == '.');
    }
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static void test_dump_tree(void **state)
{
    (void)state;
    char tmpl[] = "/tmp/shardsim_adam_pax_XXXXXX", outdir[128], file[256];
    char *tmp = mkdtemp(tmpl);
    assert_non_null(tmp);
    snprintf(outdir, sizeof outdir, "output_dir=%s", tmp);
    char *argv[24];
    int argc = 0;
    for (size_t i = 0; i < sizeof TINY / sizeof *TINY; i++) argv[argc++] = (char *)TINY[i];
    argv[argc++] = "ici_fsdp_parallelism=4";
    argv[argc++] = outdir;
    FILE *devnull = fopen("/dev/null", "w");
    int rc = cli_dump(argc, argv, devnull, stderr);
    fclose(devnull);
    assert_int_equal(rc, 0);
    snprintf(file, sizeof file, "%s/named_shardings.json", tmp);
    cfg_json *root;
    if (cfg_json_read_file(file, &root) != SIM_OK) fail_msg("%s", sim_errmsg());
    for (const char *f = "named_shardings.json logical_shardings.json input_shardings.json shardings.json"; *f;) {
        size_t len = strcspn(f, " ");
        snprintf(file, sizeof file, "%s/%.*s", tmp, (int)len, f);
        unlink(file);
        f += len + (f[len] == ' ');
    }
    rmdir(tmp);

    /* the expected keys, from the parameter paths: .step, the parameters, then optax's
     * ScaleByAdamState(count, mu, nu) as a NamedTuple flattens (fields in order, no chain index) */
    cfg_config *cfg;
    model_def *def = model_run_load(TINY, (int)(sizeof TINY / sizeof *TINY), ROWS,
                                    (const char *[]){"ici_fsdp_parallelism=4"}, 1, 4, 1, &cfg);
    int n = def->nparams;
    char **rel = calloc((size_t)n, sizeof *rel);
    for (int i = 0; i < n; i++) {
        rel[i] = calloc(512, 1);
        rel_key(def->defs[i].path, rel[i], 512);
    }
    /* JAX sorts dict keys: component by component ("/['" sorts the same way for these names) */
    qsort(rel, (size_t)n, sizeof *rel, cmp_str);
    int nk = 0;
    char(*want)[600] = calloc((size_t)(3 * n + 2), sizeof *want);
    snprintf(want[nk++], 600, ".step");
    for (int i = 0; i < n; i++) snprintf(want[nk++], 600, ".params/['params']%s", rel[i]);
    snprintf(want[nk++], 600, ".opt_state/.count");
    for (int i = 0; i < n; i++) snprintf(want[nk++], 600, ".opt_state/.mu/['params']%s", rel[i]);
    for (int i = 0; i < n; i++) snprintf(want[nk++], 600, ".opt_state/.nu/['params']%s", rel[i]);
    assert_int_equal(root->kind, CFG_JSON_OBJECT);
    if (root->n != nk) fail_msg("named_shardings.json has %d leaves, optax's tree %d", root->n, nk);
    for (int i = 0; i < nk; i++) {
        if (strcmp(root->keys[i], want[i])) fail_msg("leaf %d: '%s', expected '%s'", i, root->keys[i], want[i]);
        /* a moment is sharded as its parameter (no ZeRO-1 here) */
        if (!strncmp(want[i], ".opt_state/.mu", 14) || !strncmp(want[i], ".opt_state/.nu", 14)) {
            char pk[600];
            snprintf(pk, sizeof pk, ".params/['params']%s", want[i] + strlen(".opt_state/.mu/['params']"));
            const cfg_json *a = cfg_json_get(cfg_json_get(root, want[i]), "partition_spec"),
                           *b = cfg_json_get(cfg_json_get(root, pk), "partition_spec");
            assert_non_null(a);
            assert_non_null(b);
            if (!cfg_json_equal(a, b)) fail_msg("%s: partition_spec differs from its parameter's", want[i]);
        }
    }
    for (int i = 0; i < n; i++) free(rel[i]);
    free(rel);
    free(want);
    cfg_json_free(root);
    model_run_unload(def);
    cfg_free(cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_update_reference),
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_dump_tree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

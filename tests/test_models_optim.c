/* test_models_optim.c — schedule, AdamW and the global gradient norm.
 *
 * The schedule is checked against closed forms written here from MaxText's
 * description; one AdamW step (with and without clipping) against a scalar
 * double-precision reference and, bitwise, against the 1-device result; the
 * global norm on 1-D/2-D meshes (and a 'stage'-split scanned parameter)
 * against the norm of the global gradient, bitwise equal on every device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/optimizers/adamw.h"
#include "models/optimizers/optim.h"
#include "sim/collectives.h"
#include "tests/helpers.h"

static cfg_config *load_cfg(int n, const char *const *ovr)
{
    cfg_args a = {NULL, NULL, NULL, 0, ovr, n};
    cfg_config *cfg;
    if (cfg_load(&a, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    return cfg;
}

static model_optim_cfg optim_cfg(int n, const char *const *ovr)
{
    cfg_config *cfg = load_cfg(n, ovr);
    model_optim_cfg o;
    if (model_optim_from_config(cfg, &o) != SIM_OK) fail_msg("optim: %s", sim_errmsg());
    cfg_free(cfg);
    return o;
}

static void assert_close(double got, double want, double rtol)
{
    if (!(fabs(got - want) <= rtol * fabs(want) + 1e-300)) fail_msg("got %.17g, expected %.17g", got, want);
}

/* ------------------------------------------------------------ schedule */

static void test_base_keys(void **state)
{
    (void)state;
    /* every key comes from configs/base.yml: nothing falls back to a compiled-in default */
    model_optim_cfg o = optim_cfg(0, NULL);
    assert_int_equal(o.type, MODEL_OPT_ADAMW);
    assert_close(o.lr, 3e-5, 0);
    assert_close(o.b1, 0.9, 0);
    assert_close(o.b2, 0.95, 0);
    assert_close(o.eps, 1e-8, 0);
    assert_true(o.eps_root == 0.0);
    assert_close(o.weight_decay, 0.1, 0);
    assert_close(o.clip, 1.0, 0);
    assert_close(o.warmup_fraction, 0.1, 0);
    assert_close(o.final_fraction, 0.1, 0);
    assert_int_equal(o.schedule_steps, o.steps); /* -1 resolved */
    /* refused when the config is loaded (configs/ranges.yml), naming key, value and range */
    const char *bad[] = {"learning_rate_schedule_steps=0"};
    cfg_args a = {NULL, NULL, NULL, 0, bad, 1};
    cfg_config *cfg = NULL;
    assert_int_equal(cfg_load(&a, &cfg), SIM_ERR_INPUT);
    assert_null(cfg);
    assert_non_null(strstr(sim_errmsg(), "learning_rate_schedule_steps=0"));
    assert_non_null(strstr(sim_errmsg(), "1 <= learning_rate_schedule_steps"));
}

static void test_schedule(void **state)
{
    (void)state;
    const double pi = 3.14159265358979323846;
    /* steps 100, S = 100: W = 10 warmup steps lr*s/9, then cosine over C = 90 steps
     * from lr at s = 10 to lr/10 at s = 99: lr/10 + 0.9 lr (1 + cos(pi (s-10)/89)) / 2 */
    const char *o1[] = {"learning_rate=1e-3", "steps=100"};
    model_optim_cfg o = optim_cfg(2, o1);
    const double lr = 1e-3, fin = 1e-4;
    for (int s = 0; s < 10; s++) assert_close(model_lr_at(&o, s), lr * s / 9.0, 1e-12);
    assert_true(model_lr_at(&o, 0) == 0.0);
    assert_close(model_lr_at(&o, 9), lr, 1e-12);
    for (int s = 10; s < 100; s++)
        assert_close(model_lr_at(&o, s), fin + (lr - fin) * 0.5 * (1 + cos(pi * (s - 10) / 89.0)), 1e-12);
    assert_close(model_lr_at(&o, 10), lr, 1e-12);
    assert_close(model_lr_at(&o, 99), fin, 1e-12);
    assert_close(model_lr_at(&o, 55), fin + (lr - fin) * 0.5 * (1 + cos(pi * 45 / 89.0)), 1e-12);

    /* S = 50 < steps = 80: W = 5, cosine over 45 steps, then 0 from s = 50 */
    const char *o2[] = {"learning_rate=2e-3", "steps=80", "learning_rate_schedule_steps=50",
                        "learning_rate_final_fraction=0.25"};
    o = optim_cfg(4, o2);
    assert_close(model_lr_at(&o, 2), 2e-3 * 2 / 4.0, 1e-12);
    assert_close(model_lr_at(&o, 5), 2e-3, 1e-12);
    assert_close(model_lr_at(&o, 49), 5e-4, 1e-12);
    assert_close(model_lr_at(&o, 27), 5e-4 + 1.5e-3 * 0.5 * (1 + cos(pi * 22 / 44.0)), 1e-12);
    for (int s = 50; s < 80; s++) assert_true(model_lr_at(&o, s) == 0.0);

    /* the base's steps = 10, fraction 0.1: W = 1 -> the first update has lr 0, then the cosine from lr */
    const char *o3[] = {"learning_rate=1e-2"};
    o = optim_cfg(1, o3);
    assert_true(model_lr_at(&o, 0) == 0.0);
    assert_close(model_lr_at(&o, 1), 1e-2, 1e-12);
    assert_close(model_lr_at(&o, 9), 1e-3, 1e-12);
    assert_close(model_lr_at(&o, 5), 1e-3 + 9e-3 * 0.5 * (1 + cos(pi * 4 / 8.0)), 1e-12);

    /* no warmup: the cosine starts at s = 0 */
    const char *o4[] = {"learning_rate=1e-2", "warmup_steps_fraction=0", "steps=21"};
    o = optim_cfg(3, o4);
    assert_close(model_lr_at(&o, 0), 1e-2, 1e-12);
    assert_close(model_lr_at(&o, 10), 1e-3 + 9e-3 * 0.5, 1e-12);
    assert_close(model_lr_at(&o, 20), 1e-3, 1e-12);

    /* clipping factor, and the norm after clipping (MaxText's learning/grad_norm): the threshold 1.0
     * to float32 rounding when clipping acts (3.3 is no float32), the raw norm when it does not */
    assert_close(model_clip_factor(&o, 4.0), 0.25, 1e-15);
    assert_true(model_clip_factor(&o, 0.5) == 1.0);
    assert_close(model_clipped_norm(&o, 3.3), 1.0, 1e-7);
    assert_true(model_clipped_norm(&o, 4.0) == 1.0);
    assert_true(model_clipped_norm(&o, 1.0) == 1.0); /* at the threshold clipping acts, as optax's g_norm < max_norm */
    assert_true(model_clip_applies(&o, 1.0) && !model_clip_applies(&o, 0.5));
    assert_true(model_clipped_norm(&o, 0.5) == 0.5);
    o.clip = 0;
    assert_true(model_clip_factor(&o, 100.0) == 1.0);
    assert_true(model_clipped_norm(&o, 100.0) == 100.0 && !model_clip_applies(&o, 100.0));
}

/* ------------------------------------------------------------ arrays on a mesh */

typedef struct {
    model_param p;        /* def + stacked spec (storage filled per device) */
    const float *gw, *gg; /* global stacked-as-layers values: (n_layers, per-layer elements) */
    int64_t nel;          /* elements per layer */
} tparam;

/* Allocates w, g, m, v of every layer on this device, loaded from the globals (m, v zero). */
static sim_status build(sim_device *d, const mesh_shape *m, const tparam *t, model_param *out, mesh_array *store)
{
    *out = t->p;
    int L = t->p.n_layers, rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    mesh_spec spec;
    model_param_layer_shape(&t->p, &rank, shape);
    model_param_layer_spec(&t->p, &spec);
    out->w = store;
    out->g = store + L;
    out->n_slots = 2;
    out->slot_name[0] = "mu", out->slot_name[1] = "nu";
    out->slot[0] = store + 2 * L;
    out->slot[1] = store + 3 * L;
    for (int l = 0; l < L; l++) {
        SIM_TRY(mesh_array_new(d, m, t->p.def.path, rank, shape, &spec, SIM_F32, SIM_MEM_PARAMS, &out->w[l]));
        SIM_TRY(mesh_array_new(d, m, t->p.def.path, rank, shape, &spec, SIM_F32, SIM_MEM_GRADS, &out->g[l]));
        SIM_TRY(mesh_array_new(d, m, t->p.def.path, rank, shape, &spec, SIM_F32, SIM_MEM_OPTIMIZER, &out->slot[0][l]));
        SIM_TRY(mesh_array_new(d, m, t->p.def.path, rank, shape, &spec, SIM_F32, SIM_MEM_OPTIMIZER, &out->slot[1][l]));
        mesh_array_load_global(d, m, &out->w[l], t->gw + l * t->nel);
        mesh_array_load_global(d, m, &out->g[l], t->gg + l * t->nel);
    }
    return SIM_OK;
}

static void release(sim_device *d, model_param *p)
{
    for (int l = 0; l < p->n_layers; l++) {
        mesh_array_free(d, &p->w[l]);
        mesh_array_free(d, &p->g[l]);
        mesh_array_free(d, &p->slot[0][l]);
        mesh_array_free(d, &p->slot[1][l]);
    }
}

static tparam make_tparam(const mesh_shape *m, const char *path, int rank, const int64_t *shape, int scan_dim,
                          const char *spec, uint32_t seed)
{
    tparam t;
    memset(&t, 0, sizeof t);
    snprintf(t.p.def.path, sizeof t.p.def.path, "%s", path);
    t.p.def.rank = rank;
    memcpy(t.p.def.shape, shape, (size_t)rank * sizeof *shape);
    t.p.def.scan_dim = scan_dim;
    t.p.n_layers = scan_dim >= 0 ? (int)shape[scan_dim] : 1;
    if (mesh_spec_parse(spec, m, &t.p.spec) != SIM_OK) fail_msg("%s", sim_errmsg());
    int64_t tot = 1;
    for (int i = 0; i < rank; i++) tot *= shape[i];
    t.nel = tot / t.p.n_layers;
    float *w = malloc((size_t)tot * sizeof *w), *g = malloc((size_t)tot * sizeof *g);
    uint32_t s = seed;
    for (int64_t i = 0; i < tot; i++) {
        s = s * 1664525u + 1013904223u;
        w[i] = (float)((int)(s >> 9) % 2001 - 1000) / 1000.0f;
        s = s * 1664525u + 1013904223u;
        g[i] = (float)((int)(s >> 9) % 2001 - 1000) / 500.0f;
    }
    t.gw = w;
    t.gg = g;
    return t;
}

enum { MAXP = 4 };

typedef struct {
    const mesh_shape *m;
    tparam *tp;
    int np;
    model_optim_cfg o;
    int poison_unowned; /* fill non-owned layers' gradients with junk */
    double norm[SIM_MAX_DEVICES];
    size_t n_records[SIM_MAX_DEVICES];
    float *out_w[MAXP]; /* global params after the updates */
    int updates;
} run_case;

static sim_status run_device(sim_device *d, void *arg)
{
    run_case *c = arg;
    model_param p[MAXP];
    mesh_array store[MAXP][4 * 8];
    for (int i = 0; i < c->np; i++) {
        SIM_TRY(build(d, c->m, &c->tp[i], &p[i], store[i]));
        if (c->poison_unowned)
            for (int l = 0; l < p[i].n_layers; l++) {
                bool mine;
                SIM_TRY(model_layer_primary(c->m, &p[i], &p[i].g[l], l, sim_device_id(d), &mine));
                /* a device that holds a replica but not the primary keeps the true values; one that
                 * does not hold the layer at all (stage split) gets junk that must not count */
                int held = 1;
                if (p[i].def.scan_dim >= 0 && p[i].spec.n_axes[p[i].def.scan_dim] > 0) {
                    int ax = p[i].spec.axes[p[i].def.scan_dim][0];
                    held = l / (p[i].n_layers / c->m->sizes[ax]) == sim_device_coord(d, ax);
                }
                if (!held) {
                    float *x = p[i].g[l].data;
                    for (size_t k = 0; k < p[i].g[l].nlocal; k++) x[k] = 1000.0f;
                }
            }
    }
    sim_device_clear_records(d);
    double norm;
    SIM_TRY(model_grad_global_norm(d, c->m, p, c->np, &norm));
    c->norm[sim_device_id(d)] = norm;
    size_t nr;
    const sim_record *r = sim_device_records(d, &nr);
    c->n_records[sim_device_id(d)] = nr;
    if (nr != 1 || r[0].op != SIM_OP_ALL_REDUCE || r[0].elements != 1 || r[0].group_size != c->m->num_devices)
        return sim_err(SIM_ERR_CHECK, "the norm should take one all-reduce of 1 float over the whole mesh");
    for (int s = 0; s < c->updates; s++) SIM_TRY(model_adamw_update(d, &c->o, p, c->np, s, norm));
    for (int i = 0; i < c->np; i++) {
        for (int l = 0; l < p[i].n_layers && c->out_w[i]; l++)
            SIM_TRY(mesh_array_store_global(d, c->m, &p[i].w[l], c->out_w[i] + l * c->tp[i].nel));
        release(d, &p[i]);
    }
    return SIM_OK;
}

static double global_norm_ref(const tparam *tp, int np)
{
    double s = 0;
    for (int i = 0; i < np; i++)
        for (int64_t k = 0; k < tp[i].nel * tp[i].p.n_layers; k++) s += (double)tp[i].gg[k] * tp[i].gg[k];
    return sqrt(s);
}

static void run_on(const mesh_shape *m, run_case *c)
{
    sim_machine *mach = helper_machine(m, false);
    c->m = m;
    if (sim_machine_run(mach, run_device, c) != SIM_OK) fail_msg("%s", sim_errmsg());
    sim_machine_free(mach);
}

static void free_tparams(tparam *tp, int n)
{
    for (int i = 0; i < n; i++) {
        free((void *)tp[i].gw);
        free((void *)tp[i].gg);
    }
}

/* ------------------------------------------------------------ global norm */

static void test_global_norm(void **state)
{
    (void)state;
    static const char *names[] = {"data", "fsdp"};
    const int s1[] = {4}, s2[] = {2, 3};
    mesh_shape meshes[2] = {helper_mesh(1, names, s1), helper_mesh(2, names, s2)};
    const char *specs[2][3] = {
        {"P()", "P('data', None)", "P(None, None, 'data')"},
        {"P()", "P(('data', 'fsdp'), None)", "P('fsdp', None, 'data')"},
    };
    for (int mi = 0; mi < 2; mi++) {
        const mesh_shape *m = &meshes[mi];
        const int64_t emb[] = {12};
        const int64_t mat[] = {24, 6};
        const int64_t stk[] = {6, 2, 12}; /* scanned: 2 layers at dim 1 */
        tparam tp[3] = {
            make_tparam(m, "params.decoder.decoder_norm.scale", 1, emb, -1, specs[mi][0], 1),
            make_tparam(m, "params.token_embedder.embedding", 2, mat, -1, specs[mi][1], 2),
            make_tparam(m, "params.decoder.layers.mlp.wo.kernel", 3, stk, 1, specs[mi][2], 3),
        };
        run_case *c = calloc(1, sizeof *c);
        c->tp = tp;
        c->np = 3;
        run_on(m, c);
        double want = global_norm_ref(tp, 3);
        for (int dv = 0; dv < m->num_devices; dv++) {
            assert_true(memcmp(&c->norm[dv], &c->norm[0], sizeof(double)) == 0); /* bitwise on all devices */
            assert_close(c->norm[dv], want, 2e-7);                               /* float32 reduction */
        }
        free(c);
        free_tparams(tp, 3);
    }

    /* layers split over 'stage': a device holds its stage's layers only; junk elsewhere must not count */
    static const char *pn[] = {"stage", "fsdp"};
    const int ps[] = {2, 2};
    mesh_shape pm = helper_mesh(2, pn, ps);
    const int64_t stk[] = {8, 4, 6};
    tparam tp = make_tparam(&pm, "params.decoder.layers.mlp.wi_0.kernel", 3, stk, 1, "P('fsdp', 'stage', None)", 9);
    run_case *c = calloc(1, sizeof *c);
    c->tp = &tp;
    c->np = 1;
    c->poison_unowned = 1;
    run_on(&pm, c);
    for (int dv = 0; dv < 4; dv++) assert_close(c->norm[dv], global_norm_ref(&tp, 1), 2e-7);
    free(c);
    free_tparams(&tp, 1);
}

/* ------------------------------------------------------------ AdamW */

/* Two AdamW updates of one element in double, optax's formulas. */
static double adamw_ref(const model_optim_cfg *o, double p, double g, double clipf, int updates)
{
    double mu = 0, nu = 0;
    for (int s = 0; s < updates; s++) {
        double gi = g * clipf;
        mu = (1 - o->b1) * gi + o->b1 * mu;
        nu = (1 - o->b2) * gi * gi + o->b2 * nu;
        double mh = mu / (1 - pow(o->b1, s + 1)), vh = nu / (1 - pow(o->b2, s + 1));
        double u = mh / (sqrt(vh + o->eps_root) + o->eps) + o->weight_decay * p;
        p -= model_lr_at(o, s) * u;
    }
    return p;
}

static void test_adamw(void **state)
{
    (void)state;
    static const char *names[] = {"data", "fsdp"};
    const int s1[] = {1}, s2[] = {2, 2};
    mesh_shape one = helper_mesh(1, names, s1), two = helper_mesh(2, names, s2);
    const int64_t mat[] = {8, 6};
    for (int clip = 0; clip < 2; clip++) {
        /* clip threshold 1e9 never triggers; 1.0 always does (the norm is ~ 30) */
        const char *ov[] = {"learning_rate=1e-1", "steps=20", "warmup_steps_fraction=0.1", "adam_eps_root=1e-10",
                            clip ? "gradient_clipping_threshold=1.0" : "gradient_clipping_threshold=1e9"};
        model_optim_cfg o = optim_cfg(5, ov);
        float *res[2];
        for (int k = 0; k < 2; k++) {
            const mesh_shape *m = k ? &two : &one;
            tparam tp =
                make_tparam(m, "params.decoder.logits_dense.kernel", 2, mat, -1, k ? "P('fsdp', 'data')" : "P()", 5);
            run_case *c = calloc(1, sizeof *c);
            c->tp = &tp;
            c->np = 1;
            c->o = o;
            c->updates = 3;
            res[k] = c->out_w[0] = calloc(48, sizeof(float));
            run_on(m, c);
            double norm = c->norm[0];
            double clipf = clip ? 1.0 / norm : 1.0;
            if (clip) assert_true(norm > 1.0);
            for (int i = 0; i < 48; i++) {
                double want = adamw_ref(&o, tp.gw[i], tp.gg[i], clipf, 3);
                /* compare the change: float32 arithmetic vs double is a few ulps of it, plus the
                 * rounding of p itself (~6e-8 for |p| <= 1) */
                double dgot = (double)res[k][i] - tp.gw[i], dwant = want - tp.gw[i];
                if (fabs(dgot - dwant) > 1e-5 * fabs(dwant) + 2e-7)
                    fail_msg("clip %d mesh %d element %d: %.9g vs reference %.9g", clip, k, i, res[k][i], want);
                assert_true(res[k][i] != tp.gw[i]); /* it moved (lr(0) = 0, lr(1), lr(2) > 0) */
            }
            free(c);
            free_tparams(&tp, 1);
        }
        /* mesh-independent: bitwise without clipping; with it the norm's float32 reduction
         * order differs between meshes (~1e-7 relative), and so may the last bit */
        if (!clip) assert_memory_equal(res[0], res[1], 48 * sizeof(float));
        else
            for (int i = 0; i < 48; i++) assert_close(res[1][i], res[0][i], 1e-6);
        free(res[0]);
        free(res[1]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_base_keys),
        cmocka_unit_test(test_schedule),
        cmocka_unit_test(test_global_norm),
        cmocka_unit_test(test_adamw),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

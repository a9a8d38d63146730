/* test_models_init.c — mesh-independent init.
 *
 * Shards filled on 1-D, 2-D and 3-D meshes under several specs must equal,
 * element for element, the matching block of the 1-device global fill, on
 * every replica.  Statistics of 2^20 samples are checked against bounds of
 * 5 standard errors (derivations beside each check).  Different names and
 * seeds give different tensors; scanned layers use "P/layer_l". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/init.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ shards vs global */

typedef struct {
    const mesh_shape *m;
    int rank;
    int64_t shape[3];
    mesh_spec spec;
    model_init_kind kind;
    const float *global;
    int64_t bad[SIM_MAX_DEVICES]; /* mismatching elements per device */
} shard_case;

static sim_status shard_device(sim_device *d, void *arg)
{
    shard_case *c = arg;
    mesh_array a;
    SIM_TRY(mesh_array_new(d, c->m, "t", c->rank, c->shape, &c->spec, SIM_F32, SIM_MEM_PARAMS, &a));
    SIM_TRY(model_init_fill(d, c->m, &a, "decoder.layers.mlp.wi_0.kernel", c->kind, 0.02, 7));
    /* the expected block, cut from the global tensor */
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a.spec, c->m, a.shape, sim_device_id(d), sh);
    int64_t start[MESH_SPEC_MAX_RANK];
    for (int i = 0; i < a.rank; i++) start[i] = sh[i].offset;
    float *want = malloc(a.nlocal * sizeof *want);
    mesh_copy_block(want, c->global, a.rank, a.shape, a.local, start, sizeof(float));
    const float *x = a.data;
    for (size_t i = 0; i < a.nlocal; i++)
        if (memcmp(&x[i], &want[i], sizeof *x) != 0) c->bad[sim_device_id(d)]++;
    free(want);
    mesh_array_free(d, &a);
    return SIM_OK;
}

static void test_shards_reassemble(void **state)
{
    (void)state;
    static const char *names[] = {"data", "fsdp", "tensor"};
    struct {
        int n;
        int sizes[3];
        const char *specs[6];
    } meshes[] = {
        {1, {4, 0, 0}, {"P()", "P('data')", "P(None, 'data')", "P(None, None, 'data')", NULL}},
        {1, {3, 0, 0}, {"P('data')", "P(None, 'data')", "P(None, None, 'data')", NULL}},
        {2,
         {2, 3, 0},
         {"P('data', 'fsdp')", "P(('fsdp', 'data'))", "P(None, ('data', 'fsdp'))", "P('fsdp', None, 'data')",
          "P(None, 'fsdp')", NULL}},
        {3,
         {2, 2, 2},
         {"P(('data', 'fsdp'), 'tensor')", "P('tensor', None, ('fsdp', 'data'))", "P(None, 'fsdp')",
          "P('fsdp', 'tensor', 'data')", "P(None, None, ('tensor', 'data', 'fsdp'))", NULL}},
    };
    const int64_t shape[3] = {12, 12, 24}; /* 3456 elements */
    float *global = malloc(3456 * sizeof *global);
    int checked = 0;
    for (int k = 0; k < 4; k++) {
        model_init_kind kind = k == 0   ? MODEL_INIT_NORMAL
                               : k == 1 ? MODEL_INIT_TRUNC_NORMAL
                               : k == 2 ? MODEL_INIT_ONES
                                        : MODEL_INIT_ZEROS;
        model_init_global(global, 3456, "decoder.layers.mlp.wi_0.kernel", kind, 0.02, 7);
        for (size_t mi = 0; mi < sizeof meshes / sizeof meshes[0]; mi++) {
            mesh_shape m = helper_mesh(meshes[mi].n, names, meshes[mi].sizes);
            sim_machine *mach = helper_machine(&m, false);
            for (int s = 0; meshes[mi].specs[s]; s++) {
                shard_case *c = calloc(1, sizeof *c);
                c->m = &m;
                c->rank = 3;
                memcpy(c->shape, shape, sizeof shape);
                c->kind = kind;
                c->global = global;
                if (mesh_spec_parse(meshes[mi].specs[s], &m, &c->spec) != SIM_OK) fail_msg("%s", sim_errmsg());
                if (sim_machine_run(mach, shard_device, c) != SIM_OK) fail_msg("%s", sim_errmsg());
                for (int dv = 0; dv < m.num_devices; dv++)
                    if (c->bad[dv])
                        fail_msg("kind %d mesh %zu spec %s: device %d has %lld wrong elements", k, mi,
                                 meshes[mi].specs[s], dv, (long long)c->bad[dv]);
                free(c);
                checked++;
            }
            sim_machine_free(mach);
        }
    }
    assert_int_equal(checked, 4 * 17);
    /* ranges that start at an odd index agree with the whole */
    float part[101];
    model_init_global(global, 3456, "x", MODEL_INIT_NORMAL, 1.0, 3);
    model_init_range(part, 333, 101, "x", MODEL_INIT_NORMAL, 1.0, 3);
    assert_memory_equal(part, global + 333, sizeof part);
    model_init_global(global, 3456, "x", MODEL_INIT_TRUNC_NORMAL, 1.0, 3);
    model_init_range(part, 1, 101, "x", MODEL_INIT_TRUNC_NORMAL, 1.0, 3);
    assert_memory_equal(part, global + 1, sizeof part);
    free(global);
}

/* ------------------------------------------------------------ statistics */

enum { NSTAT = 1 << 20 };

typedef struct {
    double mean, var, lag1, tail2, maxabs;
} stats;

/* tail2 = fraction with |x| > 2 sigma (the true sigma) */
static stats moments(const float *x, int64_t n, double sigma)
{
    stats s = {0};
    double sum = 0, sq = 0, lag = 0;
    int64_t tail = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += x[i];
        sq += (double)x[i] * x[i];
        if (i) lag += (double)x[i] * x[i - 1];
        if (fabs(x[i]) > s.maxabs) s.maxabs = fabs(x[i]);
    }
    s.mean = sum / (double)n;
    s.var = sq / (double)n - s.mean * s.mean;
    s.lag1 = lag / (double)(n - 1) / s.var;
    for (int64_t i = 0; i < n; i++) tail += fabs(x[i]) > 2.0 * sigma;
    s.tail2 = (double)tail / (double)n;
    return s;
}

static void test_statistics(void **state)
{
    (void)state;
    float *x = malloc(NSTAT * sizeof *x);
    const double n = NSTAT, sigma = 0.5;

    /* normal(0, sigma^2), n samples:
     *   mean:      standard error sigma/sqrt(n)                  -> |mean| < 5 sigma/sqrt(n)
     *   variance:  standard error sigma^2 sqrt(2/n) (mu4 = 3)   -> |var - sigma^2| < 5 sigma^2 sqrt(2/n)
     *   lag-1 correlation of neighbours: standard error 1/sqrt(n)
     *   P(|x| > a sigma) = p(a): standard error sqrt(p(1-p)/n); a = 0.5, 1, 2, 3 and the
     *   ziggurat's tail start R = 3.4426 (that branch draws differently) */
    model_init_global(x, NSTAT, "params.decoder.layers.self_attention.query.kernel", MODEL_INIT_NORMAL, sigma, 0);
    stats s = moments(x, NSTAT, sigma);
    assert_true(fabs(s.mean) < 5 * sigma / sqrt(n));
    assert_true(fabs(s.var - sigma * sigma) < 5 * sigma * sigma * sqrt(2 / n));
    assert_true(fabs(s.lag1) < 5 / sqrt(n));
    assert_true(fabs(s.tail2 - 0.0455003) < 5 * sqrt(0.0455 * 0.9545 / n));
    const double a[] = {0.5, 1.0, 2.0, 3.0, 3.442619855899};
    const double p[] = {0.6170750775, 0.3173105079, 0.0455002639, 0.0026997961, 0.0005761085};
    for (int k = 0; k < 5; k++) {
        int64_t cnt = 0;
        for (int64_t i = 0; i < NSTAT; i++) cnt += fabs(x[i]) > a[k] * sigma;
        double f = (double)cnt / n;
        if (fabs(f - p[k]) >= 5 * sqrt(p[k] * (1 - p[k]) / n))
            fail_msg("P(|x| > %g sigma) = %g, expected %g", a[k], f, p[k]);
    }

    /* truncated normal rescaled to std sigma; for Z ~ N(0,1) cut at +-2:
     *   E[Z^2] = 1 - 4 phi(2)/(2 Phi(2) - 1) = 0.773741 (= 0.8796257^2)
     *   E[Z^4] = 3 - 14 * 2 phi(2)/(2 Phi(2) - 1) = 1.416189
     * so the rescaled X = sigma Z / 0.8796257 has var sigma^2 and
     *   mu4 / sigma^4 = 1.416189 / 0.773741^2 = 2.36554, var of the sample variance (mu4 - sigma^4)/n:
     *   |var - sigma^2| < 5 sigma^2 sqrt(1.36554/n); |mean| < 5 sigma/sqrt(n); bound |x| <= 2 sigma/0.8796257 */
    model_init_global(x, NSTAT, "params.decoder.layers.mlp.wo.kernel", MODEL_INIT_TRUNC_NORMAL, sigma, 0);
    s = moments(x, NSTAT, sigma);
    assert_true(fabs(s.mean) < 5 * sigma / sqrt(n));
    assert_true(fabs(s.var - sigma * sigma) < 5 * sigma * sigma * sqrt(1.36554 / n));
    assert_true(fabs(s.lag1) < 5 / sqrt(n));
    double bound = 2 * sigma / MODEL_TRUNC_NORMAL_STD;
    assert_true(s.maxabs <= bound * (1 + 1e-7));
    assert_true(s.maxabs > 0.99 * bound); /* the support really reaches the bound */
    /* fraction with |Z| > 1.9: 2 (Phi(2) - Phi(1.9)) / (2 Phi(2) - 1) = 0.0125017 */
    int64_t beyond = 0;
    for (int64_t i = 0; i < NSTAT; i++) beyond += fabs(x[i]) > 1.9 * sigma / MODEL_TRUNC_NORMAL_STD;
    assert_true(fabs((double)beyond / n - 0.0125017) < 5 * sqrt(0.0125 * 0.9875 / n));

    /* ones and zeros */
    model_init_global(x, 1000, "n", MODEL_INIT_ONES, 0.3, 0);
    for (int i = 0; i < 1000; i++) assert_true(x[i] == 1.0f);
    model_init_global(x, 1000, "n", MODEL_INIT_ZEROS, 0.3, 0);
    for (int i = 0; i < 1000; i++) assert_true(x[i] == 0.0f);
    free(x);
}

static int64_t equal_count(const float *a, const float *b, int64_t n)
{
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) k += a[i] == b[i];
    return k;
}

static void test_names_and_seeds_differ(void **state)
{
    (void)state;
    enum { N = 4096 };
    float a[N], b[N], c[N], a2[N];
    for (int kind = MODEL_INIT_NORMAL; kind <= MODEL_INIT_TRUNC_NORMAL; kind++) {
        model_init_global(a, N, "p.w/layer_0", kind, 1.0, 1);
        model_init_global(a2, N, "p.w/layer_0", kind, 1.0, 1);
        model_init_global(b, N, "p.w/layer_1", kind, 1.0, 1);
        model_init_global(c, N, "p.w/layer_0", kind, 1.0, 2);
        assert_memory_equal(a, a2, sizeof a); /* deterministic */
        assert_true(equal_count(a, b, N) == 0);
        assert_true(equal_count(a, c, N) == 0);
        /* scale is a pure multiplier (a power of two commutes with rounding: exact) */
        model_init_global(b, N, "p.w/layer_0", kind, 2.0, 1);
        for (int i = 0; i < N; i++) assert_true(b[i] == 2 * a[i]);
    }
    assert_true(model_init_key(0, "a") != model_init_key(0, "b"));
    assert_true(model_init_key(0, "a") != model_init_key(1, "a"));
    char buf[64];
    assert_string_equal(model_init_layer_name("params.decoder.layers.mlp.wo.kernel", 3, buf, sizeof buf),
                        "params.decoder.layers.mlp.wo.kernel/layer_3");
    assert_string_equal(model_init_layer_name("params.token_embedder.embedding", -1, buf, sizeof buf),
                        "params.token_embedder.embedding");
}

/* ------------------------------------------------------------ scanned params */

typedef struct {
    const mesh_shape *m;
    model_param *p;
    int64_t bad[SIM_MAX_DEVICES];
} scan_case;

static sim_status scan_device(sim_device *d, void *arg)
{
    scan_case *c = arg;
    model_param p = *c->p; /* this device's storage */
    mesh_array w[3];
    p.w = w;
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    mesh_spec spec;
    model_param_layer_shape(&p, &rank, shape);
    model_param_layer_spec(&p, &spec);
    for (int l = 0; l < p.n_layers; l++)
        SIM_TRY(mesh_array_new(d, c->m, p.def.path, rank, shape, &spec, SIM_F32, SIM_MEM_PARAMS, &w[l]));
    SIM_TRY(model_params_init(d, c->m, &p, 1, 11));
    /* layer l equals the global fill of "P/layer_l" */
    float *g = malloc(8 * 6 * sizeof *g), *out = malloc(8 * 6 * sizeof *out);
    char name[200];
    for (int l = 0; l < p.n_layers; l++) {
        model_init_global(g, 48, model_init_layer_name(p.def.path, l, name, sizeof name), p.def.init, p.def.scale, 11);
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&w[l].spec, c->m, w[l].shape, sim_device_id(d), sh);
        int64_t start[2] = {sh[0].offset, sh[1].offset};
        mesh_copy_block(out, g, 2, w[l].shape, w[l].local, start, sizeof(float));
        if (memcmp(out, w[l].data, w[l].nlocal * sizeof(float))) c->bad[sim_device_id(d)]++;
        mesh_array_free(d, &w[l]);
    }
    free(g);
    free(out);
    return SIM_OK;
}

static void test_scanned_layers(void **state)
{
    (void)state;
    static const char *names[] = {"fsdp", "tensor"};
    const int sizes[] = {2, 2};
    mesh_shape m = helper_mesh(2, names, sizes);
    sim_machine *mach = helper_machine(&m, false);
    model_param p;
    memset(&p, 0, sizeof p);
    snprintf(p.def.path, sizeof p.def.path, "params.decoder.layers.mlp.wi_0.kernel");
    p.def.rank = 3;
    p.def.shape[0] = 8;
    p.def.shape[1] = 3; /* layers */
    p.def.shape[2] = 6;
    p.def.scan_dim = 1;
    p.def.init = MODEL_INIT_TRUNC_NORMAL;
    p.def.scale = 0.1;
    p.n_layers = 3;
    assert_int_equal(mesh_spec_parse("P('fsdp', None, 'tensor')", &m, &p.spec), SIM_OK);
    scan_case *c = calloc(1, sizeof *c);
    c->m = &m;
    c->p = &p;
    if (sim_machine_run(mach, scan_device, c) != SIM_OK) fail_msg("%s", sim_errmsg());
    for (int dv = 0; dv < 4; dv++) assert_int_equal(c->bad[dv], 0);
    free(c);
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ speed */

static void test_speed(void **state)
{
    (void)state;
    enum { N = 1 << 22 };
    float *x = malloc((size_t)N * sizeof *x);
    memset(x, 0, (size_t)N * sizeof *x); /* page faults out of the timing */
    uint64_t t0 = sim_now_ns();
    model_init_global(x, N, "speed.normal", MODEL_INIT_NORMAL, 1.0, 0);
    uint64_t t1 = sim_now_ns();
    model_init_global(x, N, "speed.trunc", MODEL_INIT_TRUNC_NORMAL, 1.0, 0);
    uint64_t t2 = sim_now_ns();
    double nn = (double)(t1 - t0) / N, nt = (double)(t2 - t1) / N;
    fprintf(stderr, "init speed: normal %.1f ns/element, truncated normal %.1f ns/element\n", nn, nt);
    assert_true(nn < 200 && nt < 400); /* generous: a shared, loaded machine */
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shards_reassemble),
        cmocka_unit_test(test_statistics),
        cmocka_unit_test(test_names_and_seeds_differ),
        cmocka_unit_test(test_scanned_layers),
        cmocka_unit_test(test_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_mesh_ops.c — sharded ops and their sharding rules, in explicit and auto mode.
 *
 * Most cases run on a 2x2 mesh ('x', 'y') like JAX's pjit tests.  Each case loads integer-valued
 * operands from global buffers, runs one op on every device, and checks on the main thread:
 * the error and its JAX wording (explicit mode), or the output spec, the values (against the
 * _ref kernels on the global arrays; exact), the bytes each device sent and whether the
 * collectives were recorded as explicit or implicit.  Every device's arena must be empty
 * afterwards (no leaked temporaries).
 *
 * Byte counts follow the collective formulas (sim/collectives.h) on the local buffer of the step:
 *   all-gather (k-1)*s, reduce-scatter (k-1)*n/k, all-reduce 2(k-1)*n/k, all-to-all (k-1)*n/k.
 * OPS_DEBUG=1 prints each case before it runs (to find the one a sweep failed on). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_einsum.h"
#include "mesh/ops.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ harness */

typedef enum {
    OP_EINSUM,
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_MAP,
    OP_REDUCE,
    OP_TRANSPOSE,
    OP_RESHAPE,
    OP_RESHARD,
    OP_WSC,
    OP_SHARD_AS
} op_kind;

enum { MAXDEV = 8, MAXREC = 16 };

typedef struct {
    /* the case */
    const mesh_shape *m;
    op_kind op;
    mesh_mode mode;
    bool keep_size_one; /* ctx->drop_size_one = !keep_size_one */
    const char *sub;    /* einsum */
    int nin;
    int rank[2];
    int64_t shape[2][MESH_SPEC_MAX_RANK];
    const char *spec[2];
    const char *out_sharding;            /* einsum, reduce, reshape: or NULL */
    int ndims, dims[MESH_SPEC_MAX_RANK]; /* reduce */
    int perm[MESH_SPEC_MAX_RANK];        /* transpose */
    int out_rank;                        /* reshape */
    int64_t out_shape[MESH_SPEC_MAX_RANK];
    const char *target; /* reshard / constraint / shard_as */
    /* filled by the harness */
    float *global[2];
    float *expect, *got;
    int64_t out_n;
    sim_status st;
    char msg[4096];
    mesh_spec out_spec;
    mesh_einsum_info info;
    uint64_t sent[MAXDEV];
    int nrec[MAXDEV];
    sim_record rec[MAXDEV][MAXREC];
    size_t live_after[MAXDEV];
    bool dry; /* dry-run machine: no values to check */
} run_t;

static int64_t numel(int rank, const int64_t *s)
{
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= s[i];
    return n;
}

static void square_fn(float *out, const float *in, size_t n, void *arg)
{
    (void)arg;
    for (size_t i = 0; i < n; i++) out[i] = in[i] * in[i];
}

/* Host-side result on the global arrays. */
static void host_expect(run_t *r)
{
    float *a = r->global[0], *b = r->global[1];
    int64_t na = numel(r->rank[0], r->shape[0]);
    switch (r->op) {
    case OP_EINSUM: {
        bk_einsum_dims d;
        char err[256];
        if (bk_einsum_parse(r->sub, r->rank[0], r->shape[0], r->rank[1], r->shape[1], &d, err, sizeof err))
            fail_msg("%s", err);
        r->out_rank = d.ro;
        memcpy(r->out_shape, d.out_shape, sizeof r->out_shape);
        r->out_n = numel(d.ro, d.out_shape);
        r->expect = calloc((size_t)r->out_n + 1, sizeof(float));
        bk_einsum_ref(r->sub, r->expect, a, r->rank[0], r->shape[0], b, r->rank[1], r->shape[1], 0.0f);
        break;
    }
    case OP_ADD:
    case OP_SUB:
    case OP_MUL: {
        int rank = r->rank[0] > r->rank[1] ? r->rank[0] : r->rank[1];
        r->out_rank = rank;
        for (int d = 0; d < rank; d++) {
            int64_t s0 = r->rank[0] ? r->shape[0][d] : 1, s1 = r->rank[1] ? r->shape[1][d] : 1;
            r->out_shape[d] = s0 > s1 ? s0 : s1;
        }
        r->out_n = numel(rank, r->out_shape);
        r->expect = calloc((size_t)r->out_n + 1, sizeof(float));
        for (int64_t e = 0; e < r->out_n; e++) {
            int64_t rem = e, ia = 0, ib = 0, sa = 1, sb = 1;
            for (int d = rank - 1; d >= 0; d--) {
                int64_t i = rem % r->out_shape[d];
                rem /= r->out_shape[d];
                if (r->rank[0]) {
                    ia += (r->shape[0][d] == 1 ? 0 : i) * sa;
                    sa *= r->shape[0][d];
                }
                if (r->rank[1]) {
                    ib += (r->shape[1][d] == 1 ? 0 : i) * sb;
                    sb *= r->shape[1][d];
                }
            }
            r->expect[e] = r->op == OP_ADD ? a[ia] + b[ib] : r->op == OP_SUB ? a[ia] - b[ib] : a[ia] * b[ib];
        }
        break;
    }
    case OP_MAP:
        r->out_rank = r->rank[0];
        memcpy(r->out_shape, r->shape[0], sizeof r->out_shape);
        r->out_n = na;
        r->expect = calloc((size_t)na + 1, sizeof(float));
        square_fn(r->expect, a, (size_t)na, NULL);
        break;
    case OP_REDUCE: {
        uint32_t red = 0;
        for (int i = 0; i < r->ndims; i++) red |= 1u << r->dims[i];
        int k = 0;
        int64_t ost[MESH_SPEC_MAX_RANK], s = 1;
        for (int d = 0; d < r->rank[0]; d++)
            if (!(red & (1u << d))) r->out_shape[k++] = r->shape[0][d];
        r->out_rank = k;
        for (int d = r->rank[0] - 1; d >= 0; d--) {
            ost[d] = (red & (1u << d)) ? 0 : s;
            if (!(red & (1u << d))) s *= r->shape[0][d];
        }
        r->out_n = s;
        r->expect = calloc((size_t)s + 1, sizeof(float));
        for (int64_t e = 0; e < na; e++) {
            int64_t rem = e, o = 0;
            for (int d = r->rank[0] - 1; d >= 0; d--) {
                o += (rem % r->shape[0][d]) * ost[d];
                rem /= r->shape[0][d];
            }
            r->expect[o] += a[e];
        }
        break;
    }
    case OP_TRANSPOSE:
        r->out_rank = r->rank[0];
        for (int d = 0; d < r->rank[0]; d++) r->out_shape[d] = r->shape[0][r->perm[d]];
        r->out_n = na;
        r->expect = calloc((size_t)na + 1, sizeof(float));
        bk_permute(r->expect, a, sizeof(float), r->rank[0], r->shape[0], r->perm);
        break;
    case OP_RESHAPE:
        r->out_n = na;
        r->expect = calloc((size_t)na + 1, sizeof(float));
        memcpy(r->expect, a, (size_t)na * sizeof(float));
        break;
    default: /* reshard and constraints keep the value */
        r->out_rank = r->rank[0];
        memcpy(r->out_shape, r->shape[0], sizeof r->out_shape);
        r->out_n = na;
        r->expect = calloc((size_t)na + 1, sizeof(float));
        memcpy(r->expect, a, (size_t)na * sizeof(float));
        break;
    }
}

static sim_status run_device(sim_device *d, void *arg)
{
    run_t *r = arg;
    int id = sim_device_id(d);
    mesh_ctx ctx = {.dev = d, .mesh = r->m, .mode = r->mode, .drop_size_one = !r->keep_size_one, .layer = "layer0"};
    mesh_array in[2], out;
    memset(&out, 0, sizeof out);
    /* no cmocka assertion on a device thread: failures come back as statuses */
    for (int i = 0; i < r->nin; i++) {
        mesh_spec s;
        SIM_TRY(mesh_spec_parse(r->spec[i], r->m, &s));
        char nm[16];
        snprintf(nm, sizeof nm, "in%d", i);
        SIM_TRY(mesh_array_new(d, r->m, nm, r->rank[i], r->shape[i], &s, SIM_F32, SIM_MEM_ACTIVATIONS, &in[i]));
        mesh_array_load_global(d, r->m, &in[i], r->global[i]);
    }
    mesh_spec osh, tgt;
    if (r->out_sharding) SIM_TRY(mesh_spec_parse(r->out_sharding, r->m, &osh));
    if (r->target) SIM_TRY(mesh_spec_parse(r->target, r->m, &tgt));
    const mesh_spec *os = r->out_sharding ? &osh : NULL;
    sim_device_clear_records(d);
    sim_status st = SIM_OK;
    mesh_array *res = &out;
    switch (r->op) {
    case OP_EINSUM:
        st = mesh_einsum(&ctx, r->sub, &in[0], &in[1], os, "einsum", SIM_MEM_ACTIVATIONS, &out, id ? NULL : &r->info);
        break;
    case OP_ADD: st = mesh_add(&ctx, &in[0], &in[1], "add", &out); break;
    case OP_SUB: st = mesh_sub(&ctx, &in[0], &in[1], "sub", &out); break;
    case OP_MUL: st = mesh_mul(&ctx, &in[0], &in[1], "mul", &out); break;
    case OP_MAP: st = mesh_map(&ctx, &in[0], square_fn, NULL, "square", &out); break;
    case OP_REDUCE: st = mesh_reduce_sum(&ctx, &in[0], r->ndims, r->dims, os, "sum", &out); break;
    case OP_TRANSPOSE: st = mesh_transpose(&ctx, &in[0], r->perm, "transpose", &out); break;
    case OP_RESHAPE: st = mesh_reshape(&ctx, &in[0], r->out_rank, r->out_shape, os, "reshape", &out); break;
    case OP_RESHARD:
        st = mesh_reshard_op(&ctx, &in[0], &tgt, "reshard");
        res = &in[0];
        break;
    case OP_WSC:
        st = mesh_with_sharding_constraint(&ctx, &in[0], &tgt, "constraint");
        res = &in[0];
        break;
    case OP_SHARD_AS:
        st = mesh_shard_as(&ctx, &in[0], &tgt, "shard_as");
        res = &in[0];
        break;
    }
    if (st != SIM_OK) {
        for (int i = 0; i < r->nin; i++) mesh_array_free(d, &in[i]);
        return st;
    }
    size_t n;
    const sim_record *rec = sim_device_records(d, &n);
    r->nrec[id] = (int)n;
    for (size_t i = 0; i < n && i < MAXREC; i++) {
        r->rec[id][i] = rec[i];
        r->sent[id] += rec[i].bytes_sent;
    }
    if (id == 0) r->out_spec = res->spec;
    if (res->spec.partial) { /* sum the partial value to compare it */
        mesh_spec full = res->spec;
        full.partial = 0;
        SIM_TRY(mesh_reshard(d, r->m, res, &full, sim_meta_implicit("test/check")));
    }
    SIM_TRY(mesh_array_store_global(d, r->m, res, r->got));
    if (res == &out) mesh_array_free(d, &out);
    for (int i = 0; i < r->nin; i++) mesh_array_free(d, &in[i]);
    sim_arena_stats stats;
    sim_arena_get_stats(sim_device_arena(d), &stats);
    r->live_after[id] = stats.live;
    return SIM_OK;
}

/* Fills the operands with small integers, runs, checks values when the op succeeded. */
static void run_case(sim_machine *mach, run_t *r)
{
    static uint64_t seed = 1;
    for (int i = 0; i < r->nin; i++) {
        int64_t n = numel(r->rank[i], r->shape[i]);
        r->global[i] = malloc((size_t)(n + 1) * sizeof(float));
        for (int64_t e = 0; e < n; e++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            r->global[i][e] = (float)((int)((seed >> 33) % 9) - 4);
        }
    }
    host_expect(r);
    if (getenv("OPS_DEBUG"))
        fprintf(stderr, "case op %d mode %d %s %s %s -> %s\n", (int)r->op, (int)r->mode, r->sub ? r->sub : "",
                r->spec[0], r->nin > 1 ? r->spec[1] : "-",
                r->out_sharding ? r->out_sharding : (r->target ? r->target : "-"));
    r->got = calloc((size_t)r->out_n + 1, sizeof(float));
    r->st = sim_machine_run(mach, run_device, r);
    snprintf(r->msg, sizeof r->msg, "%s", r->st == SIM_OK ? "" : sim_errmsg());
    if (r->st == SIM_OK && !r->dry) {
        for (int64_t e = 0; e < r->out_n; e++)
            if (r->got[e] != r->expect[e])
                fail_msg("%s: element %lld is %g, expected %g", r->sub ? r->sub : "op", (long long)e, r->got[e],
                         r->expect[e]);
        for (int dv = 0; dv < r->m->num_devices; dv++)
            if (r->live_after[dv]) fail_msg("device %d: %zu bytes still live after the op", dv, r->live_after[dv]);
    }
}

static void free_case(run_t *r)
{
    for (int i = 0; i < r->nin; i++) free(r->global[i]);
    free(r->expect);
    free(r->got);
}

/* The op succeeded with output `spec`, every device sent `bytes` in `nrec` collectives, all
 * recorded as implicit or all as explicit, tagged layer0/<op>. */
static void expect_ok(const run_t *r, const char *spec, uint64_t bytes, int nrec, bool implicit)
{
    if (r->st != SIM_OK) fail_msg("expected success, got %s: %s", sim_status_name(r->st), r->msg);
    mesh_spec want = helper_spec(r->m, spec);
    if (!mesh_spec_equal(&want, &r->out_spec)) {
        char got[256];
        mesh_spec_format(&r->out_spec, r->m, got, sizeof got);
        fail_msg("output spec %s, expected %s", got, spec);
    }
    for (int dv = 0; dv < r->m->num_devices; dv++) {
        if (r->sent[dv] != bytes)
            fail_msg("device %d sent %llu bytes, expected %llu", dv, (unsigned long long)r->sent[dv],
                     (unsigned long long)bytes);
        if (r->nrec[dv] != nrec) fail_msg("device %d: %d collectives, expected %d", dv, r->nrec[dv], nrec);
        for (int i = 0; i < r->nrec[dv]; i++) {
            if (r->rec[dv][i].implicit != implicit)
                fail_msg("device %d collective %d (%s) implicit=%d, expected %d", dv, i, sim_op_name(r->rec[dv][i].op),
                         r->rec[dv][i].implicit, implicit);
            if (strncmp(r->rec[dv][i].tag, "layer0/", 7)) fail_msg("collective tag '%s'", r->rec[dv][i].tag);
        }
    }
}

static void expect_op(const run_t *r, int i, sim_op op)
{
    if (r->nrec[0] <= i || r->rec[0][i].op != op)
        fail_msg("collective %d is %s, expected %s", i, r->nrec[0] > i ? sim_op_name(r->rec[0][i].op) : "none",
                 sim_op_name(op));
}

/* An explicit-mode error: SIM_ERR_SHARDING, the JAX text, the layer and a fix. */
static void expect_err(const run_t *r, const char *needle)
{
    if (r->st != SIM_ERR_SHARDING) fail_msg("expected a sharding error, got %s: %s", sim_status_name(r->st), r->msg);
    if (!strstr(r->msg, needle)) fail_msg("message\n%s\nlacks\n%s", r->msg, needle);
    if (!strstr(r->msg, "layer0/")) fail_msg("message lacks the layer: %s", r->msg);
    if (!strstr(r->msg, "fix:")) fail_msg("message lacks a fix: %s", r->msg);
}

static const char *const XY[] = {"x", "y"};
static const int S22[] = {2, 2};

/* A two-operand case. */
static run_t two(const mesh_shape *m, op_kind op, mesh_mode mode, const char *sub, int ra, const int64_t *sa,
                 const char *pa, int rb, const int64_t *sb, const char *pb, const char *out_sharding)
{
    run_t r;
    memset(&r, 0, sizeof r);
    r.m = m;
    r.op = op;
    r.mode = mode;
    r.sub = sub;
    r.nin = 2;
    r.rank[0] = ra;
    r.rank[1] = rb;
    memcpy(r.shape[0], sa, (size_t)ra * sizeof *sa);
    memcpy(r.shape[1], sb, (size_t)rb * sizeof *sb);
    r.spec[0] = pa;
    r.spec[1] = pb;
    r.out_sharding = out_sharding;
    return r;
}

static run_t one(const mesh_shape *m, op_kind op, mesh_mode mode, int ra, const int64_t *sa, const char *pa)
{
    run_t r;
    memset(&r, 0, sizeof r);
    r.m = m;
    r.op = op;
    r.mode = mode;
    r.nin = 1;
    r.rank[0] = ra;
    memcpy(r.shape[0], sa, (size_t)ra * sizeof *sa);
    r.spec[0] = pa;
    return r;
}

/* ------------------------------------------------------------ einsum: JAX's pjit cases */

/* lhs (8, 2) @ rhs (2, 8) on mesh (2, 2) ('x', 'y'), f32: the cases of jax tests/pjit_test.py.
 * Bytes: an all-gather over one axis (k = 2) sends (k-1)*s = s, s = the gathered local block:
 *   P('x','y') lhs local (4, 1) = 16 B; P('x',None) rhs local (1, 8) = 32 B;
 *   P(None,'y') lhs local (8, 1) = 32 B. */
typedef struct {
    const char *lhs, *rhs;
    const char *out; /* expected output spec, or NULL for an error */
    uint64_t bytes;  /* per device */
    int ncoll;
    const char *err; /* the JAX text */
} dot_case;

static const dot_case PJIT_CASES[] = {
    {"P('x', None)", "P(None, 'y')", "P('x', 'y')", 0, 0, NULL},
    {"P('x', None)", "P(None, None)", "P('x', None)", 0, 0, NULL},
    {"P('x', 'y')", "P(None, None)", "P('x', None)", 16, 1, NULL}, /* lhs contraction one-sided: AG over y */
    {"P('x', None)", "P('x', None)", "P('x', None)", 32, 1, NULL}, /* fsdp: AG rhs over x */
    {"P(None, 'y')", "P(None, 'y')", "P(None, 'y')", 32, 1, NULL}, /* half_tp: AG lhs over y */
    {"P('x', None)", "P(None, 'x')", NULL, 0, 0,
     "dot_general operation with inputs: f32[8@x,2], f32[2,8@x] produces an illegally sharded result: f32[8@x,8@x]"},
    {"P('x', 'y')", "P('x', 'y')", NULL, 0, 0,
     "Contracting dimensions are sharded and it is ambiguous how the output should be sharded. Please specify the "
     "output sharding via the `out_sharding` parameter. Got lhs_contracting_spec=('y',) and "
     "rhs_contracting_spec=('x',)"},
    {"P('x', 'y')", "P('y', None)", NULL, 0, 0,
     "Contracting dimensions are sharded and it is ambiguous how the output should be sharded. Please specify the "
     "output sharding via the `out_sharding` parameter. Got lhs_contracting_spec=('y',) and "
     "rhs_contracting_spec=('y',)"},
    {"P(None, 'y')", "P('y', None)", NULL, 0, 0,
     "Contracting dimensions are sharded and it is ambiguous how the output should be sharded. Please specify the "
     "output sharding via the `out_sharding` parameter. Got lhs_contracting_spec=('y',) and "
     "rhs_contracting_spec=('y',)"},
};

static void test_einsum_pjit_explicit(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t sa[] = {8, 2}, sb[] = {2, 8};
    for (size_t i = 0; i < sizeof PJIT_CASES / sizeof PJIT_CASES[0]; i++) {
        const dot_case *c = &PJIT_CASES[i];
        run_t r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, sa, c->lhs, 2, sb, c->rhs, NULL);
        run_case(mach, &r);
        if (c->out) {
            expect_ok(&r, c->out, c->bytes, c->ncoll, false);
            if (c->ncoll) expect_op(&r, 0, SIM_OP_ALL_GATHER);
        } else {
            expect_err(&r, c->err);
            assert_non_null(strstr(r.msg, "einsum 'ij,jk->ik'"));
            assert_non_null(strstr(r.msg, c->lhs)); /* operands named with their P(...) specs */
            assert_non_null(strstr(r.msg, c->rhs));
        }
        free_case(&r);
    }
    sim_machine_free(mach);
}

/* Auto mode: no errors, same values; the operand reshards are implicit.
 *   illegal result P('x',None)@P(None,'x'): keep lhs, gather rhs over x on k: rhs local (2, 4) = 32 B.
 *   P('x','y')@P('x','y'): gather y off the lhs contraction (local (4,1) = 16 B) and x off the rhs
 *     contraction (local (1,4) = 16 B): 32 B, output P('x','y').
 *   contraction sharded alike on both sides: local product, output partial over that axis, 0 B. */
static void test_einsum_pjit_auto(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t sa[] = {8, 2}, sb[] = {2, 8};
    static const dot_case want[] = {
        {"P('x', None)", "P(None, 'y')", "P('x', 'y')", 0, 0, NULL},
        {"P('x', None)", "P(None, None)", "P('x', None)", 0, 0, NULL},
        {"P('x', 'y')", "P(None, None)", "P('x', None)", 16, 1, NULL},
        {"P('x', None)", "P('x', None)", "P('x', None)", 32, 1, NULL},
        {"P(None, 'y')", "P(None, 'y')", "P(None, 'y')", 32, 1, NULL},
        {"P('x', None)", "P(None, 'x')", "P('x', None)", 32, 1, NULL},
        {"P('x', 'y')", "P('x', 'y')", "P('x', 'y')", 32, 2, NULL},
        {"P('x', 'y')", "P('y', None)", "P('x', None, unreduced={'y'})", 0, 0, NULL},
        {"P(None, 'y')", "P('y', None)", "P(None, None, unreduced={'y'})", 0, 0, NULL},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const dot_case *c = &want[i];
        run_t r = two(&m, OP_EINSUM, MESH_MODE_AUTO, "ij,jk->ik", 2, sa, c->lhs, 2, sb, c->rhs, NULL);
        run_case(mach, &r);
        expect_ok(&r, c->out, c->bytes, c->ncoll, true);
        for (int k = 0; k < c->ncoll; k++) expect_op(&r, k, SIM_OP_ALL_GATHER);
        free_case(&r);
    }
    sim_machine_free(mach);
}

/* dot(f32[8,4@x], f32[4@x,16]) with out_sharding (the doc's four legitimate results).  The local
 * product is (8, 16) = 512 B, partial over x (k = 2):
 *   P(None,None)   all-reduce      2(k-1)n/k = 512 B
 *   P('x',None)    reduce-scatter  (k-1)n/k  = 256 B   (and P(None,'x') likewise)
 *   unreduced x    nothing         0 B */
static void test_einsum_out_sharding(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t sa[] = {8, 4}, sb[] = {4, 16};
    struct {
        const char *out;
        uint64_t bytes;
        sim_op op;
    } cases[] = {
        {"P(None, None)", 512, SIM_OP_ALL_REDUCE},
        {"P('x', None)", 256, SIM_OP_REDUCE_SCATTER},
        {"P(None, 'x')", 256, SIM_OP_REDUCE_SCATTER},
        {"P(None, None, unreduced={'x'})", 0, SIM_NOP},
    };
    for (int mode = 0; mode < 2; mode++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            run_t r = two(&m, OP_EINSUM, mode ? MESH_MODE_EXPLICIT : MESH_MODE_AUTO, "ij,jk->ik", 2, sa, "P(None, 'x')",
                          2, sb, "P('x', None)", cases[i].out);
            run_case(mach, &r);
            expect_ok(&r, cases[i].out, cases[i].bytes, cases[i].bytes ? 1 : 0, mode == 0);
            if (cases[i].bytes) expect_op(&r, 0, cases[i].op);
            /* the VJP's view: operands as they were, output partial over x before the collective */
            mesh_spec as = helper_spec(&m, "P(None, 'x')"), bs = helper_spec(&m, "P('x', None)");
            assert_true(mesh_spec_equal(&r.info.a_spec, &as) && mesh_spec_equal(&r.info.b_spec, &bs));
            mesh_spec lo = helper_spec(&m, "P(None, None, unreduced={'x'})");
            assert_true(mesh_spec_equal(&r.info.local_out, &lo));
            assert_int_equal(r.info.bytes_in, 0);
            assert_int_equal(r.info.bytes_out, cases[i].bytes);
            free_case(&r);
        }
    /* explicit: the unreduced rules of dot_general */
    run_t r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, sa, "P(None, 'x')", 2, sb, "P(None, None)",
                  "P(None, None, unreduced={'x'})");
    run_case(mach, &r);
    expect_err(&r, "lhs and rhs contracting dims should be sharded identically when out_sharding provided to "
                   "dot_general mentions unreduced_axes. Got lhs_contracting_spec=('x',) and "
                   "rhs_contracting_spec=(None,)");
    free_case(&r);
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, sa, "P(None, 'x')", 2, sb, "P('x', None)",
            "P(None, None, unreduced={'y'})");
    run_case(mach, &r);
    expect_err(&r, "out_sharding's unreduced axes should be equal to the contracting specs. Got unreduced "
                   "axes={'y'} and contracting spec=('x',)");
    free_case(&r);
    /* explicit with out_sharding: the rule takes it verbatim (no batch check); the one-sided
     * contraction still gathers: lhs P('x','y') local (4,1) = 16 B, then slice to P('x','y') free */
    int64_t s8[] = {8, 2}, t8[] = {2, 8};
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, s8, "P('x', 'y')", 2, t8, "P(None, None)",
            "P('x', 'y')");
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 16, 1, false);
    free_case(&r);
    sim_machine_free(mach);
}

/* Batch dims, model-shaped einsums, partial operands, indices summed away. */
static void test_einsum_batch_and_partial(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t sa[] = {4, 2, 6}, sb[] = {4, 6, 4};
    /* batch dims sharded differently: JAX's batch error; auto slices rhs to P('x', ...) for free */
    run_t r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "bij,bjk->bik", 3, sa, "P('x', None, None)", 3, sb,
                  "P(None, None, None)", NULL);
    run_case(mach, &r);
    expect_err(&r, "dot_general requires lhs batch dimensions and rhs batch dimensions to have the same sharding, "
                   "got ('x',) and (None,).");
    free_case(&r);
    r = two(&m, OP_EINSUM, MESH_MODE_AUTO, "bij,bjk->bik", 3, sa, "P('x', None, None)", 3, sb, "P(None, None, None)",
            NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, None)", 0, 0, true);
    free_case(&r);

    /* projection "btd,dh->bth": batch on x, TP on y: no communication */
    int64_t xs[] = {4, 3, 8}, ws[] = {8, 6};
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "btd,dh->bth", 3, xs, "P('x', None, None)", 2, ws, "P(None, 'y')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, 'y')", 0, 0, false);
    free_case(&r);
    /* FSDP weight (d on y): the contraction is sharded on the weight only -> AG of w over y:
     * w local (4, 6) = 96 B */
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "btd,dh->bth", 3, xs, "P('x', None, None)", 2, ws, "P('y', None)", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, None)", 96, 1, false);
    expect_op(&r, 0, SIM_OP_ALL_GATHER);
    free_case(&r);

    /* attention scores "bsnh,btnh->bnst" with heads on y */
    int64_t q[] = {2, 4, 2, 3}, k[] = {2, 6, 2, 3};
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "bsnh,btnh->bnst", 4, q, "P('x', None, 'y', None)", 4, k,
            "P('x', None, 'y', None)", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y', None, None)", 0, 0, false);
    free_case(&r);

    /* partial operands: explicit refuses; auto is linear */
    int64_t pa[] = {8, 4}, pb[] = {4, 8};
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, pa, "P('x', None, unreduced={'y'})", 2, pb,
            "P(None, None)", NULL);
    run_case(mach, &r);
    expect_err(&r, "dot_general inputs may not be unreduced");
    free_case(&r);
    r = two(&m, OP_EINSUM, MESH_MODE_AUTO, "ij,jk->ik", 2, pa, "P('x', None, unreduced={'y'})", 2, pb, "P(None, None)",
            NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, unreduced={'y'})", 0, 0, true);
    free_case(&r);
    /* both partial over y: one operand is all-reduced first, the cheaper one: lhs local (4, 4) =
     * 64 B -> AR 2(k-1)n/k = 64 B, against 128 B for rhs (4, 8); the output keeps rhs's partial */
    r = two(&m, OP_EINSUM, MESH_MODE_AUTO, "ij,jk->ik", 2, pa, "P('x', None, unreduced={'y'})", 2, pb,
            "P(None, None, unreduced={'y'})", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, unreduced={'y'})", 64, 1, true);
    expect_op(&r, 0, SIM_OP_ALL_REDUCE);
    free_case(&r);
    /* partial over different axes: bilinear, the output is partial over both */
    r = two(&m, OP_EINSUM, MESH_MODE_AUTO, "ij,jk->ik", 2, pa, "P(None, None, unreduced={'x'})", 2, pb,
            "P(None, None, unreduced={'y'})", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None, None, unreduced={'x', 'y'})", 0, 0, true);
    free_case(&r);

    /* an index in one operand only ("ij,jk->i"): k summed first by reduce_sum's rule; rhs (4, 8)
     * P(None, 'x'): local (4, 4) -> (4,) = 16 B, all-reduce over x: 2(k-1)n/k = 16 B */
    r = two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->i", 2, pa, "P(None, None)", 2, pb, "P(None, 'x')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None,)", 16, 1, false);
    expect_op(&r, 0, SIM_OP_ALL_REDUCE);
    assert_string_equal(r.info.subscripts, "ij,j->i");
    free_case(&r);

    sim_machine_free(mach);
}

/* ------------------------------------------------------------ elementwise */

static void test_elementwise_broadcasting(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    /* the doc example f32[4@x,1] + f32[1,8@y] -> f32[4@x,8@y], no communication */
    int64_t a41[] = {4, 1}, b18[] = {1, 8}, s48[] = {4, 8}, s44[] = {4, 4};
    for (int mode = 0; mode < 2; mode++) {
        run_t r = two(&m, OP_ADD, (mesh_mode)mode, NULL, 2, a41, "P('x', None)", 2, b18, "P(None, 'y')", NULL);
        run_case(mach, &r);
        expect_ok(&r, "P('x', 'y')", 0, 0, mode == MESH_MODE_AUTO);
        free_case(&r);
    }
    /* equal specs keep; None vs A -> A (the replicated operand is sliced, no bytes) */
    run_t r = two(&m, OP_SUB, MESH_MODE_EXPLICIT, NULL, 2, s48, "P('x', 'y')", 2, s48, "P('x', 'y')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 0, 0, false);
    free_case(&r);
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, s48, "P('x', None)", 2, s48, "P(None, 'y')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 0, 0, false);
    free_case(&r);
    /* a scalar broadcasts to anything */
    int64_t none[1] = {0};
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, s48, "P('x', 'y')", 0, none, "P()", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 0, 0, false);
    free_case(&r);
    /* A vs B: JAX's error; auto moves one operand */
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, s44, "P('x', 'y')", 2, s44, "P('y', 'x')", NULL);
    run_case(mach, &r);
    expect_err(&r, "mul got incompatible shardings for broadcasting: ('x', 'y'), ('y', 'x').");
    free_case(&r);
    /* auto: (x, y) keeps lhs; rhs P('y','x') -> P('x','y'): local (2, 2) = 16 B; the planner
     * gathers x on dim 1 (1*16 = 16 B, local (2, 4)), moves y dim 0 -> 1 by all-to-all
     * ((k-1)n/k = 16 B), slices x on dim 0: 32 B */
    r = two(&m, OP_MUL, MESH_MODE_AUTO, NULL, 2, s44, "P('x', 'y')", 2, s44, "P('y', 'x')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 32, 2, true);
    free_case(&r);
    /* an axis on two dims of the result */
    r = two(&m, OP_ADD, MESH_MODE_EXPLICIT, NULL, 2, s44, "P('x', None)", 2, s44, "P(None, 'x')", NULL);
    run_case(mach, &r);
    expect_err(&r, "add operation with inputs: f32[4@x,4], f32[4,4@x] produces an illegally sharded result: "
                   "f32[4@x,4@x]");
    free_case(&r);
    /* auto: keep lhs, rhs moves x from dim 1 to dim 0: all-to-all of local (4, 2) = 32 B -> 16 B */
    r = two(&m, OP_ADD, MESH_MODE_AUTO, NULL, 2, s44, "P('x', None)", 2, s44, "P(None, 'x')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None)", 16, 1, true);
    expect_op(&r, 0, SIM_OP_ALL_TO_ALL);
    free_case(&r);
    /* broadcasting with a sharded non-1 dim: f32[4@x,1] * f32[4,8@y]: None on the size-1 dim is ignored */
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, a41, "P('x', None)", 2, s48, "P(None, 'y')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 0, 0, false);
    free_case(&r);
    sim_machine_free(mach);
}

static void test_elementwise_partial(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t s[] = {4, 8};
    /* add of two partials over the same axes stays partial (linear) in both modes */
    for (int mode = 0; mode < 2; mode++) {
        run_t r = two(&m, OP_ADD, (mesh_mode)mode, NULL, 2, s, "P('y', None, unreduced={'x'})", 2, s,
                      "P('y', None, unreduced={'x'})", NULL);
        run_case(mach, &r);
        expect_ok(&r, "P('y', None, unreduced={'x'})", 0, 0, mode == MESH_MODE_AUTO);
        free_case(&r);
    }
    run_t r =
        two(&m, OP_ADD, MESH_MODE_EXPLICIT, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s, "P(None, None)", NULL);
    run_case(mach, &r);
    expect_err(&r, "lhs is unreduced while rhs is not. `add` operation does not allow this because there will be "
                   "implicit communication. Please reduce lhs via `reshard` before calling `add`.");
    free_case(&r);
    r = two(&m, OP_SUB, MESH_MODE_EXPLICIT, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s,
            "P(None, None, unreduced={'y'})", NULL);
    run_case(mach, &r);
    expect_err(&r, "lhs and rhs to `sub` must be unreduced along the same mesh axes.");
    free_case(&r);
    /* auto: the replicated operand becomes partial for free (one copy kept, zeros elsewhere) */
    r = two(&m, OP_SUB, MESH_MODE_AUTO, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s, "P(None, None)", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None, None, unreduced={'x'})", 0, 0, true);
    free_case(&r);
    /* mul: explicit refuses (JAX wants a reduced rhs), auto is linear in the partial operand */
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s, "P(None, 'y')", NULL);
    run_case(mach, &r);
    expect_err(&r, "RHS should be reduced along the same axes LHS is unreduced on.");
    free_case(&r);
    r = two(&m, OP_MUL, MESH_MODE_AUTO, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s, "P(None, 'y')", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None, 'y', unreduced={'x'})", 0, 0, true);
    free_case(&r);
    r = two(&m, OP_MUL, MESH_MODE_EXPLICIT, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s,
            "P(None, None, unreduced={'x'})", NULL);
    run_case(mach, &r);
    expect_err(&r, "lhs and rhs to `mul` cannot be unreduced since mul is bilinear.");
    free_case(&r);
    /* auto, both partial over x: one operand all-reduced ((4, 8) = 128 B: 2(k-1)n/k = 128 B) */
    r = two(&m, OP_MUL, MESH_MODE_AUTO, NULL, 2, s, "P(None, None, unreduced={'x'})", 2, s,
            "P(None, None, unreduced={'x'})", NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None, None, unreduced={'x'})", 128, 1, true);
    expect_op(&r, 0, SIM_OP_ALL_REDUCE);
    free_case(&r);
    /* a nonlinear map: explicit refuses a partial input; auto all-reduces it first (128 B) */
    r = one(&m, OP_MAP, MESH_MODE_EXPLICIT, 2, s, "P(None, None, unreduced={'x'})");
    run_case(mach, &r);
    expect_err(&r, "unreduced rule for square is not implemented");
    free_case(&r);
    r = one(&m, OP_MAP, MESH_MODE_AUTO, 2, s, "P(None, None, unreduced={'x'})");
    run_case(mach, &r);
    expect_ok(&r, "P(None, None)", 128, 1, true);
    expect_op(&r, 0, SIM_OP_ALL_REDUCE);
    free_case(&r);
    r = one(&m, OP_MAP, MESH_MODE_EXPLICIT, 2, s, "P('x', 'y')");
    run_case(mach, &r);
    expect_ok(&r, "P('x', 'y')", 0, 0, false);
    free_case(&r);
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ reductions, transpose */

/* (8, 4) P('x','y'):
 *   sum over dim 0 -> (4,) P('y',): local (2,) = 8 B all-reduced over x: 2(k-1)n/k = 8 B
 *   (8, 4, 4) P('x','y',None) summed over dims 0 and 1 -> (4,): local 16 B all-reduced over
 *                                    (x, y), k = 4: 2*3*16/4 = 24 B
 *   out_sharding unreduced={'x'}  : nothing */
static void test_reduce_sum(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t s[] = {8, 4};
    for (int mode = 0; mode < 2; mode++) {
        bool imp = mode == MESH_MODE_AUTO;
        run_t r = one(&m, OP_REDUCE, (mesh_mode)mode, 2, s, "P('x', 'y')");
        r.ndims = 1;
        r.dims[0] = 0;
        run_case(mach, &r);
        expect_ok(&r, "P('y',)", 8, 1, imp);
        expect_op(&r, 0, SIM_OP_ALL_REDUCE);
        free_case(&r);
        int64_t s3[] = {8, 4, 4};
        r = one(&m, OP_REDUCE, (mesh_mode)mode, 3, s3, "P('x', 'y', None)");
        r.ndims = 2;
        r.dims[0] = 1;
        r.dims[1] = 0;
        run_case(mach, &r);
        expect_ok(&r, "P(None,)", 24, 1, imp);
        free_case(&r);
        r = one(&m, OP_REDUCE, (mesh_mode)mode, 2, s, "P('x', 'y')");
        r.ndims = 1;
        r.dims[0] = 0;
        r.out_sharding = "P('y', unreduced={'x'})";
        run_case(mach, &r);
        expect_ok(&r, "P('y', unreduced={'x'})", 0, 0, imp);
        free_case(&r);
        /* an unsharded reduced dim needs nothing; a partial input stays partial */
        r = one(&m, OP_REDUCE, (mesh_mode)mode, 2, s, "P(None, 'y', unreduced={'x'})");
        r.ndims = 1;
        r.dims[0] = 0;
        run_case(mach, &r);
        expect_ok(&r, "P('y', unreduced={'x'})", 0, 0, imp);
        free_case(&r);
    }
    run_t r = one(&m, OP_REDUCE, MESH_MODE_EXPLICIT, 2, s, "P('x', None)");
    r.ndims = 1;
    r.dims[0] = 0;
    r.out_sharding = "P(None, unreduced={'y'})";
    run_case(mach, &r);
    expect_err(&r, "out_sharding of reduce_sum declares unreduced axes {'y'} that do not shard the reduced dims");
    free_case(&r);
    sim_machine_free(mach);
}

static void test_transpose(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t s[] = {8, 4, 6};
    run_t r = one(&m, OP_TRANSPOSE, MESH_MODE_EXPLICIT, 3, s, "P('x', 'y', None)");
    r.perm[0] = 2, r.perm[1] = 0, r.perm[2] = 1;
    run_case(mach, &r);
    expect_ok(&r, "P(None, 'x', 'y')", 0, 0, false);
    free_case(&r);
    int64_t s2[] = {8, 4};
    r = one(&m, OP_TRANSPOSE, MESH_MODE_AUTO, 2, s2, "P(('y', 'x'), None)");
    r.perm[0] = 1, r.perm[1] = 0;
    run_case(mach, &r);
    expect_ok(&r, "P(None, ('y', 'x'))", 0, 0, true);
    free_case(&r);
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ reshape */

static run_t reshape_case(const mesh_shape *m, mesh_mode mode, int ra, const int64_t *sa, const char *spec, int rb,
                          const int64_t *sb, const char *out_sharding)
{
    run_t r = one(m, OP_RESHAPE, mode, ra, sa, spec);
    r.out_rank = rb;
    memcpy(r.out_shape, sb, (size_t)rb * sizeof *sb);
    r.out_sharding = out_sharding;
    return r;
}

static void test_reshape(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t v8[] = {8}, s24[] = {2, 4}, s42[] = {4, 2}, s81[] = {8, 1}, s18[] = {1, 8}, s84[] = {8, 4}, v32[] = {32};
    int64_t s8x4x2[] = {8, 4, 2}, s2x4x4x2[] = {2, 4, 4, 2};
    struct {
        int ra;
        const int64_t *sa;
        const char *spec;
        int rb;
        const int64_t *sb;
        const char *out;
        uint64_t bytes;
    } ok[] = {
        {1, v8, "P('x',)", 2, s24, "P('x', None)", 0},       /* split: x goes to the leading dim */
        {1, v8, "P(('x', 'y'),)", 2, s24, "P('x', 'y')", 0}, /* axes handed out major first */
        {1, v8, "P(('x', 'y'),)", 2, s42, "P(('x', 'y'), None)", 0},
        {2, s42, "P('x', None)", 1, v8, "P('x',)", 0}, /* merge */
        {2, s42, "P(('x', 'y'), None)", 1, v8, "P(('x', 'y'),)", 0},
        /* merge (4@x, 2@y) -> 8@(x,y): JAX's rule; the blocks are not contiguous, so y moves to
         * dim 0 first by all-to-all: local (2, 1) = 8 B -> (k-1)n/k = 4 B */
        {2, s42, "P('x', 'y')", 1, v8, "P(('x', 'y'),)", 4},
        {2, s81, "P('x', None)", 1, v8, "P('x',)", 0}, /* singleton dims */
        {1, v8, "P('y',)", 2, s18, "P(None, 'y')", 0},
        {3, s8x4x2, "P('x', 'y', None)", 4, s2x4x4x2, "P('x', None, 'y', None)", 0},
    };
    for (int mode = 0; mode < 2; mode++)
        for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
            run_t r = reshape_case(&m, (mesh_mode)mode, ok[i].ra, ok[i].sa, ok[i].spec, ok[i].rb, ok[i].sb, NULL);
            run_case(mach, &r);
            expect_ok(&r, ok[i].out, ok[i].bytes, ok[i].bytes ? 1 : 0, mode == MESH_MODE_AUTO);
            free_case(&r);
        }
    /* a sharded dim after an unsharded one cannot merge: JAX's error; auto gathers x:
     * local (4, 1) = 16 B, all-gather (k-1)s = 16 B, output replicated */
    run_t r = reshape_case(&m, MESH_MODE_EXPLICIT, 2, s42, "P(None, 'x')", 1, v8, NULL);
    run_case(mach, &r);
    expect_err(&r, "This reshape is not supported. Please specify the sharding of the output via the "
                   "`out_sharding` argument of jax.lax.reshape. Got operand type: f32[4,2@x], new sizes: (8,)");
    free_case(&r);
    r = reshape_case(&m, MESH_MODE_AUTO, 2, s42, "P(None, 'x')", 1, v8, NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None,)", 16, 1, true);
    expect_op(&r, 0, SIM_OP_ALL_GATHER);
    free_case(&r);
    /* out_sharding: (8,4) P('x',None) -> (32,) P('y',): the input is first made P('y', None)
     * (gather x: local (4, 4) = 64 B, then a free slice), the copy is then local */
    for (int mode = 0; mode < 2; mode++) {
        r = reshape_case(&m, (mesh_mode)mode, 2, s84, "P('x', None)", 1, v32, "P('y',)");
        run_case(mach, &r);
        expect_ok(&r, "P('y',)", 64, 1, mode == MESH_MODE_AUTO);
        free_case(&r);
    }
    /* two dims split at once is beyond JAX's rule; auto keeps both contiguous groups */
    int64_t s8x6[] = {8, 6}, s2x4x2x3[] = {2, 4, 2, 3};
    r = reshape_case(&m, MESH_MODE_EXPLICIT, 2, s8x6, "P('x', 'y')", 4, s2x4x2x3, NULL);
    run_case(mach, &r);
    expect_err(&r, "This reshape is not supported.");
    free_case(&r);
    r = reshape_case(&m, MESH_MODE_AUTO, 2, s8x6, "P('x', 'y')", 4, s2x4x2x3, NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None, 'y', None)", 0, 0, true);
    free_case(&r);
    sim_machine_free(mach);

    /* 8@x with x = 4 cannot split into (2, 4): JAX's error; auto gathers (local 2 = 8 B, (k-1)s = 24 B) */
    const char *n1[] = {"x"};
    int s1[] = {4};
    mesh_shape m4 = helper_mesh(1, n1, s1);
    mach = helper_machine(&m4, false);
    r = reshape_case(&m4, MESH_MODE_EXPLICIT, 1, v8, "P('x',)", 2, s24, NULL);
    run_case(mach, &r);
    expect_err(&r, "Got operand type: f32[8@x], new sizes: (2, 4)");
    free_case(&r);
    r = reshape_case(&m4, MESH_MODE_AUTO, 1, v8, "P('x',)", 2, s24, NULL);
    run_case(mach, &r);
    expect_ok(&r, "P(None, None)", 24, 1, true);
    free_case(&r);
    r = reshape_case(&m4, MESH_MODE_EXPLICIT, 1, v8, "P('x',)", 2, s42, NULL);
    run_case(mach, &r);
    expect_ok(&r, "P('x', None)", 0, 0, false);
    free_case(&r);
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ reshard and constraints */

/* (8, 4) P('x', None) -> P(None, 'x'): all-to-all of the local (4, 4) = 64 B: (k-1)n/k = 32 B. */
static void test_reshard_and_constraints(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    int64_t s[] = {8, 4};
    for (int mode = 0; mode < 2; mode++) {
        /* reshard: asked for by model code, explicit in both modes */
        run_t r = one(&m, OP_RESHARD, (mesh_mode)mode, 2, s, "P('x', None)");
        r.target = "P(None, 'x')";
        run_case(mach, &r);
        expect_ok(&r, "P(None, 'x')", 32, 1, false);
        expect_op(&r, 0, SIM_OP_ALL_TO_ALL);
        free_case(&r);
        /* shard_as: reshard in explicit (explicit), constraint in auto (implicit) */
        r = one(&m, OP_SHARD_AS, (mesh_mode)mode, 2, s, "P('x', None)");
        r.target = "P(None, 'x')";
        run_case(mach, &r);
        expect_ok(&r, "P(None, 'x')", 32, 1, mode == MESH_MODE_AUTO);
        free_case(&r);
        /* a matching constraint is a no-op */
        r = one(&m, OP_WSC, (mesh_mode)mode, 2, s, "P('x', None)");
        r.target = "P('x', None)";
        run_case(mach, &r);
        expect_ok(&r, "P('x', None)", 0, 0, false);
        free_case(&r);
        /* reshard may introduce and remove partial sums: replicated -> unreduced is free */
        r = one(&m, OP_RESHARD, (mesh_mode)mode, 2, s, "P(None, None)");
        r.target = "P(None, None, unreduced={'y'})";
        run_case(mach, &r);
        expect_ok(&r, "P(None, None, unreduced={'y'})", 0, 0, false);
        free_case(&r);
    }
    /* explicit: a differing constraint is an assert with JAX's text */
    run_t r = one(&m, OP_WSC, MESH_MODE_EXPLICIT, 2, s, "P('x', None)");
    r.target = "P(None, 'x')";
    run_case(mach, &r);
    expect_err(&r, "`with_sharding_constraint` acts as an assert when all axes of mesh are of type `Explicit`. The "
                   "array sharding: P('x', None) did not match the sharding provided: P(None, 'x'). Please use "
                   "`jax.sharding.reshard` to shard your input to the sharding you want.");
    free_case(&r);
    /* auto: the constraint reshards, implicit */
    r = one(&m, OP_WSC, MESH_MODE_AUTO, 2, s, "P('x', None)");
    r.target = "P(None, 'x')";
    run_case(mach, &r);
    expect_ok(&r, "P(None, 'x')", 32, 1, true);
    free_case(&r);
    /* missing trailing entries are None (jax normalises the spec to the rank) */
    r = one(&m, OP_RESHARD, MESH_MODE_EXPLICIT, 2, s, "P(None, 'y')");
    r.target = "P('x',)";
    run_case(mach, &r);
    /* P(None,'y') -> P('x', None): slice x first (free, local (4, 2) = 32 B), then gather y: 32 B */
    expect_ok(&r, "P('x', None)", 32, 1, false);
    expect_op(&r, 0, SIM_OP_ALL_GATHER);
    free_case(&r);
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ size-1 axes */

/* Mesh data=2, context=1, tensor=2.  P(('data','context'), None) equals P('data', None) once size-1
 * axes are dropped (MaxText's default); without dropping, the constraint fails — the mismatch
 * MaxText met in its DeepSeek batch-split scan — and elementwise rules see two different tuples. */
static void test_size_one_axes(void **state)
{
    (void)state;
    const char *names[] = {"data", "context", "tensor"};
    int sizes[] = {2, 1, 2};
    mesh_shape m = helper_mesh(3, names, sizes);
    sim_machine *mach = helper_machine(&m, false);
    int64_t s[] = {8, 4};
    for (int keep = 0; keep < 2; keep++) {
        run_t r = one(&m, OP_WSC, MESH_MODE_EXPLICIT, 2, s, "P(('data', 'context'), None)");
        r.keep_size_one = keep;
        r.target = "P('data', None)";
        run_case(mach, &r);
        if (!keep) {
            expect_ok(&r, "P(('data', 'context'), None)", 0, 0, false);
        } else {
            expect_err(&r, "The array sharding: P(('data', 'context'), None) did not match the sharding provided: "
                           "P('data', None).");
            assert_non_null(strstr(r.msg, "size-1"));
        }
        free_case(&r);
        r = two(&m, OP_ADD, MESH_MODE_EXPLICIT, NULL, 2, s, "P(('data', 'context'), None)", 2, s, "P('data', 'tensor')",
                NULL);
        r.keep_size_one = keep;
        run_case(mach, &r);
        if (!keep) expect_ok(&r, "P('data', 'tensor')", 0, 0, false);
        else
            expect_err(&r, "add got incompatible shardings for broadcasting: (('data', 'context'), None), "
                           "('data', 'tensor').");
        free_case(&r);
        /* auto mode never fails on it: the size-1 axis is a free slice */
        r = two(&m, OP_ADD, MESH_MODE_AUTO, NULL, 2, s, "P(('data', 'context'), None)", 2, s, "P('data', 'tensor')",
                NULL);
        r.keep_size_one = keep;
        run_case(mach, &r);
        assert_int_equal(r.st, SIM_OK);
        assert_int_equal(r.sent[0], 0);
        free_case(&r);
    }
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ reshard cache */

typedef struct {
    const mesh_shape *m;
    uint64_t sent_first[MAXDEV], sent_second[MAXDEV];
    size_t live_with_cache[MAXDEV], live_after[MAXDEV];
} cache_run;

/* With ctx->cache, the FSDP all-gather of a weight feeding two einsums runs once. */
static sim_status cache_device(sim_device *d, void *arg)
{
    cache_run *cr = arg;
    int id = sim_device_id(d);
    mesh_ctx ctx = {.dev = d, .mesh = cr->m, .mode = MESH_MODE_EXPLICIT, .drop_size_one = true, .layer = "layer0"};
    ctx.cache = mesh_reshard_cache_new(d);
    int64_t xs[] = {4, 8}, ws[] = {8, 4};
    mesh_spec px, pw;
    SIM_TRY(mesh_spec_parse("P('x', None)", cr->m, &px));
    SIM_TRY(mesh_spec_parse("P('y', None)", cr->m, &pw));
    mesh_array x, w, y1, y2;
    SIM_TRY(mesh_array_new(d, cr->m, "x", 2, xs, &px, SIM_F32, SIM_MEM_ACTIVATIONS, &x));
    SIM_TRY(mesh_array_new(d, cr->m, "w", 2, ws, &pw, SIM_F32, SIM_MEM_PARAMS, &w));
    sim_device_clear_records(d);
    SIM_TRY(mesh_einsum(&ctx, "bd,dh->bh", &x, &w, NULL, "first", SIM_MEM_ACTIVATIONS, &y1, NULL));
    cr->sent_first[id] = sim_device_op_totals(d, SIM_OP_ALL_GATHER).bytes_sent;
    SIM_TRY(mesh_einsum(&ctx, "bd,dh->bh", &x, &w, NULL, "second", SIM_MEM_ACTIVATIONS, &y2, NULL));
    cr->sent_second[id] = sim_device_op_totals(d, SIM_OP_ALL_GATHER).bytes_sent - cr->sent_first[id];
    mesh_array_free(d, &y1);
    mesh_array_free(d, &y2);
    mesh_array_free(d, &x);
    mesh_array_free(d, &w);
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(d), &st);
    cr->live_with_cache[id] = st.live; /* the gathered weight, owned by the cache */
    mesh_reshard_cache_free(ctx.cache);
    sim_arena_get_stats(sim_device_arena(d), &st);
    cr->live_after[id] = st.live;
    return SIM_OK;
}

static void test_reshard_cache(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    cache_run cr;
    memset(&cr, 0, sizeof cr);
    cr.m = &m;
    assert_int_equal(sim_machine_run(mach, cache_device, &cr), SIM_OK);
    for (int dv = 0; dv < 4; dv++) {
        assert_int_equal(cr.sent_first[dv], 64); /* w local (4, 4) = 64 B gathered over y: (k-1)s */
        assert_int_equal(cr.sent_second[dv], 0);
        assert_int_equal(cr.live_with_cache[dv], 8 * 4 * 4);
        assert_int_equal(cr.live_after[dv], 0);
    }
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ bad input */

typedef struct {
    int which;
    const mesh_shape *m;
} bad_arg;

static sim_status bad_device(sim_device *d, void *arg)
{
    bad_arg *ba = arg;
    mesh_ctx ctx = {.dev = d, .mesh = ba->m, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "layer0"};
    int64_t s48[] = {4, 8}, s38[] = {3, 8};
    mesh_spec rep;
    mesh_spec_init(&rep, 2);
    mesh_array a, b, out;
    SIM_TRY(mesh_array_new(d, ba->m, "a", 2, s48, &rep, SIM_F32, SIM_MEM_ACTIVATIONS, &a));
    SIM_TRY(mesh_array_new(d, ba->m, "b", 2, s38, &rep, SIM_F32, SIM_MEM_ACTIVATIONS, &b));
    sim_status st = SIM_OK;
    int perm[] = {0, 0};
    int64_t s5[] = {5};
    switch (ba->which) {
    case 0: st = mesh_einsum(&ctx, "ij,kj->iz", &a, &a, NULL, "bad", SIM_MEM_TEMP, &out, NULL); break;
    case 1: st = mesh_add(&ctx, &a, &b, "bad", &out); break;
    case 2: st = mesh_transpose(&ctx, &a, perm, "bad", &out); break;
    case 3: st = mesh_reshape(&ctx, &a, 1, s5, NULL, "bad", &out); break;
    }
    mesh_array_free(d, &a);
    mesh_array_free(d, &b);
    return st;
}

static void test_bad_input(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *mach = helper_machine(&m, false);
    const char *needles[] = {
        "layer0/bad: einsum 'ij,kj->iz': output index 'z' appears in neither operand",
        "add got incompatible shapes for broadcasting: (4, 8), (3, 8).",
        "perm must be a permutation",
        "cannot reshape 'a' of shape (4, 8) (32 elements) to (5,)",
    };
    for (int i = 0; i < 4; i++) {
        bad_arg ba = {i, &m};
        assert_int_equal(sim_machine_run(mach, bad_device, &ba), SIM_ERR_INPUT);
        if (!strstr(sim_errmsg(), needles[i])) fail_msg("message \"%s\" lacks \"%s\"", sim_errmsg(), needles[i]);
    }
    sim_machine_free(mach);
}

/* ------------------------------------------------------------ random sweep */

/* Each axis goes nowhere, to a random dim (random position) or, if allowed, to the partial set. */
static void random_spec_for(const mesh_shape *m, int rank, const int64_t *shape, uint64_t *rng, bool allow_partial,
                            char *buf, int cap);
static void random_spec(const mesh_shape *m, int rank, uint64_t *rng, bool allow_partial, char *buf, int cap)
{
    random_spec_for(m, rank, NULL, rng, allow_partial, buf, cap);
}

/* Same, with axes of size > 1 kept off the size-1 dims of `shape` (when given). */
static void random_spec_for(const mesh_shape *m, int rank, const int64_t *shape, uint64_t *rng, bool allow_partial,
                            char *buf, int cap)
{
    mesh_spec s = helper_random_spec(m, rank, rng, allow_partial);
    for (int d = 0; shape && d < rank; d++)
        if (shape[d] == 1) {
            int w = 0;
            for (int j = 0; j < s.n_axes[d]; j++)
                if (m->sizes[s.axes[d][j]] == 1) s.axes[d][w++] = s.axes[d][j];
            s.n_axes[d] = w;
        }
    mesh_spec_format(&s, m, buf, cap);
}

/* Random specs (partial ones included), random out_sharding, both modes: auto never fails, explicit
 * fails only with a sharding error, and whatever succeeds is exact and leaks nothing.  Every dim is a
 * multiple of 4, so every placement divides. */
static void test_random_sweep(void **state)
{
    (void)state;
    static const struct {
        const char *sub;
        int ra, rb;
        int64_t sa[4], sb[4];
    } eins[] = {
        {"ij,jk->ik", 2, 2, {8, 4}, {4, 8}},      {"bij,bjk->bik", 3, 3, {4, 4, 8}, {4, 8, 4}},
        {"btd,dh->bth", 3, 2, {4, 4, 8}, {8, 4}}, {"bsnh,btnh->bnst", 4, 4, {4, 4, 4, 4}, {4, 8, 4, 4}},
        {"ij,kj->ki", 2, 2, {8, 4}, {4, 4}},      {"ij,jk->i", 2, 2, {8, 4}, {4, 8}},
    };
    static const struct {
        int ra, rb;
        int64_t sa[4], sb[4];
    } resh[] = {
        {2, 1, {8, 4}, {32}},       {1, 2, {32}, {4, 8}},           {3, 2, {4, 4, 8}, {16, 8}},
        {2, 3, {16, 8}, {4, 4, 8}}, {2, 4, {16, 16}, {4, 4, 4, 4}}, {3, 3, {4, 1, 8}, {4, 8, 1}},
    };
    static const char *names[] = {"x", "y", "z"};
    static const int sizes[2][3] = {{2, 2, 0}, {2, 1, 2}};
    uint64_t rng = 7;
    int ok = 0, errs = 0, total = 0;
    char sp[3][256];
    for (int mi = 0; mi < 2; mi++) {
        mesh_shape m = helper_mesh(mi ? 3 : 2, names, sizes[mi]);
        sim_machine *mach = helper_machine(&m, false);
        for (int it = 0; it < 300; it++) {
            mesh_mode mode = (mesh_mode)(helper_rng_next(&rng) % 2);
            bool partial = helper_rng_next(&rng) % 3 == 0;
            int kind = (int)(helper_rng_next(&rng) % 6);
            run_t r;
            if (kind <= 1) { /* einsum */
                int e = (int)(helper_rng_next(&rng) % (sizeof eins / sizeof eins[0]));
                random_spec(&m, eins[e].ra, &rng, partial, sp[0], sizeof sp[0]);
                random_spec(&m, eins[e].rb, &rng, partial, sp[1], sizeof sp[1]);
                r = two(&m, OP_EINSUM, mode, eins[e].sub, eins[e].ra, eins[e].sa, sp[0], eins[e].rb, eins[e].sb, sp[1],
                        NULL);
                if (helper_rng_next(&rng) % 2) {
                    bk_einsum_dims d;
                    char err[256];
                    assert_int_equal(bk_einsum_parse(eins[e].sub, eins[e].ra, eins[e].sa, eins[e].rb, eins[e].sb, &d,
                                                     err, sizeof err),
                                     0);
                    random_spec(&m, d.ro, &rng, true, sp[2], sizeof sp[2]);
                    r.out_sharding = sp[2];
                }
            } else if (kind == 2) { /* elementwise with broadcasting */
                int64_t a[] = {8, 4, 4}, b[] = {8, 1, 4};
                op_kind ops[] = {OP_ADD, OP_SUB, OP_MUL};
                bool bc = helper_rng_next(&rng) % 2;
                random_spec(&m, 3, &rng, partial, sp[0], sizeof sp[0]);
                random_spec_for(&m, 3, bc ? b : a, &rng, partial, sp[1], sizeof sp[1]);
                r = two(&m, ops[helper_rng_next(&rng) % 3], mode, NULL, 3, a, sp[0], 3, bc ? b : a, sp[1], NULL);
            } else if (kind == 3) { /* reduce_sum */
                int64_t a[] = {8, 4, 8};
                random_spec(&m, 3, &rng, partial, sp[0], sizeof sp[0]);
                r = one(&m, OP_REDUCE, mode, 3, a, sp[0]);
                r.ndims = 1 + (int)(helper_rng_next(&rng) % 2);
                r.dims[0] = (int)(helper_rng_next(&rng) % 3);
                r.dims[1] = (r.dims[0] + 1 + (int)(helper_rng_next(&rng) % 2)) % 3;
                if (helper_rng_next(&rng) % 2) {
                    random_spec(&m, 3 - r.ndims, &rng, true, sp[2], sizeof sp[2]);
                    r.out_sharding = sp[2];
                }
            } else if (kind == 4) { /* reshape */
                int e = (int)(helper_rng_next(&rng) % (sizeof resh / sizeof resh[0]));
                random_spec_for(&m, resh[e].ra, resh[e].sa, &rng, partial, sp[0], sizeof sp[0]);
                r = reshape_case(&m, mode, resh[e].ra, resh[e].sa, sp[0], resh[e].rb, resh[e].sb, NULL);
                if (helper_rng_next(&rng) % 3 == 0) {
                    random_spec_for(&m, resh[e].rb, resh[e].sb, &rng, partial, sp[2], sizeof sp[2]);
                    r.out_sharding = sp[2];
                }
            } else { /* transpose, reshard, constraint */
                int64_t a[] = {8, 4, 8};
                op_kind ops[] = {OP_TRANSPOSE, OP_RESHARD, OP_WSC, OP_SHARD_AS};
                random_spec(&m, 3, &rng, partial, sp[0], sizeof sp[0]);
                random_spec(&m, 3, &rng, true, sp[2], sizeof sp[2]);
                r = one(&m, ops[helper_rng_next(&rng) % 4], mode, 3, a, sp[0]);
                r.target = sp[2];
                r.perm[0] = 2, r.perm[1] = 0, r.perm[2] = 1;
            }
            /* size-1 axes in specs are only legal on dims they divide: every dim here is >= 4 or a
             * size-1 dim, and size-1 axes divide anything */
            run_case(mach, &r);
            total++;
            if (r.st == SIM_OK) ok++;
            else if (mode == MESH_MODE_EXPLICIT && r.st == SIM_ERR_SHARDING) errs++;
            else
                fail_msg("%s mode, op %d %s (%s, %s -> %s): %s", mode ? "explicit" : "auto", (int)r.op,
                         r.sub ? r.sub : "", r.spec[0], r.nin > 1 ? r.spec[1] : "-",
                         r.out_sharding ? r.out_sharding : (r.target ? r.target : "-"), r.msg);
            free_case(&r);
        }
        sim_machine_free(mach);
    }
    assert_int_equal(total, 600);
    assert_true(ok > 350);
    assert_true(errs > 20);
}

/* A dry run (no data) counts the same collectives as a real run. */
static void test_dry_run_counts(void **state)
{
    (void)state;
    mesh_shape m = helper_mesh(2, XY, S22);
    sim_machine *real = helper_machine(&m, false), *dry = helper_machine(&m, true);
    int64_t sa[] = {8, 4}, sb[] = {4, 16}, sc[] = {4, 8};
    run_t cases[] = {
        two(&m, OP_EINSUM, MESH_MODE_EXPLICIT, "ij,jk->ik", 2, sa, "P(None, 'x')", 2, sb, "P('x', None)",
            "P('x', None)"),
        two(&m, OP_EINSUM, MESH_MODE_AUTO, "ij,jk->ik", 2, sa, "P('x', 'y')", 2, sb, "P('x', 'y')", NULL),
        two(&m, OP_MUL, MESH_MODE_AUTO, NULL, 2, sc, "P('x', 'y')", 2, sc, "P('y', 'x')", NULL),
        one(&m, OP_MAP, MESH_MODE_AUTO, 2, sc, "P(None, None, unreduced={'x'})"),
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_t a = cases[i], b = cases[i];
        run_case(real, &a);
        b.dry = true;
        run_case(dry, &b);
        assert_int_equal(a.st, SIM_OK);
        assert_int_equal(b.st, SIM_OK);
        for (int dv = 0; dv < 4; dv++) {
            assert_int_equal(a.sent[dv], b.sent[dv]);
            assert_int_equal(a.nrec[dv], b.nrec[dv]);
        }
        assert_true(mesh_spec_equal(&a.out_spec, &b.out_spec));
        free_case(&a);
        free_case(&b);
    }
    sim_machine_free(real);
    sim_machine_free(dry);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_einsum_pjit_explicit),
        cmocka_unit_test(test_einsum_pjit_auto),
        cmocka_unit_test(test_einsum_out_sharding),
        cmocka_unit_test(test_einsum_batch_and_partial),
        cmocka_unit_test(test_elementwise_broadcasting),
        cmocka_unit_test(test_elementwise_partial),
        cmocka_unit_test(test_reduce_sum),
        cmocka_unit_test(test_transpose),
        cmocka_unit_test(test_reshape),
        cmocka_unit_test(test_reshard_and_constraints),
        cmocka_unit_test(test_size_one_axes),
        cmocka_unit_test(test_reshard_cache),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_random_sweep),
        cmocka_unit_test(test_dry_run_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

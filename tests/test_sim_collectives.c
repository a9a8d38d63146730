/* test_sim_collectives.c — every collective on 1-D, 2-D and 3-D meshes, group
 * sizes 1, 2, 3, 4, 6, 8 (and 12), counts 0, 1, odd and larger, checked
 * element by element with exact integer-valued data and byte by byte against
 * the formulas.  Expected values come from the definitions, computed here
 * with the test's own coordinate arithmetic.  Device threads only write into
 * per-device slots; all assertions run on the main thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "sim/collectives.h"
#include "tests/helpers.h"

/* ------------------------------------------------------------ test mesh math */

typedef struct {
    int naxes;
    int sizes[4];
} tmesh;

static int t_ndev(const tmesh *m)
{
    int n = 1;
    for (int i = 0; i < m->naxes; i++) n *= m->sizes[i];
    return n;
}

static void t_coords(const tmesh *m, int id, int *c)
{
    for (int i = m->naxes - 1; i >= 0; i--) {
        c[i] = id % m->sizes[i];
        id /= m->sizes[i];
    }
}

static int t_id(const tmesh *m, const int *c)
{
    int id = 0;
    for (int i = 0; i < m->naxes; i++) id = id * m->sizes[i] + c[i];
    return id;
}

static int t_k(const tmesh *m, sim_axes ax)
{
    int k = 1;
    for (int i = 0; i < ax.n; i++) k *= m->sizes[ax.axis[i]];
    return k;
}

static int t_rank(const tmesh *m, int id, sim_axes ax)
{
    int c[4], r = 0;
    t_coords(m, id, c);
    for (int i = 0; i < ax.n; i++) r = r * m->sizes[ax.axis[i]] + c[ax.axis[i]];
    return r;
}

static int t_member(const tmesh *m, int id, sim_axes ax, int q)
{
    int c[4];
    t_coords(m, id, c);
    for (int i = ax.n - 1; i >= 0; i--) {
        c[ax.axis[i]] = q % m->sizes[ax.axis[i]];
        q /= m->sizes[ax.axis[i]];
    }
    return t_id(m, c);
}

static float val(int dev, size_t i) { return (float)(dev * 1000 + (int)i + 1); }

static sim_machine *make_machine(const tmesh *tm, bool dry)
{
    static const char *const names[] = {"a0", "a1", "a2", "a3"};
    return helper_sim_machine(tm->naxes, names, tm->sizes, dry);
}

/* ------------------------------------------------------------ the six ops */

enum { NOPS = 6, MAXDEV = 16 };

typedef struct {
    tmesh tm;
    sim_axes ax;
    size_t c;      /* per-peer / per-device count */
    int perm_kind; /* 0 cyclic shift, 1 partial (last rank sends nowhere) */
    float *out[MAXDEV][NOPS];
    size_t out_n[MAXDEV][NOPS];
    size_t ragged_send_off[MAXDEV][MAXDEV], ragged_send_cnt[MAXDEV][MAXDEV];
    size_t ragged_recv_off[MAXDEV][MAXDEV], ragged_recv_cnt[MAXDEV][MAXDEV];
    sim_record rec[MAXDEV][NOPS];
    sim_status st[MAXDEV];
} sweep_case;

static size_t ragged_cnt(int sender_rank, int dest_rank, size_t c)
{
    return (size_t)(sender_rank + 2 * dest_rank + (int)c) % 4;
}

static sim_status sweep_device(sim_device *d, void *arg)
{
    sweep_case *sc = arg;
    int id = sim_device_id(d);
    int k = t_k(&sc->tm, sc->ax), r = t_rank(&sc->tm, id, sc->ax);
    size_t c = sc->c;
    /* inputs: enough for the largest op */
    size_t nin = (size_t)k * c + 1;
    float *in = malloc((nin + 1) * sizeof(float));
    for (size_t i = 0; i < nin; i++) in[i] = val(id, i);
    float **o = sc->out[id];
    size_t *on = sc->out_n[id];
    on[0] = (size_t)k * c;
    on[1] = c;
    on[2] = (size_t)k * c + 1; /* all-reduce on a count k does not divide (for k > 1) */
    on[3] = (size_t)k * c;
    on[4] = c;
    for (int j = 0; j < 4; j++) o[j] = calloc(on[j] + 1, sizeof(float));
    o[4] = calloc(c + 1, sizeof(float));
    sim_status st = SIM_OK;
    if (!st) st = sim_all_gather(d, in, o[0], c, SIM_F32, sc->ax, sim_meta_tag("t/ag"));
    if (!st) st = sim_reduce_scatter(d, in, o[1], (size_t)k * c, SIM_F32, sc->ax, sim_meta_tag("t/rs"));
    if (!st) st = sim_all_reduce(d, in, o[2], on[2], SIM_F32, sc->ax, sim_meta_tag("t/ar"));
    if (!st) st = sim_all_to_all(d, in, o[3], (size_t)k * c, SIM_F32, sc->ax, sim_meta_implicit("t/a2a"));
    int perm[MAXDEV];
    for (int q = 0; q < k; q++) perm[q] = sc->perm_kind == 0 ? (q + 1) % k : (q + 1 < k ? q + 1 : -1);
    if (!st) st = sim_ppermute(d, in, o[4], c, perm, SIM_F32, sc->ax, sim_meta_tag("t/pp"));
    /* ragged: rank r sends ragged_cnt(r, q) elements to rank q */
    size_t *so = sc->ragged_send_off[id], *sn = sc->ragged_send_cnt[id];
    size_t *ro = sc->ragged_recv_off[id], *rn = sc->ragged_recv_cnt[id];
    size_t stot = 0, rtot = 0;
    for (int q = 0; q < k; q++) {
        sn[q] = ragged_cnt(r, q, c);
        so[q] = stot;
        stot += sn[q];
        rn[q] = ragged_cnt(q, r, c);
        ro[q] = rtot;
        rtot += rn[q];
    }
    float *rin = malloc((stot + 1) * sizeof(float));
    for (size_t i = 0; i < stot; i++) rin[i] = val(id, i);
    o[5] = calloc(rtot + 1, sizeof(float));
    on[5] = rtot;
    if (!st) st = sim_ragged_all_to_all(d, rin, o[5], rtot, so, sn, ro, rn, SIM_F32, sc->ax, sim_meta_tag("t/ragged"));
    free(rin);
    free(in);
    size_t nrec;
    const sim_record *rec = sim_device_records(d, &nrec);
    for (size_t i = 0; i < nrec && i < NOPS; i++) sc->rec[id][i] = rec[i];
    sc->st[id] = st;
    return st;
}

static void check_sweep(sweep_case *sc)
{
    const tmesh *tm = &sc->tm;
    int n = t_ndev(tm), k = t_k(tm, sc->ax);
    size_t c = sc->c;
    for (int id = 0; id < n; id++) {
        int r = t_rank(tm, id, sc->ax);
        assert_int_equal(sc->st[id], SIM_OK);
        /* all-gather: block q from rank q */
        for (int q = 0; q < k; q++)
            for (size_t i = 0; i < c; i++)
                assert_true(sc->out[id][0][(size_t)q * c + i] == val(t_member(tm, id, sc->ax, q), i));
        /* reduce-scatter: block r of the sum */
        for (size_t i = 0; i < c; i++) {
            float s = 0;
            for (int q = 0; q < k; q++) s += val(t_member(tm, id, sc->ax, q), (size_t)r * c + i);
            assert_true(sc->out[id][1][i] == s);
        }
        /* all-reduce */
        for (size_t i = 0; i < sc->out_n[id][2]; i++) {
            float s = 0;
            for (int q = 0; q < k; q++) s += val(t_member(tm, id, sc->ax, q), i);
            assert_true(sc->out[id][2][i] == s);
        }
        /* all-to-all: block q = rank q's block r */
        for (int q = 0; q < k; q++)
            for (size_t i = 0; i < c; i++)
                assert_true(sc->out[id][3][(size_t)q * c + i] == val(t_member(tm, id, sc->ax, q), (size_t)r * c + i));
        /* ppermute */
        int src = sc->perm_kind == 0 ? (r + k - 1) % k : r - 1;
        for (size_t i = 0; i < c; i++)
            assert_true(sc->out[id][4][i] == (src >= 0 ? val(t_member(tm, id, sc->ax, src), i) : 0.0f));
        /* ragged: from rank q, the elements q addressed to me */
        for (int q = 0; q < k; q++) {
            int peer = t_member(tm, id, sc->ax, q);
            size_t off = 0;
            for (int p = 0; p < r; p++) off += ragged_cnt(q, p, c);
            for (size_t i = 0; i < ragged_cnt(q, r, c); i++)
                assert_true(sc->out[id][5][sc->ragged_recv_off[id][q] + i] == val(peer, off + i));
        }
        /* bytes */
        const sim_record *rec = sc->rec[id];
        uint64_t e = 4, kk = (uint64_t)k;
        assert_int_equal(rec[0].op, SIM_OP_ALL_GATHER);
        assert_int_equal(rec[0].bytes_sent, (kk - 1) * c * e);
        assert_int_equal(rec[0].bytes_recv, (kk - 1) * c * e);
        assert_int_equal(rec[1].bytes_sent, (kk - 1) * (kk * c) / kk * e);
        assert_int_equal(rec[3].bytes_sent, (kk - 1) * (kk * c) / kk * e);
        assert_int_equal(rec[3].implicit, true);
        assert_int_equal(rec[0].implicit, false);
        assert_int_equal(rec[4].bytes_sent, (k > 1 && !(sc->perm_kind == 1 && r == k - 1)) ? c * e : 0);
        assert_int_equal(rec[4].bytes_recv, (k > 1 && src >= 0) ? c * e : 0);
        uint64_t rs = 0, rr = 0;
        for (int q = 0; q < k; q++)
            if (q != r) {
                rs += ragged_cnt(r, q, c) * e;
                rr += ragged_cnt(q, r, c) * e;
            }
        assert_int_equal(rec[5].bytes_sent, rs);
        assert_int_equal(rec[5].bytes_recv, rr);
        /* records list the group's axes without the size-1 ones (the same group) */
        int nbig = 0;
        for (int i = 0; i < sc->ax.n; i++) nbig += tm->sizes[sc->ax.axis[i]] > 1;
        for (int j = 0; j < NOPS; j++) {
            assert_int_equal(rec[j].group_size, k);
            assert_int_equal(rec[j].axes.n, nbig);
        }
        assert_string_equal(rec[0].tag, "t/ag");
    }
    /* all-reduce: the group's devices together send 2(k-1)n bytes (n not divisible by k) */
    for (int id = 0; id < n; id++) {
        if (t_rank(tm, id, sc->ax) != 0) continue;
        uint64_t tot = 0, nn = sc->out_n[id][2];
        for (int q = 0; q < k; q++) tot += sc->rec[t_member(tm, id, sc->ax, q)][2].bytes_sent;
        assert_int_equal(tot, 2 * (uint64_t)(k - 1) * nn * 4);
    }
    for (int id = 0; id < n; id++)
        for (int j = 0; j < NOPS; j++) free(sc->out[id][j]);
}

static void run_sweep(const tmesh *tm, sim_axes ax, size_t c, int perm_kind, int *cases)
{
    sweep_case *sc = calloc(1, sizeof *sc);
    sc->tm = *tm;
    sc->ax = ax;
    sc->c = c;
    sc->perm_kind = perm_kind;
    sim_machine *m = make_machine(tm, false);
    sim_status st = sim_machine_run(m, sweep_device, sc);
    if (st != SIM_OK) fail_msg("run failed: %s", sim_errmsg());
    check_sweep(sc);
    sim_machine_free(m);
    free(sc);
    (*cases)++;
}

static void test_sweep_all_ops(void **state)
{
    (void)state;
    static const tmesh meshes[] = {
        {1, {1}},    {1, {2}},    {1, {3}},    {1, {4}},       {1, {6}},       {1, {8}},
        {2, {2, 3}}, {2, {4, 2}}, {2, {3, 2}}, {3, {2, 2, 2}}, {3, {2, 3, 2}}, {3, {2, 1, 3}},
    };
    static const size_t counts[] = {0, 1, 5};
    int cases = 0, seen_k[16] = {0};
    for (size_t mi = 0; mi < sizeof meshes / sizeof meshes[0]; mi++) {
        const tmesh *tm = &meshes[mi];
        /* every non-empty subset in mesh order, and every subset reversed */
        for (unsigned mask = 1; mask < (1u << tm->naxes); mask++) {
            for (int rev = 0; rev < 2; rev++) {
                sim_axes ax = sim_axes_none();
                for (int a = 0; a < tm->naxes; a++)
                    if (mask & (1u << a)) ax.axis[ax.n++] = (int8_t)a;
                if (rev) {
                    if (ax.n < 2) continue;
                    for (int i = 0; i < ax.n / 2; i++) {
                        int8_t t = ax.axis[i];
                        ax.axis[i] = ax.axis[ax.n - 1 - i];
                        ax.axis[ax.n - 1 - i] = t;
                    }
                }
                seen_k[t_k(tm, ax)] = 1;
                for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
                    run_sweep(tm, ax, counts[ci], (int)(ci % 2), &cases);
            }
        }
    }
    /* the group sizes all occurred */
    int want[] = {1, 2, 3, 4, 6, 8};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) assert_true(seen_k[want[i]]);
    assert_true(cases > 100);
}

/* ------------------------------------------------------------ strided layouts */

typedef struct {
    tmesh tm;
    sim_axes ax;
    float *ag[MAXDEV], *rs[MAXDEV], *a2a[3][MAXDEV];
    size_t shapes[3][3];
    int split[3], concat[3];
    sim_status st[MAXDEV];
} dims_case;

enum { AO = 3, AM = 2, AI = 5 };

static sim_status dims_device(sim_device *d, void *arg)
{
    dims_case *dc = arg;
    int id = sim_device_id(d), k = t_k(&dc->tm, dc->ax);
    size_t nag = AO * AM * AI, nrs = 2 * (size_t)(2 * k) * 3;
    float in[4096];
    for (size_t i = 0; i < 4096; i++) in[i] = val(id, i);
    dc->ag[id] = calloc(nag * (size_t)k, sizeof(float));
    dc->rs[id] = calloc(nrs / (size_t)k, sizeof(float));
    sim_status st = sim_all_gather_dim(d, in, dc->ag[id], AO, AM, AI, SIM_F32, dc->ax, sim_meta_tag("ag_dim"));
    if (!st)
        st = sim_reduce_scatter_dim(d, in, dc->rs[id], 2, (size_t)(2 * k), 3, SIM_F32, dc->ax, sim_meta_tag("rs_dim"));
    for (int t = 0; t < 3 && !st; t++) {
        size_t tot = dc->shapes[t][0] * dc->shapes[t][1] * dc->shapes[t][2];
        dc->a2a[t][id] = calloc(tot, sizeof(float));
        st = sim_all_to_all_dims(d, in, dc->a2a[t][id], 3, dc->shapes[t], dc->split[t], dc->concat[t], SIM_F32, dc->ax,
                                 sim_meta_tag("a2a_dims"));
    }
    dc->st[id] = st;
    return st;
}

static void test_strided_layouts(void **state)
{
    (void)state;
    static const tmesh meshes[] = {{1, {2}}, {1, {3}}, {2, {2, 2}}, {2, {2, 3}}};
    for (size_t mi = 0; mi < 4; mi++) {
        dims_case *dc = calloc(1, sizeof *dc);
        dc->tm = meshes[mi];
        for (int a = dc->tm.naxes - 1; a >= 0; a--) dc->ax.axis[dc->ax.n++] = (int8_t)a; /* reversed order */
        const tmesh *tm = &dc->tm;
        int n = t_ndev(tm), k = t_k(tm, dc->ax);
        size_t K = (size_t)k;
        /* (4, 2k, 3) split 1 concat 0;  (2k, 3, 2) split 0 concat 2;  (2, 3k, 2) split 1 concat 1 */
        size_t sh[3][3] = {{4, 2 * K, 3}, {2 * K, 3, 2}, {2, 3 * K, 2}};
        int sp[3] = {1, 0, 1}, cc[3] = {0, 2, 1};
        memcpy(dc->shapes, sh, sizeof sh);
        memcpy(dc->split, sp, sizeof sp);
        memcpy(dc->concat, cc, sizeof cc);
        sim_machine *m = make_machine(tm, false);
        if (sim_machine_run(m, dims_device, dc) != SIM_OK) fail_msg("%s", sim_errmsg());
        for (int id = 0; id < n; id++) {
            int r = t_rank(tm, id, dc->ax);
            /* all-gather along the middle dim: out (AO, k*AM, AI) */
            for (size_t o = 0; o < AO; o++)
                for (size_t j = 0; j < K * AM; j++)
                    for (size_t i = 0; i < AI; i++) {
                        int q = (int)(j / AM);
                        float want = val(t_member(tm, id, dc->ax, q), (o * AM + j % AM) * AI + i);
                        assert_true(dc->ag[id][(o * K * AM + j) * AI + i] == want);
                    }
            /* reduce-scatter along the middle dim: in (2, 2k, 3) -> out (2, 2, 3) */
            for (size_t o = 0; o < 2; o++)
                for (size_t j = 0; j < 2; j++)
                    for (size_t i = 0; i < 3; i++) {
                        float s = 0;
                        for (int q = 0; q < k; q++)
                            s += val(t_member(tm, id, dc->ax, q), (o * 2 * K + (size_t)r * 2 + j) * 3 + i);
                        assert_true(dc->rs[id][(o * 2 + j) * 3 + i] == s);
                    }
            /* all-to-all: out index -> (source rank, source index) from the definition */
            for (int t = 0; t < 3; t++) {
                size_t in_sh[3], out_sh[3];
                memcpy(in_sh, dc->shapes[t], sizeof in_sh);
                memcpy(out_sh, in_sh, sizeof out_sh);
                out_sh[dc->split[t]] /= K;
                out_sh[dc->concat[t]] *= K;
                size_t blk = out_sh[dc->concat[t]] / K;
                for (size_t x = 0; x < out_sh[0]; x++)
                    for (size_t y = 0; y < out_sh[1]; y++)
                        for (size_t z = 0; z < out_sh[2]; z++) {
                            size_t idx[3] = {x, y, z};
                            int q = (int)(idx[dc->concat[t]] / blk);
                            size_t src[3] = {x, y, z};
                            src[dc->concat[t]] = idx[dc->concat[t]] % blk;
                            src[dc->split[t]] += (size_t)r * (in_sh[dc->split[t]] / K);
                            size_t flat = (src[0] * in_sh[1] + src[1]) * in_sh[2] + src[2];
                            float want = val(t_member(tm, id, dc->ax, q), flat);
                            assert_true(dc->a2a[t][id][(x * out_sh[1] + y) * out_sh[2] + z] == want);
                        }
            }
        }
        for (int id = 0; id < n; id++) {
            free(dc->ag[id]);
            free(dc->rs[id]);
            for (int t = 0; t < 3; t++) free(dc->a2a[t][id]);
        }
        sim_machine_free(m);
        free(dc);
    }
}

/* ------------------------------------------------------------ errors */

typedef struct {
    int mode;
} err_case;

static sim_status err_device(sim_device *d, void *arg)
{
    err_case *ec = arg;
    int id = sim_device_id(d);
    float buf[64] = {0}, out[64];
    sim_axes ax = sim_axes_1(0);
    switch (ec->mode) {
    case 0: /* indivisible reduce-scatter */
        return sim_reduce_scatter(d, buf, out, 7, SIM_F32, ax, sim_meta_tag("layer3/rs"));
    case 1: /* different sizes */
        return sim_all_gather(d, buf, out, id == 1 ? 5 : 4, SIM_F32, ax, sim_meta_tag(id == 1 ? "mlp/wi" : "mlp/wo"));
    case 2: /* different ops */
        if (id == 2) return sim_all_reduce(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("attn/out"));
        return sim_all_gather(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("attn/q"));
    case 3: /* one device leaves early: the rest wait forever */
        if (id == 3) return SIM_OK;
        return sim_all_gather(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("embed/ag"));
    case 4: /* different axis order on a 2-D group */
        return sim_all_gather(d, buf, out, 2, SIM_F32, id == 0 ? sim_axes_2(0, 1) : sim_axes_2(1, 0),
                              sim_meta_tag("order"));
    case 5: { /* ragged counts that disagree */
        size_t so[4] = {0, 1, 2, 3}, sn[4] = {1, 1, 1, 1}, ro[4] = {0, 1, 2, 3}, rn[4] = {1, 1, 1, 1};
        if (id == 0) rn[1] = 2;
        return sim_ragged_all_to_all(d, buf, out, 8, so, sn, ro, rn, SIM_F32, ax, sim_meta_tag("moe/dispatch"));
    }
    case 7: /* one odd device among many */
        if (id == 437) return sim_all_reduce(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("odd/one"));
        return sim_all_gather(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("attn/q"));
    case 8: /* device 2 is stuck elsewhere: the watchdog names who waits, on what, for whom */
        if (id == 2) {
            usleep(1500 * 1000);
            return SIM_OK;
        }
        return sim_all_gather(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("stuck/ag"));
    case 6: /* a device's own failure stops the others */
        if (id == 0) return sim_err(SIM_ERR_CHECK, "device 0 found a problem");
        return sim_all_reduce(d, buf, out, 4, SIM_F32, ax, sim_meta_tag("x"));
    case 9:  /* dry runs: device 0 runs far ahead of the others, then they catch up */
    case 10: /* ... and device 2 stops half way */
        if (id != 0) usleep(20000);
        for (int i = 0; i < (ec->mode == 10 && id == 2 ? 150 : 300); i++)
            SIM_TRY(sim_all_gather(d, NULL, NULL, 4, SIM_F32, ax, sim_meta_tag("loop/ag")));
        return SIM_OK;
    }
    return SIM_OK;
}

static sim_status run_err_in(int mode, const tmesh *tm, double *secs, bool dry)
{
    sim_machine *m = make_machine(tm, dry);
    if (mode == 8) sim_machine_set_collective_timeout(m, 0.3);
    err_case ec = {mode};
    uint64_t t0 = sim_now_ns();
    sim_status st = sim_machine_run(m, err_device, &ec);
    *secs = (double)(sim_now_ns() - t0) / 1e9;
    if (st == SIM_OK && (mode == 9 || mode == 10))
        for (int id = 0; id < sim_machine_num_devices(m); id++) {
            size_t nrec;
            sim_device_records(sim_machine_device(m, id), &nrec);
            assert_int_equal(nrec, 300);
        }
    sim_machine_free(m);
    return st;
}

static sim_status run_err(int mode, const tmesh *tm, double *secs) { return run_err_in(mode, tm, secs, false); }

/* Dry runs post calls without waiting (sim_post): the same mismatches are found, calls without
 * partners are a deadlock, and a device far ahead waits (bounded memory) without changing results. */
static void test_errors_dry(void **state)
{
    (void)state;
    tmesh m4 = {1, {4}};
    double secs;
    assert_int_equal(run_err_in(1, &m4, &secs, true), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "mlp/wi"));
    assert_non_null(strstr(sim_errmsg(), "mlp/wo"));
    assert_int_equal(run_err_in(2, &m4, &secs, true), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "all-reduce"));
    assert_int_equal(run_err_in(5, &m4, &secs, true), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "moe/dispatch"));
    assert_int_equal(run_err_in(3, &m4, &secs, true), SIM_ERR_DEADLOCK);
    assert_non_null(strstr(sim_errmsg(), "device 3 made 0 collective calls"));
    assert_non_null(strstr(sim_errmsg(), "embed/ag"));
    assert_int_equal(run_err_in(9, &m4, &secs, true), SIM_OK);
    assert_int_equal(run_err_in(10, &m4, &secs, true), SIM_ERR_DEADLOCK);
    assert_true(secs < 5.0);
    assert_non_null(strstr(sim_errmsg(), "device 2 (finished)"));
    assert_non_null(strstr(sim_errmsg(), "loop/ag"));
}

static void test_errors(void **state)
{
    (void)state;
    tmesh m4 = {1, {4}}, m22 = {2, {2, 2}};
    double secs;
    assert_int_equal(run_err(0, &m4, &secs), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "not divisible"));
    assert_non_null(strstr(sim_errmsg(), "layer3/rs"));

    assert_int_equal(run_err(1, &m4, &secs), SIM_ERR_MISMATCH);
    assert_true(secs < 5.0);
    assert_non_null(strstr(sim_errmsg(), "device 1"));
    assert_non_null(strstr(sim_errmsg(), "mlp/wi"));
    assert_non_null(strstr(sim_errmsg(), "mlp/wo"));

    assert_int_equal(run_err(2, &m4, &secs), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "all-reduce"));
    assert_non_null(strstr(sim_errmsg(), "attn/q"));

    assert_int_equal(run_err(3, &m4, &secs), SIM_ERR_DEADLOCK);
    assert_true(secs < 5.0);
    assert_non_null(strstr(sim_errmsg(), "device 3 (finished)"));
    assert_non_null(strstr(sim_errmsg(), "embed/ag"));

    assert_int_equal(run_err(4, &m22, &secs), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "(a0, a1)"));
    assert_non_null(strstr(sim_errmsg(), "(a1, a0)"));

    assert_int_equal(run_err(5, &m4, &secs), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "moe/dispatch"));

    /* 512 devices, one odd one out: named, the other 511 summarised */
    tmesh m512 = {1, {512}};
    assert_int_equal(run_err(7, &m512, &secs), SIM_ERR_MISMATCH);
    assert_non_null(strstr(sim_errmsg(), "2 different collectives"));
    assert_non_null(strstr(sim_errmsg(), "1 device (device 437"));
    assert_non_null(strstr(sim_errmsg(), "odd/one"));
    assert_non_null(strstr(sim_errmsg(), "511 devices (device 0"));
    assert_non_null(strstr(sim_errmsg(), "503 more"));

    /* the watchdog: ends the wait after 0.3 s (before device 2 finishes at 1.5 s) */
    assert_int_equal(run_err(8, &m4, &secs), SIM_ERR_DEADLOCK);
    assert_non_null(strstr(sim_errmsg(), "collective watchdog"));
    assert_non_null(strstr(sim_errmsg(), "all-gather"));
    assert_non_null(strstr(sim_errmsg(), "stuck/ag"));
    assert_non_null(strstr(sim_errmsg(), "device 2 (elsewhere)"));

    assert_int_equal(run_err(6, &m4, &secs), SIM_ERR_CHECK);
    assert_non_null(strstr(sim_errmsg(), "device 0 found a problem"));
}

/* ------------------------------------------------------------ determinism, dry run */

typedef struct {
    float *out[MAXDEV];
    size_t n;
    sim_record rec[MAXDEV];
} det_case;

static float noise(int dev, size_t i)
{
    uint64_t x = (uint64_t)dev * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 29;
    return (float)((double)(x >> 11) / 9007199254740992.0 - 0.5) * 3.7f;
}

static sim_status det_device(sim_device *d, void *arg)
{
    det_case *dc = arg;
    int id = sim_device_id(d);
    float *x = NULL;
    if (!sim_device_dry(d)) {
        x = malloc(dc->n * sizeof(float));
        dc->out[id] = malloc(dc->n * sizeof(float));
        for (size_t i = 0; i < dc->n; i++) x[i] = noise(id, i);
    }
    sim_status st = sim_all_reduce(d, x, dc->out[id], dc->n, SIM_F32, sim_axes_1(0), sim_meta_tag("grad"));
    size_t nr;
    dc->rec[id] = sim_device_records(d, &nr)[0];
    free(x);
    return st;
}

static void test_all_reduce_deterministic_and_dry(void **state)
{
    (void)state;
    tmesh tm = {1, {6}};
    det_case a = {.n = 1003}, b = {.n = 1003}, dry = {.n = 1003};
    for (int run = 0; run < 2; run++) {
        sim_machine *m = make_machine(&tm, false);
        assert_int_equal(sim_machine_run(m, det_device, run ? &b : &a), SIM_OK);
        sim_machine_free(m);
    }
    /* the sum in rank order, computed here */
    for (size_t i = 0; i < a.n; i++) {
        float s = noise(0, i);
        for (int q = 1; q < 6; q++) s += noise(q, i);
        for (int id = 0; id < 6; id++) {
            assert_memory_equal(&a.out[id][i], &s, sizeof s);
            assert_memory_equal(&b.out[id][i], &s, sizeof s);
        }
    }
    sim_machine *m = make_machine(&tm, true);
    assert_int_equal(sim_machine_run(m, det_device, &dry), SIM_OK);
    for (int id = 0; id < 6; id++) {
        assert_int_equal(dry.rec[id].bytes_sent, a.rec[id].bytes_sent);
        assert_int_equal(dry.rec[id].bytes_recv, a.rec[id].bytes_recv);
        assert_int_equal(dry.rec[id].elements, a.rec[id].elements);
        free(a.out[id]);
        free(b.out[id]);
    }
    sim_machine_free(m);
}

/* ------------------------------------------------------------ large exchanges */

/* Collectives large enough that the last member to arrive shares the data
 * movement with helper threads (sim_exchange), several in a row on the same
 * groups: an in-place all-reduce over y (k = 4, chunks of unequal size), a
 * reduce-scatter over (x, y) (k = 8) and one of 1001 short rows (summed a row
 * at a time, in tasks of unequal row counts).  The sums, in rank order, are
 * computed here; they must match bit for bit on every device and round. */
enum { BIG_AR = 100003, BIG_RS = 40000, BIG_ROUNDS = 3 };
/* and a reduce-scatter of short rows (summed row by row): 1001 rows of 16 x 5 scattered on the 16 */
enum { ROWS_O = 1001, ROWS_MID = 16, ROWS_IN = 5, ROWS_CHUNK = ROWS_MID / 8 * ROWS_IN };

typedef struct {
    float *ar[8], *rs[8], *rows[8];
} big_case;

static sim_status big_device(sim_device *d, void *arg)
{
    big_case *bc = arg;
    int id = sim_device_id(d);
    float *x = malloc((size_t)8 * BIG_RS * sizeof *x);
    float *ar = bc->ar[id], *rs = bc->rs[id], *rows = bc->rows[id];
    sim_status st = SIM_OK;
    for (int round = 0; round < BIG_ROUNDS && st == SIM_OK; round++) {
        for (size_t i = 0; i < BIG_AR; i++) ar[(size_t)round * BIG_AR + i] = noise(id + 8 * round, i);
        st = sim_all_reduce(d, ar + (size_t)round * BIG_AR, ar + (size_t)round * BIG_AR, BIG_AR, SIM_F32, sim_axes_1(1),
                            sim_meta_tag("big/ar"));
        for (size_t i = 0; i < (size_t)8 * BIG_RS; i++) x[i] = noise(100 + id + 8 * round, i);
        if (st == SIM_OK)
            st = sim_reduce_scatter(d, x, rs + (size_t)round * BIG_RS, (size_t)8 * BIG_RS, SIM_F32, sim_axes_2(0, 1),
                                    sim_meta_tag("big/rs"));
        for (size_t i = 0; i < (size_t)ROWS_O * ROWS_MID * ROWS_IN; i++) x[i] = noise(200 + id + 8 * round, i);
        if (st == SIM_OK)
            st = sim_reduce_scatter_dim(d, x, rows + (size_t)round * ROWS_O * ROWS_CHUNK, ROWS_O, ROWS_MID, ROWS_IN,
                                        SIM_F32, sim_axes_2(0, 1), sim_meta_tag("big/rows"));
    }
    free(x);
    return st;
}

static void test_large_exchanges(void **state)
{
    (void)state;
    tmesh tm = {2, {2, 4}};
    big_case *bc = calloc(1, sizeof *bc);
    for (int id = 0; id < 8; id++) {
        bc->ar[id] = malloc((size_t)BIG_ROUNDS * BIG_AR * sizeof(float));
        bc->rs[id] = malloc((size_t)BIG_ROUNDS * BIG_RS * sizeof(float));
        bc->rows[id] = malloc((size_t)BIG_ROUNDS * ROWS_O * ROWS_CHUNK * sizeof(float));
    }
    sim_machine *m = make_machine(&tm, false);
    assert_int_equal(sim_machine_run(m, big_device, bc), SIM_OK);
    int bad = 0;
    for (int round = 0; round < BIG_ROUNDS; round++)
        for (int id = 0; id < 8; id++) {
            int x = id / 4;
            for (size_t i = 0; i < BIG_AR; i++) { /* over y: the devices 4x .. 4x+3, in y order */
                float s = noise(4 * x + 8 * round, i);
                for (int y = 1; y < 4; y++) s += noise(4 * x + y + 8 * round, i);
                bad += memcmp(&bc->ar[id][(size_t)round * BIG_AR + i], &s, sizeof s) != 0;
            }
            for (size_t i = 0; i < BIG_RS; i++) { /* over (x, y): rank = device id; this device's block */
                size_t at = (size_t)id * BIG_RS + i;
                float s = noise(100 + 8 * round, at);
                for (int q = 1; q < 8; q++) s += noise(100 + q + 8 * round, at);
                bad += memcmp(&bc->rs[id][(size_t)round * BIG_RS + i], &s, sizeof s) != 0;
            }
            for (size_t o = 0; o < ROWS_O; o++) /* row o, this device's piece of the scattered dim */
                for (size_t i = 0; i < ROWS_CHUNK; i++) {
                    size_t at = o * ROWS_MID * ROWS_IN + (size_t)id * ROWS_CHUNK + i;
                    float s = noise(200 + 8 * round, at);
                    for (int q = 1; q < 8; q++) s += noise(200 + q + 8 * round, at);
                    bad += memcmp(&bc->rows[id][((size_t)round * ROWS_O + o) * ROWS_CHUNK + i], &s, sizeof s) != 0;
                }
        }
    assert_int_equal(bad, 0);
    for (int id = 0; id < 8; id++) {
        free(bc->ar[id]);
        free(bc->rs[id]);
        free(bc->rows[id]);
    }
    free(bc);
    sim_machine_free(m);
}

/* ------------------------------------------------------------ summation order */

/* The reductions sum up to four sources per pass (the first pass two to four): every group size
 * from 2 to 13 (first passes of 2, 3 and 4 sources, later ones of 1 to 4), counts that end inside
 * and across the 2048-element blocks, in place and not.  Values whose sums round, so only the
 * rank-order sum x0 + x1 + ... (computed here one add at a time) matches bit for bit. */
enum { ORDER_N = 2 * 2048 + 37 };

typedef struct {
    int k;
    float *ar[13], *ip[13], *rs[13];
} order_case;

static sim_status order_device(sim_device *d, void *arg)
{
    order_case *oc = arg;
    int id = sim_device_id(d);
    float *x = malloc((size_t)ORDER_N * sizeof *x);
    for (size_t i = 0; i < ORDER_N; i++) x[i] = oc->ip[id][i] = noise(300 + id, i);
    sim_status st = sim_all_reduce(d, x, oc->ar[id], ORDER_N, SIM_F32, sim_axes_1(0), sim_meta_tag("order/ar"));
    if (st == SIM_OK)
        st = sim_all_reduce(d, oc->ip[id], oc->ip[id], ORDER_N, SIM_F32, sim_axes_1(0), sim_meta_tag("order/ip"));
    if (st == SIM_OK) /* (k, ORDER_N / k) rows scattered on the rows: each rank its block */
        st = sim_reduce_scatter(d, x, oc->rs[id], (size_t)ORDER_N / (size_t)oc->k * (size_t)oc->k, SIM_F32,
                                sim_axes_1(0), sim_meta_tag("order/rs"));
    free(x);
    return st;
}

static void test_sum_order(void **state)
{
    (void)state;
    for (int k = 2; k <= 13; k++) {
        tmesh tm = {1, {k}};
        order_case oc = {k, {0}, {0}, {0}};
        size_t blk = (size_t)ORDER_N / (size_t)k;
        for (int id = 0; id < k; id++) {
            oc.ar[id] = malloc((size_t)ORDER_N * sizeof(float));
            oc.ip[id] = malloc((size_t)ORDER_N * sizeof(float));
            oc.rs[id] = malloc(blk * sizeof(float));
        }
        sim_machine *m = make_machine(&tm, false);
        assert_int_equal(sim_machine_run(m, order_device, &oc), SIM_OK);
        int bad = 0;
        for (size_t i = 0; i < ORDER_N; i++) {
            float s = noise(300, i);
            for (int q = 1; q < k; q++) s += noise(300 + q, i);
            for (int id = 0; id < k; id++) {
                bad += memcmp(&oc.ar[id][i], &s, sizeof s) != 0;
                bad += memcmp(&oc.ip[id][i], &s, sizeof s) != 0;
                if (i / blk == (size_t)id && i < blk * (size_t)k) bad += memcmp(&oc.rs[id][i % blk], &s, sizeof s) != 0;
            }
        }
        if (bad) fail_msg("group of %d: %d sums differ from the rank-order sum", k, bad);
        for (int id = 0; id < k; id++) {
            free(oc.ar[id]);
            free(oc.ip[id]);
            free(oc.rs[id]);
        }
        sim_machine_free(m);
    }
}

/* ------------------------------------------------------------ shared all-gather */

/* Every member gathers the same (outer, mid, inner) blocks twice: the plain
 * way into its own buffer, then into the group's shared one.  Device 1 may
 * call the plain one where the others share (a mismatch), and a second run
 * may give the references back. */
enum { SG_MAXDEV = 8 };

typedef struct {
    tmesh tm;
    sim_axes ax;
    size_t outer, mid, inner;
    bool odd_one_out; /* device 1 calls the plain all-gather in place of the shared one */
    float *plain[SG_MAXDEV];
    void *shared[SG_MAXDEV];
    sim_record rec_plain[SG_MAXDEV], rec_shared[SG_MAXDEV];
    sim_arena_stats arena_before[SG_MAXDEV], arena_after[SG_MAXDEV];
} sg_case;

static sim_status sg_device(sim_device *d, void *arg)
{
    sg_case *sc = arg;
    int id = sim_device_id(d), k = t_k(&sc->tm, sc->ax);
    size_t n = sc->outer * sc->mid * sc->inner;
    bool dry = sim_device_dry(d);
    float *in = dry ? NULL : malloc(n * sizeof(float) + 1);
    for (size_t i = 0; in && i < n; i++) in[i] = val(id, i);
    sc->plain[id] = dry ? NULL : malloc((size_t)k * n * sizeof(float) + 1);
    sim_arena_get_stats(sim_device_arena(d), &sc->arena_before[id]);
    sim_status st = sim_all_gather_dim(d, in, sc->plain[id], sc->outer, sc->mid, sc->inner, SIM_F32, sc->ax,
                                       sim_meta_weight("w/ag"));
    if (st == SIM_OK) {
        size_t nr;
        sc->rec_plain[id] = sim_device_records(d, &nr)[nr - 1];
        if (sc->odd_one_out && id == 1) {
            float *again = dry ? NULL : malloc((size_t)k * n * sizeof(float) + 1);
            st = sim_all_gather_dim(d, in, again, sc->outer, sc->mid, sc->inner, SIM_F32, sc->ax,
                                    sim_meta_weight("w/ag"));
            free(again);
        } else {
            st = sim_all_gather_dim_shared(d, in, &sc->shared[id], sc->outer, sc->mid, sc->inner, SIM_F32, sc->ax,
                                           sim_meta_weight("w/ag"));
        }
        if (st == SIM_OK) sc->rec_shared[id] = sim_device_records(d, &nr)[nr - 1];
    }
    sim_arena_get_stats(sim_device_arena(d), &sc->arena_after[id]);
    free(in);
    return st;
}

static sim_status sg_release(sim_device *d, void *arg)
{
    sg_case *sc = arg;
    sim_shared_release(d, sc->shared[sim_device_id(d)]);
    return SIM_OK;
}

static void sg_free(sg_case *sc)
{
    for (int id = 0; id < SG_MAXDEV; id++) free(sc->plain[id]);
}

static void sg_same_record(const sim_record *a, const sim_record *b)
{
    assert_int_equal(a->op, SIM_OP_ALL_GATHER);
    assert_int_equal(b->op, SIM_OP_ALL_GATHER);
    assert_int_equal(a->group_size, b->group_size);
    assert_int_equal(a->dtype, b->dtype);
    assert_int_equal(a->elements, b->elements);
    assert_int_equal(a->bytes_sent, b->bytes_sent);
    assert_int_equal(a->bytes_recv, b->bytes_recv);
    assert_int_equal(a->weight, b->weight);
    assert_string_equal(a->tag, b->tag);
}

/* The shared buffer holds what the plain gather gives (both checked against the definition: block
 * q of each outer row is rank q's row), is one pointer per group, counts like the plain one, leaves
 * the arenas alone, and is freed once every member gave its reference back. */
static void sg_check_on(sim_machine *m, const tmesh *tm, sim_axes ax, size_t outer, size_t mid, size_t inner)
{
    sg_case *sc = calloc(1, sizeof *sc);
    sc->tm = *tm;
    sc->ax = ax;
    sc->outer = outer, sc->mid = mid, sc->inner = inner;
    int ndev = t_ndev(tm), k = t_k(tm, ax);
    size_t chunk = mid * inner, K = (size_t)k;
    uint64_t made0, made, live;
    sim_machine_shared_stats(m, &made0, &live);
    assert_int_equal(live, 0);
    if (sim_machine_run(m, sg_device, sc) != SIM_OK) fail_msg("%s", sim_errmsg());
    sim_machine_shared_stats(m, &made, &live);
    made -= made0;
    assert_int_equal(made, (uint64_t)(ndev / k)); /* one buffer per group */
    assert_int_equal(live, made);
    int bad = 0;
    for (int id = 0; id < ndev; id++) {
        const float *sh = sc->shared[id];
        assert_non_null(sh);
        for (size_t o = 0; o < outer; o++)
            for (size_t q = 0; q < K; q++)
                for (size_t i = 0; i < chunk; i++) {
                    float want = val(t_member(tm, id, ax, (int)q), o * chunk + i);
                    size_t at = (o * K + q) * chunk + i;
                    bad += sc->plain[id][at] != want;
                    bad += memcmp(&sh[at], &want, sizeof want) != 0;
                }
        for (int other = 0; other < ndev; other++) { /* the same buffer exactly within the group */
            bool same_group = t_member(tm, id, ax, 0) == t_member(tm, other, ax, 0);
            assert_true((sc->shared[other] == sc->shared[id]) == same_group);
        }
        sg_same_record(&sc->rec_shared[id], &sc->rec_plain[id]);
        assert_int_equal(sc->rec_shared[id].bytes_sent, (K - 1) * outer * chunk * sizeof(float));
        assert_memory_equal(&sc->arena_before[id], &sc->arena_after[id], sizeof(sim_arena_stats));
    }
    assert_int_equal(bad, 0);
    /* references given back: the last member of each group frees its buffer (ASan checks once) */
    if (sim_machine_run(m, sg_release, sc) != SIM_OK) fail_msg("%s", sim_errmsg());
    sim_machine_shared_stats(m, &made, &live);
    assert_int_equal(made - made0, (uint64_t)(ndev / k));
    assert_int_equal(live, 0);
    sg_free(sc);
    free(sc);
}

static void sg_check(const tmesh *tm, sim_axes ax, size_t outer, size_t mid, size_t inner)
{
    sim_machine *m = make_machine(tm, false);
    sg_check_on(m, tm, ax, outer, mid, inner);
    sim_machine_free(m);
}

/* Released shared buffers of 32 MiB or more are kept for the next gather of the same size: a second
 * gather of the same bytes in another layout (block q of each row lands elsewhere: stale contents
 * would show) takes the kept one and gives it back; smaller ones are not kept; at most 4 are, the
 * oldest dropped; the machine frees them (ASan's leak check). */
static void test_shared_gather_kept(void **state)
{
    (void)state;
    tmesh m2 = {1, {2}};
    sim_machine *m = make_machine(&m2, false);
    const size_t MiB4 = (size_t)1 << 20; /* floats in 4 MiB */
    size_t kept_bytes;
    sg_check_on(m, &m2, sim_axes_1(0), 1, 4 * MiB4 - 16, 1); /* 32 MiB less 128 bytes: not kept */
    assert_int_equal(sim_machine_shared_kept(m, &kept_bytes), 0);
    sg_check_on(m, &m2, sim_axes_1(0), 1, 4 * MiB4, 1); /* 2 x 16 MiB: a 32 MiB buffer */
    assert_int_equal(sim_machine_shared_kept(m, &kept_bytes), 1);
    assert_int_equal(kept_bytes, (size_t)32 << 20);
    sg_check_on(m, &m2, sim_axes_1(0), 4, MiB4, 1); /* the same bytes, 4 rows: reuses it */
    assert_int_equal(sim_machine_shared_kept(m, &kept_bytes), 1);
    assert_int_equal(kept_bytes, (size_t)32 << 20);
    for (size_t extra = 1; extra <= 4; extra++) /* four more sizes: 5 released, the oldest (32 MiB) dropped */
        sg_check_on(m, &m2, sim_axes_1(0), 1, 4 * MiB4 + extra * 1024, 1);
    assert_int_equal(sim_machine_shared_kept(m, &kept_bytes), 4);
    assert_int_equal(kept_bytes, 4 * ((size_t)32 << 20) + 2 * sizeof(float) * 1024 * (1 + 2 + 3 + 4));
    sim_machine_free(m);
}

#ifdef __SANITIZE_ADDRESS__
/* sg_huge asks for more than ASan's allocator serves: let it return NULL, as glibc's malloc does */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }
#endif
#ifdef __SANITIZE_THREAD__
const char *__tsan_default_options(void);
const char *__tsan_default_options(void) { return "allocator_may_return_null=1"; }
#endif

static sim_status sg_huge(sim_device *d, void *arg)
{
    (void)arg;
    float dummy[4] = {0}; /* never read: the buffer is made before any data moves */
    void *out = NULL;
    /* 2^58 floats a rank: no host can map that many bytes */
    sim_status st = sim_all_gather_dim_shared(d, dummy, &out, 1, (size_t)1 << 58, 1, SIM_F32, sim_axes_1(0),
                                              sim_meta_tag("act/huge"));
    assert_null(out);
    return st;
}

/* A shared buffer the host cannot allocate fails the run with an error naming the gather and the
 * bytes (one member alone and a group of 4: the others stop), and the machine stays usable. */
static void test_shared_gather_no_host_memory(void **state)
{
    (void)state;
    tmesh m1 = {1, {1}}, m4 = {1, {4}};
    const tmesh *meshes[] = {&m1, &m4};
    const char *bytes[] = {"1152921504606846976 bytes", "4611686018427387904 bytes"};
    for (int i = 0; i < 2; i++) {
        sim_machine *m = make_machine(meshes[i], false);
        assert_int_equal(sim_machine_run(m, sg_huge, NULL), SIM_ERR_INTERNAL);
        assert_non_null(strstr(sim_errmsg(), "out of host memory"));
        assert_non_null(strstr(sim_errmsg(), "act/huge"));
        if (!strstr(sim_errmsg(), bytes[i])) fail_msg("'%s' lacks '%s'", sim_errmsg(), bytes[i]);
        uint64_t made, live;
        sim_machine_shared_stats(m, &made, &live);
        assert_int_equal(made, 0);
        sim_machine_free(m);
    }
}

static void test_shared_gather(void **state)
{
    (void)state;
    tmesh m1 = {1, {1}}, m4 = {1, {4}}, m23 = {2, {2, 3}}, m222 = {3, {2, 2, 2}};
    sg_check(&m1, sim_axes_1(0), 2, 3, 1);      /* a group of one */
    sg_check(&m4, sim_axes_1(0), 1, 5, 1);      /* odd count */
    sg_check(&m4, sim_axes_1(0), 3, 2, 4);      /* a middle dim */
    sg_check(&m23, sim_axes_2(1, 0), 2, 3, 2);  /* two axes in reverse order, 6 devices */
    sg_check(&m23, sim_axes_1(1), 1, 0, 1);     /* nothing to gather */
    sg_check(&m222, sim_axes_2(0, 2), 2, 2, 2); /* groups that are not neighbours */
    sg_check(&m4, sim_axes_1(0), 4, 4096, 2);   /* large enough for helpers to share the copy */
}

static void test_shared_gather_dry_and_mismatch(void **state)
{
    (void)state;
    tmesh m4 = {1, {4}};
    /* dry run: nothing moves and nothing is made, the records are the plain ones */
    sg_case *sc = calloc(1, sizeof *sc);
    sc->tm = m4;
    sc->ax = sim_axes_1(0);
    sc->outer = 2, sc->mid = 3, sc->inner = 1;
    sim_machine *m = make_machine(&m4, true);
    if (sim_machine_run(m, sg_device, sc) != SIM_OK) fail_msg("%s", sim_errmsg());
    uint64_t made, live;
    sim_machine_shared_stats(m, &made, &live);
    assert_int_equal(made, 0);
    for (int id = 0; id < 4; id++) {
        assert_null(sc->shared[id]);
        sg_same_record(&sc->rec_shared[id], &sc->rec_plain[id]);
        assert_int_equal(sc->rec_shared[id].bytes_sent, 3 * 2 * 3 * sizeof(float));
    }
    sim_machine_free(m);
    sg_free(sc);
    /* a shared and a plain all-gather in one group: a mismatch naming the shared call, no buffer made */
    for (int dry = 0; dry < 2; dry++) {
        memset(sc, 0, sizeof *sc);
        sc->tm = m4;
        sc->ax = sim_axes_1(0);
        sc->outer = 1, sc->mid = 4, sc->inner = 1;
        sc->odd_one_out = true;
        m = make_machine(&m4, dry);
        assert_int_equal(sim_machine_run(m, sg_device, sc), SIM_ERR_MISMATCH);
        assert_non_null(strstr(sim_errmsg(), "all-gather (shared)"));
        assert_non_null(strstr(sim_errmsg(), "w/ag"));
        sim_machine_shared_stats(m, &made, &live);
        assert_int_equal(made, 0);
        sim_machine_free(m);
        sg_free(sc);
    }
    free(sc);
}

/* ------------------------------------------------------------ slices */

/* Mesh (x=4, y=2) on two slices: x = dcn 2 x ici 2, so devices with x in
 * {0,1} form slice 0 and x in {2,3} slice 1; y stays inside a slice. */
typedef struct {
    sim_record rec[8][5];
} dcn_case;

static sim_status dcn_device(sim_device *d, void *arg)
{
    dcn_case *dc = arg;
    int id = sim_device_id(d);
    float x[32] = {0}, y[256];
    sim_axes both = sim_axes_2(0, 1), xs = sim_axes_1(0), ys = sim_axes_1(1);
    int perm[4] = {2, 3, 0, 1}; /* x -> x+2 mod 4: every pair crosses slices */
    SIM_TRY(sim_all_gather(d, x, y, 8, SIM_F32, both, sim_meta_tag("ag")));
    SIM_TRY(sim_all_reduce(d, x, y, 32, SIM_F32, xs, sim_meta_tag("ar")));
    SIM_TRY(sim_reduce_scatter(d, x, y, 16, SIM_F32, ys, sim_meta_tag("rs")));
    SIM_TRY(sim_ppermute(d, x, y, 8, perm, SIM_F32, xs, sim_meta_tag("pp")));
    SIM_TRY(sim_all_to_all(d, x, y, 32, SIM_F32, xs, sim_meta_tag("a2a")));
    size_t nr;
    const sim_record *r = sim_device_records(d, &nr);
    for (size_t i = 0; i < 5 && i < nr; i++) dc->rec[id][i] = r[i];
    return SIM_OK;
}

static void test_dcn_bytes(void **state)
{
    (void)state;
    static const char *names[] = {"x", "y"};
    int sizes[] = {4, 2};
    sim_mesh_desc md;
    assert_int_equal(sim_mesh_desc_make(2, names, sizes, &md), SIM_OK);
    md.dcn[0] = 2;
    for (int id = 0; id < 8; id++) assert_int_equal(sim_mesh_slice(&md, id), id / 4); /* x = id / 2 */
    sim_machine_opts o = {0};
    o.quiet = true;
    sim_machine *m = NULL;
    assert_int_equal(sim_machine_new(&md, &o, &m), SIM_OK);
    dcn_case *dc = calloc(1, sizeof *dc);
    assert_int_equal(sim_machine_run(m, dcn_device, dc), SIM_OK);
    for (int id = 0; id < 8; id++) {
        const sim_record *r = dc->rec[id];
        /* all-gather over (x, y), 8 peers: 7 blocks of 32 B sent, 4 of them to the other slice */
        assert_int_equal(r[0].bytes_sent, 7 * 32);
        assert_int_equal(r[0].bytes_sent_dcn, 4 * 32);
        /* all-reduce over x (k=4, 32 floats, chunks of 8): to each peer its chunk and my reduced chunk,
         * 2 x 32 B; 2 of the 3 peers are in the other slice */
        assert_int_equal(r[1].bytes_sent, 3 * 64);
        assert_int_equal(r[1].bytes_sent_dcn, 2 * 64);
        /* reduce-scatter over y: within a slice */
        assert_int_equal(r[2].bytes_sent, 32);
        assert_int_equal(r[2].bytes_sent_dcn, 0);
        /* ppermute x -> x+2: all of it crosses */
        assert_int_equal(r[3].bytes_sent, 32);
        assert_int_equal(r[3].bytes_sent_dcn, 32);
        /* all-to-all over x, 32 floats: 8 floats to each of 3 peers, 2 across */
        assert_int_equal(r[4].bytes_sent, 3 * 32);
        assert_int_equal(r[4].bytes_sent_dcn, 2 * 32);
    }
    free(dc);
    sim_machine_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sweep_all_ops),
        cmocka_unit_test(test_strided_layouts),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_errors_dry),
        cmocka_unit_test(test_all_reduce_deterministic_and_dry),
        cmocka_unit_test(test_large_exchanges),
        cmocka_unit_test(test_sum_order),
        cmocka_unit_test(test_dcn_bytes),
        cmocka_unit_test(test_shared_gather),
        cmocka_unit_test(test_shared_gather_dry_and_mismatch),
        cmocka_unit_test(test_shared_gather_kept),
        cmocka_unit_test(test_shared_gather_no_host_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

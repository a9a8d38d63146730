/* bk_attention.c — blocked causal attention with positions.
 *
 * Forward, per (batch, query head, query tile): for each key tile that has a visible key,
 * S = scale * Q K^T (sgemm straight from the strided (B, T, H, D) layout, no copies), mask
 * k_pos > q_pos to -inf, then the online softmax: m' = max(m, rowmax S), P = exp(S - m'),
 * l = l e^(m - m') + rowsum P, acc = acc e^(m - m') + P V (sgemm). At the end out = acc / l and
 * lse = m + log l. Tiles whose keys are all later than every query of the tile are skipped; a tile
 * that is only partly visible runs in blocks of ATTN_SUB_ROWS query rows, each over the keys up to
 * the last one it can see (the same products and sums, without the masked tail).
 *
 * Backward (FlashAttention-2): with Dvec_i = sum(dO_i * O_i) - dlse_i, per visible tile recompute
 * P = exp(S - lse), then dV += P^T dO, dP = dO V^T, dS = P (dP - Dvec), dQ += scale dS K,
 * dK += scale dS^T Q (P, dP and dQ per block of rows as in the forward; dV and dK over the whole
 * tile, whose skipped entries are zeros). The loops run in a fixed order, so results do not depend
 * on timing.
 *
 * Soft cap (MaxText attn_logits_soft_cap, applied to the scaled scores before the mask): the
 * forward replaces S by cap tanh(S / cap); the backward recomputes the same capped scores and
 * multiplies dS by 1 - tanh^2 before the dQ/dK products.
 */
#include "blas_kernels/bk_attention.h"

#include <math.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_math.h"
#include "blas_kernels/bk_parallel.h"

#include <cblas.h>
#include "blas_kernels/bk_gemm.h"

static void check_dims(const bk_attn_dims *d)
{
    BK_ASSERT(d != NULL);
    BK_ASSERTF(d->B >= 0 && d->Tq >= 0 && d->Tk >= 0, "B=%d Tq=%d Tk=%d", d->B, d->Tq, d->Tk);
    BK_ASSERTF(d->Hq > 0 && d->Hkv > 0 && d->Hq % d->Hkv == 0, "Hq=%d must be a positive multiple of Hkv=%d", d->Hq,
               d->Hkv);
    BK_ASSERTF(d->Dqk > 0 && d->Dv > 0, "Dqk=%d Dv=%d", d->Dqk, d->Dv);
    BK_ASSERTF(d->block_q >= 0 && d->block_k >= 0, "block_q=%d block_k=%d", d->block_q, d->block_k);
    BK_ASSERTF(d->window >= 0, "window=%d", d->window);
}

/* Key position kp is hidden from query position qp: later than it, or (window w > 0) w or more
 * positions before it. */
static inline int masked(int32_t kp, int32_t qp, int w) { return kp > qp || (w > 0 && (int64_t)kp <= (int64_t)qp - w); }

/* A key tile with positions [klo, khi] against queries [qlo, qhi]: no pair visible (skipped), or
 * every pair visible (no mask needed). */
static inline int tile_hidden(int32_t klo, int32_t khi, int32_t qlo, int32_t qhi, int w)
{
    return klo > qhi || (w > 0 && (int64_t)khi <= (int64_t)qlo - w);
}
static inline int tile_full(int32_t klo, int32_t khi, int32_t qlo, int32_t qhi, int w)
{
    return khi <= qlo && (w == 0 || (int64_t)klo > (int64_t)qhi - w);
}

/* Row reductions run in ATTN_LANES lanes, lane l taking every ATTN_LANES-th element in order and
 * the lanes combined in order at the end, so they vectorise and give the same bits from every
 * clone (a single running sum is one dependent add per element). */
enum { ATTN_LANES = 16 };

/* A tile that is only partly visible (the diagonal of a causal mask) runs in blocks of this many
 * query rows, each over the keys it can see: on a 128 x 128 diagonal tile, 64 x 64 and 64 x 128
 * products instead of 128 x 128, a quarter less work. */
enum { ATTN_SUB_ROWS = 64 };

/* max of s[0..n) (-inf when n = 0); a max is exact, so any lane split gives the same value */
static inline float row_max(const float *s, int n)
{
    float lane[ATTN_LANES];
    for (int l = 0; l < ATTN_LANES; l++) lane[l] = -INFINITY;
    const int body = n - n % ATTN_LANES;
    for (int j = 0; j < body; j += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) lane[l] = s[j + l] > lane[l] ? s[j + l] : lane[l];
    for (int j = body; j < n; j++) lane[j - body] = s[j] > lane[j - body] ? s[j] : lane[j - body];
    float m = -INFINITY;
    for (int l = 0; l < ATTN_LANES; l++) m = lane[l] > m ? lane[l] : m;
    return m;
}

/* s[j] = e^(s[j] - mn) (masked keys, -inf, get exactly 0); returns their sum in double */
static inline double exp_row_sum(float *s, int n, float mn)
{
    double lane[ATTN_LANES] = {0};
    const int body = n - n % ATTN_LANES;
    for (int j = 0; j < body; j += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) {
            const float e = s[j + l] == -INFINITY ? 0.0f : bk_expf(s[j + l] - mn);
            s[j + l] = e;
            lane[l] += e;
        }
    for (int j = body; j < n; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : bk_expf(s[j] - mn);
        lane[j - body] += s[j];
    }
    double sum = 0.0;
    for (int l = 0; l < ATTN_LANES; l++) sum += lane[l];
    return sum;
}

/* sum of a[c] b[c] over c < n, in double */
static inline double dot_double(const float *a, const float *b, int n)
{
    double lane[ATTN_LANES] = {0};
    const int body = n - n % ATTN_LANES;
    for (int c = 0; c < body; c += ATTN_LANES)
        for (int l = 0; l < ATTN_LANES; l++) lane[l] += (double)a[c + l] * b[c + l];
    for (int c = body; c < n; c++) lane[c - body] += (double)a[c] * b[c];
    double sum = 0.0;
    for (int l = 0; l < ATTN_LANES; l++) sum += lane[l];
    return sum;
}

static int block_q_of(const bk_attn_dims *d) { return d->block_q > 0 ? d->block_q : 128; }
static int block_k_of(const bk_attn_dims *d) { return d->block_k > 0 ? d->block_k : 128; }

/* min and max of pos[0..n) */
static void pos_range(const int32_t *pos, int n, int32_t *lo, int32_t *hi)
{
    int32_t a = pos[0], b = pos[0];
    for (int i = 1; i < n; i++) {
        a = pos[i] < a ? pos[i] : a;
        b = pos[i] > b ? pos[i] : b;
    }
    *lo = a, *hi = b;
}

/* Key-tile position ranges of one batch row: kmin/kmax per tile. */
static void key_tile_ranges(const int32_t *kp, int Tk, int bk, int32_t *kmin, int32_t *kmax)
{
    for (int t = 0, j0 = 0; j0 < Tk; t++, j0 += bk)
        pos_range(kp + j0, (Tk - j0 < bk ? Tk - j0 : bk), &kmin[t], &kmax[t]);
}

/* S (nq, nk), rows lds apart = scale * Q K^T, soft-capped when cap > 0 (th, if not NULL, receives
 * tanh(S / cap), rows lds apart too), then -inf where key j is hidden from query i (later, or
 * outside the window), unless the whole tile is visible. */
BK_CLONES static void score_tile(float *S, int lds, const float *Q, int ldq, const float *K, int ldk, int nq, int nk,
                                 int D, float scale, float cap, float *th, const int32_t *qp, const int32_t *kp,
                                 int window, int full)
{
    bk_gemm(0, 1, nq, nk, D, scale, Q, ldq, K, ldk, 0.0f, S, lds);
    if (cap > 0.0f) {
        const float inv = 1.0f / cap;
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < nk; j++) {
                const size_t x = (size_t)i * lds + j;
                const float tv = tanhf(S[x] * inv);
                if (th) th[x] = tv;
                S[x] = cap * tv;
            }
    }
    if (full) return;
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++)
            if (masked(kp[j], qp[i], window)) S[(size_t)i * lds + j] = -INFINITY;
}

/* Keys [0, n) of a tile that a block of queries can see: up to the last one whose position is at
 * most the block's latest query position (0 when none is).  Keys after it are masked for every
 * query of the block, so the products skip them: their scores would be -inf, their
 * probabilities 0, and a product's trailing zero terms leave its sums unchanged. */
static int visible_keys(const int32_t *kp, int n, int32_t qhi)
{
    while (n > 0 && kp[n - 1] > qhi) n--;
    return n;
}

/* The operands of one attention call, shared by its per-batch-row chunks. */
typedef struct {
    float *out, *lse, *dq, *dk, *dv;
    const float *q, *k, *v, *dout, *dlse, *o;
    const int32_t *q_pos, *k_pos;
    const bk_attn_dims *d;
    double *dsink; /* backward with sinks: (B, Hq) per batch row, summed over rows by the caller */
} attn_job;

/* Runs n independent items (batch rows, or (batch row, kv head) pairs) on the kernel pool.  The
 * tile products are small: when the items run in parallel, each runs its sgemms on one OpenBLAS
 * thread (OpenBLAS's own threads would fight the pool's over the same cores). */
static void run_rows(int64_t n, bk_range_fn fn, void *job)
{
    if (bk_parallel_threads() > 1 && n > 1) {
        int saved = openblas_get_num_threads();
        openblas_set_num_threads(1);
        bk_parallel_for(n, 1, fn, job);
        openblas_set_num_threads(saved);
    } else {
        bk_parallel_for(n, 1, fn, job);
    }
}

/* The blocked kernels run per (batch row, kv head) pair, item u = b Hkv + g, over the query heads
 * of the group in order: a pair owns its rows of out, lse and dq and its dk and dv, which sum the
 * group's heads in the order one thread would.  Pairs rather than batch rows, so a device with a
 * few sequences still keeps its threads busy and the last item to finish is small. */

/* Items [u_lo, u_hi) of the forward pass. */
BK_CLONES static void attention_fwd_rows(int64_t u_lo, int64_t u_hi, void *arg)
{
    const attn_job *J = arg;
    const bk_attn_dims *d = J->d;
    float *out = J->out, *lse = J->lse;
    const float *q = J->q, *k = J->k, *v = J->v;
    const int32_t *q_pos = J->q_pos, *k_pos = J->k_pos;
    const int Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv;
    const int bq = block_q_of(d), bk = block_k_of(d), rep = Hq / Hkv, W = d->window;
    const int ldq = Hq * Dqk, ldk = Hkv * Dqk, ldv = Hkv * Dv, ldo = Hq * Dv;
    const int nkt = (Tk + bk - 1) / bk;
    float *S = bk_xmalloc((size_t)bq * bk * sizeof *S);
    float *acc = bk_xmalloc((size_t)bq * Dv * sizeof *acc);
    float *m = bk_xmalloc((size_t)bq * sizeof *m);
    double *l = bk_xmalloc((size_t)bq * sizeof *l);
    int32_t *kmin = bk_xmalloc((size_t)(nkt + 1) * sizeof *kmin);
    int32_t *kmax = bk_xmalloc((size_t)(nkt + 1) * sizeof *kmax);

    for (int64_t u = u_lo; u < u_hi; u++) {
        const int b = (int)(u / Hkv), g = (int)(u % Hkv);
        const int32_t *qpb = q_pos + (size_t)b * Tq, *kpb = k_pos ? k_pos + (size_t)b * Tk : NULL;
        if (Tk > 0) key_tile_ranges(kpb, Tk, bk, kmin, kmax);
        for (int h = g * rep; h < (g + 1) * rep; h++) {
            for (int i0 = 0; i0 < Tq; i0 += bq) {
                const int nq = Tq - i0 < bq ? Tq - i0 : bq;
                const int32_t *qp = qpb + i0;
                const float *Q = q + ((size_t)b * Tq + i0) * ldq + (size_t)h * Dqk;
                int32_t qlo, qhi;
                pos_range(qp, nq, &qlo, &qhi);
                memset(acc, 0, (size_t)nq * Dv * sizeof *acc);
                /* a sink is a column seen by every row, with no value: it starts the running max and sum */
                for (int i = 0; i < nq; i++)
                    if (d->sinks) m[i] = d->sinks[h], l[i] = 1.0;
                    else m[i] = -INFINITY, l[i] = 0.0;
                for (int t = 0, j0 = 0; j0 < Tk; t++, j0 += bk) {
                    if (tile_hidden(kmin[t], kmax[t], qlo, qhi, W))
                        continue; // no query of this tile sees any key of it
                    const int nk = Tk - j0 < bk ? Tk - j0 : bk;
                    const float *K = k + ((size_t)b * Tk + j0) * ldk + (size_t)g * Dqk;
                    const float *V = v + ((size_t)b * Tk + j0) * ldv + (size_t)g * Dv;
                    const int full = tile_full(kmin[t], kmax[t], qlo, qhi, W), sub = full ? nq : ATTN_SUB_ROWS;
                    for (int r0 = 0; r0 < nq; r0 += sub) { // a partly visible tile: blocks of rows
                        const int nr = nq - r0 < sub ? nq - r0 : sub;
                        int32_t rlo, rhi;
                        pos_range(qp + r0, nr, &rlo, &rhi);
                        const int ne = full ? nk : visible_keys(kpb + j0, nk, rhi);
                        if (ne == 0) continue; // the rows see no key of this tile: their state stays
                        score_tile(S, ne, Q + (size_t)r0 * ldq, ldq, K, ldk, nr, ne, Dqk, d->scale, d->soft_cap, NULL,
                                   qp + r0, kpb + j0, W, full || tile_full(kmin[t], kmax[t], rlo, rhi, W));
                        for (int r = 0; r < nr; r++) {
                            const int i = r0 + r;
                            float *s = S + (size_t)r * ne;
                            float mb = row_max(s, ne);
                            float mn = mb > m[i] ? mb : m[i];
                            if (mn == -INFINITY) { // nothing visible to this row yet: P row = 0
                                memset(s, 0, (size_t)ne * sizeof *s);
                                continue;
                            }
                            double rs = exp_row_sum(s, ne, mn);
                            if (mn != m[i]) {
                                float alpha = expf(m[i] - mn); // 0 when m was -inf
                                float *a = acc + (size_t)i * Dv;
                                for (int c = 0; c < Dv; c++) a[c] *= alpha;
                                l[i] *= alpha;
                                m[i] = mn;
                            }
                            l[i] += rs;
                        }
                        bk_gemm(0, 0, nr, Dv, ne, 1.0f, S, ne, V, ldv, 1.0f, acc + (size_t)r0 * Dv, Dv);
                    }
                }
                for (int i = 0; i < nq; i++) {
                    float *o = out + ((size_t)b * Tq + i0 + i) * ldo + (size_t)h * Dv;
                    float *L = lse + ((size_t)b * Hq + h) * Tq + i0 + i;
                    if (l[i] > 0.0) {
                        float inv = (float)(1.0 / l[i]);
                        for (int c = 0; c < Dv; c++) o[c] = acc[(size_t)i * Dv + c] * inv;
                        *L = (float)(m[i] + log(l[i]));
                    } else { // fully masked row
                        memset(o, 0, (size_t)Dv * sizeof *o);
                        *L = -INFINITY;
                    }
                }
            }
        }
    }
    free(S), free(acc), free(m), free(l), free(kmin), free(kmax);
}

void bk_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                      const int32_t *k_pos, const bk_attn_dims *d)
{
    check_dims(d);
    if (d->B == 0 || d->Tq == 0) return;
    BK_ASSERT(out && lse && q && q_pos && (d->Tk == 0 || (k && v && k_pos)));
    attn_job J = {out, lse, NULL, NULL, NULL, q, k, v, NULL, NULL, NULL, q_pos, k_pos, d, NULL};
    run_rows((int64_t)d->B * d->Hkv, attention_fwd_rows, &J);
}

/* The sinks' gradient of a backward call: (B, Hq) zeros, one row per batch row (the items of
 * different batch rows run in parallel and share heads); sink_parts_sum adds the rows into dsinks in
 * batch order, so the bits do not depend on the threads. */
static double *sink_parts_new(const bk_attn_dims *d)
{
    BK_ASSERT(d->dsinks != NULL);
    double *p = bk_xmalloc((size_t)d->B * d->Hq * sizeof *p + sizeof *p);
    memset(p, 0, (size_t)d->B * d->Hq * sizeof *p);
    return p;
}
static void sink_parts_sum(double *p, const bk_attn_dims *d)
{
    for (int h = 0; h < d->Hq; h++) {
        double s = 0.0;
        for (int b = 0; b < d->B; b++) s += p[(size_t)b * d->Hq + h];
        d->dsinks[h] += (float)s;
    }
    free(p);
}

/* Items [u_lo, u_hi) of the backward pass. */
BK_CLONES static void attention_bwd_rows(int64_t u_lo, int64_t u_hi, void *arg)
{
    const attn_job *J = arg;
    const bk_attn_dims *d = J->d;
    float *dq = J->dq, *dk = J->dk, *dv = J->dv;
    const float *dout = J->dout, *dlse = J->dlse, *out = J->o, *lse = J->lse, *q = J->q, *k = J->k, *v = J->v;
    const int32_t *q_pos = J->q_pos, *k_pos = J->k_pos;
    const int Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv;
    const int bq = block_q_of(d), bk = block_k_of(d), rep = Hq / Hkv, W = d->window;
    const int ldq = Hq * Dqk, ldk = Hkv * Dqk, ldv = Hkv * Dv, ldo = Hq * Dv;
    const int nkt = (Tk + bk - 1) / bk;
    float *P = bk_xmalloc((size_t)bq * bk * sizeof *P);
    float *dP = bk_xmalloc((size_t)bq * bk * sizeof *dP);
    float *Dvec = bk_xmalloc((size_t)bq * sizeof *Dvec);
    float *Th = d->soft_cap > 0.0f ? bk_xmalloc((size_t)bq * bk * sizeof *Th) : NULL;
    int32_t *kmin = bk_xmalloc((size_t)nkt * sizeof *kmin);
    int32_t *kmax = bk_xmalloc((size_t)nkt * sizeof *kmax);

    for (int64_t u = u_lo; u < u_hi; u++) {
        const int b = (int)(u / Hkv), g = (int)(u % Hkv);
        const int32_t *qpb = q_pos + (size_t)b * Tq, *kpb = k_pos + (size_t)b * Tk;
        key_tile_ranges(kpb, Tk, bk, kmin, kmax);
        for (int h = g * rep; h < (g + 1) * rep; h++) {
            for (int i0 = 0; i0 < Tq; i0 += bq) {
                const int nq = Tq - i0 < bq ? Tq - i0 : bq;
                const int32_t *qp = qpb + i0;
                const size_t qrow = ((size_t)b * Tq + i0);
                const float *Q = q + qrow * ldq + (size_t)h * Dqk;
                float *dQ = dq + qrow * ldq + (size_t)h * Dqk;
                const float *dO = dout + qrow * ldo + (size_t)h * Dv;
                const float *L = lse + ((size_t)b * Hq + h) * Tq + i0;
                int32_t qlo, qhi;
                pos_range(qp, nq, &qlo, &qhi);
                for (int i = 0; i < nq; i++) {
                    const float *o = out + (qrow + i) * ldo + (size_t)h * Dv, *go = dO + (size_t)i * ldo;
                    double s = dot_double(go, o, Dv);
                    if (dlse) s -= dlse[((size_t)b * Hq + h) * Tq + i0 + i];
                    Dvec[i] = (float)s;
                    /* the sink's column: p_sink = e^(sink - lse), dS_sink = p_sink (0 - Dvec) */
                    if (d->sinks && L[i] != -INFINITY)
                        J->dsink[(size_t)b * Hq + h] -= exp((double)d->sinks[h] - (double)L[i]) * s;
                }
                for (int t = 0, j0 = 0; j0 < Tk; t++, j0 += bk) {
                    if (tile_hidden(kmin[t], kmax[t], qlo, qhi, W)) continue;
                    const int nk = Tk - j0 < bk ? Tk - j0 : bk;
                    const size_t krow = (size_t)b * Tk + j0;
                    const float *K = k + krow * ldk + (size_t)g * Dqk;
                    const float *V = v + krow * ldv + (size_t)g * Dv;
                    float *dK = dk + krow * ldk + (size_t)g * Dqk;
                    float *dV = dv + krow * ldv + (size_t)g * Dv;
                    /* per block of rows (one block when the tile is all visible): P, dP = dO V^T, dS and
           * dQ += s dS K over the keys the block sees; P and dS are 0 past them, so dV and dK
           * sum the whole tile's rows as before */
                    const int full = tile_full(kmin[t], kmax[t], qlo, qhi, W), sub = full ? nq : ATTN_SUB_ROWS;
                    for (int r0 = 0; r0 < nq; r0 += sub) {
                        const int nr = nq - r0 < sub ? nq - r0 : sub;
                        int32_t rlo, rhi;
                        pos_range(qp + r0, nr, &rlo, &rhi);
                        const int ne = full ? nk : visible_keys(kpb + j0, nk, rhi);
                        float *Pr = P + (size_t)r0 * nk, *dPr = dP + (size_t)r0 * nk;
                        for (int r = 0; r < nr; r++) { // the keys no row of the block sees
                            memset(Pr + (size_t)r * nk + ne, 0, (size_t)(nk - ne) * sizeof *P);
                            memset(dPr + (size_t)r * nk + ne, 0, (size_t)(nk - ne) * sizeof *dP);
                        }
                        if (ne == 0) continue;
                        score_tile(Pr, nk, Q + (size_t)r0 * ldq, ldq, K, ldk, nr, ne, Dqk, d->scale, d->soft_cap,
                                   Th ? Th + (size_t)r0 * nk : NULL, qp + r0, kpb + j0, W,
                                   full || tile_full(kmin[t], kmax[t], rlo, rhi, W));
                        for (int r = 0; r < nr; r++) {
                            float *p = Pr + (size_t)r * nk;
                            if (L[r0 + r] == -INFINITY) { // fully masked row: no probability mass, no gradient
                                memset(p, 0, (size_t)ne * sizeof *p);
                                continue;
                            }
                            const float Li = L[r0 + r];
                            for (int j = 0; j < ne; j++) p[j] = p[j] == -INFINITY ? 0.0f : bk_expf(p[j] - Li);
                        }
                        bk_gemm(0, 1, nr, ne, Dv, 1.0f, dO + (size_t)r0 * ldo, ldo, V, ldv, 0.0f, dPr,
                                nk); // dP = dO V^T
                        for (int r = 0; r < nr; r++) {
                            float *ds = dPr + (size_t)r * nk;
                            const float *p = Pr + (size_t)r * nk;
                            const float Di = Dvec[r0 + r];
                            for (int j = 0; j < ne; j++) ds[j] = p[j] * (ds[j] - Di); // dS (scale applied below)
                            if (Th) { // through the soft cap: d(cap tanh(s / cap))/ds = 1 - tanh^2
                                const float *th = Th + (size_t)(r0 + r) * nk;
                                for (int j = 0; j < ne; j++) ds[j] *= 1.0f - th[j] * th[j];
                            }
                        }
                        bk_gemm(0, 0, nr, Dqk, ne, d->scale, dPr, nk, K, ldk, 1.0f, dQ + (size_t)r0 * ldq,
                                ldq); // dQ += s dS K
                    }
                    bk_gemm(1, 0, nk, Dv, nq, 1.0f, P, nk, dO, ldo, 1.0f, dV, ldv);      // dV += P^T dO
                    bk_gemm(1, 0, nk, Dqk, nq, d->scale, dP, nk, Q, ldq, 1.0f, dK, ldk); // dK += s dS^T Q
                }
            }
        }
    }
    free(P), free(dP), free(Dvec), free(Th), free(kmin), free(kmax);
}

void bk_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *dlse, const float *out,
                      const float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                      const int32_t *k_pos, const bk_attn_dims *d)
{
    check_dims(d);
    if (d->B == 0 || d->Tq == 0 || d->Tk == 0) return;
    BK_ASSERT(dq && dk && dv && dout && out && lse && q && k && v && q_pos && k_pos);
    attn_job J = {NULL, (float *)lse, dq, dk, dv, q, k, v, dout, dlse, out, q_pos, k_pos, d, NULL};
    if (d->sinks) J.dsink = sink_parts_new(d);
    run_rows((int64_t)d->B * d->Hkv, attention_bwd_rows, &J);
    if (d->sinks) sink_parts_sum(J.dsink, d);
}

/* ---- reference ---- */

void bk_attention_fwd_ref(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                          const int32_t *k_pos, const bk_attn_dims *d)
{
    check_dims(d);
    const int B = d->B, Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv;
    double *s = bk_xmalloc((size_t)(Tk + 1) * sizeof *s);
    double *o = bk_xmalloc((size_t)Dv * sizeof *o);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int i = 0; i < Tq; i++) {
                const int g = h / (Hq / Hkv);
                const float *qi = q + (((size_t)b * Tq + i) * Hq + h) * Dqk;
                double mx = -INFINITY;
                for (int j = 0; j < Tk; j++) {
                    s[j] = -INFINITY;
                    const int64_t kq = k_pos[(size_t)b * Tk + j], qq = q_pos[(size_t)b * Tq + i];
                    if (kq > qq || (d->window > 0 && kq <= qq - d->window)) continue; // causal, window
                    const float *kj = k + (((size_t)b * Tk + j) * Hkv + g) * Dqk;
                    double dot = 0.0;
                    for (int c = 0; c < Dqk; c++) dot += (double)qi[c] * kj[c];
                    s[j] = dot * d->scale;
                    if (d->soft_cap > 0.0f) s[j] = d->soft_cap * tanh(s[j] / d->soft_cap);
                    if (s[j] > mx) mx = s[j];
                }
                const double sink = d->sinks ? (double)d->sinks[h] : -INFINITY; /* a column with no value */
                if (sink > mx) mx = sink;
                double z = d->sinks ? exp(sink - mx) : 0.0;
                for (int c = 0; c < Dv; c++) o[c] = 0.0;
                if (mx > -INFINITY)
                    for (int j = 0; j < Tk; j++) {
                        if (s[j] == -INFINITY) continue;
                        double p = exp(s[j] - mx);
                        z += p;
                        const float *vj = v + (((size_t)b * Tk + j) * Hkv + g) * Dv;
                        for (int c = 0; c < Dv; c++) o[c] += p * vj[c];
                    }
                float *oi = out + (((size_t)b * Tq + i) * Hq + h) * Dv;
                for (int c = 0; c < Dv; c++) oi[c] = z > 0 ? (float)(o[c] / z) : 0.0f;
                lse[((size_t)b * Hq + h) * Tq + i] = z > 0 ? (float)(mx + log(z)) : -INFINITY;
            }
    free(s), free(o);
}

/* Probabilities are recomputed in double from q and k (the saved out and lse are not used), so
 * this twin also checks that the fast kernel's use of them is right. */
void bk_attention_bwd_ref(float *dq, float *dk, float *dv, const float *dout, const float *dlse, const float *out,
                          const float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                          const int32_t *k_pos, const bk_attn_dims *d)
{
    check_dims(d);
    (void)out, (void)lse;
    const int B = d->B, Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv;
    const size_t nq = (size_t)B * Tq * Hq * Dqk, nk = (size_t)B * Tk * Hkv * Dqk, nv = (size_t)B * Tk * Hkv * Dv;
    double *gq = calloc(nq + 1, sizeof *gq), *gk = calloc(nk + 1, sizeof *gk), *gv = calloc(nv + 1, sizeof *gv);
    double *p = bk_xmalloc((size_t)(Tk + 1) * sizeof *p), *dp = bk_xmalloc((size_t)(Tk + 1) * sizeof *dp);
    double *dcap = bk_xmalloc((size_t)(Tk + 1) * sizeof *dcap); // d capped score / d raw score
    double *gsink = calloc((size_t)Hq, sizeof *gsink);
    BK_ASSERT(gq && gk && gv && gsink);
    BK_ASSERT(!d->sinks || d->dsinks);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int i = 0; i < Tq; i++) {
                const int g = h / (Hq / Hkv);
                const size_t qi = (((size_t)b * Tq + i) * Hq + h);
                double mx = -INFINITY, z = 0.0;
                for (int j = 0; j < Tk; j++) {
                    p[j] = -INFINITY;
                    const int64_t kq = k_pos[(size_t)b * Tk + j], qq = q_pos[(size_t)b * Tq + i];
                    if (kq > qq || (d->window > 0 && kq <= qq - d->window)) continue; // causal, window
                    const size_t kj = ((size_t)b * Tk + j) * Hkv + g;
                    double dot = 0.0;
                    for (int c = 0; c < Dqk; c++) dot += (double)q[qi * Dqk + c] * k[kj * Dqk + c];
                    p[j] = dot * d->scale;
                    dcap[j] = 1.0;
                    if (d->soft_cap > 0.0f) {
                        double c = cosh(p[j] / d->soft_cap);
                        dcap[j] = 1.0 / (c * c);
                        p[j] = d->soft_cap * tanh(p[j] / d->soft_cap);
                    }
                    if (p[j] > mx) mx = p[j];
                }
                const double sink = d->sinks ? (double)d->sinks[h] : -INFINITY;
                if (sink > mx) mx = sink;
                if (mx == -INFINITY) continue; // fully masked: no gradient
                for (int j = 0; j < Tk; j++) {
                    p[j] = p[j] == -INFINITY ? 0.0 : exp(p[j] - mx);
                    z += p[j];
                }
                const double psink_u = d->sinks ? exp(sink - mx) : 0.0; // the sink's unnormalised weight
                z += psink_u;
                double Dsum = 0.0;
                for (int j = 0; j < Tk; j++) {
                    p[j] /= z;
                    const size_t kj = ((size_t)b * Tk + j) * Hkv + g;
                    dp[j] = 0.0;
                    for (int c = 0; c < Dv; c++) dp[j] += (double)dout[qi * Dv + c] * v[kj * Dv + c];
                    Dsum += p[j] * dp[j];
                }
                double gl = dlse ? dlse[((size_t)b * Hq + h) * Tq + i] : 0.0;
                if (d->sinks) gsink[h] += (psink_u / z) * (gl - Dsum); // its value is 0: dp_sink = 0
                for (int j = 0; j < Tk; j++) {
                    if (p[j] == 0.0) continue;
                    const size_t kj = ((size_t)b * Tk + j) * Hkv + g;
                    double ds = p[j] * (dp[j] - Dsum + gl) * dcap[j] * d->scale; // d lse / d s_j = p_j
                    for (int c = 0; c < Dv; c++) gv[kj * Dv + c] += p[j] * dout[qi * Dv + c];
                    for (int c = 0; c < Dqk; c++) {
                        gq[qi * Dqk + c] += ds * k[kj * Dqk + c];
                        gk[kj * Dqk + c] += ds * q[qi * Dqk + c];
                    }
                }
            }
    for (size_t i = 0; i < nq; i++) dq[i] += (float)gq[i];
    for (size_t i = 0; i < nk; i++) dk[i] += (float)gk[i];
    for (size_t i = 0; i < nv; i++) dv[i] += (float)gv[i];
    if (d->sinks)
        for (int h = 0; h < Hq; h++) d->dsinks[h] += (float)gsink[h];
    free(gq), free(gk), free(gv), free(p), free(dp), free(dcap), free(gsink);
}

/* ------------------------------------------------------------------------------------------------
 * Dot-product attention (MaxText's apply_attention_dot): per (batch, query head) the whole score
 * matrix S = scale Q K^T (Tq x Tk, one sgemm), masked, softmaxed in place into P, saved; out = P V.
 * Backward from the saved P: dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dP P)), dQ = scale dS K,
 * dK += scale dS^T Q.  Parallel over batch rows (a row's dk/dv are its own), fixed loop order.
 * ---------------------------------------------------------------------------------------------- */

BK_CLONES static void attention_dot_fwd_rows(int64_t b_lo, int64_t b_hi, void *arg)
{
    const attn_job *J = arg;
    const bk_attn_dims *d = J->d;
    const int Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv, rep = Hq / Hkv;
    const int ldq = Hq * Dqk, ldk = Hkv * Dqk, ldv = Hkv * Dv, ldo = Hq * Dv;
    for (int b = (int)b_lo; b < (int)b_hi; b++) {
        const int32_t *qp = J->q_pos + (size_t)b * Tq, *kp = J->k_pos + (size_t)b * Tk;
        for (int h = 0; h < Hq; h++) {
            const int g = h / rep;
            float *P = J->lse + ((size_t)b * Hq + h) * Tq * Tk; /* the probabilities buffer */
            const float *Q = J->q + (size_t)b * Tq * ldq + (size_t)h * Dqk;
            const float *K = J->k + (size_t)b * Tk * ldk + (size_t)g * Dqk;
            const float *V = J->v + (size_t)b * Tk * ldv + (size_t)g * Dv;
            float *O = J->out + (size_t)b * Tq * ldo + (size_t)h * Dv;
            score_tile(P, Tk, Q, ldq, K, ldk, Tq, Tk, Dqk, d->scale, 0.0f, NULL, qp, kp, d->window,
                       0); /* no soft cap: refused with this kernel */
            for (int i = 0; i < Tq; i++) {
                /* with a sink, MaxText's concatenated column: in the max and the sum, not in P */
                float *s = P + (size_t)i * Tk, m = d->sinks ? d->sinks[h] : -INFINITY;
                for (int j = 0; j < Tk; j++) m = s[j] > m ? s[j] : m;
                if (m == -INFINITY) { // no visible key: a zero row, as the blocked kernel
                    memset(s, 0, (size_t)Tk * sizeof *s);
                    continue;
                }
                double l = d->sinks ? (double)bk_expf(d->sinks[h] - m) : 0.0;
                for (int j = 0; j < Tk; j++) {
                    s[j] = s[j] == -INFINITY ? 0.0f : bk_expf(s[j] - m);
                    l += s[j];
                }
                float inv = (float)(1.0 / l);
                for (int j = 0; j < Tk; j++) s[j] *= inv;
            }
            bk_gemm(0, 0, Tq, Dv, Tk, 1.0f, P, Tk, V, ldv, 0.0f, O, ldo);
        }
    }
}

void bk_attention_dot_fwd(float *out, float *probs, const float *q, const float *k, const float *v,
                          const int32_t *q_pos, const int32_t *k_pos, const bk_attn_dims *d)
{
    check_dims(d);
    if (d->B == 0 || d->Tq == 0) return;
    BK_ASSERT(out && probs && q && q_pos && (d->Tk == 0 || (k && v && k_pos)));
    if (d->Tk == 0) {
        memset(out, 0, (size_t)d->B * d->Tq * d->Hq * d->Dv * sizeof *out);
        return;
    }
    attn_job J = {out, probs, NULL, NULL, NULL, q, k, v, NULL, NULL, NULL, q_pos, k_pos, d, NULL};
    run_rows(d->B, attention_dot_fwd_rows, &J);
}

BK_CLONES static void attention_dot_bwd_rows(int64_t b_lo, int64_t b_hi, void *arg)
{
    const attn_job *J = arg;
    const bk_attn_dims *d = J->d;
    const int Tq = d->Tq, Tk = d->Tk, Hq = d->Hq, Hkv = d->Hkv, Dqk = d->Dqk, Dv = d->Dv, rep = Hq / Hkv;
    const int ldq = Hq * Dqk, ldk = Hkv * Dqk, ldv = Hkv * Dv, ldo = Hq * Dv;
    float *dS = bk_xmalloc((size_t)Tq * Tk * sizeof *dS);
    for (int b = (int)b_lo; b < (int)b_hi; b++) {
        for (int h = 0; h < Hq; h++) {
            const int g = h / rep;
            const float *P = J->o + ((size_t)b * Hq + h) * Tq * Tk;
            const float *Q = J->q + (size_t)b * Tq * ldq + (size_t)h * Dqk;
            const float *K = J->k + (size_t)b * Tk * ldk + (size_t)g * Dqk;
            const float *V = J->v + (size_t)b * Tk * ldv + (size_t)g * Dv;
            const float *dO = J->dout + (size_t)b * Tq * ldo + (size_t)h * Dv;
            float *dQ = J->dq + (size_t)b * Tq * ldq + (size_t)h * Dqk;
            float *dK = J->dk + (size_t)b * Tk * ldk + (size_t)g * Dqk;
            float *dV = J->dv + (size_t)b * Tk * ldv + (size_t)g * Dv;
            bk_gemm(1, 0, Tk, Dv, Tq, 1.0f, P, Tk, dO, ldo, 1.0f, dV, ldv);
            bk_gemm(0, 1, Tq, Tk, Dv, 1.0f, dO, ldo, V, ldv, 0.0f, dS, Tk);
            for (int i = 0; i < Tq; i++) {
                const float *p = P + (size_t)i * Tk;
                float *s = dS + (size_t)i * Tk;
                double dot = 0.0, mass = 0.0;
                for (int j = 0; j < Tk; j++) dot += (double)s[j] * p[j], mass += p[j];
                for (int j = 0; j < Tk; j++) s[j] = p[j] * (s[j] - (float)dot);
                /* the sink's probability is what the keys leave (a zero row: none), its value 0 */
                if (d->sinks && mass > 0.0) J->dsink[(size_t)b * Hq + h] -= (1.0 - mass) * dot;
            }
            bk_gemm(0, 0, Tq, Dqk, Tk, d->scale, dS, Tk, K, ldk, 0.0f, dQ, ldq);
            bk_gemm(1, 0, Tk, Dqk, Tq, d->scale, dS, Tk, Q, ldq, 1.0f, dK, ldk);
        }
    }
    free(dS);
}

void bk_attention_dot_bwd(float *dq, float *dk, float *dv, const float *dout, const float *probs, const float *q,
                          const float *k, const float *v, const bk_attn_dims *d)
{
    check_dims(d);
    if (d->B == 0 || d->Tq == 0) return;
    BK_ASSERT(dq && dout && probs && q && (d->Tk == 0 || (dk && dv && k && v)));
    memset(dq, 0, (size_t)d->B * d->Tq * d->Hq * d->Dqk * sizeof *dq);
    if (d->Tk == 0) return;
    memset(dk, 0, (size_t)d->B * d->Tk * d->Hkv * d->Dqk * sizeof *dk);
    memset(dv, 0, (size_t)d->B * d->Tk * d->Hkv * d->Dv * sizeof *dv);
    attn_job J = {NULL, NULL, dq, dk, dv, q, k, v, dout, NULL, probs, NULL, NULL, d, NULL};
    if (d->sinks) J.dsink = sink_parts_new(d);
    run_rows(d->B, attention_dot_bwd_rows, &J);
    if (d->sinks) sink_parts_sum(J.dsink, d);
}

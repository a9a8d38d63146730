/* bk_einsum.c — two-operand einsum as batched sgemm (see bk_einsum.h).
 *
 * Plan: sum away the letters found in one operand only, then group the letters into batch (B),
 * lhs-free (M), rhs-free (N) and contraction (K).  Each operand is looked at as a matrix per batch
 * entry: A as (M, K) or stored transposed, B as (K, N) or transposed, C as (M, N) or (N, M) (then
 * C^T = B^T A^T is computed).  A group of letters can be one matrix dim only when its letters
 * (size-1 letters ignored) are nested in memory in group order, and one of a matrix's two groups
 * must have stride 1.  The order of letters within each group is free, so every combination of
 * "order as in one tensor or the other" is tried and the one copying the fewest elements wins;
 * batch letters may have any strides (they are walked with an index vector), so no batch
 * transpose is ever needed. */
#include "blas_kernels/bk_einsum.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_gemm.h"

/* ------------------------------------------------------------ parsing */

static int fail(char *err, size_t errcap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(char *err, size_t errcap, const char *fmt, ...)
{
    if (err && errcap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errcap, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Reads letters up to one of the stop characters; spaces are skipped. */
static int read_term(const char *s, size_t *pos, const char *stops, char *letters, int *n, const char *what, char *err,
                     size_t errcap)
{
    *n = 0;
    for (;;) {
        char c = s[*pos];
        if (c == '\0' || strchr(stops, c)) return 0;
        (*pos)++;
        if (c == ' ') continue;
        if (c == '-' && s[*pos] == '>') return fail(err, errcap, "einsum '%s': unexpected '->' in %s", s, what);
        if (c < 'a' || c > 'z')
            return fail(err, errcap,
                        "einsum '%s': character '%c' at position %zu is not an index letter a-z "
                        "(ellipsis and upper-case letters are not supported)",
                        s, c, *pos - 1);
        if (*n == BK_EINSUM_MAX_RANK)
            return fail(err, errcap, "einsum '%s': %s has more than %d indices", s, what, BK_EINSUM_MAX_RANK);
        for (int i = 0; i < *n; i++)
            if (letters[i] == c)
                return fail(err, errcap,
                            "einsum '%s': index '%c' appears twice in %s (diagonals and traces are not "
                            "supported; give each dim its own letter)",
                            s, c, what);
        letters[(*n)++] = c;
    }
}

static int has(const char *l, int n, char c)
{
    for (int i = 0; i < n; i++)
        if (l[i] == c) return 1;
    return 0;
}

int bk_einsum_parse(const char *s, int ra, const int64_t *sa, int rb, const int64_t *sb, bk_einsum_dims *out, char *err,
                    size_t errcap)
{
    bk_einsum_dims d;
    memset(&d, 0, sizeof d);
    for (int i = 0; i < 26; i++) d.size[i] = -1;
    if (!s) return fail(err, errcap, "einsum: no subscripts given");
    size_t pos = 0;
    int na, nb, no;
    if (read_term(s, &pos, ",-", d.la, &na, "operand 0", err, errcap)) return -1;
    if (s[pos] != ',')
        return fail(err, errcap, "einsum '%s': expected two operands separated by ',' (like 'ij,jk->ik')", s);
    pos++;
    if (read_term(s, &pos, ",-", d.lb, &nb, "operand 1", err, errcap)) return -1;
    if (s[pos] == ',') return fail(err, errcap, "einsum '%s': only two operands are supported", s);
    if (s[pos] != '-' || s[pos + 1] != '>')
        return fail(err, errcap,
                    "einsum '%s': the output must be explicit: add '->' and its indices (like 'ij,jk->ik')", s);
    pos += 2;
    if (read_term(s, &pos, ",-", d.lo, &no, "the output", err, errcap)) return -1;
    if (s[pos] != '\0')
        return fail(err, errcap, "einsum '%s': unexpected '%c' at position %zu after the output indices", s, s[pos],
                    pos);
    const char *names[2] = {"operand 0", "operand 1"};
    const char *lets[2] = {d.la, d.lb};
    int n[2] = {na, nb}, r[2] = {ra, rb};
    const int64_t *sh[2] = {sa, sb};
    int where_op[26], where_dim[26];
    for (int k = 0; k < 2; k++) {
        if (n[k] != r[k])
            return fail(err, errcap, "einsum '%s': %s has %d indices '%.*s' but the array has rank %d", s, names[k],
                        n[k], n[k], lets[k], r[k]);
        for (int i = 0; i < n[k]; i++) {
            int c = lets[k][i] - 'a';
            if (sh[k][i] < 0)
                return fail(err, errcap, "einsum '%s': %s dim %d has negative size %lld", s, names[k], i,
                            (long long)sh[k][i]);
            if (d.size[c] >= 0 && d.size[c] != sh[k][i])
                return fail(err, errcap, "einsum '%s': index '%c' has size %lld in %s (dim %d) but %lld in %s (dim %d)",
                            s, lets[k][i], (long long)d.size[c], names[where_op[c]], where_dim[c], (long long)sh[k][i],
                            names[k], i);
            d.size[c] = sh[k][i];
            where_op[c] = k;
            where_dim[c] = i;
        }
    }
    for (int i = 0; i < no; i++) {
        int c = d.lo[i] - 'a';
        if (d.size[c] < 0)
            return fail(err, errcap, "einsum '%s': output index '%c' appears in neither operand", s, d.lo[i]);
        d.out_shape[i] = d.size[c];
    }
    for (int c = 0; c < 26; c++) {
        if (d.size[c] < 0) continue;
        int ia = has(d.la, na, (char)('a' + c)), ib = has(d.lb, nb, (char)('a' + c)),
            io = has(d.lo, no, (char)('a' + c));
        d.role[c] = ia && ib ? (io ? BK_EIN_BATCH : BK_EIN_CONTRACT)
                    : ia     ? (io ? BK_EIN_LHS_FREE : BK_EIN_LHS_SUM)
                             : (io ? BK_EIN_RHS_FREE : BK_EIN_RHS_SUM);
    }
    d.ra = na;
    d.rb = nb;
    d.ro = no;
    if (out) *out = d;
    return 0;
}

/* ------------------------------------------------------------ strided helpers */

static int64_t size_of(const bk_einsum_dims *d, char c) { return d->size[c - 'a']; }

/* Row-major strides of a tensor given by its letters. */
static void strides_of(const bk_einsum_dims *d, const char *l, int n, int64_t *st)
{
    int64_t s = 1;
    for (int i = n - 1; i >= 0; i--) {
        st[i] = s;
        s *= size_of(d, l[i]);
    }
}

static int64_t stride_of(const char *l, int n, const int64_t *st, char c)
{
    for (int i = 0; i < n; i++)
        if (l[i] == c) return st[i];
    return 0; // absent: broadcast
}

/* dst (contiguous, dims size[0..n)) = src walked with element strides sst; accumulates
 * dst = beta * dst + src when acc (beta == 0 ignores dst). */
static void strided_copy(float *dst, const float *src, int n, const int64_t *size, const int64_t *sst, int acc,
                         float beta)
{
    int64_t total = 1;
    for (int i = 0; i < n; i++) total *= size[i];
    if (total == 0) return;
    if (n == 0) {
        dst[0] = acc && beta != 0.0f ? beta * dst[0] + src[0] : src[0];
        return;
    }
    int64_t idx[BK_EINSUM_MAX_RANK] = {0};
    int64_t inner = size[n - 1], is = sst[n - 1], rows = total / inner;
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = 0;
        for (int i = 0; i < n - 1; i++) off += idx[i] * sst[i];
        const float *s = src + off;
        float *o = dst + r * inner;
        if (!acc || beta == 0.0f) {
            if (is == 1) memcpy(o, s, (size_t)inner * sizeof *o);
            else
                for (int64_t j = 0; j < inner; j++) o[j] = s[j * is];
        } else if (beta == 1.0f) {
            for (int64_t j = 0; j < inner; j++) o[j] += s[j * is];
        } else {
            for (int64_t j = 0; j < inner; j++) o[j] = beta * o[j] + s[j * is];
        }
        for (int i = n - 2; i >= 0; i--) {
            if (++idx[i] < size[i]) break;
            idx[i] = 0;
        }
    }
}

void bk_permute(void *out, const void *in, size_t es, int rank, const int64_t *shape, const int *perm)
{
    BK_ASSERTF(rank >= 0 && rank <= BK_EINSUM_MAX_RANK, "rank %d", rank);
    int64_t ist[BK_EINSUM_MAX_RANK], osz[BK_EINSUM_MAX_RANK], sst[BK_EINSUM_MAX_RANK];
    int64_t s = 1, total = 1;
    for (int i = rank - 1; i >= 0; i--) {
        ist[i] = s;
        s *= shape[i];
    }
    int seen = 0;
    for (int i = 0; i < rank; i++) {
        BK_ASSERTF(perm[i] >= 0 && perm[i] < rank && !(seen & (1 << perm[i])), "perm[%d] = %d is not a permutation", i,
                   perm[i]);
        seen |= 1 << perm[i];
        osz[i] = shape[perm[i]];
        sst[i] = ist[perm[i]];
        total *= osz[i];
    }
    if (total == 0) return;
    if (es == sizeof(float)) {
        strided_copy(out, in, rank, osz, sst, 0, 0.0f);
        return;
    }
    int64_t idx[BK_EINSUM_MAX_RANK] = {0};
    char *o = out;
    for (int64_t e = 0; e < total; e++) {
        int64_t off = 0;
        for (int i = 0; i < rank; i++) off += idx[i] * sst[i];
        memcpy(o + (size_t)e * es, (const char *)in + (size_t)off * es, es);
        for (int i = rank - 1; i >= 0; i--) {
            if (++idx[i] < osz[i]) break;
            idx[i] = 0;
        }
    }
}

/* out (letters lo) = sum of in (letters li) over the letters li has and lo lacks. */
static void sum_away(const bk_einsum_dims *d, float *out, const char *lo, int no, const float *in, const char *li,
                     int ni)
{
    int64_t ost[BK_EINSUM_MAX_RANK], ist[BK_EINSUM_MAX_RANK], ostride_in[BK_EINSUM_MAX_RANK], n_out = 1, n_in = 1;
    strides_of(d, lo, no, ost);
    strides_of(d, li, ni, ist);
    for (int i = 0; i < no; i++) n_out *= size_of(d, lo[i]);
    for (int i = 0; i < ni; i++) {
        n_in *= size_of(d, li[i]);
        ostride_in[i] = stride_of(lo, no, ost, li[i]);
    }
    double *acc = bk_xmalloc((size_t)n_out * sizeof *acc);
    memset(acc, 0, (size_t)n_out * sizeof *acc);
    int64_t idx[BK_EINSUM_MAX_RANK] = {0};
    for (int64_t e = 0; e < n_in; e++) {
        int64_t o = 0;
        for (int i = 0; i < ni; i++) o += idx[i] * ostride_in[i];
        acc[o] += in[e];
        for (int i = ni - 1; i >= 0; i--) {
            if (++idx[i] < size_of(d, li[i])) break;
            idx[i] = 0;
        }
    }
    for (int64_t i = 0; i < n_out; i++) out[i] = (float)acc[i];
    free(acc);
}

/* ------------------------------------------------------------ matrix views */

typedef struct {
    int n;
    char l[BK_EINSUM_MAX_RANK];
} group;

static int64_t group_size(const bk_einsum_dims *d, const group *g)
{
    int64_t p = 1;
    for (int i = 0; i < g->n; i++) p *= size_of(d, g->l[i]);
    return p;
}

/* Letters of `role` in the order they appear in l. */
static group group_from(const bk_einsum_dims *d, const char *l, int n, bk_ein_role role)
{
    group g = {0, {0}};
    for (int i = 0; i < n; i++)
        if (d->role[l[i] - 'a'] == role) g.l[g.n++] = l[i];
    return g;
}

/* Whether the group's letters (size-1 ones ignored) are nested in tensor (l, st) in group order;
 * *stride = the stride of the merged dim, 0 when the group has no letter of size > 1. */
static int group_view(const bk_einsum_dims *d, const group *g, const char *l, int n, const int64_t *st, int64_t *stride)
{
    int64_t prev = -1;
    *stride = 0;
    for (int i = 0; i < g->n; i++) {
        int64_t sz = size_of(d, g->l[i]);
        if (sz == 1) continue;
        int64_t s = stride_of(l, n, st, g->l[i]);
        if (prev >= 0 && prev != s * sz) return 0;
        prev = s;
        *stride = s;
    }
    return 1;
}

typedef struct {
    int ok;
    int trans;  // stored as (cols, rows)
    int64_t ld; // leading dimension as stored
} mview;

/* A (rows x cols) matrix whose row group has stride rs and column group stride cs (0 = size 1). */
static mview matrix_view(int64_t rows, int64_t cols, int64_t rs, int64_t cs)
{
    mview v = {0, 0, 0};
    if (cs == 1 || cs == 0) {
        v.ld = rs ? rs : (cols > 1 ? cols : 1);
        v.ok = v.ld >= (cols > 1 ? cols : 1);
    } else if (rs == 1 || rs == 0) {
        v.trans = 1;
        v.ld = cs;
        v.ok = v.ld >= (rows > 1 ? rows : 1);
    }
    return v;
}

static mview tensor_view(const bk_einsum_dims *d, const group *rg, const group *cg, const char *l, int n)
{
    int64_t st[BK_EINSUM_MAX_RANK], rs, cs;
    mview bad = {0, 0, 0};
    strides_of(d, l, n, st);
    if (!group_view(d, rg, l, n, st, &rs) || !group_view(d, cg, l, n, st, &cs)) return bad;
    return matrix_view(group_size(d, rg), group_size(d, cg), rs, cs);
}

static int concat(char *dst, const group *g0, const group *g1, const group *g2)
{
    int n = 0;
    const group *gs[3] = {g0, g1, g2};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < gs[k]->n; i++) dst[n++] = gs[k]->l[i];
    return n;
}

/* Copies tensor (l, n) into the contiguous layout `dl` (same letters, another order). */
static float *relayout(const bk_einsum_dims *d, const float *src, const char *l, int n, const char *dl)
{
    int64_t st[BK_EINSUM_MAX_RANK], sst[BK_EINSUM_MAX_RANK], sz[BK_EINSUM_MAX_RANK], total = 1;
    strides_of(d, l, n, st);
    for (int i = 0; i < n; i++) {
        sz[i] = size_of(d, dl[i]);
        sst[i] = stride_of(l, n, st, dl[i]);
        total *= sz[i];
    }
    float *dst = bk_xmalloc((size_t)total * sizeof *dst);
    strided_copy(dst, src, n, sz, sst, 0, 0.0f);
    return dst;
}

/* Picks the letter order of the M, N and K groups (as in a or the output, b or the output, a or b)
 * that copies the fewest elements; returns that count (the output counts twice: copy and scatter). */
static int64_t choose_orders(const bk_einsum_dims *d, const char *la, int na, const char *lb, int nb, group *gm,
                             group *gn, group *gk)
{
    group gm_opt[2] = {group_from(d, la, na, BK_EIN_LHS_FREE), group_from(d, d->lo, d->ro, BK_EIN_LHS_FREE)};
    group gn_opt[2] = {group_from(d, lb, nb, BK_EIN_RHS_FREE), group_from(d, d->lo, d->ro, BK_EIN_RHS_FREE)};
    group gk_opt[2] = {group_from(d, la, na, BK_EIN_CONTRACT), group_from(d, lb, nb, BK_EIN_CONTRACT)};
    int64_t n_a = 1, n_b = 1, n_c = 1, best = -1;
    for (int i = 0; i < na; i++) n_a *= size_of(d, la[i]);
    for (int i = 0; i < nb; i++) n_b *= size_of(d, lb[i]);
    for (int i = 0; i < d->ro; i++) n_c *= d->out_shape[i];
    for (int im = 0; im < 2; im++)
        for (int in = 0; in < 2; in++)
            for (int ik = 0; ik < 2; ik++) {
                int64_t cost = 0;
                if (!tensor_view(d, &gm_opt[im], &gk_opt[ik], la, na).ok) cost += n_a;
                if (!tensor_view(d, &gk_opt[ik], &gn_opt[in], lb, nb).ok) cost += n_b;
                if (!tensor_view(d, &gm_opt[im], &gn_opt[in], d->lo, d->ro).ok) cost += 2 * n_c;
                if (best < 0 || cost < best) {
                    best = cost;
                    *gm = gm_opt[im];
                    *gn = gn_opt[in];
                    *gk = gk_opt[ik];
                }
            }
    return best;
}

/* Letters of a (or b) once the summed-away ones are gone. */
static int kept_letters(const bk_einsum_dims *d, const char *l, int n, bk_ein_role drop, char *out)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        if (d->role[l[i] - 'a'] != drop) out[k++] = l[i];
    return k;
}

/* Parses `subscripts` for operands of shapes sa, sb and picks the operand orders bk_einsum
 * picks; returns the elements it would copy to lay the operands out (choose_orders). */
static int64_t orders_of(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb,
                         bk_einsum_dims *d, group *gm, group *gn, group *gk)
{
    char err[256], la[BK_EINSUM_MAX_RANK], lb[BK_EINSUM_MAX_RANK];
    int rc = bk_einsum_parse(subscripts, ra, sa, rb, sb, d, err, sizeof err);
    BK_ASSERTF(rc == 0, "%s", err);
    int na = kept_letters(d, d->la, d->ra, BK_EIN_LHS_SUM, la), nb = kept_letters(d, d->lb, d->rb, BK_EIN_RHS_SUM, lb);
    return choose_orders(d, la, na, lb, nb, gm, gn, gk);
}

int64_t bk_einsum_copied(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb)
{
    bk_einsum_dims d;
    group gm, gn, gk;
    return orders_of(subscripts, ra, sa, rb, sb, &d, &gm, &gn, &gk);
}

int bk_einsum_out_direct(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb)
{
    bk_einsum_dims d;
    group gm, gn, gk;
    orders_of(subscripts, ra, sa, rb, sb, &d, &gm, &gn, &gk);
    return tensor_view(&d, &gm, &gn, d.lo, d.ro).ok;
}

/* ------------------------------------------------------------ the kernel */

void bk_einsum(const char *subscripts, float *out, const float *a, int ra, const int64_t *sa, const float *b, int rb,
               const int64_t *sb, float beta)
{
    bk_einsum_dims d;
    char err[256];
    int rc = bk_einsum_parse(subscripts, ra, sa, rb, sb, &d, err, sizeof err);
    BK_ASSERTF(rc == 0, "%s", err);

    /* 1. letters in one operand only: sum them away first */
    char la[BK_EINSUM_MAX_RANK], lb[BK_EINSUM_MAX_RANK];
    int na = kept_letters(&d, d.la, d.ra, BK_EIN_LHS_SUM, la), nb = kept_letters(&d, d.lb, d.rb, BK_EIN_RHS_SUM, lb);
    float *a_own = NULL, *b_own = NULL, *c_tmp = NULL;
    int64_t n_a = 1, n_b = 1, n_c = 1;
    for (int i = 0; i < na; i++) n_a *= size_of(&d, la[i]);
    for (int i = 0; i < nb; i++) n_b *= size_of(&d, lb[i]);
    for (int i = 0; i < d.ro; i++) n_c *= d.out_shape[i];
    if (n_c == 0) return;
    if (na < d.ra) {
        a_own = bk_xmalloc((size_t)n_a * sizeof *a_own);
        sum_away(&d, a_own, la, na, a, d.la, d.ra);
        a = a_own;
    }
    if (nb < d.rb) {
        b_own = bk_xmalloc((size_t)n_b * sizeof *b_own);
        sum_away(&d, b_own, lb, nb, b, d.lb, d.rb);
        b = b_own;
    }

    /* 2. group orders: try each source order per group, keep the fewest copied elements */
    group gb = group_from(&d, d.lo, d.ro, BK_EIN_BATCH), gm, gn, gk;
    choose_orders(&d, la, na, lb, nb, &gm, &gn, &gk);
    int64_t M = group_size(&d, &gm), N = group_size(&d, &gn), K = group_size(&d, &gk);
    BK_ASSERTF(M <= 0x7fffffff && N <= 0x7fffffff && K <= 0x7fffffff, "einsum '%s': matrix dims %lld x %lld x %lld",
               subscripts, (long long)M, (long long)N, (long long)K);

    /* 3. views, copying what cannot be viewed */
    mview va = tensor_view(&d, &gm, &gk, la, na);
    if (!va.ok) {
        char dl[BK_EINSUM_MAX_RANK];
        concat(dl, &gb, &gm, &gk);
        float *t = relayout(&d, a, la, na, dl);
        free(a_own);
        a = a_own = t;
        memcpy(la, dl, (size_t)na);
        va = tensor_view(&d, &gm, &gk, la, na);
    }
    mview vb = tensor_view(&d, &gk, &gn, lb, nb);
    if (!vb.ok) {
        char dl[BK_EINSUM_MAX_RANK];
        concat(dl, &gb, &gk, &gn);
        float *t = relayout(&d, b, lb, nb, dl);
        free(b_own);
        b = b_own = t;
        memcpy(lb, dl, (size_t)nb);
        vb = tensor_view(&d, &gk, &gn, lb, nb);
    }
    char lc[BK_EINSUM_MAX_RANK];
    int nc = d.ro;
    memcpy(lc, d.lo, (size_t)nc);
    float *c = out, cbeta = beta;
    mview vc = tensor_view(&d, &gm, &gn, lc, nc); // trans: C is stored (N, M)
    if (!vc.ok) {
        nc = concat(lc, &gb, &gm, &gn);
        c = c_tmp = bk_xmalloc((size_t)n_c * sizeof *c);
        cbeta = 0.0f;
        vc = tensor_view(&d, &gm, &gn, lc, nc);
    }
    BK_ASSERT(va.ok && vb.ok && vc.ok);

    /* 4. one sgemm per batch entry; batch letters of size > 1 walked with strides */
    int64_t sta[BK_EINSUM_MAX_RANK], stb[BK_EINSUM_MAX_RANK], stc[BK_EINSUM_MAX_RANK];
    strides_of(&d, la, na, sta);
    strides_of(&d, lb, nb, stb);
    strides_of(&d, lc, nc, stc);
    int nbat = 0;
    int64_t bsz[BK_EINSUM_MAX_RANK], bsa[BK_EINSUM_MAX_RANK], bsb[BK_EINSUM_MAX_RANK], bsc[BK_EINSUM_MAX_RANK];
    int64_t nbatch = 1;
    for (int i = 0; i < gb.n; i++) {
        char l = gb.l[i];
        if (size_of(&d, l) == 1) continue;
        bsz[nbat] = size_of(&d, l);
        bsa[nbat] = stride_of(la, na, sta, l);
        bsb[nbat] = stride_of(lb, nb, stb, l);
        bsc[nbat] = stride_of(lc, nc, stc, l);
        nbatch *= bsz[nbat++];
    }
    int64_t idx[BK_EINSUM_MAX_RANK] = {0};
    for (int64_t e = 0; e < nbatch; e++) {
        int64_t oa = 0, ob = 0, oc = 0;
        for (int i = 0; i < nbat; i++) {
            oa += idx[i] * bsa[i];
            ob += idx[i] * bsb[i];
            oc += idx[i] * bsc[i];
        }
        if (!vc.trans)
            bk_gemm(va.trans, vb.trans, (int)M, (int)N, (int)K, 1.0f, a + oa, (int)va.ld, b + ob, (int)vb.ld, cbeta,
                    c + oc, (int)vc.ld);
        else // C stored (N, M): C^T = B^T A^T
            bk_gemm(!vb.trans, !va.trans, (int)N, (int)M, (int)K, 1.0f, b + ob, (int)vb.ld, a + oa, (int)va.ld, cbeta,
                    c + oc, (int)vc.ld);
        for (int i = nbat - 1; i >= 0; i--) {
            if (++idx[i] < bsz[i]) break;
            idx[i] = 0;
        }
    }

    /* 5. scatter a temporary result into the output's layout */
    if (c_tmp) {
        int64_t sz[BK_EINSUM_MAX_RANK], sst[BK_EINSUM_MAX_RANK];
        for (int i = 0; i < d.ro; i++) {
            sz[i] = d.out_shape[i];
            sst[i] = stride_of(lc, nc, stc, d.lo[i]);
        }
        strided_copy(out, c_tmp, d.ro, sz, sst, 1, beta);
    }
    free(a_own);
    free(b_own);
    free(c_tmp);
}

void bk_einsum_ref(const char *subscripts, float *out, const float *a, int ra, const int64_t *sa, const float *b,
                   int rb, const int64_t *sb, float beta)
{
    bk_einsum_dims d;
    char err[256];
    int rc = bk_einsum_parse(subscripts, ra, sa, rb, sb, &d, err, sizeof err);
    BK_ASSERTF(rc == 0, "%s", err);
    /* every letter: output letters first, then the summed ones */
    char all[26];
    int n = 0, no = d.ro;
    for (int i = 0; i < d.ro; i++) all[n++] = d.lo[i];
    for (int c = 0; c < 26; c++)
        if (d.size[c] >= 0 && !has(d.lo, d.ro, (char)('a' + c))) all[n++] = (char)('a' + c);
    int64_t sta[BK_EINSUM_MAX_RANK], stb[BK_EINSUM_MAX_RANK], wa[26], wb[26], sz[26];
    strides_of(&d, d.la, d.ra, sta);
    strides_of(&d, d.lb, d.rb, stb);
    int64_t n_out = 1, n_sum = 1;
    for (int i = 0; i < n; i++) {
        wa[i] = stride_of(d.la, d.ra, sta, all[i]);
        wb[i] = stride_of(d.lb, d.rb, stb, all[i]);
        sz[i] = size_of(&d, all[i]);
        if (i < no) n_out *= sz[i];
        else n_sum *= sz[i];
    }
    int64_t idx[26] = {0};
    for (int64_t o = 0; o < n_out; o++) {
        double acc = 0.0;
        for (int i = no; i < n; i++) idx[i] = 0;
        for (int64_t s = 0; s < n_sum; s++) {
            int64_t oa = 0, ob = 0;
            for (int i = 0; i < n; i++) {
                oa += idx[i] * wa[i];
                ob += idx[i] * wb[i];
            }
            acc += (double)a[oa] * (double)b[ob];
            for (int i = n - 1; i >= no; i--) {
                if (++idx[i] < sz[i]) break;
                idx[i] = 0;
            }
        }
        out[o] = (float)(acc + (beta == 0.0f ? 0.0 : (double)beta * out[o]));
        for (int i = no - 1; i >= 0; i--) {
            if (++idx[i] < sz[i]) break;
            idx[i] = 0;
        }
    }
}

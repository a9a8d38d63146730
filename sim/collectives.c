/* collectives.c — the collectives, each as: check arguments, post the call
 * at the group's exchange (sim_exchange: the last arriver checks that
 * everybody called the same thing, then it and a helper per other core move
 * the data straight from the senders' buffers into the receivers', one task
 * per receiving rank, while the other members sleep until it is done), then
 * record the bytes.
 *
 * Layouts, in elements (p[] of sim_call):
 *   all-gather      p0 outer, p1 chunk:  send (outer, chunk)    -> recv (outer, k, chunk);
 *                           shared (sim_all_gather_dim_shared): one recv for the group, made by
 *                           the last arriver (match_shared), and task r copies only rank r's block
 *   reduce-scatter  p0 outer, p1 chunk:  send (outer, k, chunk) -> recv (outer, chunk)
 *   all-reduce      p0 n:   rank r owns [r*n/k, (r+1)*n/k): it sums that chunk over
 *                           all ranks, then everybody copies the owners' chunks
 *                           (reduce-scatter then all-gather, as on real fabrics)
 *   all-to-all      p0 a, p1 b, p2 c, p3 e:  send (a, k, b) -> recv (c, k, e); the
 *                           piece for rank q is send[:, q, :] read row-major and it
 *                           lands in recv[:, sender, :] row-major (a*b == c*e)
 *   ppermute        p0 n, perm[k]
 *   ragged          per-peer counts and offsets (checked pairwise at the rendezvous) */
#include "sim/collectives.h"
#include "sim/machine_priv.h"
#include "sim/xrank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ------------------------------------------------------------ checks */

static const char *tag_or_dash(const char *tag) { return tag && tag[0] ? tag : "-"; }

static sim_status check_call(sim_device *d, const sim_call *c)
{
    const sim_mesh_desc *mesh = &d->m->mesh;
    const char *op = sim_op_name(c->op);
    if (c->dt < 0 || c->dt >= SIM_NDTYPE)
        return sim_err(SIM_ERR_INPUT, "%s '%s': unknown dtype %d", op, tag_or_dash(c->tag), (int)c->dt);
    if (c->counted_set && (c->counted < 0 || c->counted >= SIM_NDTYPE))
        return sim_err(SIM_ERR_INPUT, "%s '%s': unknown counted dtype %d", op, tag_or_dash(c->tag), (int)c->counted);
    if (c->axes.n < 0 || c->axes.n > mesh->naxes)
        return sim_err(SIM_ERR_INPUT, "%s '%s': %d axes listed, the mesh has %d", op, tag_or_dash(c->tag), c->axes.n,
                       mesh->naxes);
    unsigned seen = 0;
    for (int i = 0; i < c->axes.n; i++) {
        int a = c->axes.axis[i];
        if (a < 0 || a >= mesh->naxes)
            return sim_err(SIM_ERR_INPUT, "%s '%s': mesh axis index %d is out of range 0..%d", op, tag_or_dash(c->tag),
                           a, mesh->naxes - 1);
        if (seen & (1u << a))
            return sim_err(SIM_ERR_INPUT, "%s '%s': mesh axis '%s' is listed twice", op, tag_or_dash(c->tag),
                           mesh->names[a]);
        seen |= 1u << a;
    }
    return SIM_OK;
}

static bool same_axes(sim_axes a, sim_axes b)
{
    if (a.n != b.n) return false;
    for (int i = 0; i < a.n; i++)
        if (a.axis[i] != b.axis[i]) return false;
    return true;
}

static size_t describe_call(const sim_machine *m, const sim_call *c, char *buf, size_t cap)
{
    char ax[96];
    return (size_t)snprintf(buf, cap, "%s%s over %s, %s, sizes [%zu %zu %zu %zu], tag '%s'", sim_op_name(c->op),
                            c->shared ? " (shared)" : "", sim_axes_label(&m->mesh, c->axes, ax, sizeof ax),
                            sim_dtype_name(c->dt), c->p[0], c->p[1], c->p[2], c->p[3], tag_or_dash(c->tag));
}

/* Rank of device `id` in the group over `axes`. */
static int rank_of(const sim_machine *m, int id, sim_axes axes) { return sim_device_group_rank(&m->dev[id], axes); }

static bool same_call(const sim_call *a, const sim_call *b, int k)
{
    bool ok = a->op == b->op && a->dt == b->dt && a->shared == b->shared && same_axes(a->axes, b->axes) &&
              !memcmp(a->p, b->p, sizeof a->p);
    if (ok && a->op == SIM_OP_PPERMUTE)
        for (int q = 0; q < k && ok; q++) ok = a->perm[q] == b->perm[q];
    return ok;
}

/* Runs in the last arriver, under the machine lock.  On disagreement the
 * members are grouped by the call they made and the groups listed smallest
 * first, each with its devices (the first 8, then a count), so the odd
 * device out is named even in a group of 512. */
static bool match_calls(sim_machine *m, sim_group *g, char *why, size_t cap)
{
    const sim_call *c0 = g->slot[0];
    bool ok = true;
    for (int j = 1; j < g->k && ok; j++) ok = same_call(g->slot[j], c0, g->k);
    if (ok && c0->op == SIM_OP_RAGGED_ALL_TO_ALL) {
        for (int j = 0; j < g->k; j++) {
            const sim_call *c = g->slot[j];
            int rj = rank_of(m, c->device, c->axes);
            for (int q = 0; q < g->k; q++) {
                int peer = sim_device_group_member(&m->dev[c->device], c->axes, q);
                const sim_call *cp = g->slot[sim_group_slot(g, &m->dev[peer])];
                if (c->recv_cnt[q] != cp->send_cnt[rj]) {
                    snprintf(why, cap,
                             "ragged-all-to-all mismatch (tag '%s'): device %d expects %zu elements from device %d, "
                             "which sends it %zu",
                             tag_or_dash(c->tag), c->device, c->recv_cnt[q], peer, cp->send_cnt[rj]);
                    return false;
                }
            }
        }
        return true;
    }
    if (ok) return true;
    /* classes of equal calls: cls[j] = the first slot with slot j's call */
    int cls[SIM_MAX_DEVICES], count[SIM_MAX_DEVICES] = {0}, order[SIM_MAX_DEVICES], nc = 0;
    for (int j = 0; j < g->k; j++) {
        cls[j] = j;
        for (int i = 0; i < j; i++)
            if (cls[i] == i && same_call(g->slot[i], g->slot[j], g->k)) {
                cls[j] = i;
                break;
            }
        if (cls[j] == j) order[nc++] = j;
        count[cls[j]]++;
    }
    /* smallest class first (insertion sort: few classes) */
    for (int a = 1; a < nc; a++)
        for (int b = a; b > 0 && count[order[b]] < count[order[b - 1]]; b--) {
            int t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    size_t n = (size_t)snprintf(why, cap,
                                "collective mismatch: the %d devices of one group called %d different "
                                "collectives:",
                                g->k, nc);
    for (int a = 0; a < nc && a < 8 && n + 1 < cap; a++) {
        int head = order[a], shown = 0;
        n += (size_t)snprintf(why + n, cap - n, "\n  %d device%s (", count[head], count[head] == 1 ? "" : "s");
        for (int j = 0; j < g->k && n + 1 < cap; j++) {
            if (cls[j] != head) continue;
            if (shown == 8) {
                n += (size_t)snprintf(why + n, cap - n, ", ... %d more", count[head] - 8);
                break;
            }
            n += (size_t)snprintf(why + n, cap - n, "%s%s", shown ? ", " : "", m->dev[g->slot[j]->device].label);
            shown++;
        }
        if (n + 1 < cap) n += (size_t)snprintf(why + n, cap - n, ") call%s ", count[head] == 1 ? "s" : "");
        if (n + 1 < cap) n += describe_call(m, g->slot[head], why + n, cap - n);
    }
    if (nc > 8 && n + 1 < cap) n += (size_t)snprintf(why + n, cap - n, "\n  ... and %d more kinds of call", nc - 8);
    if (n + 1 < cap)
        snprintf(why + n, cap - n, "\nEvery device of a group must make the same collective calls in the same order.");
    return false;
}

/* ------------------------------------------------------------ data movement */

/* t[i] += x[i] for i < m (int32, wrapping).  Groups of 16 go through a loop of constant length,
 * which vectorises under any cost model.  Always inlined: in each clone of sum_sources (below) it
 * compiles for that clone's vector width (a call would run the baseline version). */
static inline __attribute__((always_inline)) void add_i32(int32_t *restrict t, const int32_t *restrict x, size_t m)
{
    size_t i = 0;
    for (; i + 16 <= m; i += 16)
        for (size_t j = 0; j < 16; j++) t[i + j] = (int32_t)((uint32_t)t[i + j] + (uint32_t)x[i + j]);
    for (; i < m; i++) t[i] = (int32_t)((uint32_t)t[i] + (uint32_t)x[i]);
}

/* t[i] = ((t[i] + a[i]) + b[i]) + c[i] (init: t[i] = a[i] + b[i], ...): up to four sources per pass
 * over the block, in source order, so each element gets exactly the adds of the one-at-a-time loop.
 * Fewer passes over the block than one add per source (a 64-device step sums hundreds of millions
 * of elements, in rows as short as 64: the passes and their loads and stores of t were half of it). */
static inline __attribute__((always_inline)) void sum_pass_f32(float *restrict t, const float *const *x, int n,
                                                               bool init, size_t m)
{
    const float *restrict a = x[0], *restrict b = n > 1 ? x[1] : NULL, *restrict c = n > 2 ? x[2] : NULL,
                          *restrict e = n > 3 ? x[3] : NULL;
    if (init) { /* t = a + b (+ c (+ e)): n >= 2 */
        if (n == 2)
            for (size_t i = 0; i < m; i++) t[i] = a[i] + b[i];
        else if (n == 3)
            for (size_t i = 0; i < m; i++) t[i] = (a[i] + b[i]) + c[i];
        else
            for (size_t i = 0; i < m; i++) t[i] = ((a[i] + b[i]) + c[i]) + e[i];
    } else if (n == 1) {
        for (size_t i = 0; i < m; i++) t[i] += a[i];
    } else if (n == 2) {
        for (size_t i = 0; i < m; i++) t[i] = (t[i] + a[i]) + b[i];
    } else if (n == 3) {
        for (size_t i = 0; i < m; i++) t[i] = ((t[i] + a[i]) + b[i]) + c[i];
    } else {
        for (size_t i = 0; i < m; i++) t[i] = (((t[i] + a[i]) + b[i]) + c[i]) + e[i];
    }
}

/* True when [p, p + bytes) overlaps [q, q + qbytes). */
static bool overlaps(const void *p, size_t bytes, const void *q, size_t qbytes)
{
    uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
    return a < b + qbytes && b < a + bytes;
}

/* Sums `len` elements of k sources (in the given order: x0 + x1 + ...) into
 * dst.  dst may alias any source: then each block is finished in a temporary
 * first; otherwise dst itself holds the partial sums. */
/* The reduction of every reduce-scatter and all-reduce (about a tenth of the extra CPU of a 64-device step):
 * built for AVX-512, AVX2 and baseline x86-64, the widest the CPU has runs (GCC target_clones, as
 * the kernels' BK_CLONES; not under TSan, whose runtime is not up when the loader picks).  Each
 * element is summed in source order in every version, so the bits do not depend on which runs. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(BK_NO_CLONES) &&                       \
    !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void
sum_sources(sim_dtype dt, void *dst, const void *const *src, int k, size_t off, size_t len)
{
    enum { BLK = 2048 };
    if (dt == SIM_F32) {
        if (k == 1) {
            memmove(dst, (const float *)src[0] + off, len * sizeof(float));
            return;
        }
        bool alias = false;
        for (int q = 0; q < k && !alias; q++)
            alias = overlaps(dst, len * sizeof(float), (const float *)src[q] + off, len * sizeof(float));
        float tmp[BLK];
        for (size_t s = 0; s < len; s += BLK) {
            size_t m = len - s < BLK ? len - s : BLK;
            float *t = alias ? tmp : (float *)dst + s;
            const float *x[4];
            for (int q = 0; q < k;) {
                int n = k - q < 4 ? k - q : 4;
                for (int j = 0; j < n; j++) x[j] = (const float *)src[q + j] + off + s;
                sum_pass_f32(t, x, n, q == 0, m);
                q += n;
            }
            if (alias) memcpy((float *)dst + s, tmp, m * sizeof(float));
        }
    } else if (dt == SIM_I32) {
        int32_t tmp[BLK];
        for (size_t s = 0; s < len; s += BLK) {
            size_t m = len - s < BLK ? len - s : BLK;
            memcpy(tmp, (const int32_t *)src[0] + off + s, m * sizeof(int32_t));
            for (int q = 1; q < k; q++) add_i32(tmp, (const int32_t *)src[q] + off + s, m);
            memcpy((int32_t *)dst + s, tmp, m * sizeof(int32_t));
        }
    } else {
        SIM_ASSERT(!"reductions support float32 and int32 only");
    }
}

/* Copies one all-to-all piece: element t of the piece is src[(t/b)*k*b + t%b]
 * (src already offset to the piece's block) and goes to dst[(t/e)*k*e + t%e]. */
static void copy_piece(char *dst, const char *src, size_t piece, size_t k, size_t b, size_t e, size_t es)
{
    if (b == e) {
        for (size_t t = 0; t < piece; t += b) memcpy(dst + (t / e) * k * e * es, src + (t / b) * k * b * es, b * es);
        return;
    }
    size_t t = 0;
    while (t < piece) {
        size_t rb = b - t % b, re = e - t % e;
        size_t run = rb < re ? rb : re;
        memcpy(dst + ((t / e) * k * e + t % e) * es, src + ((t / b) * k * b + t % b) * es, run * es);
        t += run;
    }
}

/* ------------------------------------------------------------ core */

typedef struct {
    uint64_t sent, recv, elements;
    uint64_t sent_dcn; /* of sent, to other slices */
} byte_count;

/* Whether the group's devices are strided: a mesh axis of more than one device that is not in the
 * group varies faster than one that is (the last axis varies fastest), so the group's members are
 * not neighbours (fsdp under tensor parallelism: MaxText puts `tensor` after `fsdp`). */
static bool group_strided(const sim_device *d, sim_axes axes)
{
    const sim_mesh_desc *m = &d->m->mesh;
    int first = m->naxes;
    for (int i = 0; i < axes.n; i++)
        if (m->sizes[axes.axis[i]] > 1 && axes.axis[i] < first) first = axes.axis[i];
    for (int a = first + 1; a < m->naxes; a++) {
        bool in = false;
        for (int i = 0; i < axes.n; i++) in |= axes.axis[i] == a;
        if (!in && m->sizes[a] > 1) return true;
    }
    return false;
}

/* The links the plain collective of device 0's group over `axes` uses at once in XLA:TPU's cost
 * model (GetCommunicationMultiplier): 2 where the group is a 2x2 plane of chips (two neighbours
 * along each of two physical dims), else 1; 0 where the slice's shape is not known
 * (sim_machine_opts.windowed_torus) or the mesh spans several slices.  Devices are laid over the
 * slice's chips in id order, x fastest.  libtpu 0.0.50.1's logs (TPU_VMODULE=dot_handler=2, a
 * one-layer Llama and llama2-7b): 2 for fsdp=4 on v5p-8 and v4-8 (2x2x1); 1 for fsdp=8 on v6e-8
 * (2x4) and v5p-16 (2x2x2), for fsdp=4 strided by tensor=2 on v6e-8 ({0,2,4,6}) and fsdp=8
 * strided by tensor=2 on v5p-32 (2x2x4).  deepseek2-16b's wkv_b over fsdp=4 strided by expert=2 on
 * v5p-16 (a 2x2 plane) stays an all-gather in XLA's compile, as M = 2 gives. */
static int group_links(const sim_device *d, sim_axes axes)
{
    const sim_machine_opts *o = &d->m->opts;
    const sim_mesh_desc *m = &d->m->mesh;
    int n = o->windowed_torus_n, chips = 1;
    for (int i = 0; i < n; i++) chips *= o->windowed_torus[i];
    if (n == 0 || chips != sim_mesh_num_devices(m)) return 0; /* unknown (several slices, or no shape) */
    int lo[3] = {1 << 30, 1 << 30, 1 << 30}, hi[3] = {-1, -1, -1}, coords[SIM_MAX_AXES] = {0};
    int k = 1;
    for (int i = 0; i < axes.n; i++) k *= m->sizes[axes.axis[i]];
    for (int r = 0; r < k; r++) { /* member r of device 0's group */
        int rest = r;
        for (int i = axes.n - 1; i >= 0; i--) {
            coords[axes.axis[i]] = rest % m->sizes[axes.axis[i]];
            rest /= m->sizes[axes.axis[i]];
        }
        int id = sim_mesh_device_id(m, coords);
        for (int dim = 0; dim < n; dim++) {
            int c = id % o->windowed_torus[dim];
            id /= o->windowed_torus[dim];
            if (c < lo[dim]) lo[dim] = c;
            if (c > hi[dim]) hi[dim] = c;
        }
    }
    int spanned = 0;
    for (int dim = 0; dim < n; dim++) {
        if (hi[dim] > lo[dim] && hi[dim] - lo[dim] != 1) return 1;
        spanned += hi[dim] > lo[dim];
    }
    return spanned == 2 ? 2 : 1;
}

/* A weight's collective the compiler runs as a windowed einsum (collective matmul): a single_use
 * gather or gradient reduce-scatter over a group of at least sim_machine_opts.windowed_min_group
 * neighbouring devices (llama2-7b fsdp=8 on v6e-8, v5p-16 and v4-8, fsdp=16 and 32 on v5p: every
 * such product; fsdp=4 on v5p-8 and v4-8: none).  Over a strided group (another axis varies
 * faster: fsdp under tensor parallelism) XLA's cost model decides per product, where the
 * machine has windowed_ici_bw and the product is known.  XLA's SPMD partitioner (dot_handler.cc,
 * GetWindowedEinsumConfiguration's disable_windowed_einsum) skips the windowed einsum when
 * max(C, M c) + 2 M c / k >= C + c, C the product's time with the gathered operand
 * (GetComputationTimeInMilliSec: flops at the peak rate, 0.0748578 ms for 6.87e10 flops on v6e),
 * c the plain collective's time (GetCommunicationTimeInMilliSec: the gathered bytes / (M x the
 * link rate): 16 MiB in 0.0898619 ms on v6e), M its GetCommunicationMultiplier (the links the
 * plain collective uses at once; the ring uses one).  libtpu 0.0.50.1's log of llama2-7b fsdp=4 x
 * tensor=2 on v6e-8 (TPU_VMODULE=dot_handler=2) prints M = 1 for the strided fsdp groups
 * {0,2,4,6}: the ring can pay from 4 devices (k > 2M) and pays where C > 2c/k.  Where the other
 * operand is gathered for the same product too (the activation's embed dim split over tensor),
 * libtpu first compares the two gathers' times (lhs_all_gather_time_in_ms against
 * rhs_all_gather_time_in_ms) and windows the weight only where its gather is the longer:
 * llama2-7b's query (16 MiB against the activation's 32 MiB) is all-gathered, the MLP's wi
 * (43 MiB) windowed.  And over a strided group the gather the recomputation and the input
 * gradient share is each product's own (sharding propagation finds the two users wanting the
 * weight differently, so check_users_sharding does not keep it a plain gather): llama2-7b's
 * query is gathered for the recomputation and windowed for the input gradient, `out` the other
 * way round (mesh/ops.c: stage). */
static bool cost_model(const sim_device *d, sim_meta meta)
{
    const sim_machine_opts *o = &d->m->opts;
    return o->windowed_min_group > 0 && o->windowed_ici_bw > 0 && o->windowed_peak > 0 && meta.product_flops > 0;
}

bool sim_windowed_per_product(const sim_device *d, sim_axes axes, sim_meta meta)
{
    return cost_model(d, meta) && group_strided(d, axes);
}

bool sim_collective_windowed(const sim_device *d, sim_op op, sim_axes axes, int k, sim_meta meta, uint64_t whole_bytes)
{
    const sim_machine_opts *o = &d->m->opts;
    if (o->windowed_min_group <= 0 || k < 2 || !meta.weight) return false;
    if (op != SIM_OP_ALL_GATHER && op != SIM_OP_REDUCE_SCATTER) return false;
    bool strided = group_strided(d, axes);
    int M = group_links(d, axes);
    if (!cost_model(d, meta) || (!strided && M == 0)) return meta.single_use && k >= o->windowed_min_group;
    if (!meta.single_use && !strided) return false; /* a gather two products share */
    if (M == 0) M = 1;
    if (k <= 2 * M) return false;
    double C = meta.product_flops / o->windowed_peak, plain = (double)whole_bytes / (M * o->windowed_ici_bw);
    /* the other operand's own collective for this product, where a faster axis splits it (tensor) */
    if (strided && op == SIM_OP_ALL_GATHER && meta.product_other_bytes >= whole_bytes) return false;
    if (strided && op == SIM_OP_ALL_GATHER && !meta.product_other_bytes && meta.product_partial_bytes >= whole_bytes &&
        C >= plain)
        return false;
    /* a gradient's reduce-scatter against the gather of the output's cotangent over tensor inside
     * its product (libtpu: all_gather_time_in_ms against reduce_scatter_time_in_ms): windowed where
     * it is the longer, or where the product does not hide it (llama2-7b's out projection: its 16 MiB
     * gradient against the 32 MiB cotangent, windowed on v6e, C = 0.0749 ms < c = 0.0899 ms, plain
     * on v5p-32, C = 0.174 ms) */
    if (strided && op == SIM_OP_REDUCE_SCATTER && meta.product_other_bytes >= whole_bytes && C >= plain) return false;
    if (plain <= 1e-8) return true; /* XLA disables it only past 1e-5 ms of communication */
    return !((C > M * plain ? C : M * plain) + 2.0 * M * plain / k >= C + plain);
}

static void add_record(sim_device *d, const sim_call *c, int k, byte_count bc, sim_meta meta, uint64_t t0)
{
    if (meta.silent) return;
    sim_op op = c->op;
    if (k > 1 && sim_collective_windowed(d, c->op, c->axes, k, meta, bc.sent / (uint64_t)(k - 1) * (uint64_t)k)) {
        /* the bidirectional ring's k/2 steps send k+1 blocks (XLA's while loop); over 4 devices
         * XLA unrolls its 2 steps: a gather's last sends feed nothing and go (k-1 blocks, as the
         * all-gather), a reduce-scatter's first, of zeros, are shared by the layer's rings of one
         * shape (CSE): k blocks (llama2-7b fsdp=4 x tensor=2 on v6e: 3 per gather, 4 or 5 per
         * gradient, 13 for the MLP's three) */
        uint64_t blocks = k > 4 ? (uint64_t)k + 1 : c->op == SIM_OP_ALL_GATHER ? (uint64_t)k - 1 : (uint64_t)k;
        op = SIM_OP_PPERMUTE;
        bc.sent = bc.sent / (uint64_t)(k - 1) * blocks;
        bc.recv = bc.recv / (uint64_t)(k - 1) * blocks;
        bc.sent_dcn = bc.sent_dcn / (uint64_t)(k - 1) * blocks;
    } else if (meta.psum && c->op == SIM_OP_REDUCE_SCATTER && d->m->opts.psum_scatter_max_group > 0 &&
               k > d->m->opts.psum_scatter_max_group) { /* the psum stays whole: a ring all-reduce sends twice */
        op = SIM_OP_ALL_REDUCE;
        bc.sent *= 2, bc.recv *= 2, bc.sent_dcn *= 2;
    } else if (meta.weight && c->op == SIM_OP_REDUCE_SCATTER && meta.lane_slice > 0 &&
               meta.lane_slice <= (size_t)d->m->opts.lane_scatter_ar_max) { /* a lane-tile slice: left whole */
        op = SIM_OP_ALL_REDUCE;
        bc.sent *= 2, bc.recv *= 2, bc.sent_dcn *= 2;
    }
    if (d->nrec == d->caprec) {
        d->caprec = d->caprec ? 2 * d->caprec : 256;
        d->rec = realloc(d->rec, d->caprec * sizeof *d->rec);
        SIM_ASSERT(d->rec);
    }
    sim_record *r = &d->rec[d->nrec++];
    memset(r, 0, sizeof *r);
    r->step = d->step;
    r->op = op;
    r->phase = d->phase;
    /* size-1 axes do not change the group: leave them out of the record */
    r->axes.n = 0;
    for (int i = 0; i < c->axes.n; i++)
        if (d->m->mesh.sizes[c->axes.axis[i]] > 1) r->axes.axis[r->axes.n++] = c->axes.axis[i];
    r->group_size = k;
    r->dtype = c->counted;
    r->elements = bc.elements;
    r->bytes_sent = bc.sent;
    r->bytes_sent_dcn = bc.sent_dcn;
    r->bytes_recv = bc.recv;
    r->implicit = meta.implicit;
    r->weight = meta.weight;
    sim_str_put(r->tag, sizeof r->tag, 0, tag_or_dash(c->tag), SIZE_MAX);
    sim_op_totals *t = &d->totals[op];
    t->calls++;
    t->bytes_sent += bc.sent;
    t->bytes_recv += bc.recv;
    if (d->m->opts.trace && !sim_trace_keeps(d)) { /* counted only */
        sim_span s = {0};
        sim_trace_add(d, &s);
    } else if (d->m->opts.trace) {
        sim_span s = {0};
        s.t0 = t0;
        s.t1 = sim_now_ns();
        s.lane = 1 + (int)sim_axes_mask(r->axes);
        sim_str_put(s.name, sizeof s.name,
                    sim_str_put(s.name, sizeof s.name, sim_str_put(s.name, sizeof s.name, 0, sim_op_name(op), SIZE_MAX),
                                " ", 1),
                    tag_or_dash(c->tag), SIZE_MAX); /* "%s %s" */
        s.op = op;
        s.bytes = bc.sent;
        s.rec = (int64_t)(r - d->rec); /* the record just filled: axes, group, dtype, elements, bytes */
        sim_arena_stats st;
        sim_arena_get_stats(d->arena, &st);
        s.live_bytes = st.live;
        sim_trace_add(d, &s);
    }
}

/* Whether group member q lies in another slice than this device. */
static bool cross_slice(const sim_device *d, sim_axes axes, int q)
{
    const sim_mesh_desc *m = &d->m->mesh;
    return sim_mesh_slice(m, sim_device_group_member(d, axes, q)) != sim_mesh_slice(m, d->id);
}

/* Of the bytes this device sends, those to other slices: each op sends a
 * known amount to each peer (all-gather: its block; reduce-scatter and
 * all-to-all: the peer's block; all-reduce: the peer's chunk, then its own
 * reduced chunk; ppermute: all to one peer; ragged: per-peer counts). */
static uint64_t count_dcn_bytes(const sim_device *d, const sim_call *c, int k, int r)
{
    bool multi = false;
    for (int a = 0; a < d->m->mesh.naxes; a++) multi |= d->m->mesh.dcn[a] > 1;
    if (!multi) return 0;
    size_t es = sim_dtype_size(c->counted);
    uint64_t b = 0;
    for (int q = 0; q < k; q++) {
        if (q == r || !cross_slice(d, c->axes, q)) continue;
        switch (c->op) {
        case SIM_OP_ALL_GATHER: b += (uint64_t)c->p[0] * c->p[1] * es; break;
        case SIM_OP_REDUCE_SCATTER:
        case SIM_OP_ALL_TO_ALL: b += (uint64_t)c->p[0] * c->p[1] * es; break;
        case SIM_OP_ALL_REDUCE: {
            size_t n = c->p[0];
            size_t cq = (size_t)(q + 1) * n / (size_t)k - (size_t)q * n / (size_t)k;
            size_t cr = (size_t)(r + 1) * n / (size_t)k - (size_t)r * n / (size_t)k;
            b += (uint64_t)(cq + cr) * es;
            break;
        }
        case SIM_OP_PPERMUTE: b += c->perm[r] == q ? (uint64_t)c->p[0] * es : 0; break;
        case SIM_OP_RAGGED_ALL_TO_ALL: b += (uint64_t)c->send_cnt[q] * es; break;
        default: SIM_ASSERT(!"bad op");
        }
    }
    return b;
}

/* Bytes this device sends and receives, by the formulas in the header. */
static byte_count count_bytes(const sim_device *d, const sim_call *c, int k, int r)
{
    size_t es = sim_dtype_size(c->counted);
    byte_count bc = {0, 0, 0, 0};
    switch (c->op) {
    case SIM_OP_ALL_GATHER:
        bc.elements = c->p[0] * c->p[1];
        bc.sent = bc.recv = (uint64_t)(k - 1) * bc.elements * es;
        break;
    case SIM_OP_REDUCE_SCATTER:
        bc.elements = c->p[0] * (size_t)k * c->p[1];
        bc.sent = bc.recv = (uint64_t)(k - 1) * c->p[0] * c->p[1] * es;
        break;
    case SIM_OP_ALL_REDUCE: {
        size_t n = c->p[0], cr = (size_t)(r + 1) * n / (size_t)k - (size_t)r * n / (size_t)k;
        bc.elements = n;
        bc.sent = bc.recv = k > 1 ? (uint64_t)(n + (size_t)(k - 2) * cr) * es : 0;
        break;
    }
    case SIM_OP_ALL_TO_ALL:
        bc.elements = c->p[0] * (size_t)k * c->p[1];
        bc.sent = bc.recv = (uint64_t)(k - 1) * c->p[0] * c->p[1] * es;
        break;
    case SIM_OP_PPERMUTE: {
        bc.elements = c->p[0];
        int dst = c->perm[r], src = -1;
        for (int q = 0; q < k; q++)
            if (c->perm[q] == r) src = q;
        bc.sent = dst >= 0 && dst != r ? c->p[0] * es : 0;
        bc.recv = src >= 0 && src != r ? c->p[0] * es : 0;
        break;
    }
    case SIM_OP_RAGGED_ALL_TO_ALL:
        for (int q = 0; q < k; q++) {
            bc.elements += c->send_cnt[q];
            if (q == r) continue;
            bc.sent += c->send_cnt[q] * es;
            bc.recv += c->recv_cnt[q] * es;
        }
        break;
    default: SIM_ASSERT(!"bad op");
    }
    bc.sent_dcn = count_dcn_bytes(d, c, k, r);
    return bc;
}

/* ------------------------------------------------------------ shared all-gather buffers
 * One host block per shared all-gather: a header (reference count, links in
 * the machine's list) then the data.  The list only lets sim_machine_free
 * free what a failed run left referenced, and counts buffers for tests.
 *
 * A buffer as large as glibc maps afresh (32 MiB and more, sim/machine.c)
 * would be page-faulted in again at every gather: the last release keeps a
 * few of them (SHARED_KEEP, newest first) for the next gather of the same
 * size, as the arena keeps its large blocks (sim/arena.c).
 *
 * opts.guard_shared (tests): each buffer is its own mapping, its data pages
 * made read-only once the gather has filled them, so a kernel that writes
 * into a shared operand faults at the write instead of corrupting the
 * other members' copy. */

enum { SHARED_HDR = 64, SHARED_KEEP = 4 };
#define SHARED_MAGIC 0x5348474154484552ull /* a live shared buffer */
#define SHARED_KEEP_MIN ((size_t)32 << 20) /* glibc's mmap threshold as sim/machine.c sets it */

struct sim_shared_buf {
    uint64_t magic;
    atomic_int refs;
    size_t bytes;
    size_t map; /* guarded: the mapping's length (it starts a page before the data); else 0 */
    struct sim_shared_buf *prev, *next;
};
_Static_assert(sizeof(struct sim_shared_buf) <= SHARED_HDR, "the header must fit in SHARED_HDR bytes");
_Static_assert(sizeof((sim_machine *)0)->shared_kept / sizeof(void *) == SHARED_KEEP,
               "sim_machine.shared_kept holds SHARED_KEEP buffers");

static size_t shared_alloc_bytes(size_t bytes)
{
    return SHARED_HDR + (bytes + SHARED_HDR - 1) / SHARED_HDR * SHARED_HDR;
}

static void shared_dispose(struct sim_shared_buf *b)
{
    if (b->map) {
        long page = sysconf(_SC_PAGESIZE);
        munmap((char *)b + SHARED_HDR - page, b->map);
    } else {
        free(b);
    }
}

/* A buffer for `bytes` (a kept one of that size first); NULL when the host has no memory left. */
static struct sim_shared_buf *shared_get(sim_machine *m, size_t bytes)
{
    if (m->opts.guard_shared) {
        size_t page = (size_t)sysconf(_SC_PAGESIZE), map = page + (bytes + page - 1) / page * page;
        char *base = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) return NULL;
        struct sim_shared_buf *b = (struct sim_shared_buf *)(base + page - SHARED_HDR);
        b->map = map;
        return b;
    }
    if (bytes >= SHARED_KEEP_MIN) {
        pthread_mutex_lock(&m->shared_lock);
        struct sim_shared_buf *b = NULL;
        for (int i = 0; i < m->shared_nkept && !b; i++)
            if (m->shared_kept[i]->bytes == bytes) {
                b = m->shared_kept[i];
                memmove(&m->shared_kept[i], &m->shared_kept[i + 1], (size_t)(m->shared_nkept - i - 1) * sizeof b);
                m->shared_nkept--;
            }
        pthread_mutex_unlock(&m->shared_lock);
        if (b) return b;
    }
    struct sim_shared_buf *b = aligned_alloc(SHARED_HDR, shared_alloc_bytes(bytes));
    if (b) b->map = 0;
    return b;
}

/* The gather has filled buf: a guarded one becomes read-only (every member may call it). */
static void shared_seal(const sim_machine *m, void *buf)
{
    if (!buf || !m->opts.guard_shared) return;
    struct sim_shared_buf *b = (struct sim_shared_buf *)((char *)buf - SHARED_HDR);
    long page = sysconf(_SC_PAGESIZE);
    if (b->map > (size_t)page) SIM_ASSERT(mprotect(buf, b->map - (size_t)page, PROT_READ) == 0);
}

static void *shared_new(sim_machine *m, size_t bytes, int refs)
{
    struct sim_shared_buf *b = shared_get(m, bytes);
    if (!b) return NULL;
    b->magic = SHARED_MAGIC;
    atomic_init(&b->refs, refs);
    b->bytes = bytes;
    pthread_mutex_lock(&m->shared_lock);
    b->prev = NULL;
    b->next = m->shared;
    if (m->shared) m->shared->prev = b;
    m->shared = b;
    m->shared_made++;
    m->shared_live++;
    pthread_mutex_unlock(&m->shared_lock);
    return (char *)b + SHARED_HDR;
}

static void shared_unlink_locked(sim_machine *m, struct sim_shared_buf *b)
{
    if (b->prev) b->prev->next = b->next;
    else m->shared = b->next;
    if (b->next) b->next->prev = b->prev;
    m->shared_live--;
    b->magic = 0;
}

void sim_shared_release(sim_device *d, const void *buf)
{
    if (!buf) return; /* a dry run's */
    struct sim_shared_buf *b = (struct sim_shared_buf *)((char *)buf - SHARED_HDR);
    SIM_ASSERT(b->magic == SHARED_MAGIC && atomic_load(&b->refs) > 0);
    if (atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1) return;
    sim_machine *m = d->m;
    struct sim_shared_buf *drop = b;
    pthread_mutex_lock(&m->shared_lock);
    shared_unlink_locked(m, b);
    if (!b->map && b->bytes >= SHARED_KEEP_MIN) { /* kept, newest first; the oldest goes when full */
        drop = m->shared_nkept == SHARED_KEEP ? m->shared_kept[SHARED_KEEP - 1] : NULL;
        if (drop) m->shared_nkept--;
        memmove(&m->shared_kept[1], &m->shared_kept[0], (size_t)m->shared_nkept * sizeof b);
        m->shared_kept[0] = b;
        m->shared_nkept++;
    }
    pthread_mutex_unlock(&m->shared_lock);
    if (drop) shared_dispose(drop);
}

void sim_shared_free_all(sim_machine *m)
{
    while (m->shared) {
        struct sim_shared_buf *b = m->shared;
        shared_unlink_locked(m, b);
        shared_dispose(b);
    }
    for (int i = 0; i < m->shared_nkept; i++) shared_dispose(m->shared_kept[i]);
    m->shared_nkept = 0;
}

int sim_machine_shared_kept(sim_machine *m, size_t *bytes)
{
    pthread_mutex_lock(&m->shared_lock);
    int n = m->shared_nkept;
    size_t b = 0;
    for (int i = 0; i < n; i++) b += m->shared_kept[i]->bytes;
    pthread_mutex_unlock(&m->shared_lock);
    if (bytes) *bytes = b;
    return n;
}

void sim_machine_shared_stats(sim_machine *m, uint64_t *made, uint64_t *live)
{
    pthread_mutex_lock(&m->shared_lock);
    *made = m->shared_made;
    *live = m->shared_live;
    pthread_mutex_unlock(&m->shared_lock);
}

/* match_calls, then (the calls agree: a shared all-gather) the group's one
 * buffer, with a reference for each member, as every member's receive buffer. */
static bool match_shared(sim_machine *m, sim_group *g, char *why, size_t cap)
{
    if (!match_calls(m, g, why, cap)) return false;
    const sim_call *c0 = g->slot[0];
    size_t bytes = c0->p[0] * c0->p[1] * (size_t)g->k * sim_dtype_size(c0->dt);
    void *buf = shared_new(m, bytes, g->local_k); /* a buffer per rank when the group spans ranks */
    if (!buf) { /* every member fails with this (the machine's failure, SIM_ERR_INTERNAL) */
        snprintf(why, cap,
                 "all-gather '%s': out of host memory for its shared buffer of %zu bytes (%d members); "
                 "run a smaller model or batch, or fewer devices",
                 tag_or_dash(c0->tag), bytes, g->k);
        m->match_fail = SIM_ERR_INTERNAL;
        return false;
    }
    for (int j = 0; j < g->k; j++) g->slot[j]->recv = buf;
    return true;
}

/* Moves this device's share of the data.  peers[q] = call of rank q. */
static void move_data(sim_device *d, const sim_call *c, sim_call *const *peers, int k, int r)
{
    size_t es = sim_dtype_size(c->dt);
    char *recv = c->recv;
    switch (c->op) {
    case SIM_OP_ALL_GATHER: { /* shared: one buffer for the group, and task r copies rank r's block */
        size_t outer = c->p[0], chunk = c->p[1];
        for (int q = c->shared ? r : 0; q < (c->shared ? r + 1 : k); q++) {
            const char *src = peers[q]->send;
            for (size_t o = 0; o < outer; o++)
                memcpy(recv + (o * (size_t)k + (size_t)q) * chunk * es, src + o * chunk * es, chunk * es);
        }
        break;
    }
    case SIM_OP_REDUCE_SCATTER: {
        size_t outer = c->p[0], chunk = c->p[1];
        const void *src[SIM_MAX_DEVICES];
        for (int q = 0; q < k; q++) src[q] = peers[q]->send;
        for (size_t o = 0; o < outer; o++)
            sum_sources(c->dt, recv + o * chunk * es, src, k, (o * (size_t)k + (size_t)r) * chunk, chunk);
        break;
    }
    case SIM_OP_ALL_REDUCE: { /* phase 1 only: my chunk of the sum */
        size_t n = c->p[0], lo = (size_t)r * n / (size_t)k, hi = (size_t)(r + 1) * n / (size_t)k;
        const void *src[SIM_MAX_DEVICES];
        for (int q = 0; q < k; q++) src[q] = peers[q]->send;
        sum_sources(c->dt, recv + lo * es, src, k, lo, hi - lo);
        break;
    }
    case SIM_OP_ALL_TO_ALL: {
        size_t b = c->p[1], e = c->p[3], piece = c->p[0] * b;
        for (int q = 0; q < k; q++) {
            const char *src = (const char *)peers[q]->send + (size_t)r * b * es;
            copy_piece(recv + (size_t)q * e * es, src, piece, (size_t)k, b, e, es);
        }
        break;
    }
    case SIM_OP_PPERMUTE: {
        int src = -1;
        for (int q = 0; q < k; q++)
            if (c->perm[q] == r) src = q;
        if (src >= 0) memcpy(recv, peers[src]->send, c->p[0] * es);
        else memset(recv, 0, c->p[0] * es);
        break;
    }
    case SIM_OP_RAGGED_ALL_TO_ALL:
        for (int q = 0; q < k; q++) {
            const sim_call *p = peers[q];
            memcpy(recv + c->recv_off[q] * es, (const char *)p->send + p->send_off[r] * es, c->recv_cnt[q] * es);
        }
        break;
    default: SIM_ASSERT(!"bad op");
    }
}

/* A reduce-scatter of many short rows (an activation scattered on its last
 * dim: 256 rows of 64 floats over 8 ranks) is summed a whole row at a time:
 * task t takes rows [t*outer/k, (t+1)*outer/k) of every rank, reads each
 * source's row as one contiguous run and hands every rank its piece, where
 * a task per rank would read pieces of 64 floats strided across all rows of
 * all sources.  Each element gets the same adds in the same order. */
enum { RS_ROW_MAX = 2048 };

static bool reduce_scatter_by_rows(const sim_call *c, int k)
{
    return c->op == SIM_OP_REDUCE_SCATTER && c->p[0] >= (size_t)k && (size_t)k * c->p[1] <= RS_ROW_MAX;
}

static void reduce_scatter_rows(sim_group *g, int t)
{
    const sim_call *c = g->byrank[0];
    int k = g->k;
    size_t outer = c->p[0], chunk = c->p[1], es = sim_dtype_size(c->dt), row = (size_t)k * chunk;
    size_t lo = (size_t)t * outer / (size_t)k, hi = (size_t)(t + 1) * outer / (size_t)k;
    const void *src[SIM_MAX_DEVICES];
    for (int q = 0; q < k; q++) src[q] = g->byrank[q]->send;
    float sum[RS_ROW_MAX]; /* float32 or int32: 4 bytes an element */
    for (size_t o = lo; o < hi; o++) {
        sum_sources(c->dt, sum, src, k, o * row, row);
        for (int r = 0; r < k; r++)
            memcpy((char *)g->byrank[r]->recv + o * chunk * es, (const char *)sum + (size_t)r * chunk * es, chunk * es);
    }
}

/* Task t of a collective's data movement (sim_exchange): what rank t
 * receives (a reduce-scatter of short rows: rows, see above).  An all-reduce's task t also hands chunk t, which rank t owns
 * and has just summed, to every other rank: each task writes only its own
 * chunk of each buffer, so the tasks are independent even in place. */
static void move_task(sim_machine *m, sim_group *g, int t)
{
    sim_call *c = g->byrank[t];
    int k = g->k;
    if (reduce_scatter_by_rows(c, k)) {
        reduce_scatter_rows(g, t);
        return;
    }
    move_data(&m->dev[c->device], c, g->byrank, k, t);
    if (c->op == SIM_OP_ALL_REDUCE) {
        size_t n = c->p[0], es = sim_dtype_size(c->dt);
        size_t lo = (size_t)t * n / (size_t)k, hi = (size_t)(t + 1) * n / (size_t)k;
        for (int q = 0; q < k; q++)
            if (q != t) memcpy((char *)g->byrank[q]->recv + lo * es, (const char *)c->recv + lo * es, (hi - lo) * es);
    }
}

/* ------------------------------------------------------------ groups spanning ranks
 * The last local arriver sends every other rank of the group its local members' calls (a fixed-size
 * record each), and receives theirs: "ghost" calls for the remote members fill g->slot, so the
 * ordinary match sees the k calls a one-process run sees and gives the same verdict on every rank.
 * Data: to each other rank, for each local sender in rank order, one message of exactly the slices
 * that rank's receivers read (xseg_walk: straight from the sender's buffer when they form one run,
 * else packed); the receiver puts them at the same offsets of a staging copy of the sender's buffer,
 * which becomes the ghost's `send`, so move_data and sum_sources run unchanged for the local
 * receivers and sum in group-rank order: the same bits.  An all-reduce then sends the chunks its
 * local members own, summed, to the other ranks. */

/* One member's call on the wire; then k uint64 send_off, send_cnt, recv_off, recv_cnt and k int32 perm. */
typedef struct {
    int32_t op, dt, counted, counted_set, shared, device, has_perm, has_ragged;
    uint64_t p[4];
    sim_axes axes;
    char tag[SIM_TAG_MAX];
    char pad[8 - (sizeof(sim_axes) + SIM_TAG_MAX) % 8];
} xdesc;

struct sim_xgroup {
    int nother; /* other ranks in the group */
    int other[SIM_MAX_DEVICES];
    size_t rec;      /* bytes of one member's record */
    char *mine;      /* local members' records, canonical order */
    char **theirs;   /* [nother]: each other rank's records, canonical order */
    sim_call *ghost; /* [k], by canonical slot (remote members only) */
    char (*tags)[SIM_TAG_MAX];
    void **staging; /* [k], by group rank: ghosts' send data */
};

static size_t xdesc_bytes(int k) /* a multiple of 8: the next record's uint64 arrays stay aligned */
{
    return (sizeof(xdesc) + (size_t)k * (4 * sizeof(uint64_t) + sizeof(int32_t)) + 7) / 8 * 8;
}

void sim_xgroup_pack_calls(sim_machine *m, sim_group *g)
{
    struct sim_xgroup *x = calloc(1, sizeof *x);
    SIM_ASSERT(x);
    g->x = x;
    int k = g->k;
    for (int j = 0; j < k; j++) {
        int r = g->owner[j], seen = r == m->rank;
        for (int i = 0; i < x->nother && !seen; i++) seen = x->other[i] == r;
        if (!seen) x->other[x->nother++] = r;
    }
    x->rec = xdesc_bytes(k);
    x->mine = calloc((size_t)g->local_k, x->rec);
    SIM_ASSERT(x->mine);
    char *at = x->mine;
    for (int j = 0; j < k; j++) {
        if (g->owner[j] != m->rank) continue;
        const sim_call *c = g->slot[j];
        xdesc h;
        memset(&h, 0, sizeof h);
        h.op = c->op;
        h.dt = c->dt;
        h.counted = c->counted;
        h.counted_set = c->counted_set;
        h.shared = c->shared;
        h.device = c->device;
        h.has_perm = c->perm != NULL;
        h.has_ragged = c->send_cnt != NULL;
        for (int i = 0; i < 4; i++) h.p[i] = c->p[i];
        h.axes = c->axes;
        if (c->tag) sim_str_put(h.tag, sizeof h.tag, 0, c->tag, SIZE_MAX);
        memcpy(at, &h, sizeof h);
        uint64_t *u = (uint64_t *)(at + sizeof h);
        /* the call's own group size: a mismatched call may name other axes (the match reports it) */
        int kc = sim_mesh_group_size(&m->mesh, c->axes) < k ? sim_mesh_group_size(&m->mesh, c->axes) : k;
        if (h.has_ragged)
            for (int q = 0; q < kc; q++) {
                u[q] = c->send_off[q];
                u[k + q] = c->send_cnt[q];
                u[2 * k + q] = c->recv_off[q];
                u[3 * k + q] = c->recv_cnt[q];
            }
        int32_t *pm = (int32_t *)(u + 4 * k);
        if (h.has_perm)
            for (int q = 0; q < kc; q++) pm[q] = c->perm[q];
        at += x->rec;
    }
}

sim_status sim_xgroup_trade_calls(sim_machine *m, sim_group *g)
{
    struct sim_xgroup *x = g->x;
    x->theirs = calloc((size_t)x->nother, sizeof *x->theirs);
    sim_xmsg *msgs = calloc(2 * (size_t)x->nother, sizeof *msgs);
    SIM_ASSERT(x->theirs && msgs);
    for (int i = 0; i < x->nother; i++) {
        int n = 0;
        for (int j = 0; j < g->k; j++) n += g->owner[j] == x->other[i];
        x->theirs[i] = calloc((size_t)n, x->rec);
        SIM_ASSERT(x->theirs[i]);
        msgs[2 * i] = (sim_xmsg){x->other[i], true, x->mine, (size_t)g->local_k * x->rec};
        msgs[2 * i + 1] = (sim_xmsg){x->other[i], false, x->theirs[i], (size_t)n * x->rec};
    }
    sim_status st = sim_xrank_exchange(msgs, 2 * x->nother, g->tag, &m->xstop, m->opts.collective_timeout_s);
    free(msgs);
    if (st == SIM_ERR_DEADLOCK) { /* the collective watchdog, for a group whose other members are elsewhere */
        char ax[96], who[256];
        xdesc c; /* the first local member's call, as sent (the members' own calls may be gone by now) */
        memcpy(&c, x->mine, sizeof c);
        size_t n = 0;
        for (int i = 0; i < x->nother && n + 16 < sizeof who; i++)
            n += (size_t)snprintf(who + n, sizeof who - n, "%s%d", i ? ", " : "", x->other[i]);
        sim_err(st,
                "collective watchdog: %s waited more than %g s (collective_timeout_s) entering %s over %s (tag "
                "'%s') for its peers on MPI rank%s %s; a peer is stuck or far slower, or the ranks called different "
                "collectives",
                m->dev[c.device].label, m->opts.collective_timeout_s, sim_op_name((sim_op)c.op),
                sim_axes_label(&m->mesh, c.axes, ax, sizeof ax), tag_or_dash(c.tag), x->nother > 1 ? "s" : "", who);
    }
    return st;
}

void sim_xgroup_ghosts(sim_machine *m, sim_group *g)
{
    struct sim_xgroup *x = g->x;
    int k = g->k;
    x->ghost = calloc((size_t)k, sizeof *x->ghost);
    x->tags = calloc((size_t)k, sizeof *x->tags);
    SIM_ASSERT(x->ghost && x->tags);
    for (int i = 0; i < x->nother; i++) {
        const char *at = x->theirs[i];
        for (int j = 0; j < k; j++) {
            if (g->owner[j] != x->other[i]) continue;
            xdesc h;
            memcpy(&h, at, sizeof h);
            sim_call *c = &x->ghost[j];
            c->op = (sim_op)h.op;
            c->dt = (sim_dtype)h.dt;
            c->counted = (sim_dtype)h.counted;
            c->counted_set = h.counted_set;
            c->shared = h.shared;
            c->device = h.device;
            for (int q = 0; q < 4; q++) c->p[q] = (size_t)h.p[q];
            c->axes = h.axes;
            memcpy(x->tags[j], h.tag, SIM_TAG_MAX);
            x->tags[j][SIM_TAG_MAX - 1] = '\0';
            c->tag = x->tags[j][0] ? x->tags[j] : NULL;
            /* size_t and uint64_t are one type on every target shardsim builds for (LP64) */
            const size_t *u = (const size_t *)(const void *)(at + sizeof h);
            if (h.has_ragged) {
                c->send_off = u;
                c->send_cnt = u + k;
                c->recv_off = u + 2 * k;
                c->recv_cnt = u + 3 * k;
            }
            if (h.has_perm) c->perm = (const int *)(const void *)(u + 4 * k);
            g->slot[j] = c;
            at += x->rec;
        }
    }
}
_Static_assert(sizeof(size_t) == sizeof(uint64_t) && sizeof(int) == sizeof(int32_t), "LP64");

/* Where one sender's slices for one rank lie: when they are one run of its buffer they travel
 * straight from it and land straight in the staging copy, else through a packed buffer. */
typedef struct {
    size_t bytes;    /* all slices */
    size_t first;    /* byte offset of the first */
    bool contiguous; /* each slice starts where the one before ends */
} xseg_span;

/* The slices of sender rank q's send buffer (its call c) that the receivers in `to` read, in
 * elements, in a fixed order; with pack, each is copied from src to pack (at advancing), with
 * unpack from pack to the same offset of dst.  Returns where they lie. */
static xseg_span xseg_walk(const sim_call *c, int k, int q, const bool *to, size_t es, const char *src, char *dst,
                           char *pack, bool unpack)
{
    xseg_span sp = {0, 0, true};
    size_t next = 0;
#define SEG(off, len)                                                                                                  \
    do {                                                                                                               \
        size_t o_ = (off)*es, l_ = (len)*es;                                                                           \
        if (pack && !unpack) memcpy(pack + sp.bytes, src + o_, l_);                                                    \
        if (pack && unpack) memcpy(dst + o_, pack + sp.bytes, l_);                                                     \
        if (sp.bytes == 0) sp.first = o_;                                                                              \
        else if (o_ != next) sp.contiguous = false;                                                                    \
        next = o_ + l_;                                                                                                \
        sp.bytes += l_;                                                                                                \
    } while (0)
    bool any = false;
    for (int t = 0; t < k; t++) any |= to[t];
    if (!any) return sp;
    switch (c->op) {
    case SIM_OP_ALL_GATHER: SEG(0, c->p[0] * c->p[1]); break;
    case SIM_OP_REDUCE_SCATTER:
    case SIM_OP_ALL_TO_ALL: /* (outer, k, chunk): receiver t reads [:, t, :] */
        for (size_t o = 0; o < c->p[0]; o++)
            for (int t = 0; t < k; t++)
                if (to[t]) SEG((o * (size_t)k + (size_t)t) * c->p[1], c->p[1]);
        break;
    case SIM_OP_ALL_REDUCE:
        for (int t = 0; t < k; t++)
            if (to[t]) {
                size_t lo = (size_t)t * c->p[0] / (size_t)k, hi = (size_t)(t + 1) * c->p[0] / (size_t)k;
                SEG(lo, hi - lo);
            }
        break;
    case SIM_OP_PPERMUTE:
        if (c->perm[q] >= 0 && to[c->perm[q]]) SEG(0, c->p[0]);
        break;
    case SIM_OP_RAGGED_ALL_TO_ALL:
        for (int t = 0; t < k; t++)
            if (to[t]) SEG(c->send_off[t], c->send_cnt[t]);
        break;
    default: SIM_ASSERT(!"bad op");
    }
#undef SEG
    return sp;
}

/* Elements of a sender's buffer that receivers may read (the staging copy's size). */
static size_t send_extent(const sim_call *c, int k)
{
    switch (c->op) {
    case SIM_OP_ALL_GATHER: return c->p[0] * c->p[1];
    case SIM_OP_REDUCE_SCATTER:
    case SIM_OP_ALL_TO_ALL: return c->p[0] * (size_t)k * c->p[1];
    case SIM_OP_ALL_REDUCE:
    case SIM_OP_PPERMUTE: return c->p[0];
    case SIM_OP_RAGGED_ALL_TO_ALL: {
        size_t e = 0;
        for (int t = 0; t < k; t++)
            if (c->send_off[t] + c->send_cnt[t] > e) e = c->send_off[t] + c->send_cnt[t];
        return e;
    }
    default: SIM_ASSERT(!"bad op");
    }
    return 0;
}

/* The messages of one exchange, and the packed buffers to unpack or free afterwards. */
typedef struct {
    sim_xmsg *msg;
    int n, cap;
    struct xpacked {
        char *buf;
        int q; /* a receive's: the sender whose staging copy it unpacks into; -1 for a send */
    } * packed;
    int npacked;
} xplan;

/* Room for one more message (and its packed buffer: at most one each). */
static void plan_grow(xplan *p)
{
    if (p->n < p->cap && p->npacked < p->cap) return;
    p->cap = p->cap ? 2 * p->cap : 16;
    p->msg = realloc(p->msg, (size_t)p->cap * sizeof *p->msg);
    p->packed = realloc(p->packed, (size_t)p->cap * sizeof *p->packed);
    SIM_ASSERT(p->msg && p->packed);
}

static void plan_msg(xplan *p, int peer, bool send, void *buf, size_t bytes)
{
    plan_grow(p);
    p->msg[p->n++] = (sim_xmsg){peer, send, buf, bytes};
}

static char *plan_packed(xplan *p, size_t bytes, int q)
{
    plan_grow(p);
    char *b = malloc(bytes ? bytes : 1);
    SIM_ASSERT(b);
    p->packed[p->npacked].buf = b;
    p->packed[p->npacked].q = q;
    p->npacked++;
    return b;
}

static void plan_free(xplan *p)
{
    for (int i = 0; i < p->npacked; i++) free(p->packed[i].buf);
    free(p->packed);
    free(p->msg);
    memset(p, 0, sizeof *p);
}

sim_status sim_xgroup_move(sim_machine *m, sim_device *d, sim_group *g)
{
    struct sim_xgroup *x = g->x;
    int k = g->k, me = m->rank, nother = x->nother;
    SIM_ASSERT(k >= 1 && k <= SIM_MAX_DEVICES && nother >= 1);
    const sim_call *c0 = g->byrank[0];
    size_t es = sim_dtype_size(c0->dt);
    int rank_owner[SIM_MAX_DEVICES];
    for (int t = 0; t < k; t++) rank_owner[t] = sim_machine_owner(m, g->byrank[t]->device);
    bool *to =
        calloc((size_t)(nother + 1) * (size_t)k, sizeof *to); /* [i][t]: receiver t on other rank i; last row: mine */
    x->staging = calloc((size_t)k, sizeof *x->staging);
    SIM_ASSERT(to && x->staging);
    bool *mine = to + (size_t)nother * (size_t)k;
    for (int t = 0; t < k; t++) {
        mine[t] = rank_owner[t] == me;
        for (int i = 0; i < nother; i++) to[(size_t)i * (size_t)k + (size_t)t] = rank_owner[t] == x->other[i];
    }
    /* to each other rank, each local sender's slices for its receivers (rank order), and from it, each of
     * its senders' slices for mine, into a staging copy of that sender's buffer at the same offsets */
    xplan plan = {0};
    uint64_t sent = 0;
    for (int i = 0; i < nother; i++) {
        const bool *ti = to + (size_t)i * (size_t)k;
        for (int q = 0; q < k; q++) {
            sim_call *c = g->byrank[q];
            if (rank_owner[q] == me) {
                xseg_span sp = xseg_walk(c, k, q, ti, es, NULL, NULL, NULL, false);
                if (!sp.bytes) continue;
                const char *from = (const char *)c->send + sp.first;
                if (!sp.contiguous) {
                    char *b = plan_packed(&plan, sp.bytes, -1);
                    xseg_walk(c, k, q, ti, es, c->send, NULL, b, false);
                    from = b;
                }
                plan_msg(&plan, x->other[i], true, (void *)from, sp.bytes);
                sent += sp.bytes;
            } else if (rank_owner[q] == x->other[i]) {
                xseg_span sp = xseg_walk(c, k, q, mine, es, NULL, NULL, NULL, false);
                if (!sp.bytes) continue;
                x->staging[q] = malloc(send_extent(c, k) * es + 1);
                SIM_ASSERT(x->staging[q]);
                char *into = (char *)x->staging[q] + sp.first;
                if (!sp.contiguous) into = plan_packed(&plan, sp.bytes, q);
                plan_msg(&plan, x->other[i], false, into, sp.bytes);
            }
        }
    }
    sim_status st = sim_xrank_exchange(plan.msg, plan.n, g->tag, &m->xstop, 0);
    if (st == SIM_OK) {
        for (int i = 0; i < plan.npacked; i++) {
            int q = plan.packed[i].q;
            if (q >= 0) xseg_walk(g->byrank[q], k, q, mine, es, NULL, x->staging[q], plan.packed[i].buf, true);
        }
        for (int q = 0; q < k; q++)
            if (x->staging[q]) g->byrank[q]->send = x->staging[q];
        /* the local receivers' tasks (a shared all-gather fills this rank's one buffer: every block) */
        for (int t = 0; t < k; t++) {
            sim_call *c = g->byrank[t];
            if (!mine[t] && !c->shared) continue;
            move_data(&m->dev[c->device], c, g->byrank, k, t);
            if (c->op == SIM_OP_ALL_REDUCE) {
                size_t lo = (size_t)t * c->p[0] / (size_t)k, hi = (size_t)(t + 1) * c->p[0] / (size_t)k;
                for (int q = 0; q < k; q++)
                    if (q != t && mine[q])
                        memcpy((char *)g->byrank[q]->recv + lo * es, (const char *)c->recv + lo * es, (hi - lo) * es);
            }
        }
    }
    plan_free(&plan);
    if (st == SIM_OK && c0->op == SIM_OP_ALL_REDUCE) {
        /* the owners' summed chunks to the other ranks, straight from and into the members' buffers
         * (the local sends went out whole in the first exchange, so writing in place is safe) */
        size_t n = c0->p[0];
        int first = -1;
        for (int t = 0; t < k && first < 0; t++)
            if (mine[t]) first = t;
        for (int i = 0; i < nother; i++)
            for (int t = 0; t < k; t++) {
                size_t lo = (size_t)t * n / (size_t)k, len = ((size_t)(t + 1) * n / (size_t)k - lo) * es;
                if (!len) continue;
                if (mine[t]) {
                    plan_msg(&plan, x->other[i], true, (char *)g->byrank[t]->recv + lo * es, len);
                    sent += len;
                } else if (rank_owner[t] == x->other[i]) {
                    plan_msg(&plan, x->other[i], false, (char *)g->byrank[first]->recv + lo * es, len);
                }
            }
        st = sim_xrank_exchange(plan.msg, plan.n, g->tag, &m->xstop, 0);
        for (int t = 0; t < k && st == SIM_OK; t++) {
            if (mine[t]) continue;
            size_t lo = (size_t)t * n / (size_t)k, len = ((size_t)(t + 1) * n / (size_t)k - lo) * es;
            for (int q = 0; q < k; q++)
                if (mine[q] && q != first)
                    memcpy((char *)g->byrank[q]->recv + lo * es, (const char *)g->byrank[first]->recv + lo * es, len);
        }
        plan_free(&plan);
    }
    sent += (uint64_t)nother * (uint64_t)g->local_k * x->rec; /* the calls */
    sim_machine_add_xrank_bytes(m, d->step, sent);
    free(to);
    return st;
}

void sim_xgroup_end(sim_group *g)
{
    struct sim_xgroup *x = g->x;
    if (!x) return;
    for (int i = 0; x->theirs && i < x->nother; i++) free(x->theirs[i]);
    for (int q = 0; x->staging && q < g->k; q++) free(x->staging[q]);
    free(x->theirs);
    free(x->staging);
    free(x->mine);
    free(x->ghost);
    free(x->tags);
    free(x);
    g->x = NULL;
}

sim_status sim_xgroup_sync(sim_machine *m, sim_group *g)
{
    sim_xmsg msgs[2 * SIM_MAX_DEVICES];
    int n = 0, seen[SIM_MAX_DEVICES], ns = 0;
    char none = 0, sink[SIM_MAX_DEVICES];
    for (int j = 0; j < g->k; j++) {
        int r = g->owner[j], dup = r == m->rank;
        for (int i = 0; i < ns && !dup; i++) dup = seen[i] == r;
        if (dup) continue;
        seen[ns] = r;
        msgs[n++] = (sim_xmsg){r, true, &none, 0};
        msgs[n++] = (sim_xmsg){r, false, &sink[ns], 0};
        ns++;
    }
    sim_status st = sim_xrank_exchange(msgs, n, g == m->world ? 0 : g->tag, &m->xstop, m->opts.collective_timeout_s);
    if (st == SIM_ERR_DEADLOCK)
        sim_err(st,
                "collective watchdog: a barrier of all devices waited more than %g s for MPI ranks "
                "(collective_timeout_s); a peer is stuck or far slower",
                m->opts.collective_timeout_s);
    return st;
}

/* Bytes a collective's data movement reads and writes over the whole group,
 * roughly: below SPLIT_BYTES waking a second thread costs more than it saves. */
enum { SPLIT_BYTES = 512 << 10 };

static size_t exchange_bytes(const sim_call *c, int k)
{
    size_t es = sim_dtype_size(c->dt), n = 0;
    switch (c->op) {
    case SIM_OP_ALL_GATHER: n = c->p[0] * c->p[1] * (c->shared ? 1 : (size_t)k); break;
    case SIM_OP_REDUCE_SCATTER:
    case SIM_OP_ALL_TO_ALL: n = c->p[0] * c->p[1] * (size_t)k; break;
    case SIM_OP_ALL_REDUCE:
    case SIM_OP_PPERMUTE: n = c->p[0]; break;
    case SIM_OP_RAGGED_ALL_TO_ALL:
        for (int q = 0; q < k; q++) n += c->send_cnt[q];
        break;
    default: SIM_ASSERT(!"bad op");
    }
    return 2 * n * (size_t)k * es;
}

static sim_status run_collective(sim_device *d, sim_call *c, sim_meta meta)
{
    SIM_TRY(check_call(d, c));
    if (c->dt != SIM_F32) c->counted = c->dt;
    else if (!c->counted_set)
        c->counted = d->phase == SIM_PHASE_OPTIMIZER ? d->m->opts.counted_optimizer : d->m->opts.counted_wire;
    uint64_t t0 = sim_now_ns();
    sim_machine *m = d->m;
    int k = sim_mesh_group_size(&m->mesh, c->axes);
    int r = sim_device_group_rank(d, c->axes);
    c->device = d->id;
    bool dry = m->opts.dry_run;
    if (k == 1) {
        sim_call *self[1] = {c};
        if (c->shared && !dry) {
            size_t bytes = c->p[0] * c->p[1] * sim_dtype_size(c->dt);
            c->recv = shared_new(m, bytes, 1);
            if (!c->recv)
                return sim_err(SIM_ERR_INTERNAL,
                               "all-gather '%s' on %s: out of host memory for its shared buffer of "
                               "%zu bytes; run a smaller model or batch",
                               tag_or_dash(c->tag), d->label, bytes);
        }
        if (!dry) move_data(d, c, self, 1, 0);
        add_record(d, c, 1, count_bytes(d, c, 1, 0), meta, t0);
        return SIM_OK;
    }
    sim_group *g = sim_group_of(d, sim_axes_mask(c->axes));
    if (dry) { /* nothing moves: post the call and go on (sim_post) */
        SIM_TRY(sim_post(d, g, c, match_calls));
        add_record(d, c, k, count_bytes(d, c, k, r), meta, t0);
        return SIM_OK;
    }
    SIM_TRY(sim_exchange(d, g, c, c->shared ? match_shared : match_calls, move_task, k,
                         exchange_bytes(c, k) >= SPLIT_BYTES));
    add_record(d, c, k, count_bytes(d, c, k, r), meta, t0);
    return SIM_OK;
}

static sim_call call_init(sim_op op, const void *send, void *recv, sim_dtype dt, sim_axes axes, sim_meta meta)
{
    sim_call c;
    memset(&c, 0, sizeof c);
    c.op = op;
    c.send = send;
    c.recv = recv;
    c.dt = dt;
    c.counted_set = meta.counted_set;
    c.counted = meta.counted;
    c.axes = axes;
    c.tag = meta.tag;
    return c;
}

static sim_status need_buffers(const sim_device *d, const sim_call *c, size_t count)
{
    if (d->m->opts.dry_run || count == 0 || (c->send && c->recv)) return SIM_OK;
    return sim_err(SIM_ERR_INPUT, "%s '%s' on %s: a NULL buffer for %zu elements (only dry runs may pass NULL)",
                   sim_op_name(c->op), tag_or_dash(c->tag), d->label, count);
}

static sim_status indivisible(const sim_device *d, const sim_call *c, size_t n, int k, const char *what)
{
    char ax[96];
    return sim_err(SIM_ERR_INPUT,
                   "%s '%s' on %s: %s %zu is not divisible by the group size %d of axes %s; pad the array or "
                   "shard it over axes whose sizes divide %zu",
                   sim_op_name(c->op), tag_or_dash(c->tag), d->label, what, n, k,
                   sim_axes_label(&d->m->mesh, c->axes, ax, sizeof ax), n);
}

/* ------------------------------------------------------------ public */

sim_status sim_all_gather_dim(sim_device *d, const void *send, void *recv, size_t outer, size_t mid, size_t inner,
                              sim_dtype dt, sim_axes axes, sim_meta meta)
{
    sim_call c = call_init(SIM_OP_ALL_GATHER, send, recv, dt, axes, meta);
    c.p[0] = outer;
    c.p[1] = mid * inner;
    SIM_TRY(need_buffers(d, &c, outer * mid * inner));
    return run_collective(d, &c, meta);
}

sim_status sim_all_gather_dim_shared(sim_device *d, const void *send, void **recv, size_t outer, size_t mid,
                                     size_t inner, sim_dtype dt, sim_axes axes, sim_meta meta)
{
    *recv = NULL;
    sim_call c = call_init(SIM_OP_ALL_GATHER, send, NULL, dt, axes, meta);
    c.p[0] = outer;
    c.p[1] = mid * inner;
    c.shared = true;
    if (!d->m->opts.dry_run && outer * mid * inner != 0 && !send)
        return sim_err(SIM_ERR_INPUT,
                       "all-gather '%s' on %s: a NULL send buffer for %zu elements (only dry runs may "
                       "pass NULL)",
                       tag_or_dash(meta.tag), d->label, outer * mid * inner);
    SIM_TRY(run_collective(d, &c, meta));
    shared_seal(d->m, c.recv);
    *recv = c.recv;
    return SIM_OK;
}

sim_status sim_all_gather(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta)
{
    return sim_all_gather_dim(d, send, recv, 1, count, 1, dt, axes, meta);
}

sim_status sim_reduce_scatter_dim(sim_device *d, const void *send, void *recv, size_t outer, size_t mid, size_t inner,
                                  sim_dtype dt, sim_axes axes, sim_meta meta)
{
    sim_call c = call_init(SIM_OP_REDUCE_SCATTER, send, recv, dt, axes, meta);
    SIM_TRY(check_call(d, &c));
    if (dt != SIM_F32 && dt != SIM_I32)
        return sim_err(SIM_ERR_INPUT, "reduce-scatter '%s': sums need float32 or int32, not %s", tag_or_dash(meta.tag),
                       sim_dtype_name(dt));
    int k = sim_mesh_group_size(&d->m->mesh, axes);
    if (mid % (size_t)k) return indivisible(d, &c, mid, k, "the scattered dim of size");
    c.p[0] = outer;
    c.p[1] = mid / (size_t)k * inner;
    SIM_TRY(need_buffers(d, &c, outer * mid * inner));
    return run_collective(d, &c, meta);
}

sim_status sim_reduce_scatter(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                              sim_meta meta)
{
    return sim_reduce_scatter_dim(d, send, recv, 1, count, 1, dt, axes, meta);
}

sim_status sim_all_reduce(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta)
{
    sim_call c = call_init(SIM_OP_ALL_REDUCE, send, recv, dt, axes, meta);
    if (dt != SIM_F32 && dt != SIM_I32)
        return sim_err(SIM_ERR_INPUT, "all-reduce '%s': sums need float32 or int32, not %s", tag_or_dash(meta.tag),
                       sim_dtype_name(dt));
    c.p[0] = count;
    SIM_TRY(need_buffers(d, &c, count));
    return run_collective(d, &c, meta);
}

sim_status sim_all_to_all_dims(sim_device *d, const void *send, void *recv, int rank, const size_t *shape, int split,
                               int concat, sim_dtype dt, sim_axes axes, sim_meta meta)
{
    sim_call c = call_init(SIM_OP_ALL_TO_ALL, send, recv, dt, axes, meta);
    SIM_TRY(check_call(d, &c));
    if (rank < 1 || rank > 16 || split < 0 || split >= rank || concat < 0 || concat >= rank)
        return sim_err(SIM_ERR_INPUT, "all-to-all '%s': split dim %d / concat dim %d outside a rank-%d array",
                       tag_or_dash(meta.tag), split, concat, rank);
    size_t k = (size_t)sim_mesh_group_size(&d->m->mesh, axes);
    if (shape[split] % k) return indivisible(d, &c, shape[split], (int)k, "the split dim of size");
    size_t out[16], total = 1;
    for (int i = 0; i < rank; i++) {
        out[i] = shape[i];
        total *= shape[i];
    }
    out[split] /= k;
    out[concat] *= k;
    size_t a = 1, b = shape[split] / k, cc = 1, e = out[concat] / k;
    for (int i = 0; i < split; i++) a *= shape[i];
    for (int i = split + 1; i < rank; i++) b *= shape[i];
    for (int i = 0; i < concat; i++) cc *= out[i];
    for (int i = concat + 1; i < rank; i++) e *= out[i];
    SIM_ASSERT(a * b == cc * e && a * b * k == total);
    c.p[0] = a;
    c.p[1] = b;
    c.p[2] = cc;
    c.p[3] = e;
    SIM_TRY(need_buffers(d, &c, total));
    return run_collective(d, &c, meta);
}

sim_status sim_all_to_all(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta)
{
    size_t shape[1] = {count};
    return sim_all_to_all_dims(d, send, recv, 1, shape, 0, 0, dt, axes, meta);
}

sim_status sim_ppermute(sim_device *d, const void *send, void *recv, size_t count, const int *perm, sim_dtype dt,
                        sim_axes axes, sim_meta meta)
{
    sim_call c = call_init(SIM_OP_PPERMUTE, send, recv, dt, axes, meta);
    SIM_TRY(check_call(d, &c));
    int k = sim_mesh_group_size(&d->m->mesh, axes);
    bool hit[SIM_MAX_DEVICES] = {false};
    for (int q = 0; q < k; q++) {
        if (perm[q] < -1 || perm[q] >= k)
            return sim_err(SIM_ERR_INPUT, "ppermute '%s': rank %d sends to %d, outside -1..%d", tag_or_dash(meta.tag),
                           q, perm[q], k - 1);
        if (perm[q] >= 0 && hit[perm[q]])
            return sim_err(SIM_ERR_INPUT, "ppermute '%s': rank %d is the destination of two sources",
                           tag_or_dash(meta.tag), perm[q]);
        if (perm[q] >= 0) hit[perm[q]] = true;
    }
    c.p[0] = count;
    c.perm = perm;
    SIM_TRY(need_buffers(d, &c, count));
    return run_collective(d, &c, meta);
}

sim_status sim_ragged_all_to_all(sim_device *d, const void *send, void *recv, size_t recv_cap, const size_t *send_off,
                                 const size_t *send_cnt, const size_t *recv_off, const size_t *recv_cnt, sim_dtype dt,
                                 sim_axes axes, sim_meta meta)
{
    sim_call c = call_init(SIM_OP_RAGGED_ALL_TO_ALL, send, recv, dt, axes, meta);
    SIM_TRY(check_call(d, &c));
    int k = sim_mesh_group_size(&d->m->mesh, axes);
    size_t total = 0;
    for (int q = 0; q < k; q++) {
        if (recv_off[q] + recv_cnt[q] > recv_cap)
            return sim_err(SIM_ERR_INPUT,
                           "ragged-all-to-all '%s' on %s: %zu elements from rank %d at offset %zu overflow the "
                           "receive buffer of %zu elements",
                           tag_or_dash(meta.tag), d->label, recv_cnt[q], q, recv_off[q], recv_cap);
        total += send_cnt[q] + recv_cnt[q];
    }
    c.send_off = send_off;
    c.send_cnt = send_cnt;
    c.recv_off = recv_off;
    c.recv_cnt = recv_cnt;
    c.recv_cap = recv_cap;
    SIM_TRY(need_buffers(d, &c, total));
    return run_collective(d, &c, meta);
}

const sim_record *sim_device_records(const sim_device *d, size_t *n)
{
    *n = d->nrec;
    return d->rec;
}

void sim_device_clear_records(sim_device *d)
{
    d->nrec = 0;
    d->ncost = 0;
    d->nreps = 0;
    d->nopen = 0;
    d->rec_extra = d->cost_extra = 0;
    d->span_extra = 0;
    memset(d->totals, 0, sizeof d->totals);
}

sim_op_totals sim_device_op_totals(const sim_device *d, sim_op op)
{
    SIM_ASSERT(op >= 0 && op < SIM_NOP);
    return d->totals[op];
}

void sim_device_add_cost(sim_device *d, double flops, double elements, double weight_elements, const char *tag)
{
    sim_device_add_cost_tiled(d, flops, flops, elements, weight_elements, tag);
}

void sim_device_add_cost_tiled(sim_device *d, double flops, double mxu_flops, double elements, double weight_elements,
                               const char *tag)
{
    if (d->m->opts.no_costs) return;
    if (d->ncost && d->cost[d->ncost - 1].step != d->step) { /* the current step's only: bounded */
        SIM_ASSERT(d->nreps == 0); /* repeated blocks are the last step's only (models/core/train.c) */
        d->ncost = 0;
        d->cost_extra = 0;
    }
    if (d->ncost == d->capcost) {
        d->capcost = d->capcost ? 2 * d->capcost : 256;
        d->cost = realloc(d->cost, d->capcost * sizeof *d->cost);
        SIM_ASSERT(d->cost);
    }
    sim_cost *c = &d->cost[d->ncost++];
    c->step = d->step;
    c->phase = d->phase;
    c->flops = flops;
    c->mxu_flops = mxu_flops > flops ? mxu_flops : flops;
    c->elements = elements;
    c->weight_elements = weight_elements;
    c->layout = false;
    c->nrec_before = d->nrec;
    snprintf(c->tag, sizeof c->tag, "%s", tag ? tag : "-");
}

void sim_device_add_cost_layout(sim_device *d, double elements, const char *tag)
{
    if (d->m->opts.no_costs) return;
    sim_device_add_cost_tiled(d, 0.0, 0.0, elements, 0.0, tag);
    d->cost[d->ncost - 1].layout = true;
}

const sim_cost *sim_device_costs(const sim_device *d, size_t *n)
{
    *n = d->ncost;
    return d->cost;
}

/* ------------------------------------------------------------ repeated blocks */

void sim_device_repeat_begin(sim_device *d)
{
    SIM_ASSERT(d->nopen < SIM_WALK_DEPTH);
    if (d->nreps == d->capreps) {
        d->capreps = d->capreps ? 2 * d->capreps : 8;
        d->reps = realloc(d->reps, d->capreps * sizeof *d->reps);
        SIM_ASSERT(d->reps);
    }
    sim_repeat *b = &d->reps[d->nreps];
    memset(b, 0, sizeof *b);
    b->rec0 = d->nrec;
    b->cost0 = d->ncost;
    int k = d->nopen++;
    d->open[k] = d->nreps++;
    memcpy(d->open_totals[k], d->totals, sizeof d->totals);
    d->open_vrec[k] = d->nrec + d->rec_extra;
    d->open_vcost[k] = d->ncost + d->cost_extra;
    d->open_vspans[k] = d->nspans + d->span_extra;
    sim_arena_repeat_begin(d->arena);
}

sim_status sim_device_repeat_end(sim_device *d, uint64_t times)
{
    return sim_device_repeat_end_layers(d, times, 0, 0);
}

sim_status sim_device_repeat_end_layers(sim_device *d, uint64_t times, int64_t tag_first, int64_t tag_step)
{
    SIM_ASSERT(d->nopen > 0);
    int k = --d->nopen;
    sim_repeat *b = &d->reps[d->open[k]];
    b->rec1 = d->nrec;
    b->cost1 = d->ncost;
    b->times = times;
    b->tag_first = tag_first;
    b->tag_step = tag_step;
    SIM_ASSERT(b->rec0 <= b->rec1 && b->cost0 <= b->cost1);
    /* the block as walked (its inner blocks expanded), times more: integers, so a product equals
     * the sum the copies would have added */
    for (int op = 0; op < SIM_NOP; op++) {
        sim_op_totals *t = &d->totals[op];
        const sim_op_totals *o = &d->open_totals[k][op];
        t->calls += times * (t->calls - o->calls);
        t->bytes_sent += times * (t->bytes_sent - o->bytes_sent);
        t->bytes_recv += times * (t->bytes_recv - o->bytes_recv);
    }
    d->rec_extra += (size_t)times * (d->nrec + d->rec_extra - d->open_vrec[k]);
    d->cost_extra += (size_t)times * (d->ncost + d->cost_extra - d->open_vcost[k]);
    d->span_extra += times * (d->nspans + d->span_extra - d->open_vspans[k]);
    /* an empty block, or one without copies, walks as what it holds: dropped if it was the last begun */
    if ((times == 0 || (b->rec0 == b->rec1 && b->cost0 == b->cost1)) && d->open[k] == d->nreps - 1) d->nreps--;
    return sim_arena_repeat_end(d->arena, times);
}

const sim_repeat *sim_device_repeats(const sim_device *d, size_t *n)
{
    *n = d->nreps;
    return d->reps;
}

size_t sim_device_nrecords(const sim_device *d)
{
    return d->nrec + d->rec_extra;
}

size_t sim_device_ncosts(const sim_device *d)
{
    return d->ncost + d->cost_extra;
}

uint64_t sim_repeat_weight(const sim_repeat *reps, size_t nreps, size_t rec)
{
    uint64_t k = 1;
    for (size_t i = 0; i < nreps; i++)
        if (rec >= reps[i].rec0 && rec < reps[i].rec1) k *= 1 + reps[i].times;
    return k;
}

void sim_walk_init(sim_walk *w, const sim_record *rec, size_t nrec, const sim_cost *cost, size_t ncost,
                   const sim_repeat *reps, size_t nreps)
{
    memset(w, 0, sizeof *w);
    w->rec = rec, w->nrec = nrec, w->cost = cost, w->ncost = ncost, w->reps = reps, w->nreps = nreps;
}

void sim_walk_device(sim_walk *w, const sim_device *d)
{
    sim_walk_init(w, d->rec, d->nrec, d->cost, d->ncost, d->reps, d->nreps);
}

/* At the walk's position: the blocks that end here run again (from their start) or are left, and
 * the blocks that start here are entered. */
/* Whether the walk stands at (rec, cost): without costs (a walk of records alone), at rec. */
static bool walk_at(const sim_walk *w, size_t rec, size_t cost)
{
    return w->ri == rec && (!w->cost || w->ci == cost);
}

static void walk_blocks(sim_walk *w)
{
    for (;;) {
        if (w->depth > 0) {
            const sim_repeat *b = &w->reps[w->open[w->depth - 1]];
            if (walk_at(w, b->rec1, b->cost1)) {
                if (w->left[w->depth - 1] > 0) {
                    w->left[w->depth - 1]--;
                    w->ri = b->rec0, w->ci = w->cost ? b->cost0 : 0;
                    w->next = w->open[w->depth - 1] + 1; /* the blocks inside it come again */
                } else {
                    w->depth--;
                }
                continue;
            }
        }
        if (w->next < w->nreps) {
            const sim_repeat *b = &w->reps[w->next];
            bool empty = b->times == 0 || (b->rec0 == b->rec1 && (!w->cost || b->cost0 == b->cost1));
            if (empty && b->rec0 <= w->ri && (!w->cost || b->cost0 <= w->ci)) { /* walks as what it holds */
                w->next++;
                continue;
            }
            if (!empty && walk_at(w, b->rec0, b->cost0)) {
                SIM_ASSERT(w->depth < SIM_WALK_DEPTH);
                w->open[w->depth] = w->next;
                w->left[w->depth] = b->times;
                w->depth++;
                w->next++;
                continue;
            }
        }
        return;
    }
}

/* How far the open blocks move the layer number in the tags they hold. */
static int64_t walk_tag_shift(const sim_walk *w)
{
    int64_t shift = 0;
    for (int i = 0; i < w->depth; i++) {
        const sim_repeat *b = &w->reps[w->open[i]];
        if (b->tag_step || b->tag_first) shift += b->tag_first + (int64_t)(b->times - w->left[i]) * b->tag_step;
    }
    return shift;
}

/* tag with the number after its first "layers_" moved by shift (a layer of a stack seen as another) */
static void renumber_tag(char *tag, size_t cap, int64_t shift)
{
    char *p = strstr(tag, "layers_");
    if (!p) return;
    p += 7;
    char *q = p;
    long long n = 0;
    while (*q >= '0' && *q <= '9') n = 10 * n + (*q++ - '0');
    if (q == p) return;
    char tail[SIM_TAG_MAX];
    snprintf(tail, sizeof tail, "%s", q);
    snprintf(p, cap - (size_t)(p - tag), "%lld%s", n + (long long)shift, tail);
}

bool sim_walk_next(sim_walk *w, const sim_record **rec, sim_cost *cost)
{
    walk_blocks(w);
    size_t upto = w->ci < w->ncost ? w->cost[w->ci].nrec_before : w->nrec;
    if (w->ri < upto && w->ri < w->nrec) {
        *rec = &w->rec[w->ri++];
        w->vrec++;
        int64_t shift = walk_tag_shift(w);
        if (shift) {
            w->renamed = **rec;
            renumber_tag(w->renamed.tag, sizeof w->renamed.tag, shift);
            *rec = &w->renamed;
        }
        return true;
    }
    if (w->ci >= w->ncost) return false;
    *rec = NULL;
    *cost = w->cost[w->ci++];
    cost->nrec_before = w->vrec;
    int64_t shift = walk_tag_shift(w);
    if (shift) renumber_tag(cost->tag, sizeof cost->tag, shift);
    return true;
}

const sim_record *sim_walk_next_record(sim_walk *w)
{
    const sim_record *r;
    sim_cost c;
    while (sim_walk_next(w, &r, &c))
        if (r) return r;
    return NULL;
}

/* test_models_xla_rules.c — what XLA's program transformations change in
 * what a device holds and sends, one test per transformation.
 *
 * Hoisted weight copies: the layer stacks' copies a compiler that hoists
 * MaxText's per-layer cast out of the layer loop holds (configs/hardware/:
 * hoisted_weight_copies; SIM_MEM_WCOPY).
 * A tiny Llama (2 layers) on fsdp=2 x tensor=2, dtype=bfloat16 and
 * weight_dtype=float32, one step.  The expected bytes come from the
 * parameter definitions and their specs (global elements over the mesh axes
 * each spec splits by), not from the device's arrays:
 *   - v5p (XLA:TPU hoists the cast): the category peaks at 2 bytes x the
 *     scanned parameters' elements on a device, holds that much when the
 *     device's total peaks, and nothing after the step;
 *   - no profile (XLA:CPU), h100, dtype=float32 under v5p (nothing narrows)
 *     and scan_layers=false under v5p (no layer loop): nothing;
 *   - the losses are the same bits either way (the copy is counted only).
 *
 * The recomputation's dead tail: remat recomputes a layer for its backward,
 * and XLA removes what nothing reads from that recomputation: the layer's
 * last reshard (tensor parallelism's reduce-scatter of the MLP output) runs
 * in the forward only.  Same tiny Llama on data=2 x tensor=2, remat_policy=full and
 * none: per layer, the forward reduce-scatters the attention and the MLP
 * outputs, the backward the two norms' cotangents, and the recomputation the
 * attention output alone: 5 records a layer with remat, 4 without, each of
 * (k-1)/k x the device's rows x seq x emb x 2 bytes; losses and gradients
 * equal.
 *
 * Gradient accumulation: XLA:TPU holds two gradient sets beside the
 * gradients while the microbatch loop runs (accumulation_gradient_copies):
 * the gradients' own peak is 3 x 4 bytes x every parameter's elements on a
 * device with gradient_accumulation_steps=2 under v5p, 1 x without the
 * profile or without accumulation, and nothing is left after the step.
 *
 * Muon's Newton-Schulz operands: XLA:TPU gathers X once per step for both
 * X X^T and B X, and A = X X^T once, in bfloat16 (newton_schulz_* keys);
 * XLA:CPU (no profile) gathers X, A and X again, as computed (float32).  The
 * MLP's wi_0 stack [emb 16, layers 2, mlp 32] on fsdp=4 (rows: the 16 of
 * emb): per step X is 2 x 16 x 32 and A 2 x 16 x 16 elements, each gather
 * sending 3/4 of it; 5 steps.  matmul_precision=highest keeps the float32
 * operands (six passes): the same gathers in float32.
 *
 * Windowed einsums: over a group of 8 devices XLA:TPU runs a weight product
 * as a ring of collective-permutes sending (k+1)/k of the weight where the
 * gather or reduce-scatter sends (k-1)/k (windowed_einsum_min_group).  The
 * tiny Llama on fsdp=8 under v5p, remat full: per layer the forward windows
 * its 7 kernels (4 attention kernels of 256 elements, 3 MLP kernels of 512),
 * the backward gathers 6 of them plainly once for the recomputation and the
 * input gradient, windows wo's gather (its product is dropped from the
 * recomputation: only the input gradient reads it) and every kernel's
 * gradient reduce-scatter; bfloat16.  No profile, or fsdp=4: no ring.
 * Over a strided group (fsdp=4 x tensor=2 on v6e, a dry run of a one-layer
 * Llama of width 1024) XLA:TPU's cost model decides per product
 * (windowed_einsum_ici_gbps, windowed_einsum_tflops): query/key/value
 * gathered, out and the wide MLP windowed, the narrow MLP's wi gathered
 * (test_windowed_einsums_strided gives the arithmetic).
 *
 * A shard_map's gradient psum: the sparse MoE's expert kernels enter the
 * shard_map replicated over fsdp, so their gradients are psums then slices,
 * which XLA:TPU fuses into a reduce-scatter over up to 4 devices and keeps
 * an all-reduce over more (psum_scatter_max_group).  A tiny DeepSeek (2 MoE
 * layers of 8 experts, emb 32, expert mlp 16) under v5p: each expert
 * kernel's gradient is 8 x 32 x 16 elements in bfloat16, all-reduced over
 * fsdp=8 (2 x 7/8 of it sent), reduce-scattered over fsdp=4 (3/4).
 *
 * Gathers the collective CSE leaves apart: XLA:TPU merges two gathers of one
 * weight only when their products lie close in the layer body, so a
 * rematerialised MoE layer gathers its attention and gate weights once for
 * the recomputation and once more for the input gradient (weight_gather_cse:
 * near).  The tiny DeepSeek on fsdp=4, remat full: under v5p the backward's
 * gathers of the MoE layers' MLA kernels and gate send twice the forward's
 * (3/4 x 2 bytes x their elements, from the dims), under h100 once; the dense
 * layer's and the routed experts' gathers are the same under both; with
 * remat_policy=minimal fewer than twice.
 *
 * A gradient reduce-scattered along its last dim to one lane tile (at most
 * 128 elements a device) stays an all-reduce under XLA:TPU
 * (gradient_lane_scatter_max_all_reduce).  The tiny Llama on fsdp=4 under v5p:
 * out and the MLP's wo (emb, their last dim, split to 4) all-reduce, 2 x 3/4
 * x 2 bytes an element; wq and wi_0 (split on their first dim) reduce-scatter
 * 3/4 x 2; under h100 out reduce-scatters too.
 *
 * The pipeline's output in auto mode: MaxText reshapes the [S, M/S, mb, T, E]
 * state_io to [B, T, E] without an out_sharding, so with one microbatch per
 * stage the batch keeps 'stage' and each stage computes its own rows' logits:
 * the tiny Llama on stage=2 x fsdp=2 (no profile) all-reduces the logits
 * kernel's gradient over stage (2 x 1/2 x its fsdp shard in float32) and
 * gathers no output over stage; with two microbatches per stage the output is
 * constrained as before (gathered over stage, no such all-reduce).
 *
 * Saved products' gradient copies: with a remat policy that saves a
 * product's output for the backward, XLA:TPU's peak holds one float32 copy
 * of the device's shard of that product's weight (saved_product_gradient_
 * copies), charged as gradients from the forward layer that saves it to the
 * end of the backward.  The tiny Llama on fsdp=2 x tensor=2 under v5p: the
 * gradients' own peak is 4 bytes x (every parameter's elements on a device
 * + the saved products' weights' elements): with remat_policy=minimal q, k,
 * v, out (16 x 2 x 8 each) and wi_0, wi_1 (16 x 32 each), not wo (no
 * backward reads its output), each split 4 ways, 2 layers: 2 x (4 x 256 +
 * 2 x 512) / 4; with save_dot_except_mlp the four attention kernels alone;
 * with full remat, without the profile or with h100, nothing more; nothing
 * left after the step; the loss the same bits with and without the profile.
 *
 * A profile whose rule is missing or out of range is refused, naming the
 * key (the v5p profile with one key changed, in a scratch configs dir).
 *
 * The embedding lookup: where FSDP splits both the table's embed dim and
 * the tokens' batch, XLA:TPU all-gathers the int32 token ids over those k
 * devices, looks every gathered token up on the table's embed shard and
 * all-to-alls the rows [k*Bl, T, E/k] -> [Bl, T, E] (bfloat16, the weights'
 * gather dtype); the backward all-to-alls the cotangent rows back and
 * scatter-adds them into the table's shard (embedding_lookup: all_to_all).
 * The tiny Llama on fsdp=4, fsdp=2 x tensor=2 and data=2 x fsdp=2 under v5p: no gather of
 * the table and no reduction of its gradient over fsdp; the ids gather sends
 * (k-1) x Bl x T x 4 bytes, each all-to-all (k-1) x Bl x T x E/k x 2; the
 * loss and every gradient are the bits of the run without a profile (which
 * gathers the table).  A vocabulary of 8 makes the devices' tokens repeat
 * ids, so the table gradient's rows sum several devices' rows: one
 * scatter-add of all the gathered rows in a row (not member by member, then
 * the members' sums) fails the bit check.
 *
 * MLA's low-rank products under tensor parallelism: in auto mode the q_norm
 * and kv_norm scales, split over tensor, split wq_a's and wkv_a's outputs the
 * same way, and XLA:TPU gathers each normalised product for the next product,
 * again for that product's weight gradient in a rematerialised layer, and
 * reduce-scatters its cotangent (low_rank_norm_sharding: scale; counted only).
 * The tiny DeepSeek (3 layers, q_lora 16, kv_lora 8) on fsdp=2 x tensor=2, a
 * device's 2 rows of 16 tokens, remat full: per layer and product, an
 * all-gather forward and two backward of 1/2 x [2, 16, R] x 2 bytes, one
 * reduce-scatter of as much; under h100 (whole), with tensor=1 or in explicit
 * mode nothing; the loss the same bits as without a profile.
 *
 * Muon's update: XLA:TPU forms every Muon stack's float32 estimate before the
 * first Newton-Schulz step and holds it until the stack's update, the
 * gradients dead from then on, and holds each step's product B X and the
 * normalised estimate for the update, the stacks in optax's tree order
 * (muon_update_buffers: stacked).  The tiny Llama widened to emb 64, MLP 256,
 * 8 layers, vocabulary 8 on fsdp=4, 2 steps: under v5p the device's total
 * peaks at mlp.wi_0's fifth step (first in tree order), holding every other
 * stack's estimate, wi_0's iterate, its estimate and five products, the fifth
 * product, the step's bfloat16 gathers of X and A, and the AdamW leaves'
 * gradients alone, each from the shapes by hand; without a profile every
 * gradient is held at the peak; the losses are the same bits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/core/timemodel.h"
#include "models/core/train.h"
#include "sim/arena.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama-mha.yml: 2 layers of width 16, 2 heads of 8, MLP 32 */
static const char *const TINY[] = {TINY_LLAMA_MHA_YML};
enum { NTINY = sizeof TINY / sizeof TINY[0], NDEV = 4 };

typedef struct {
    double loss;
    uint64_t n_scanned;           /* elements of the scanned parameters on a device */
    uint64_t peak, at_peak, live; /* SIM_MEM_WCOPY on device 0: own peak, at the total's peak, after */
} figures;

static void run(const char *dtype, const char *profile, bool scan, figures *f)
{
    char dt[64], hp[64];
    snprintf(dt, sizeof dt, "dtype=%s", dtype);
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    const char *words[] = {dt,
                           "weight_dtype=float32",
                           "ici_fsdp_parallelism=2",
                           "ici_tensor_parallelism=2",
                           scan ? "scan_layers=true" : "scan_layers=false",
                           hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, profile ? 6 : 5, NDEV, 1);
    model_run_train(&r, false);
    memset(f, 0, sizeof *f);
    f->loss = r.job.stats[0].loss;
    for (int i = 0; i < r.def->nparams; i++) {
        if (r.def->defs[i].scan_dim >= 0) f->n_scanned += model_run_shard_elems(r.def, i, NULL);
    }
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    f->peak = st.peak_by[SIM_MEM_WCOPY];
    f->at_peak = st.at_peak_by[SIM_MEM_WCOPY];
    f->live = st.live_by[SIM_MEM_WCOPY];
    model_run_close(&r);
}

static void test_hoisted_copies(void **state)
{
    (void)state;
    figures tpu, cpu, gpu, f32, unscanned;
    run("bfloat16", "v5p", true, &tpu);
    run("bfloat16", NULL, true, &cpu);
    run("bfloat16", "h100", true, &gpu);
    run("float32", "v5p", true, &f32);
    run("bfloat16", "v5p", false, &unscanned);
    /* by hand: 2 layers x (4 attention kernels of 16 x 2 x 8 and 3 MLP kernels of 16 x 32, each split 4
     * ways: embed on fsdp, heads or mlp on tensor; 2 norm scales of 16, split 2 ways: MaxText's 'norm' rule
     * is [tensor]) = 2 x (256 + 384 + 16) */
    assert_int_equal(tpu.n_scanned, 2 * (4 * 256 / 4 + 3 * 512 / 4 + 2 * 16 / 2));
    assert_int_equal(tpu.peak, 2 * tpu.n_scanned);
    assert_int_equal(tpu.at_peak, 2 * tpu.n_scanned);
    assert_int_equal(tpu.live, 0);
    const figures *none[] = {&cpu, &gpu, &f32, &unscanned};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(none[i]->peak, 0);
        assert_int_equal(none[i]->at_peak, 0);
    }
    assert_true(tpu.loss == cpu.loss && tpu.loss == gpu.loss);
}

typedef struct {
    int rs_fwd, rs_bwd, rs_mlp_bwd; /* device 0's activation reduce-scatters over tensor */
    uint64_t rs_bytes;              /* every such record's bytes (all equal) */
    int bad_bytes;                  /* records of another size */
    model_run r;
} tail;

static void run_tail(const char *remat, tail *f)
{
    char rp[64];
    snprintf(rp, sizeof rp, "remat_policy=%s", remat);
    const char *words[] = {"dtype=bfloat16", "ici_data_parallelism=2", "ici_tensor_parallelism=2", rp};
    memset(f, 0, sizeof *f);
    model_run_open(&f->r, TINY, NTINY, 4, words, 4, NDEV, 1);
    model_run_train(&f->r, true);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(f->r.m, 0), &n);
    /* 2 of the 4 rows on a device (data=2), seq 16, emb 16, bfloat16; k = 2 on tensor: half of it sent */
    const uint64_t want = (2 * 16 * 16 * 2) / 2;
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        /* the layers' outputs (attention_lnx, mlp_lnx) and the norms' cotangents; not the first layer's input */
        if (x->op != SIM_OP_REDUCE_SCATTER || (!strstr(x->tag, "_lnx") && !strstr(x->tag, "_layer_norm"))) continue;
        if (x->phase == SIM_PHASE_FORWARD) f->rs_fwd++;
        else f->rs_bwd++;
        if (x->phase != SIM_PHASE_FORWARD && strstr(x->tag, "mlp_lnx")) f->rs_mlp_bwd++;
        f->rs_bytes = x->bytes_sent;
        f->bad_bytes += x->bytes_sent != want;
    }
}

static void test_dead_recompute_tail(void **state)
{
    (void)state;
    tail full, none;
    run_tail("full", &full);
    run_tail("none", &none);
    const int layers = 2;
    assert_int_equal(none.rs_fwd, 2 * layers);
    assert_int_equal(none.rs_bwd, 2 * layers);
    assert_int_equal(full.rs_fwd, 2 * layers);
    assert_int_equal(full.rs_bwd, 3 * layers); /* the norms' cotangents and the recomputed attention output */
    assert_int_equal(full.rs_mlp_bwd, 0);
    assert_int_equal(full.bad_bytes + none.bad_bytes, 0);
    assert_true(full.r.job.stats[0].loss == none.r.job.stats[0].loss);
    model_run_compare("remat full against none", &full.r, &none.r, 1);
    model_run_close(&full.r);
    model_run_close(&none.r);
}

/* One step of TINY in bfloat16 on fsdp=2 tensor=2 with `word` (and hardware_profile=profile unless
 * NULL): device 0's peak and live gradient bytes after it, the parameters' elements a device holds,
 * the loss. */
static void grads_with(const char *profile, const char *word, uint64_t *peak, uint64_t *n_params, uint64_t *live,
                       double *loss)
{
    char hp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    const char *words[] = {"dtype=bfloat16", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", word, hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, profile ? 5 : 4, NDEV, 1);
    model_run_train(&r, false);
    *n_params = 0;
    for (int i = 0; i < r.def->nparams; i++) *n_params += model_run_shard_elems(r.def, i, NULL);
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    *peak = st.peak_by[SIM_MEM_GRADS];
    *live = st.live_by[SIM_MEM_GRADS];
    *loss = r.job.stats[0].loss;
    model_run_close(&r);
}

static void grads_at(const char *profile, int ga, uint64_t *peak, uint64_t *n_params, uint64_t *live)
{
    char g[64];
    double loss;
    snprintf(g, sizeof g, "gradient_accumulation_steps=%d", ga);
    grads_with(profile, g, peak, n_params, live, &loss);
}

static void test_accumulation_copies(void **state)
{
    (void)state;
    uint64_t tpu, cpu, one, n, n2, n3, live, live2, live3;
    grads_at("v5p", 2, &tpu, &n, &live);
    grads_at(NULL, 2, &cpu, &n2, &live2);
    grads_at("v5p", 1, &one, &n3, &live3);
    assert_true(n > 0 && n == n2 && n == n3);
    assert_int_equal(tpu, 3 * 4 * n);
    assert_int_equal(cpu, 4 * n);
    assert_int_equal(one, 4 * n);
    /* after the step the charge is gone: what stays is what stays without the profile */
    assert_int_equal(live, live2);
    assert_int_equal(live, live3);
}

static void saved_grads_at(const char *profile, const char *remat, uint64_t *peak, uint64_t *n_params, uint64_t *live,
                           double *loss)
{
    char rp[64];
    snprintf(rp, sizeof rp, "remat_policy=%s", remat);
    grads_with(profile, rp, peak, n_params, live, loss);
}

static void test_saved_product_copies(void **state)
{
    (void)state;
    const char *const cases[][2] = {
        {"v5p", "minimal"}, {"v5p", "save_dot_except_mlp"}, {"v5p", "full"}, {NULL, "minimal"}, {"h100", "minimal"}};
    /* by hand: per layer q, k, v, out of 16 x 2 x 8 = 256 elements and wi_0, wi_1 of 16 x 32 = 512, each
     * split 4 ways (embed on fsdp, heads or mlp on tensor), 2 layers, float32 */
    const uint64_t extra[] = {4 * 2 * (4 * 256 + 2 * 512) / 4, 4 * 2 * (4 * 256) / 4, 0, 0, 0};
    uint64_t peak[5], n[5], live[5];
    double loss[5];
    for (int i = 0; i < 5; i++) saved_grads_at(cases[i][0], cases[i][1], &peak[i], &n[i], &live[i], &loss[i]);
    for (int i = 0; i < 5; i++) {
        assert_true(n[i] > 0 && n[i] == n[0]);
        assert_int_equal(peak[i], 4 * n[i] + extra[i]);
        assert_int_equal(live[i], live[3]); /* released with the backward: what stays is XLA:CPU's */
    }
    assert_true(loss[0] == loss[3] && loss[0] == loss[4]);
}

static void ns_gathers(const char *profile, const char *precision, int *n, uint64_t *bytes, int *bad_dtype,
                       sim_dtype want)
{
    char hp[64], mp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    snprintf(mp, sizeof mp, "matmul_precision=%s", precision);
    const char *words[] = {"dtype=bfloat16", "opt_type=muon", "ici_fsdp_parallelism=4", mp, hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, profile ? 5 : 4, NDEV, 1);
    model_run_train(&r, false);
    *n = 0, *bytes = 0, *bad_dtype = 0;
    size_t nr;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &nr);
    for (size_t i = 0; i < nr; i++) {
        const sim_record *x = &rec[i];
        if (x->phase != SIM_PHASE_OPTIMIZER || x->op != SIM_OP_ALL_GATHER || !strstr(x->tag, "mlp.wi_0")) continue;
        (*n)++;
        *bytes += x->bytes_sent;
        *bad_dtype += x->dtype != want;
    }
    model_run_close(&r);
}

static void test_newton_schulz_gathers(void **state)
{
    (void)state;
    int n_tpu, n_cpu, n_hi, bad_tpu, bad_cpu, bad_hi;
    uint64_t b_tpu, b_cpu, b_hi;
    ns_gathers("v5p", "default", &n_tpu, &b_tpu, &bad_tpu, SIM_BF16);
    ns_gathers(NULL, "default", &n_cpu, &b_cpu, &bad_cpu, SIM_F32);
    ns_gathers("v5p", "highest", &n_hi, &b_hi, &bad_hi, SIM_F32); /* six float32 passes: nothing narrows */
    const uint64_t x = 2 * 16 * 32, a = 2 * 16 * 16;              /* elements of X and A */
    assert_int_equal(n_tpu, 2 * 5);
    assert_int_equal(bad_tpu, 0);
    assert_int_equal(b_tpu, 5 * (3 * x / 4 + 3 * a / 4) * 2);
    assert_int_equal(n_cpu, 3 * 5);
    assert_int_equal(bad_cpu, 0);
    assert_int_equal(b_cpu, 5 * (2 * (3 * x / 4) + 3 * a / 4) * 4);
    assert_int_equal(n_hi, 2 * 5);
    assert_int_equal(bad_hi, 0);
    assert_int_equal(b_hi, 2 * b_tpu);
}

static void layer_weight_bytes(const char *profile, int fsdp, uint64_t *ring, uint64_t *ag)
{
    char hp[64], f[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    snprintf(f, sizeof f, "ici_fsdp_parallelism=%d", fsdp);
    const char *words[] = {"dtype=bfloat16", f, hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, fsdp, words, profile ? 3 : 2, fsdp, 1);
    model_run_train(&r, false);
    *ring = 0, *ag = 0;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (!x->weight || !strstr(x->tag, "layers")) continue; /* the decoder layers' kernels */
        if (x->op == SIM_OP_PPERMUTE) *ring += x->bytes_sent;
        if (x->op == SIM_OP_ALL_GATHER) *ag += x->bytes_sent;
    }
    model_run_close(&r);
}

static void test_windowed_einsums(void **state)
{
    (void)state;
    uint64_t ring, ag, ring_cpu, ag_cpu, ring4, ag4;
    layer_weight_bytes("v5p", 8, &ring, &ag);
    layer_weight_bytes(NULL, 8, &ring_cpu, &ag_cpu);
    layer_weight_bytes("v5p", 4, &ring4, &ag4);
    const uint64_t all = 4 * 256 + 3 * 512, wo = 512, layers = 2;
    /* bytes = 2 x elements x (k+1)/k for a ring, (k-1)/k for a gather, k = 8 */
    assert_int_equal(ring, layers * 2 * 9 * (all + wo + all) / 8);
    assert_int_equal(ag, layers * 2 * 7 * (all - wo) / 8);
    assert_int_equal(ring_cpu, 0);
    assert_int_equal(ring4, 0);
    /* XLA:CPU gathers every kernel twice (forward; recomputation and input gradient) in float32 */
    assert_int_equal(ag_cpu, layers * 4 * 7 * (all + all) / 8);
}

/* Forward weight collectives of one layer of a dry run on v6e with fsdp=4 x tensor=2 (fsdp groups
 * strided by tensor): bytes of the MLP's rings and gathers, attention's query/key/value gathers and
 * its out projection's ring, on device 0. */
typedef struct {
    uint64_t mlp_ring, mlp_ag, qkv_ring, qkv_ag, out_ring, out_ag;
    uint64_t out_grad_ring, out_grad_rs, query_grad_ring; /* the gradients' reductions over fsdp */
} strided_fwd;

static void strided_forward(const char *mlp, int rows, strided_fwd *f)
{
    char m[64];
    snprintf(m, sizeof m, "base_mlp_dim=%s", mlp);
    const char *words[] = {"dtype=bfloat16",
                           "base_emb_dim=1024",
                           "base_num_query_heads=8",
                           "base_num_kv_heads=8",
                           "head_dim=128",
                           m,
                           "base_num_decoder_layers=1",
                           "max_target_length=2048",
                           "vocab_size=1024",
                           "ici_fsdp_parallelism=4",
                           "ici_tensor_parallelism=2",
                           "hardware_profile=v6e",
                           "dry_run=true"};
    model_run r;
    model_run_open(&r, TINY, NTINY, rows, words, (int)(sizeof words / sizeof words[0]), 8, 1);
    model_run_train(&r, false);
    memset(f, 0, sizeof *f);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        bool ring = x->op == SIM_OP_PPERMUTE;
        if (x->weight && strstr(x->tag, "self_attention.out.kernel (grad)")) {
            f->out_grad_ring += ring ? x->bytes_sent : 0;
            f->out_grad_rs += x->op == SIM_OP_REDUCE_SCATTER ? x->bytes_sent : 0;
        }
        if (x->weight && ring && strstr(x->tag, "self_attention.query.kernel (grad)"))
            f->query_grad_ring += x->bytes_sent;
        if (!x->weight || x->phase != SIM_PHASE_FORWARD || !strstr(x->tag, "layers")) continue;
        bool ag = x->op == SIM_OP_ALL_GATHER;
        if (strstr(x->tag, "/mlp/")) f->mlp_ring += ring ? x->bytes_sent : 0, f->mlp_ag += ag ? x->bytes_sent : 0;
        else if (strstr(x->tag, "/out")) f->out_ring += ring ? x->bytes_sent : 0, f->out_ag += ag ? x->bytes_sent : 0;
        else f->qkv_ring += ring ? x->bytes_sent : 0, f->qkv_ag += ag ? x->bytes_sent : 0;
    }
    model_run_close(&r);
}

static void test_windowed_einsums_strided(void **state)
{
    (void)state;
    /* 8 rows of 2048 tokens over fsdp=4: N = 4096 tokens a device; E = 1024, 8 heads of 128 (4 a
     * device), bfloat16.  The cost model on v6e (186.7 GB/s a link, 918 TFLOP/s; the strided fsdp
     * group {0,2,4,6} of the 2x4 slice uses M = 1 link) windows a product over k = 4 when its time
     * C > 2c/4, c = the gathered weight's bytes / 186.7 GB/s (C < c here), and, where the product
     * also gathers its activation over tensor (the weight's gathered dim is contracted), only when
     * the weight's copy is the larger:
     *  - query, key, value: x [2, 2048, 1024] (8 MiB) against a 1 MiB kernel: gathered;
     *  - out: contracts heads (split by tensor: its output is reduced over tensor), E not
     *    contracted; its 1 MiB kernel against the 8 MiB output, but C = 2 x 4096 x 512 x 1024 /
     *    918e12 = 4.68 us < c = 5.62 us: windowed;
     *  - the MLP with mlp=16384 (8192 a device): wi's 16 MiB kernel beats the 8 MiB activation,
     *    C = 2 x 4096 x 1024 x 8192 / 918e12 = 74.9 us > 2c/4 = 44.9 us: windowed, and wo likewise
     *    (16 MiB against its 8 MiB output); with mlp=4096 wi's 4 MiB kernel loses to the 8 MiB
     *    activation (gathered), and wo's to its 8 MiB output, but C = 18.7 us < c = 22.5 us: wo
     *    still windows, as `out` does.
     * Over 4 devices XLA unrolls the ring's two steps and drops the last sends: a gather's (k-1)/k,
     * a reduce-scatter's k/k.  The gradients: query's (its product reduces nothing over tensor)
     * windows as C > 2c/4; out's product gathers the output's 8 MiB cotangent over tensor, more
     * than out's 1 MiB gradient, and C = 4.68 us < c: windowed.  With 2 rows a device (N = 8192) C
     * doubles to 9.36 us >= c = 5.62 us: out's forward gather (against its 16 MiB output) and its
     * gradient's reduce-scatter (against the 16 MiB cotangent) stay plain, query's gradient still
     * windows. */
    const uint64_t q = 1024ull * 512 * 2, big = 1024ull * 8192 * 2, small = 1024ull * 2048 * 2;
    strided_fwd f;
    strided_forward("16384", 8, &f);
    assert_int_equal(f.qkv_ag, 3 * q * 3 / 4);
    assert_int_equal(f.qkv_ring, 0);
    assert_int_equal(f.out_ring, q * 3 / 4);
    assert_int_equal(f.out_ag, 0);
    assert_int_equal(f.mlp_ring, 3 * big * 3 / 4);
    assert_int_equal(f.mlp_ag, 0);
    assert_int_equal(f.query_grad_ring, q);
    assert_int_equal(f.out_grad_ring, q);
    assert_int_equal(f.out_grad_rs, 0);
    strided_forward("4096", 8, &f);
    assert_int_equal(f.mlp_ag, 2 * small * 3 / 4); /* wi_0, wi_1 */
    assert_int_equal(f.mlp_ring, small * 3 / 4);   /* wo */
    strided_forward("16384", 16, &f);
    assert_int_equal(f.out_ag, q * 3 / 4);
    assert_int_equal(f.out_ring, 0);
    assert_int_equal(f.out_grad_rs, q * 3 / 4);
    assert_int_equal(f.out_grad_ring, 0);
    assert_int_equal(f.query_grad_ring, q);
}

/* tests/data/tiny-deepseek.yml: 1 dense + 2 MoE layers, 8 experts top-2 */
static const char *const DS[] = {TINY_DEEPSEEK_YML};

static void expert_grad_bytes(int fsdp, uint64_t *ar, uint64_t *rs)
{
    char f[64];
    snprintf(f, sizeof f, "ici_fsdp_parallelism=%d", fsdp);
    const char *words[] = {"dtype=bfloat16", f, "hardware_profile=v5p"};
    model_run r;
    model_run_open(&r, DS, sizeof DS / sizeof DS[0], fsdp, words, 3, fsdp, 1);
    model_run_train(&r, false);
    *ar = 0, *rs = 0;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (!strstr(x->tag, "grad/") || !strstr(x->tag, "MoeBlock_0.w")) continue; /* wi_0, wi_1, wo */
        if (x->op == SIM_OP_ALL_REDUCE) *ar += x->bytes_sent;
        if (x->op == SIM_OP_REDUCE_SCATTER) *rs += x->bytes_sent;
    }
    model_run_close(&r);
}

static void test_psum_scatter(void **state)
{
    (void)state;
    uint64_t ar8, rs8, ar4, rs4;
    expert_grad_bytes(8, &ar8, &rs8);
    expert_grad_bytes(4, &ar4, &rs4);
    const uint64_t kernel = 8 * 32 * 16, kernels = 2 * 3; /* 2 MoE layers x wi_0, wi_1, wo */
    assert_int_equal(ar8, kernels * 2 * 7 * kernel * 2 / 8);
    assert_int_equal(rs8, 0);
    /* over 4, wi_0 and wi_1 [8, 32, 16] split emb (dim 1) and reduce-scatter; wo [8, 16, 32] splits its
     * last dim into 8-element slices, which gradient_lane_scatter_max_all_reduce leaves an all-reduce */
    assert_int_equal(rs4, 2 * 2 * 3 * kernel * 2 / 4);
    assert_int_equal(ar4, 2 * 1 * 2 * 3 * kernel * 2 / 4);
}

/* Bytes device 0 sends for the MoE layers' attention and gate weights (all-gathers, by phase) and for
 * the routed experts' gathers, in one step of the tiny DeepSeek on fsdp=4 under `profile`. */
typedef struct {
    uint64_t attn_fwd, attn_bwd, dense_fwd, dense_bwd, experts_fwd, experts_bwd;
} regather_bytes;

static void run_regather(const char *profile, const char *policy, regather_bytes *b)
{
    char hp[64], rp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile);
    snprintf(rp, sizeof rp, "remat_policy=%s", policy);
    const char *words[] = {"dtype=bfloat16", "ici_fsdp_parallelism=4", hp, rp};
    model_run r;
    model_run_open(&r, DS, sizeof DS / sizeof DS[0], 4, words, 4, 4, 1);
    model_run_train(&r, false);
    memset(b, 0, sizeof *b);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (x->op != SIM_OP_ALL_GATHER || strstr(x->tag, "grad/")) continue;
        bool bwd = x->phase == SIM_PHASE_BACKWARD;
        bool moe = strstr(x->tag, "moe_layers") != NULL, dense = strstr(x->tag, "dense_layers") != NULL;
        bool attn = strstr(x->tag, "/self_attention/") != NULL, gate = strstr(x->tag, "MoeBlock_0/gate") != NULL;
        bool experts = strstr(x->tag, "MoeBlock_0/moe") != NULL;
        uint64_t *into = moe && (attn || gate) ? (bwd ? &b->attn_bwd : &b->attn_fwd)
                         : dense && attn       ? (bwd ? &b->dense_bwd : &b->dense_fwd)
                         : experts             ? (bwd ? &b->experts_bwd : &b->experts_fwd)
                                               : NULL;
        if (into) *into += x->bytes_sent;
    }
    model_run_close(&r);
}

static void test_regather(void **state)
{
    (void)state;
    /* the tiny DeepSeek's MLA (emb 32, 4 heads, q_lora 16, kv_lora 8, nope 8, rope 4, v 8) and gate, per
     * layer: wq_a 32x16, wq_b 16x4x12, wkv_a 32x(8+4), wkv_b 8x4x(8+8), out 4x8x32, gate 32x8 elements,
     * each split 4 ways by fsdp and gathered in bfloat16: 3/4 x 2 bytes an element, 2 MoE layers */
    const uint64_t attn = 32 * 16 + 16 * 4 * 12 + 32 * 12 + 8 * 4 * 16 + 4 * 8 * 32, gate = 32 * 8;
    const uint64_t fwd = 2 * (attn + gate) * 2 * 3 / 4;
    regather_bytes v5p, h100, minimal;
    run_regather("v5p", "full", &v5p);
    run_regather("h100", "full", &h100);
    run_regather("v5p", "minimal", &minimal);
    assert_int_equal(v5p.attn_fwd, fwd);
    assert_int_equal(h100.attn_fwd, fwd);
    /* XLA:TPU (weight_gather_cse: near): the recomputation and the input gradient gather each once */
    assert_int_equal(v5p.attn_bwd, 2 * fwd);
    /* one gather serves both (XLA:GPU's default, as XLA:CPU) */
    assert_int_equal(h100.attn_bwd, fwd);
    /* the dense layer has no routing, and the routed experts come after it: one gather each */
    assert_true(v5p.dense_fwd > 0 && v5p.experts_fwd > 0);
    assert_int_equal(v5p.dense_bwd, v5p.dense_fwd);
    assert_int_equal(v5p.dense_bwd, h100.dense_bwd);
    assert_int_equal(v5p.experts_bwd, h100.experts_bwd);
    /* a policy that saves dot outputs cuts the chains: no second gather */
    assert_true(minimal.attn_bwd < 2 * fwd);
}

/* Bytes device 0 sends reducing the tiny Llama's parameter gradients (all-reduce, reduce-scatter) on
 * fsdp=4 under `profile`, for the kernels named by `which` (a tag substring) */
static void grad_reduction_bytes(const char *profile, const char *which, uint64_t *ar, uint64_t *rs)
{
    char hp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile);
    const char *words[] = {"dtype=bfloat16", "ici_fsdp_parallelism=4", hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, 3, NDEV, 1);
    model_run_train(&r, false);
    *ar = *rs = 0;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (!strstr(x->tag, "grad/") || !strstr(x->tag, which)) continue;
        if (x->op == SIM_OP_ALL_REDUCE) *ar += x->bytes_sent;
        if (x->op == SIM_OP_REDUCE_SCATTER) *rs += x->bytes_sent;
    }
    model_run_close(&r);
}

static void test_lane_scatter(void **state)
{
    (void)state;
    /* tiny Llama (2 layers, emb 16, 2 heads of 8, MLP 32) on fsdp=4: out [2, 8, 16] and the MLP's wo
     * [32, 16] split emb, their last dim, into 4-element slices; wq [16, 2, 8] and wi_0 [16, 32] split
     * their first.  Gradients reduced in bfloat16 over 4 devices: a reduce-scatter sends 3/4 x 2 bytes an
     * element, an all-reduce twice that. */
    const uint64_t out = 2 * 2 * 8 * 16, wo = 2 * 32 * 16, wq = 2 * 16 * 2 * 8, wi0 = 2 * 16 * 32;
    uint64_t ar, rs;
    grad_reduction_bytes("v5p", "self_attention.out", &ar, &rs);
    assert_int_equal(ar, 2 * out * 2 * 3 / 4);
    assert_int_equal(rs, 0);
    grad_reduction_bytes("v5p", "mlp.wo", &ar, &rs);
    assert_int_equal(ar, 2 * wo * 2 * 3 / 4);
    assert_int_equal(rs, 0);
    grad_reduction_bytes("v5p", "self_attention.query", &ar, &rs);
    assert_int_equal(ar, 0);
    assert_int_equal(rs, wq * 2 * 3 / 4);
    grad_reduction_bytes("v5p", "mlp.wi_0", &ar, &rs);
    assert_int_equal(ar, 0);
    assert_int_equal(rs, wi0 * 2 * 3 / 4);
    /* h100 (gradient_lane_scatter_max_all_reduce: 0): every one a reduce-scatter, in float32 there
     * (its gradient_reduction_dtype is weight_dtype) */
    grad_reduction_bytes("h100", "self_attention.out", &ar, &rs);
    assert_int_equal(ar, 0);
    assert_int_equal(rs, out * 4 * 3 / 4);
}

/* Bytes device 0 sends all-reducing the logits kernel's gradient over stage, and gathering the pipeline's
 * output over stage, in one step of the tiny Llama on stage=2 x fsdp=2 with `micro` microbatches. */
static void pipeline_output_bytes(int micro, uint64_t *logits_ar, uint64_t *output_ag)
{
    char mb[64];
    snprintf(mb, sizeof mb, "num_pipeline_microbatches=%d", micro);
    const char *words[] = {"ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", mb, "per_device_batch_size=2"};
    model_run r;
    model_run_open(&r, TINY, NTINY, 8, words, 4, NDEV, 1);
    model_run_train(&r, false);
    *logits_ar = *output_ag = 0;
    int stage = sim_mesh_axis_index(sim_machine_mesh(r.m), "stage");
    assert_true(stage >= 0);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (x->op == SIM_OP_ALL_REDUCE && strstr(x->tag, "logits_dense.kernel")) *logits_ar += x->bytes_sent;
        if (x->op == SIM_OP_ALL_GATHER && strstr(x->tag, "pipeline/output") && x->phase == SIM_PHASE_FORWARD &&
            x->axes.n == 1 && x->axes.axis[0] == stage)
            *output_ag += x->bytes_sent;
    }
    model_run_close(&r);
}

static void test_pipeline_output(void **state)
{
    (void)state;
    /* one microbatch per stage: the [2, 1, mb, T, E] state_io reshaped to [B, T, E] keeps stage on the batch
     * (MaxText passes no out_sharding in auto mode), so every stage computes its rows' logits and the
     * kernel's gradient [16 emb / fsdp 2, 64 vocab] is all-reduced over stage: 2 x 1/2 x 8 x 64 elements in
     * float32 (no profile); the output is not gathered over stage */
    uint64_t ar, ag;
    pipeline_output_bytes(2, &ar, &ag);
    assert_int_equal(ar, 2 * 8 * 64 * 4 / 2);
    assert_int_equal(ag, 0);
    /* two microbatches per stage: [2, 2, mb] keeps no tiled sharding; the output is constrained to the
     * batch axes (gathered over stage) and the logits run on every stage's rows alike: no all-reduce */
    pipeline_output_bytes(4, &ar, &ag);
    assert_int_equal(ar, 0);
    assert_true(ag > 0);
}

/* configs/hardware/v5p.yml with the line starting `from` replaced by `to` (NULL: removed), loaded from a
 * scratch configs dir; the status and message of cfg_hw_load. */
static sim_status load_changed(const char *from, const char *to, char *msg, size_t cap)
{
    FILE *f = fopen("configs/hardware/v5p.yml", "r");
    assert_non_null(f);
    char dir[] = "/tmp/shardsim_hwXXXXXX";
    assert_non_null(mkdtemp(dir));
    char sub[64], path[96];
    snprintf(sub, sizeof sub, "%s/hardware", dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    snprintf(path, sizeof path, "%s/v5p.yml", sub);
    FILE *o = fopen(path, "w");
    assert_non_null(o);
    char line[1024];
    int replaced = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, from, strlen(from))) {
            replaced++;
            if (to) fprintf(o, "%s\n", to);
        } else {
            fputs(line, o);
        }
    }
    fclose(f);
    fclose(o);
    assert_int_equal(replaced, 1);
    cfg_hw hw;
    sim_status st = cfg_hw_load(dir, "v5p", 4, &hw);
    snprintf(msg, cap, "%s", st ? sim_errmsg() : "");
    unlink(path);
    rmdir(sub);
    rmdir(dir);
    return st;
}

static void test_bad_rules(void **state)
{
    (void)state;
    char msg[1024];
    assert_int_equal(load_changed("windowed_einsum_min_group:", "windowed_einsum_min_group: -3", msg, sizeof msg),
                     SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "windowed_einsum_min_group"));
    assert_int_equal(load_changed("windowed_einsum_ici_gbps:", NULL, msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "windowed_einsum_ici_gbps"));
    assert_int_equal(load_changed("windowed_einsum_tflops:", "windowed_einsum_tflops: fast", msg, sizeof msg),
                     SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "windowed_einsum_tflops"));
    assert_int_equal(load_changed("hoisted_weight_copies:", NULL, msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "hoisted_weight_copies"));
    assert_non_null(strstr(msg, "(missing)"));
    assert_int_equal(
        load_changed("newton_schulz_operand_gathers:", "newton_schulz_operand_gathers: twice", msg, sizeof msg),
        SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "per_product"));
    assert_int_equal(
        load_changed("accumulation_gradient_copies:", "accumulation_gradient_copies: 2.5", msg, sizeof msg),
        SIM_ERR_INPUT);
    assert_int_equal(load_changed("psum_scatter_max_group:", "psum_scatter_max_group: 4", msg, sizeof msg), SIM_OK);
    assert_int_equal(load_changed("saved_product_gradient_copies:", NULL, msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "saved_product_gradient_copies"));
    assert_int_equal(load_changed("embedding_lookup:", "embedding_lookup: rows", msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "gather_table"));
    assert_int_equal(load_changed("weight_gather_cse:", "weight_gather_cse: far", msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "weight_gather_cse"));
    assert_non_null(strstr(msg, "near"));
    assert_int_equal(load_changed("gradient_lane_scatter_max_all_reduce:", NULL, msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "gradient_lane_scatter_max_all_reduce"));
    assert_int_equal(load_changed("muon_update_buffers:", "muon_update_buffers: all", msg, sizeof msg), SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "muon_update_buffers"));
    assert_non_null(strstr(msg, "per_leaf"));
    assert_int_equal(load_changed("low_rank_norm_sharding:", "low_rank_norm_sharding: split", msg, sizeof msg),
                     SIM_ERR_INPUT);
    assert_non_null(strstr(msg, "low_rank_norm_sharding"));
    assert_non_null(strstr(msg, "whole"));
}

typedef struct {
    uint64_t table_ag, table_rs;         /* bytes of the table's gathers and of its gradient's fsdp reductions */
    uint64_t ids_ag, rows_fwd, rows_bwd; /* bytes of the ids' gather and the rows' all-to-alls */
    int n_ids, n_fwd, n_bwd, bad_dtype;
    sim_op rows_op; /* the rows' collective */
    model_run r;
} lookup;

static void run_lookup(const char *profile, int data, int fsdp, int tensor, int context, lookup *f)
{
    char hp[64], dp[64], fs[64], tp[64], cp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    snprintf(dp, sizeof dp, "ici_data_parallelism=%d", data);
    snprintf(fs, sizeof fs, "ici_fsdp_parallelism=%d", fsdp);
    snprintf(tp, sizeof tp, "ici_tensor_parallelism=%d", tensor);
    snprintf(cp, sizeof cp, "ici_context_parallelism=%d", context);
    const char *words[] = {"dtype=bfloat16", "vocab_size=8", dp, fs, tp, cp, hp};
    memset(f, 0, sizeof *f);
    f->rows_op = context > 1 ? SIM_OP_ALL_GATHER : SIM_OP_ALL_TO_ALL;
    model_run_open(&f->r, TINY, NTINY, 4, words, profile ? 7 : 6, NDEV, 1);
    model_run_train(&f->r, true);
    int fsdp_axis = mesh_shape_axis_index(&f->r.def->mesh, "fsdp");
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(f->r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        bool on_fsdp = false;
        for (int a = 0; a < x->axes.n; a++) on_fsdp |= x->axes.axis[a] == fsdp_axis;
        if (x->weight && strstr(x->tag, "token_embedder")) {
            if (x->op == SIM_OP_ALL_GATHER) f->table_ag += x->bytes_sent;
            if (x->op != SIM_OP_ALL_GATHER && on_fsdp) f->table_rs += x->bytes_sent;
            continue;
        }
        /* (a backward gather of the cotangent to the output's sharding, tensor's, is either path's) */
        /* the rows move by all-to-all, or by all-gather where context splits the tokens' length */
        bool rows = x->op == f->rows_op;
        if (x->op == SIM_OP_ALL_GATHER && x->dtype == SIM_I32 && strstr(x->tag, "token_embedder")) {
            f->n_ids++, f->ids_ag += x->bytes_sent;
            f->bad_dtype += x->phase != SIM_PHASE_FORWARD;
        } else if (rows && strstr(x->tag, "token_embedder")) {
            f->n_fwd++, f->rows_fwd += x->bytes_sent;
            f->bad_dtype += x->dtype != SIM_BF16;
        } else if (rows && strstr(x->tag, "embed/dtable")) {
            f->n_bwd++, f->rows_bwd += x->bytes_sent;
            f->bad_dtype += x->dtype != SIM_BF16;
        }
    }
}

static void test_embedding_lookup(void **state)
{
    (void)state;
    /* data, fsdp, tensor, context: with data=2 the table's gradient is still summed over data (an
     * all-reduce); with context=2 the table's embed dim is split over fsdp and context, the tokens'
     * batch over fsdp and their length over context, and the rows are all-gathered */
    const int mesh[4][4] = {{1, 4, 1, 1}, {1, 2, 2, 1}, {2, 2, 1, 1}, {1, 2, 1, 2}};
    for (int m = 0; m < 4; m++) {
        const int cp = mesh[m][3], k = mesh[m][1] * cp;
        lookup tpu, cpu;
        run_lookup("v5p", mesh[m][0], mesh[m][1], mesh[m][2], cp, &tpu);
        run_lookup(NULL, mesh[m][0], mesh[m][1], mesh[m][2], cp, &cpu);
        /* 4 rows over data and fsdp, seq 16 over context, emb 16: a device's tokens */
        const uint64_t tokens = 4 / (mesh[m][0] * mesh[m][1]) * 16 / cp, E = 16;
        assert_int_equal(tpu.table_ag, 0);
        assert_int_equal(tpu.table_rs, 0);
        assert_int_equal(tpu.n_ids, 1);
        assert_int_equal(tpu.n_fwd, 1);
        assert_int_equal(tpu.n_bwd, 1);
        assert_int_equal(tpu.bad_dtype, 0);
        assert_int_equal(tpu.ids_ag, (k - 1) * tokens * 4);
        /* all-to-all: the k devices' tokens on this embed shard, (k-1)/k of [k*tokens, E/k], sent
         * both ways; all-gather: every device gets those of the k devices, (k-1)/k of k x that
         * forward, and every device's cotangent rows [tokens, E] backward */
        const uint64_t rows = cp > 1 ? (k - 1) * tokens * E * 2 : (k - 1) * tokens * (E / k) * 2;
        assert_int_equal(tpu.rows_fwd, rows);
        assert_int_equal(tpu.rows_bwd, rows);
        /* XLA:CPU gathers the table and reduces its gradient, and moves no ids or rows */
        assert_true(cpu.table_ag > 0 && cpu.table_rs > 0);
        assert_int_equal(cpu.n_ids + cpu.n_fwd + cpu.n_bwd, 0);
        /* the same bits */
        assert_true(tpu.r.job.stats[0].loss == cpu.r.job.stats[0].loss);
        const model_grads *g = &tpu.r.job.step_grads[0], *gc = &cpu.r.job.step_grads[0];
        for (int i = 0; i < tpu.r.def->nparams; i++) {
            size_t bytes = (size_t)(g->layer_elems[i] * g->n_layers[i]) * sizeof(float);
            if (memcmp(g->g[i], gc->g[i], bytes))
                fail_msg("data=%d fsdp=%d tensor=%d context=%d: the gradient of %s differs from the table gather's",
                         mesh[m][0], mesh[m][1], mesh[m][2], cp, tpu.r.def->defs[i].path);
        }
        model_run_compare("all-to-all lookup against the table gather", &tpu.r, &cpu.r, 1);
        model_run_close(&tpu.r);
        model_run_close(&cpu.r);
    }
}

typedef struct {
    double loss[2];
    uint64_t temp, grads; /* device 0's SIM_MEM_TEMP and SIM_MEM_GRADS when its total peaked */
} muon_peak;

static void run_muon_peak(const char *profile, muon_peak *f)
{
    char hp[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    const char *words[] = {"dtype=bfloat16",
                           "opt_type=muon",
                           "ici_fsdp_parallelism=4",
                           "base_emb_dim=64",
                           "base_mlp_dim=256",
                           "head_dim=32",
                           "base_num_decoder_layers=8",
                           "vocab_size=8",
                           hp};
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, words, profile ? 9 : 8, NDEV, 2);
    model_run_train(&r, false);
    f->loss[0] = r.job.stats[0].loss;
    f->loss[1] = r.job.stats[1].loss;
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    f->temp = st.at_peak_by[SIM_MEM_TEMP];
    f->grads = st.at_peak_by[SIM_MEM_GRADS];
    model_run_close(&r);
}

static void test_muon_update_buffers(void **state)
{
    (void)state;
    muon_peak tpu, cpu;
    run_muon_peak("v5p", &tpu);
    run_muon_peak(NULL, &cpu);
    /* by hand, float32 shards on fsdp=4 (emb 64, 2 heads of 32, MLP 256, 8 layers, vocabulary 8): each MLP
     * stack [64, 8, 256] split on emb holds 16 x 8 x 256 elements, each attention stack 64 x 8 x 2 x 32 / 4 */
    const uint64_t mlp = 16 * 8 * 256 * 4, attn = 64 * 8 * 2 * 32 / 4 * 4, muon = 3 * mlp + 4 * attn;
    /* the AdamW leaves' gradients: the table [8, 64] and logits [64, 8] split on emb, 8 layers' two norm
     * scales of 64 and the final one (MaxText's norm rule: not split by fsdp) */
    const uint64_t adamw = (8 * 16 + 16 * 8 + 2 * 8 * 64 + 64) * 4;
    /* v5p: the peak is mlp.wi_0's last Newton-Schulz step (first in optax's tree order), just after its fifth
     * product B X is held: every other Muon stack's estimate, wi_0's iterate, its held estimate and five
     * products, the product itself, and the step's gathers in bfloat16 (X over emb: 64 x 8 x 256; A = X X^T
     * for A A: 8 x 64 x 64); the Muon stacks' gradients are dead */
    const uint64_t gathers = (64 * 8 * 256 + 8 * 64 * 64) * 2;
    assert_int_equal(tpu.temp, (muon - mlp) + mlp + 6 * mlp + mlp + gathers);
    assert_int_equal(tpu.grads, adamw);
    /* no profile: one leaf at a time, every gradient held through the update */
    assert_int_equal(cpu.grads, adamw + muon);
    assert_true(cpu.temp < tpu.temp);
    /* counted only: the same bits */
    assert_true(tpu.loss[0] == cpu.loss[0] && tpu.loss[1] == cpu.loss[1]);
}

typedef struct {
    uint64_t ag_fwd, ag_bwd, rs_bwd, other; /* bytes device 0 sends for the normalised low-rank products */
    double loss;
} norm_split_bytes;

static void run_norm_split(const char *profile, int tensor, bool explicit_mode, norm_split_bytes *b)
{
    char hp[64], tp[64], fs[64];
    snprintf(hp, sizeof hp, "hardware_profile=%s", profile ? profile : "");
    snprintf(tp, sizeof tp, "ici_tensor_parallelism=%d", tensor);
    snprintf(fs, sizeof fs, "ici_fsdp_parallelism=%d", 4 / tensor);
    /* explicit mode as MaxText 0.2.0 traces it (0.2.5 refuses MLA's norms under tensor there) */
    const char *words[] = {"dtype=bfloat16",
                           "per_device_batch_size=1",
                           "remat_policy=full",
                           fs,
                           tp,
                           explicit_mode ? "shard_mode=explicit" : "shard_mode=auto",
                           explicit_mode ? "maxtext_release=0.2.0" : "maxtext_release=0.2.5",
                           hp};
    model_run r;
    model_run_open(&r, DS, sizeof DS / sizeof DS[0], 4, words, profile ? 8 : 7, 4, 1);
    model_run_train(&r, false);
    memset(b, 0, sizeof *b);
    b->loss = r.job.stats[0].loss;
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    for (size_t i = 0; i < n; i++) {
        const sim_record *x = &rec[i];
        if (!strstr(x->tag, "_norm/gathered")) continue;
        bool bwd = x->phase == SIM_PHASE_BACKWARD;
        if (x->op == SIM_OP_ALL_GATHER && x->dtype == SIM_BF16) *(bwd ? &b->ag_bwd : &b->ag_fwd) += x->bytes_sent;
        else if (x->op == SIM_OP_REDUCE_SCATTER && bwd && x->dtype == SIM_BF16) b->rs_bwd += x->bytes_sent;
        else b->other += x->bytes_sent + 1;
    }
    model_run_close(&r);
}

static void test_norm_split(void **state)
{
    (void)state;
    norm_split_bytes v5p, h100, cpu, fsdp4, expl;
    run_norm_split("v5p", 2, false, &v5p);
    run_norm_split("h100", 2, false, &h100);
    run_norm_split(NULL, 2, false, &cpu);
    run_norm_split("v5p", 1, false, &fsdp4);
    run_norm_split("v5p", 2, true, &expl);
    /* 4 rows over fsdp=2: 2 rows of 16 tokens a device; the q_lora (16) and kv_lora (8) products split over
     * tensor=2: a gather sends the other half, [2, 16, R/2] in bfloat16, and so does the reduce-scatter */
    const uint64_t per_layer = 2 * 16 * (16 / 2) * 2 + 2 * 16 * (8 / 2) * 2, layers = 3;
    assert_int_equal(v5p.ag_fwd, layers * per_layer);
    assert_int_equal(v5p.ag_bwd, 2 * layers * per_layer); /* the recomputation's and the weight gradient's */
    assert_int_equal(v5p.rs_bwd, layers * per_layer);
    assert_int_equal(v5p.other, 0);
    /* XLA:GPU (no compile measured), XLA:CPU, or no tensor split: nothing */
    assert_int_equal(h100.ag_fwd + h100.ag_bwd + h100.rs_bwd + h100.other, 0);
    assert_int_equal(cpu.ag_fwd + cpu.ag_bwd + cpu.rs_bwd + cpu.other, 0);
    assert_int_equal(fsdp4.ag_fwd + fsdp4.ag_bwd + fsdp4.rs_bwd + fsdp4.other, 0);
    /* explicit mode: wq_a's out_sharding keeps the product whole (also in the recomputation, which runs in
     * the backward) */
    assert_int_equal(expl.ag_fwd + expl.ag_bwd + expl.rs_bwd + expl.other, 0);
    /* counted only: the same bits */
    assert_true(v5p.loss == cpu.loss);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hoisted_copies),
        cmocka_unit_test(test_dead_recompute_tail),
        cmocka_unit_test(test_accumulation_copies),
        cmocka_unit_test(test_newton_schulz_gathers),
        cmocka_unit_test(test_windowed_einsums),
        cmocka_unit_test(test_windowed_einsums_strided),
        cmocka_unit_test(test_psum_scatter),
        cmocka_unit_test(test_bad_rules),
        cmocka_unit_test(test_embedding_lookup),
        cmocka_unit_test(test_regather),
        cmocka_unit_test(test_lane_scatter),
        cmocka_unit_test(test_pipeline_output),
        cmocka_unit_test(test_muon_update_buffers),
        cmocka_unit_test(test_saved_product_copies),
        cmocka_unit_test(test_norm_split),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

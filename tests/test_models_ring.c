/* test_models_ring.c — MaxText's ring of experts (use_ring_of_experts=true,
 * moe.py roe_ag_and_route) on a small DeepSeek-V3 variant:
 *   - parity over 5 training steps (loss and every parameter gradient of
 *     every step, rtol 1e-4) with the 1-device run on fsdp=2 expert=4, in
 *     auto and explicit mode, and with the ragged all-to-all path on the same
 *     mesh; a softmax-routed variant without the bias (one logits array) in
 *     auto mode;
 *   - traffic: the ring's collectives of one step, per device, equal the
 *     formulas computed here from the shapes (rows gathered x row bytes, the
 *     reduce-scatter of the combined rows, and their transposes in backward);
 *     no ragged all-to-all runs; a dry run moves the same bytes;
 *   - the expert-axis bytes equal those of MaxText 0.2.5's own compiled step
 *     (the peer's HLO count) for the same configuration;
 *   - MaxText's dense path ignores the key: same losses and traffic as without it;
 *   - refusals naming the key: check_vma with the ring (MaxText refuses it),
 *     and a token layout the ring's
 *     tiled all-gather does not cover (cp-as-ep: the expert axes shard the
 *     sequence). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-deepseek.yml (1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora, sigmoid
 * routing with the bias: DeepSeek-V3 routing) with the MoE parity knobs of tests/data/moe-training.yml */
static const char *const TINY[] = {TINY_DEEPSEEK_YML, MOE_TRAINING_YML};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, EMB = 32, EXPERTS = 8, MOE_LAYERS = 2, STEPS = 5 };

#define RING "use_ring_of_experts=true"
#define FSDP2 "ici_fsdp_parallelism=2"
#define EXP4 "ici_expert_parallelism=4"

static void open_run(model_run *r, const char *const *extra, int n, int devices, long long steps)
{
    model_run_open(r, TINY, NTINY, ROWS, extra, n, devices, steps);
}

/* Loss and every gradient of every step within rtol 1e-4 of the reference. */
static void compare(const char *what, const model_run *a, const model_run *ref)
{
    model_run_compare(what, a, ref, STEPS);
}

/* ------------------------------------------------------------ parity */

static void test_parity(void **state)
{
    (void)state;
    model_run ref, ragged;
    open_run(&ref, NULL, 0, 1, STEPS);
    model_run_train(&ref, true);
    /* the loss moves, so five steps compare five different models */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - ref.job.stats[0].loss) > 0.05);
    const char *rg[] = {FSDP2, EXP4};
    open_run(&ragged, rg, 2, 8, STEPS);
    model_run_train(&ragged, true);
    for (int mode = 0; mode < 2; mode++) {
        const char *extra[] = {FSDP2, EXP4, RING, mode ? "shard_mode=explicit" : "shard_mode=auto"};
        model_run r;
        open_run(&r, extra, 4, 8, STEPS);
        model_run_train(&r, true);
        char what[96];
        snprintf(what, sizeof what, "ring fsdp=2 expert=4 %s", extra[3]);
        compare(what, &r, &ref);
        snprintf(what, sizeof what, "ring vs ragged all-to-all fsdp=2 expert=4 %s", extra[3]);
        compare(what, &r, &ragged);
        model_run_close(&r);
    }
    model_run_close(&ragged);
    model_run_close(&ref);
    /* softmax routing without the bias: MaxText gathers one logits array */
    const char *sref[] = {"routed_score_func=softmax", "routed_bias=false"};
    const char *sring[] = {"routed_score_func=softmax", "routed_bias=false", FSDP2, EXP4, RING};
    open_run(&ref, sref, 2, 1, STEPS);
    model_run_train(&ref, true);
    model_run r;
    open_run(&r, sring, 5, 8, STEPS);
    model_run_train(&r, true);
    compare("ring softmax routing fsdp=2 expert=4 auto", &r, &ref);
    model_run_close(&r);
    model_run_close(&ref);
}

/* ------------------------------------------------------------ traffic */

typedef struct {
    uint64_t sent[SIM_NOP][SIM_NPHASE]; /* ring collectives: bytes sent by the device */
    int calls[SIM_NOP][SIM_NPHASE];
    int ragged; /* ragged all-to-alls seen */
} ring_bytes;

static void ring_traffic(const model_run *r, int dev, ring_bytes *b)
{
    memset(b, 0, sizeof *b);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r->m, dev), &n);
    for (size_t i = 0; i < n; i++) {
        if (rec[i].op == SIM_OP_RAGGED_ALL_TO_ALL) b->ragged++;
        if (!strstr(rec[i].tag, "ring_")) continue;
        b->sent[rec[i].op][rec[i].phase] += rec[i].bytes_sent;
        b->calls[rec[i].op][rec[i].phase]++;
        assert_false(rec[i].implicit); /* MaxText's shard_map collectives are asked for */
        assert_int_equal(rec[i].group_size, 4);
    }
}

static void test_traffic(void **state)
{
    (void)state;
    /* one step; remat_policy=full (the default) runs each layer's forward again in backward */
    const char *extra[] = {FSDP2, EXP4, RING, "dry_run=false"};
    model_run real, dry;
    open_run(&real, extra, 4, 8, 1);
    model_run_train(&real, false);
    extra[3] = "dry_run=true";
    open_run(&dry, extra, 4, 8, 1);
    model_run_train(&dry, false);
    /* per device: one sequence of SEQ tokens (8 rows on 8 devices), EP = 4; tokens and router logits
     * travel in dtype (bfloat16 by default, 2 bytes; float32_gate_logits=false) */
    const uint64_t ep = 4, tokens = ROWS / 8 * SEQ, x_row = EMB * 2, logit_row = EXPERTS * 2;
    const uint64_t gather_x = (ep - 1) * tokens * x_row;            /* all-gather: (k-1) x local rows x row bytes */
    const uint64_t gather_logits = (ep - 1) * tokens * logit_row;   /* biased and pre-bias logits: one each */
    const uint64_t combine = (ep - 1) * (ep * tokens) * x_row / ep; /* reduce-scatter of the EP*T combined rows */
    const uint64_t fwd_ag = gather_x + 2 * gather_logits, fwd_rs = combine;
    for (int d = 0; d < 8; d++) {
        ring_bytes b, bd;
        ring_traffic(&real, d, &b);
        ring_traffic(&dry, d, &bd);
        assert_int_equal(b.ragged, 0);
        assert_int_equal(b.sent[SIM_OP_ALL_GATHER][SIM_PHASE_FORWARD], MOE_LAYERS * fwd_ag);
        assert_int_equal(b.calls[SIM_OP_ALL_GATHER][SIM_PHASE_FORWARD], MOE_LAYERS * 3);
        assert_int_equal(b.sent[SIM_OP_REDUCE_SCATTER][SIM_PHASE_FORWARD], MOE_LAYERS * fwd_rs);
        /* backward: the recomputed forward's gathers (its combine is dead: XLA drops it), then
         * the transposes: all-gather of the output's cotangent, reduce-scatters of the tokens'
         * and the pre-bias logits' cotangents (the selection logits get none) */
        assert_int_equal(b.sent[SIM_OP_ALL_GATHER][SIM_PHASE_BACKWARD], MOE_LAYERS * (fwd_ag + combine));
        assert_int_equal(b.sent[SIM_OP_REDUCE_SCATTER][SIM_PHASE_BACKWARD], MOE_LAYERS * (gather_x + gather_logits));
        for (int op = 0; op < SIM_NOP; op++)
            for (int ph = 0; ph < SIM_NPHASE; ph++) assert_int_equal(b.sent[op][ph], bd.sent[op][ph]);
        if (d == 0)
            printf("  ring bytes per device per MoE layer: forward all-gather %llu B (tokens %llu + 2 x logits %llu), "
                   "reduce-scatter %llu B; real and dry runs agree\n",
                   (unsigned long long)fwd_ag, (unsigned long long)gather_x, (unsigned long long)gather_logits,
                   (unsigned long long)fwd_rs);
    }
    model_run_close(&real);
    model_run_close(&dry);
}

/* MaxText 0.2.5 itself, compiled for 8 CPU devices with the ring (peers/maxtext/hlo_bytes.sh
 * num_devices=8 model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=3
 * first_num_dense_layers=1 vocab_size=512 max_target_length=16 per_device_batch_size=1
 * ici_fsdp_parallelism=2 ici_expert_parallelism=4 sparse_matmul=true megablox=true
 * use_ring_of_experts=true): per device and step, its collectives over the 4 expert devices send
 * all-gather 98304 B and reduce-scatter 55296 B.  The same configuration here (a dry run) sends the
 * same bytes (the peer compiles with dtype=float32, so this run counts in it too). */
static void test_maxtext_hlo_bytes(void **state)
{
    (void)state;
    const char *words[] = {"model_name=deepseek3-tiny",
                           "override_model_config=true",
                           "base_num_decoder_layers=3",
                           "first_num_dense_layers=1",
                           "vocab_size=512",
                           "max_target_length=16",
                           "steps=1",
                           "ici_fsdp_parallelism=2",
                           "ici_expert_parallelism=4",
                           RING,
                           "dry_run=true",
                           "dtype=float32"}; /* the peer's hlo_bytes compiles in float32 */
    model_run r;
    model_run_open(&r, words, 12, 8, NULL, 0, 8, 1);
    model_run_train(&r, false);
    for (int d = 0; d < 8; d++) {
        uint64_t ag = 0, rs = 0;
        size_t n;
        const sim_record *rec = sim_device_records(sim_machine_device(r.m, d), &n);
        for (size_t i = 0; i < n; i++) {
            if (rec[i].group_size != 4) continue;
            if (rec[i].op == SIM_OP_ALL_GATHER) ag += rec[i].bytes_sent;
            if (rec[i].op == SIM_OP_REDUCE_SCATTER) rs += rec[i].bytes_sent;
        }
        assert_int_equal(ag, 98304);
        assert_int_equal(rs, 55296);
    }
    model_run_close(&r);
}

/* ------------------------------------------------------------ the dense path ignores it */

static void test_dense_path_ignores(void **state)
{
    (void)state;
    const char *plain[] = {"sparse_matmul=false", "capacity_factor=4", FSDP2, EXP4};
    const char *ring[] = {"sparse_matmul=false", "capacity_factor=4", FSDP2, EXP4, RING};
    model_run a, b;
    open_run(&a, plain, 4, 8, 2);
    model_run_train(&a, false);
    open_run(&b, ring, 5, 8, 2);
    model_run_train(&b, false);
    for (int s = 0; s < 2; s++) assert_true(a.job.stats[s].loss == b.job.stats[s].loss);
    for (int d = 0; d < 8; d++) {
        size_t na, nb;
        const sim_record *ra = sim_device_records(sim_machine_device(a.m, d), &na);
        const sim_record *rb = sim_device_records(sim_machine_device(b.m, d), &nb);
        assert_int_equal(na, nb);
        for (size_t i = 0; i < na; i++) assert_int_equal(ra[i].bytes_sent, rb[i].bytes_sent);
    }
    model_run_close(&a);
    model_run_close(&b);
}

/* ------------------------------------------------------------ refusals */

static void expect_refused(const char *const *extra, int n, int devices, const char *key, const char *also)
{
    model_run_expect_refused(TINY, NTINY, ROWS, extra, n, devices, key, also);
}

static void test_refused(void **state)
{
    (void)state;
    const char *vma[] = {FSDP2, EXP4, RING, "check_vma=true"};
    expect_refused(vma, 4, 8, "check_vma", "ring of experts");
    const char *cp[] = {"custom_mesh_and_rule=cp-as-ep", FSDP2, "ici_context_parallelism=2", "ici_expert_parallelism=2",
                        RING};
    expect_refused(cp, 5, 8, "use_ring_of_experts", "activation_batch");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_traffic),
        cmocka_unit_test(test_maxtext_hlo_bytes),
        cmocka_unit_test(test_dense_path_ignores),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

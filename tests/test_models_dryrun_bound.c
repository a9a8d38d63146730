/* test_models_dryrun_bound.c — a dry run's cost bounded in gradient_accumulation_steps
 * (models/core/train.c: microbatches 2..ga-1 accounted as repeats of the second, sim_repeat):
 *   - the shortcut is taken (device 0 holds one repeated block standing for ga - 2 copies, and
 *     stores fewer records than the full dry run);
 *   - every figure equals the full dry run's (job.dry_full: every microbatch simulated), on every
 *     device: the collective records as read back (count, then every field), the kernel costs as
 *     read back (every field, FLOPs and elements as bitwise doubles, the position among the
 *     records), the per-op totals, the arena's peak, live bytes, per-category peaks and breakdown
 *     at the peak, and the step-time estimate on v5p (step, compute, exposed and per-axis times,
 *     FLOPs, MFU as bitwise doubles; the slowest collectives and kernels; the modelled timeline);
 *   - on each kind of layer stack gradient accumulation runs with: Llama's decoder stack (auto and
 *     explicit), Qwen3, Mixtral's routed MoE in the generic decoder, DeepSeek's dense and MoE
 *     layers (first_num_dense_layers), its batch-split schedule, a pipeline, ZeRO-1 and Muon.
 *     (MTP refuses gradient accumulation.)
 * The figures of the full run come from simulating every microbatch: nothing of the shortcut's
 * own bookkeeping (sim_repeat) is used to make them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/common.h"
#include "cli/report.h"
#include "config/hardware.h"
#include "models/core/timemodel.h"
#include "sim/arena.h"
#include "sim/collectives.h"
#include "tests/model_run.h"

enum { GA = 5 };

static const char *const LLAMA[] = {
    "model_name=llama2-7b",   "override_model_config=true", "base_emb_dim=16",
    "base_num_query_heads=4", "base_num_kv_heads=4",        "head_dim=8",
    "base_mlp_dim=32",        "base_num_decoder_layers=3",  "vocab_size=64",
    "max_target_length=16",
};

static const char *const QWEN3[] = {
    "model_name=qwen3-0.6b",  "override_model_config=true", "base_emb_dim=32",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=8",
    "base_mlp_dim=48",        "base_num_decoder_layers=3",  "vocab_size=64",
    "max_target_length=16",   "logits_via_embedding=false",
};

static const char *const MIXTRAL[] = {
    "model_name=mixtral-8x7b", "override_model_config=true", "base_emb_dim=32",
    "base_num_query_heads=4",  "base_num_kv_heads=2",        "head_dim=8",
    "base_mlp_dim=48",         "base_moe_mlp_dim=48",        "base_num_decoder_layers=3",
    "vocab_size=64",           "max_target_length=16",       "num_experts=4",
    "load_balance_loss_weight=0.01",
};

#define DEEPSEEK(name)                                                                                               \
    {name,                                                                                                           \
     "override_model_config=true",                                                                                   \
     "base_emb_dim=64",                                                                                              \
     "base_num_query_heads=4",                                                                                       \
     "base_num_kv_heads=4",                                                                                          \
     "base_mlp_dim=64",                                                                                              \
     "base_moe_mlp_dim=32",                                                                                          \
     "base_num_decoder_layers=4",                                                                                    \
     "first_num_dense_layers=1",                                                                                     \
     "vocab_size=256",                                                                                               \
     "num_experts=8",                                                                                                \
     "num_experts_per_tok=2",                                                                                        \
     "n_routing_groups=4",                                                                                           \
     "topk_routing_group=2",                                                                                         \
     "q_lora_rank=16",                                                                                               \
     "kv_lora_rank=16",                                                                                              \
     "qk_nope_head_dim=16",                                                                                          \
     "qk_rope_head_dim=8",                                                                                           \
     "v_head_dim=16",                                                                                                \
     "max_target_length=32",                                                                                         \
     "sharding_tolerance=1",                                                                                         \
     "dtype=bfloat16"}
static const char *const DS[] = DEEPSEEK("model_name=deepseek3-671b");
static const char *const DS_SPLIT[] = DEEPSEEK("model_name=deepseek3-671b-batchsplit");

#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* A dry run of base + extra + gradient accumulation on the v5p profile, full or with the shortcut. */
static void dry(model_run *r, const char *const *base, int nbase, int rows, const char *const *extra, int n,
                int devices, bool full)
{
    const char *words[32];
    int k = 0;
    for (int i = 0; i < n; i++) words[k++] = extra[i];
    char ga[64];
    snprintf(ga, sizeof ga, "gradient_accumulation_steps=%d", GA);
    words[k++] = ga;
    words[k++] = "dry_run=true";
    words[k++] = "hardware_profile=v5p";
    cfg_config *cfg = NULL;
    model_def *def = model_run_load(base, nbase, rows, words, k, devices, 1, &cfg);
    model_run_start(r, cfg, def, 1);
    r->job.dry_full = full;
    model_run_train(r, false);
}

static void expect_same_double(const char *what, const char *field, double a, double b)
{
    if (memcmp(&a, &b, sizeof a)) fail_msg("%s: %s %.17g against %.17g", what, field, a, b);
}

static void expect_same_tm(const char *what, const model_tm_result *a, const model_tm_result *b)
{
    expect_same_double(what, "step_s", a->step_s, b->step_s);
    expect_same_double(what, "compute_s", a->compute_s, b->compute_s);
    expect_same_double(what, "exposed_s", a->exposed_s, b->exposed_s);
    expect_same_double(what, "optimizer_s", a->optimizer_s, b->optimizer_s);
    expect_same_double(what, "bubble_s", a->bubble_s, b->bubble_s);
    expect_same_double(what, "model_flops", a->model_flops, b->model_flops);
    expect_same_double(what, "mfu", a->mfu, b->mfu);
    assert_int_equal(a->device, b->device);
    assert_int_equal(a->naxes, b->naxes);
    for (int i = 0; i < a->naxes; i++) expect_same_double(what, "exposed_axes_s", a->exposed_axes_s[i], b->exposed_axes_s[i]);
    assert_int_equal(a->ntop, b->ntop);
    for (int i = 0; i < a->ntop; i++) {
        assert_string_equal(a->top[i].rec.tag, b->top[i].rec.tag);
        expect_same_double(what, "top time_s", a->top[i].time_s, b->top[i].time_s);
    }
    assert_int_equal(a->ncolls, b->ncolls);
    for (int i = 0; i < a->ncolls; i++) {
        assert_string_equal(a->colls[i].rec.tag, b->colls[i].rec.tag);
        assert_int_equal(a->colls[i].calls, b->colls[i].calls);
        expect_same_double(what, "coll bytes", a->colls[i].bytes, b->colls[i].bytes);
        expect_same_double(what, "coll time_s", a->colls[i].time_s, b->colls[i].time_s);
    }
    assert_int_equal(a->nkernels, b->nkernels);
    for (int i = 0; i < a->nkernels; i++) {
        assert_string_equal(a->kernels[i].name, b->kernels[i].name);
        assert_int_equal(a->kernels[i].calls, b->kernels[i].calls);
        expect_same_double(what, "kernel flops", a->kernels[i].flops, b->kernels[i].flops);
        expect_same_double(what, "kernel time_s", a->kernels[i].time_s, b->kernels[i].time_s);
    }
    assert_int_equal(a->nspans, b->nspans);
    for (size_t i = 0; i < a->nspans; i++) {
        expect_same_double(what, "span t0", a->spans[i].t0, b->spans[i].t0);
        expect_same_double(what, "span t1", a->spans[i].t1, b->spans[i].t1);
        assert_int_equal(a->spans[i].lane, b->spans[i].lane);
        assert_string_equal(a->spans[i].name, b->spans[i].name);
    }
}

static void bounded_vs_full(const char *what, const char *const *base, int nbase, int rows,
                            const char *const *extra, int n, int devices)
{
    model_run full, fast;
    dry(&full, base, nbase, rows, extra, n, devices, true);
    dry(&fast, base, nbase, rows, extra, n, devices, false);
    size_t nfull, nfast, nreps;
    sim_device *d0 = sim_machine_device(fast.m, 0);
    sim_device_records(sim_machine_device(full.m, 0), &nfull);
    sim_device_records(d0, &nfast);
    const sim_repeat *reps = sim_device_repeats(d0, &nreps);
    printf("%s: %zu records stored against %zu, %zu repeated blocks\n", what, nfast, nfull, nreps);
    bool mb = false; /* the microbatches' block: ga - 2 copies */
    for (size_t i = 0; i < nreps; i++) mb |= reps[i].times == GA - 2;
    assert_true(mb);
    assert_true(nfast < nfull);
    sim_device_repeats(sim_machine_device(full.m, 0), &nreps);
    assert_int_equal(nreps, 0);
    for (int d = 0; d < devices; d++) {
        const sim_device *a = sim_machine_device(full.m, d), *b = sim_machine_device(fast.m, d);
        size_t na, ca;
        const sim_record *ra = sim_device_records(a, &na);
        const sim_cost *ka = sim_device_costs(a, &ca);
        if (na != sim_device_nrecords(b) || ca != sim_device_ncosts(b))
            fail_msg("%s: device %d has %zu records and %zu costs against %zu and %zu", what, d, sim_device_nrecords(b),
                     sim_device_ncosts(b), na, ca);
        /* the full run's records and costs in call order against the bounded run's walk */
        sim_walk w;
        sim_walk_device(&w, b);
        size_t ri = 0, ci = 0;
        const sim_record *y;
        sim_cost yc;
        while (sim_walk_next(&w, &y, &yc)) {
            if (y) {
                bool is_rec = ri < na && (ci >= ca || ri < ka[ci].nrec_before);
                if (!is_rec || memcmp(&ra[ri], y, sizeof *y))
                    fail_msg("%s: device %d record %zu (%s) differs", what, d, ri, y->tag);
                ri++;
                continue;
            }
            if (ci >= ca || (ri < na && ri < ka[ci].nrec_before)) fail_msg("%s: device %d cost %zu out of order", what, d, ci);
            const sim_cost *x = &ka[ci];
            if (x->step != yc.step || x->phase != yc.phase || memcmp(&x->flops, &yc.flops, sizeof x->flops) ||
                memcmp(&x->mxu_flops, &yc.mxu_flops, sizeof x->flops) ||
                memcmp(&x->elements, &yc.elements, sizeof x->flops) ||
                memcmp(&x->weight_elements, &yc.weight_elements, sizeof x->flops) || x->layout != yc.layout ||
                x->nrec_before != yc.nrec_before || strcmp(x->tag, yc.tag))
                fail_msg("%s: device %d cost %zu (%s) differs", what, d, ci, x->tag);
            ci++;
        }
        if (ri != na || ci != ca) fail_msg("%s: device %d walked %zu records, %zu costs of %zu, %zu", what, d, ri, ci, na, ca);
        for (int op = 0; op < SIM_NOP; op++) {
            sim_op_totals ta = sim_device_op_totals(a, (sim_op)op), tb = sim_device_op_totals(b, (sim_op)op);
            if (ta.calls != tb.calls || ta.bytes_sent != tb.bytes_sent || ta.bytes_recv != tb.bytes_recv)
                fail_msg("%s: device %d %s totals differ", what, d, sim_op_name((sim_op)op));
        }
        sim_arena_stats sa, sb;
        sim_arena_get_stats(sim_device_arena((sim_device *)a), &sa);
        sim_arena_get_stats(sim_device_arena((sim_device *)b), &sb);
        if (sa.peak != sb.peak || sa.live != sb.live)
            fail_msg("%s: device %d peak %zu live %zu against %zu %zu", what, d, sb.peak, sb.live, sa.peak, sa.live);
        for (int c = 0; c < SIM_NMEM; c++)
            if (sa.peak_by[c] != sb.peak_by[c] || sa.at_peak_by[c] != sb.at_peak_by[c] || sa.live_by[c] != sb.live_by[c])
                fail_msg("%s: device %d memory category %d differs", what, d, c);
    }
    /* the traffic table as printed, and its rows */
    char *text[2];
    size_t len[2];
    const model_run *runs[2] = {&full, &fast};
    cli_traffic tt[2];
    for (int k = 0; k < 2; k++) {
        cli_records recs;
        cli_records_from_machine(runs[k]->m, &recs);
        assert_int_equal(cli_traffic_build(&recs, (cli_step_range){0, 0}, &tt[k]), SIM_OK);
        FILE *f = open_memstream(&text[k], &len[k]);
        cli_report_traffic(f, &tt[k]);
        fclose(f);
    }
    assert_true(tt[0].n_rows > 0);
    assert_int_equal(tt[0].n_rows, tt[1].n_rows);
    for (int i = 0; i < tt[0].n_rows; i++)
        if (tt[0].rows[i].calls != tt[1].rows[i].calls || tt[0].rows[i].bytes != tt[1].rows[i].bytes ||
            tt[0].rows[i].bytes_recv != tt[1].rows[i].bytes_recv || tt[0].rows[i].bytes_max != tt[1].rows[i].bytes_max)
            fail_msg("%s: traffic row %d differs", what, i);
    assert_string_equal(text[0], text[1]);
    for (int k = 0; k < 2; k++) {
        free(text[k]);
        cli_traffic_free(&tt[k]);
    }
    /* the step-time estimate, with the slowest device's timeline */
    cfg_hw hw;
    bool found = false;
    model_tm_eff eff;
    assert_int_equal(cfg_hw_from_config(full.cfg, devices, &hw, &found), SIM_OK);
    assert_true(found);
    assert_int_equal(model_tm_eff_load(cli_configs_dir(), &eff), SIM_OK);
    model_tm_result ta, tb;
    const char *dt = NULL;
    assert_int_equal(cfg_get_str(full.cfg, "dtype", &dt), SIM_OK);
    assert_int_equal(model_tm_estimate(&hw, &eff, dt, full.m, 0, 0.0, model_opt_step_bytes(full.def), true, &ta),
                     SIM_OK);
    assert_int_equal(model_tm_estimate(&hw, &eff, dt, fast.m, 0, 0.0, model_opt_step_bytes(fast.def), true, &tb),
                     SIM_OK);
    assert_true(ta.step_s > 0 && ta.nspans > 0);
    expect_same_tm(what, &ta, &tb);
    free(ta.spans);
    free(tb.spans);
    model_run_close(&full);
    model_run_close(&fast);
}

static void test_llama(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    bounded_vs_full("llama fsdp=2 tensor=2", LLAMA, N(LLAMA), 8, mesh, 2, 4);
    const char *ex[] = {"ici_fsdp_parallelism=4", "shard_mode=explicit", "remat_policy=full"};
    bounded_vs_full("llama fsdp=4 explicit remat full", LLAMA, N(LLAMA), 8, ex, 3, 4);
}

static void test_qwen3(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_data_parallelism=2"};
    bounded_vs_full("qwen3 data=2 fsdp=2", QWEN3, N(QWEN3), 8, mesh, 2, 4);
}

/* the generic decoder with a routed MoE layer and its load-balance loss */
static void test_mixtral(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"};
    bounded_vs_full("mixtral fsdp=2 expert=2", MIXTRAL, N(MIXTRAL), 8, mesh, 2, 4);
}

static void test_deepseek_dense_and_moe(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"};
    bounded_vs_full("deepseek fsdp=2 expert=2", DS, N(DS), 8, mesh, 2, 4);
}

static void test_deepseek_batchsplit(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "batch_split_factor=2"};
    const char *base[N(DS_SPLIT)];
    memcpy(base, DS_SPLIT, sizeof base);
    base[7] = "base_num_decoder_layers=5"; /* MaxText's batch-split scan takes at least 4 MoE layers */
    bounded_vs_full("deepseek batch-split", base, N(DS_SPLIT), 16, mesh, 3, 4);
}

static void test_pipeline(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2"};
    const char *base[N(LLAMA)];
    memcpy(base, LLAMA, sizeof base);
    base[7] = "base_num_decoder_layers=4";
    bounded_vs_full("llama pipeline=2 fsdp=2", base, N(LLAMA), 8, mesh, 2, 4);
}

static void test_zero1(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2", "shard_optimizer_over_data=true"};
    bounded_vs_full("llama ZeRO-1 data=2 tensor=2", LLAMA, N(LLAMA), 8, mesh, 3, 4);
}

static void test_muon(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=4", "opt_type=muon"};
    bounded_vs_full("llama muon fsdp=4", LLAMA, N(LLAMA), 8, mesh, 2, 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),    cmocka_unit_test(test_qwen3), cmocka_unit_test(test_mixtral), cmocka_unit_test(test_deepseek_dense_and_moe),
        cmocka_unit_test(test_deepseek_batchsplit), cmocka_unit_test(test_pipeline), cmocka_unit_test(test_zero1),
        cmocka_unit_test(test_muon),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

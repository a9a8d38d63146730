/* test_models_timemodel.c — the hardware profiles and the step-time model on
 * hand-computable cases: one matmul on the roofline (compute- and
 * memory-bound), one ring all-gather over 4 devices, the overlap rule (an
 * asynchronous weight gather hides behind compute, a blocking one does not),
 * serial weight collectives (configs/timemodel.yml overlap_weight_collectives:
 * false), a tiled kernel's padded work (timed) against its useful FLOPs (MFU),
 * the megablox gmm tiles of a DeepSeek run, splash attention's visited
 * blocks and backward kernels, and the profile loader (figures,
 * torus shape, a bad name's message).  The expected values are derived here
 * from the formulas, not from the model. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "cli/cli.h"
#include "config/json.h"
#include "models/core/timemodel.h"
#include "models/optimizers/muon.h"
#include "tests/model_run.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

#include <stdlib.h>
#include <unistd.h>

/* A made-up accelerator with round figures. */
static cfg_hw toy_hw(void)
{
    cfg_hw hw;
    memset(&hw, 0, sizeof hw);
    snprintf(hw.name, sizeof hw.name, "toy");
    hw.devices_per_chip = 1;
    hw.peak_bf16 = 100e12;
    hw.hbm_bytes = 16e9;
    hw.hbm_bw = 1e12;
    hw.link_bw = 50e9;
    hw.dcn_bw = 5e9;
    return hw;
}

static model_tm_eff toy_eff(double mxu, double latency_s)
{
    model_tm_eff e = {mxu, 1.0, 1.0, 1.0, 1.0, latency_s, 4, true};
    return e;
}

static sim_cost cost(double flops, double elements, size_t nrec_before)
{
    sim_cost c;
    memset(&c, 0, sizeof c);
    c.phase = SIM_PHASE_FORWARD;
    c.flops = flops;
    c.elements = elements;
    c.nrec_before = nrec_before;
    snprintf(c.tag, sizeof c.tag, "matmul");
    return c;
}

static sim_record gather(int k, uint64_t shard_bytes, bool weight)
{
    sim_record r;
    memset(&r, 0, sizeof r);
    r.op = SIM_OP_ALL_GATHER;
    r.phase = SIM_PHASE_FORWARD;
    r.axes.n = 1;
    r.axes.axis[0] = 0;
    r.group_size = k;
    r.dtype = SIM_BF16;
    r.elements = shard_bytes / 2;
    r.bytes_sent = (uint64_t)(k - 1) * shard_bytes; /* the all-gather's (k-1) s */
    r.bytes_recv = r.bytes_sent;
    r.weight = weight;
    snprintf(r.tag, sizeof r.tag, "w");
    return r;
}

/* A weight-gradient reduce-scatter of a 1 MB gradient over a pair: (2-1)/2 of it, 0.5 MB, sent. */
static sim_record grad_reduce_scatter(void)
{
    sim_record r = gather(2, 1000000, true);
    r.op = SIM_OP_REDUCE_SCATTER;
    r.phase = SIM_PHASE_BACKWARD;
    r.bytes_sent = 500000;
    return r;
}

static void test_matmul_roofline(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(0.5, 0);
    model_tm_result r;
    /* (1024 x 1024) x (1024 x 1024) in bf16: 2 M N K FLOPs at half of 100 TFLOP/s = 42.95 us;
     * its 3 M^2 bf16 elements at 1 TB/s take 6.3 us: compute-bound */
    double n = 1024;
    sim_cost c = cost(2 * n * n * n, 3 * n * n, 0);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, NULL, 0, &c, 1, 0, false, &r), SIM_OK);
    double expect = 2 * n * n * n / (100e12 * 0.5);
    assert_true(fabs(r.step_s - expect) < 1e-12);
    assert_true(fabs(r.compute_s - expect) < 1e-12);
    assert_true(fabs(r.model_flops - 3 * 2 * n * n * n) < 1);
    /* a matrix-vector product (1 x 4096) x (4096 x 4096): 33.6 MB at 1 TB/s = 33.6 us, while its
     * FLOPs would take 0.67 us: memory-bound */
    double k = 4096;
    c = cost(2 * k * k, k * k + 2 * k, 0);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, NULL, 0, &c, 1, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - (k * k + 2 * k) * 2.0 / 1e12) < 1e-12);
}

/* Memory-bound ops: an elementwise op (no FLOPs) streams at hbm_efficiency, a layout op (split,
 * concatenation, head broadcast: sim_cost.layout) at layout_op_efficiency; neither adds to the
 * model FLOPs.  Expected times from bytes / (bandwidth x efficiency). */
static void test_memory_ops(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(1.0, 0);
    eff.hbm = 0.8;
    eff.layout = 0.2;
    model_tm_result r;
    double el = 64.0 * 1024 * 1024; /* 64 Mi elements of bf16: 128 MiB */
    sim_cost c[2] = {cost(0, el, 0), cost(0, el, 0)};
    c[1].layout = true;
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, NULL, 0, c, 1, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - el * 2.0 / (1e12 * 0.8)) < 1e-12); /* 167.8 us */
    assert_true(r.model_flops == 0);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, NULL, 0, c, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - (el * 2.0 / (1e12 * 0.8) + el * 2.0 / (1e12 * 0.2))) < 1e-12); /* + 671.1 us */
    assert_int_equal(r.nkernels, 1);                                                           /* one tag: one kind */
    assert_int_equal(r.kernels[0].compute_bound, 0);
}

static void test_ring_all_gather(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(1.0, 1e-6);
    /* 4 devices gather 1 MB shards: each sends 3 MB; a bidirectional ring drives two links of
     * 50 GB/s, so 3e6 / 100e9 = 30 us, plus 3 ring steps of 1 us */
    sim_record g = gather(4, 1000000, false);
    int links;
    double bw;
    double t = model_tm_collective(&hw, &eff, &g, &links, &bw);
    assert_int_equal(links, 2);
    assert_true(fabs(bw - 100e9) < 1);
    assert_true(fabs(t - (3 * 1e-6 + 3e6 / (2 * 50e9))) < 1e-12);
    /* a pair has one link: 1 MB over 50 GB/s = 20 us, plus one step */
    g = gather(2, 1000000, false);
    t = model_tm_collective(&hw, &eff, &g, &links, &bw);
    assert_int_equal(links, 1);
    assert_true(fabs(t - (1e-6 + 1e6 / 50e9)) < 1e-12);
    /* an all-to-all over 4: 3/4 of n sent; on a bidirectional ring a block to rank +d travels
     * min(d, 4-d) links: (1 + 2 + 1) / 3 hops on average */
    sim_record a = g;
    a.op = SIM_OP_ALL_TO_ALL;
    a.group_size = 4;
    a.bytes_sent = 750000;
    t = model_tm_collective(&hw, &eff, &a, &links, &bw);
    assert_true(fabs(t - (1e-6 + 750000.0 * (4.0 / 3.0) / 100e9)) < 1e-12);
    /* across slices: the DCN bytes at the DCN bandwidth (5 GB/s) */
    g = gather(2, 1000000, false);
    g.bytes_sent_dcn = g.bytes_sent;
    t = model_tm_collective(&hw, &eff, &g, &links, &bw);
    assert_true(fabs(t - (1e-6 + 1e6 / 5e9)) < 1e-12);
}

static void test_overlap_rule(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(1.0, 0);
    model_tm_result r;
    /* compute A (10 us), a gather of the next weight (1 MB shard over 2 devices: 20 us on one
     * link), compute B (10 us) that uses it */
    double f10 = 10e-6 * 100e12; /* FLOPs of 10 us */
    sim_cost c[2] = {cost(f10, 0, 0), cost(f10, 0, 1)};
    /* asynchronous (a weight): it starts with A and B waits for it until 20 us -> 30 us, 10 us exposed */
    sim_record g = gather(2, 1000000, true);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &g, 1, c, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 30e-6) < 1e-12);
    assert_true(fabs(r.exposed_s - 10e-6) < 1e-12);
    assert_true(fabs(r.compute_s - 20e-6) < 1e-12);
    /* a 0.25 MB shard (5 us) hides completely behind A: 20 us, nothing exposed */
    g = gather(2, 250000, true);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &g, 1, c, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 20e-6) < 1e-12);
    assert_true(r.exposed_s < 1e-15);
    /* the same gather of an activation blocks: 10 + 5 + 10 us, 5 us exposed on its axes */
    g = gather(2, 250000, false);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &g, 1, c, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 25e-6) < 1e-12);
    assert_true(fabs(r.exposed_s - 5e-6) < 1e-12);
    assert_int_equal(r.naxes, 1);
    assert_true(fabs(r.exposed_axes_s[0] - 5e-6) < 1e-12);
    /* a weight-gradient reduce-scatter after the last kernel: nothing waits for it but the
     * step end: 20 us of compute + its (2-1)/2 of 1 MB = 0.5 MB over one link (10 us) */
    sim_record rs = grad_reduce_scatter();
    sim_cost both[2] = {cost(f10, 0, 0), cost(f10, 0, 0)}; /* the record comes after both kernels */
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &rs, 1, both, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 30e-6) < 1e-12);
    /* records of another step are not this step's */
    rs.step = 1;
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &rs, 1, both, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 20e-6) < 1e-12);
}

/* a weight gather that may not overlap (overlap_weight_collectives: false) serialises: compute A
 * (10 us), the 1 MB-shard gather over a pair (20 us), compute B (10 us) = 40 us, 20 us exposed;
 * a weight-gradient reduction after the last kernel adds its 10 us to the step as well */
static void test_serial_weight_collectives(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(1.0, 0);
    eff.overlap_weights = false;
    model_tm_result r;
    double f10 = 10e-6 * 100e12;
    sim_cost c[2] = {cost(f10, 0, 0), cost(f10, 0, 1)};
    sim_record g = gather(2, 1000000, true);
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &g, 1, c, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 40e-6) < 1e-12);
    assert_true(fabs(r.exposed_s - 20e-6) < 1e-12);
    assert_false(r.top[0].async);
    sim_record rs = grad_reduce_scatter();
    sim_cost both[2] = {cost(f10, 0, 0), cost(f10, 0, 0)};
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &rs, 1, both, 2, 0, false, &r), SIM_OK);
    assert_true(fabs(r.step_s - 30e-6) < 1e-12);
}

/* a tiled kernel: the matrix unit computes 4x the useful FLOPs (padded tiles): the time is that of
 * the padded work, MFU's model FLOPs are the useful ones; kernels of one kind in different layers
 * (digit runs of the tag) are listed as one */
static void test_tiled_kernel(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(0.5, 0);
    model_tm_result r;
    double f = 1e9; /* 1 GFLOP useful, 4 GFLOP computed: 4e9 / (100e12 x 0.5) = 80 us each */
    sim_cost c[3] = {cost(f, 0, 0), cost(f, 0, 0), cost(f / 100, 0, 0)};
    c[0].mxu_flops = c[1].mxu_flops = 4 * f;
    snprintf(c[0].tag, sizeof c[0].tag, "decoder/moe_layers_3/moe/ffn");
    snprintf(c[1].tag, sizeof c[1].tag, "decoder/moe_layers_14/moe/ffn");
    snprintf(c[2].tag, sizeof c[2].tag, "decoder/logits");
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, NULL, 0, c, 3, 0, false, &r), SIM_OK);
    double t_tiled = 4 * f / (100e12 * 0.5), t_small = f / 100 / (100e12 * 0.5);
    assert_true(fabs(r.compute_s - (2 * t_tiled + t_small)) < 1e-12);
    assert_true(fabs(r.model_flops - 3 * (2 * f + f / 100)) < 1);
    assert_int_equal(r.nkernels, 2);
    assert_string_equal(r.kernels[0].name, "decoder/moe_layers_*/moe/ffn");
    assert_int_equal(r.kernels[0].calls, 2);
    assert_true(fabs(r.kernels[0].flops - 2 * f) < 1);
    assert_true(fabs(r.kernels[0].mxu_flops - 8 * f) < 1);
    assert_true(fabs(r.kernels[0].time_s - 2 * t_tiled) < 1e-12);
    assert_string_equal(r.kernels[1].name, "decoder/logits");
}

/* The megablox tiles of a DeepSeek dry run: 16 tokens x top-8 = 128 rows over 16 experts, 8 rows
 * each (the dry run's even routing), emb M = 64, expert width H = 64.  With tm = 512 every group
 * lies in the one row tile: 16 visits per call, each a whole tm x tk x tn block with k and n
 * rounded up to the tile (64 -> 1024; wi_tile_fwd_embed_dim=32: 64 -> 64).  Forward: wi_0 and
 * wi_1 2*16*512*64*1024 each, wo (wo_tile_fwd_batch_seq=64) 2*16*64*1024*1024; backward six
 * calls of 2*16*512*1024*1024.  The useful FLOPs stay 3 * 2 * 128 * 64 * 64 per pass. */
static void test_gmm_tiles(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_tm_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    const char *argv[] = {"model_name=deepseek3-tiny",
                          "override_model_config=true",
                          "base_num_decoder_layers=2",
                          "first_num_dense_layers=1",
                          "vocab_size=64",
                          "max_target_length=16",
                          "per_device_batch_size=1",
                          "steps=1",
                          "dry_run=true",
                          "hardware_profile=v5p",
                          "wo_tile_fwd_batch_seq=64",
                          "wi_tile_fwd_embed_dim=32",
                          od};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(strstr(r.out, "slowest kernels"));
    cli_capture_free(&r);
    char path[512];
    snprintf(path, sizeof path, "%s/run.json", dir);
    cfg_json *j = NULL;
    assert_int_equal(cfg_json_read_file(path, &j), SIM_OK);
    const cfg_json *ks = cfg_json_get(cfg_json_get(j, "step_time_model"), "slowest_kernels");
    assert_non_null(ks);
    double fwd = 2 * (2.0 * 16 * 512 * 64 * 1024) + 2.0 * 16 * 64 * 1024 * 1024,
           bwd = 6 * (2.0 * 16 * 512 * 1024 * 1024);
    double useful = 3 * 2.0 * 128 * 64 * 64;
    int seen = 0;
    for (int i = 0; i < ks->n; i++) {
        const cfg_json *k = &ks->items[i];
        const char *name = cfg_json_get(k, "kernel")->str;
        double calls = cfg_json_get(k, "calls")->number, mxu = cfg_json_get(k, "mxu_flops")->number,
               fl = cfg_json_get(k, "flops")->number;
        size_t n = strlen(name);
        if (n > 8 && !strcmp(name + n - 8, "/moe/ffn")) { /* forward and remat's recomputation */
            assert_true(fabs(mxu / calls - fwd) < 1e-5 * fwd);
            assert_true(fabs(fl / calls - useful) < 1e-5 * useful);
            seen++;
        } else if (n > 12 && !strcmp(name + n - 12, "/moe/ffn_bwd")) {
            assert_true(fabs(mxu / calls - bwd) < 1e-5 * bwd);
            assert_true(fabs(fl / calls - 2 * useful) < 1e-5 * useful);
            seen++;
        }
    }
    assert_int_equal(seen, 2);
    cfg_json_free(j);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    /* a tile of 0 is refused naming the key */
    const char *bad[] = {"model_name=deepseek3-tiny",
                         "override_model_config=true",
                         "base_num_decoder_layers=2",
                         "first_num_dense_layers=1",
                         "vocab_size=64",
                         "max_target_length=16",
                         "steps=1",
                         "dry_run=true",
                         "wi_tile_drhs_mlp_dim=0"};
    r = cli_capture_run(cli_train, (int)(sizeof bad / sizeof bad[0]), bad);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "wi_tile_drhs_mlp_dim"));
    cli_capture_free(&r);
}

/* SMALL_LLAMA_YML's parameter elements: the table and the logits kernel 256 x 32 each, the final norm's
 * scale 32, and per layer (2) query, key, value, out 32 x 4 x 8 each, wi_0, wi_1, wo 32 x 64 each, two
 * norm scales of 32. */
#define SMALL_LLAMA_ELEMS (2.0 * 256 * 32 + 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32))
/* ... of which Muon orthogonalises the attention and MLP kernels (configs/muon.yml: the table, the logits
 * kernel and the norm scales take the AdamW branch) */
#define SMALL_LLAMA_MUON_ELEMS (2.0 * (4 * 32 * 32 + 3 * 32 * 64))

/* The attention_op kind's useful FLOPs and kernel work of a tiny run (T = 16, 4 heads of 8, one
 * device, 2 layers; full remat: per layer the forward twice and the backward once). */
#define TINY SMALL_LLAMA_YML, "per_device_batch_size=1"

static void attention_kind(const char *extra1, const char *extra2, double *flops, double *mxu, double *calls)
{
    char dir[] = "/tmp/shardsim_tm_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    const char *argv[] = {TINY,
                          "steps=1",
                          "dry_run=true",
                          "hardware_profile=v5p",
                          "sa_block_q=4",
                          "sa_block_kv=8",
                          "sa_block_q_dkv=8",
                          "sa_block_kv_dkv=4",
                          "sa_block_kv_dq=2",
                          extra1,
                          extra2,
                          od};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    cli_capture_free(&r);
    char path[512];
    snprintf(path, sizeof path, "%s/run.json", dir);
    cfg_json *j = NULL;
    assert_int_equal(cfg_json_read_file(path, &j), SIM_OK);
    const cfg_json *ks = cfg_json_get(cfg_json_get(j, "step_time_model"), "slowest_kernels");
    *calls = 0;
    for (int i = 0; ks && i < ks->n; i++) {
        const char *name = cfg_json_get(&ks->items[i], "kernel")->str;
        if (!strstr(name, "attention_op")) continue;
        *flops = cfg_json_get(&ks->items[i], "flops")->number;
        *mxu = cfg_json_get(&ks->items[i], "mxu_flops")->number;
        *calls = cfg_json_get(&ks->items[i], "calls")->number;
    }
    cfg_json_free(j);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* Splash blocks over T = 16 (causal): forward (4 x 8) blocks: q rows 0-3 and 4-7 see kv block 0,
 * rows 8-11 and 12-15 kv blocks 0-1: 6 blocks of 32 scores; dkv (8 x 4): 2 + 4 = 6 blocks of 32;
 * dq (sa_block_q_dq 512 clipped to 16, x 2): 8 blocks of 32.  Per score and head, forward QK^T + PV
 * = 2 (8 + 8) FLOPs, dq 2 (2*8 + 8), dkv 2 (2*8 + 2*8); the fused backward is the dkv grid alone
 * with 2 (3*8 + 2*8).  The useful FLOPs: forward 2*4*16*16*16/2 = 16384, backward 2.5x. */
static void test_splash_blocks(void **state)
{
    (void)state;
    double flops, mxu, calls;
    double BH = 4, fwd = 2 * BH * 192 * 16, bwd = 2 * BH * (256.0 * 24 + 192.0 * 32), F = 16384;
    attention_kind("attention=flash", "sa_use_fused_bwd_kernel=false", &flops, &mxu, &calls);
    assert_true(calls == 6); /* 2 layers x (forward, recomputation, backward) */
    assert_true(fabs(mxu - 2 * (2 * fwd + bwd)) < 1e-6 * mxu);
    assert_true(fabs(flops - 2 * 4.5 * F) < 1e-6 * flops);
    attention_kind("attention=flash", "sa_use_fused_bwd_kernel=true", &flops, &mxu, &calls);
    double fused = 2 * BH * 192 * 40;
    assert_true(fabs(mxu - 2 * (2 * fwd + fused)) < 1e-6 * mxu);
    /* tokamax's splash has the fused backward only */
    attention_kind("attention=flash", "use_tokamax_splash=true", &flops, &mxu, &calls);
    assert_true(fabs(mxu - 2 * (2 * fwd + fused)) < 1e-6 * mxu);
    /* the dot-product path (the whole score matrix): no blocks, its FLOPs stand */
    attention_kind("attention=dot_product", "sa_use_fused_bwd_kernel=false", &flops, &mxu, &calls);
    assert_true(fabs(mxu - flops) < 1e-6 * flops);
}

/* collectives of one kind in different layers are listed as one: calls, bytes and time summed
 * (two 1 MB-shard gathers over a pair, 20 us each on one link of 50 GB/s) */
static void test_collective_kinds(void **state)
{
    (void)state;
    cfg_hw hw = toy_hw();
    model_tm_eff eff = toy_eff(1.0, 0);
    model_tm_result r;
    sim_record g[3] = {gather(2, 1000000, false), gather(2, 1000000, false), gather(2, 1000, false)};
    snprintf(g[0].tag, sizeof g[0].tag, "decoder/layers_1/mlp/wi");
    snprintf(g[1].tag, sizeof g[1].tag, "decoder/layers_22/mlp/wi");
    snprintf(g[2].tag, sizeof g[2].tag, "decoder/norm");
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, g, 3, NULL, 0, 0, false, &r), SIM_OK);
    assert_int_equal(r.ncolls, 2);
    assert_string_equal(r.colls[0].rec.tag, "decoder/layers_*/mlp/wi");
    assert_int_equal(r.colls[0].calls, 2);
    assert_true(fabs(r.colls[0].bytes - 2e6) < 1);
    assert_true(fabs(r.colls[0].time_s - 2 * 1e6 / 50e9) < 1e-12);
    assert_int_equal(r.colls[0].links, 1);
    assert_string_equal(r.colls[1].rec.tag, "decoder/norm");
}

static void test_profiles(void **state)
{
    (void)state;
    cfg_hw hw;
    /* v5p: 459 TFLOP/s, 95 GiB, 2765 GB/s, 1200 GB/s bidirectional ICI over 6 ports ->
     * 100 GB/s per link and direction; 4 chips are a 2x2x1 slice */
    assert_int_equal(cfg_hw_load("configs", "v5p", 4, &hw), SIM_OK);
    assert_false(hw.gpu);
    assert_true(fabs(hw.peak_bf16 - 459e12) < 1);
    assert_true(fabs(hw.hbm_bytes - 95.0 * 1073741824.0) < 1);
    assert_true(fabs(hw.hbm_bw - 2765e9) < 1);
    assert_true(fabs(hw.link_bw - 1200e9 / 6 / 2) < 1);
    assert_true(fabs(hw.dcn_bw - 50e9 / 8) < 1);
    assert_int_equal(hw.torus_n, 3);
    assert_int_equal(hw.torus[0] * hw.torus[1] * hw.torus[2], 4);
    /* tpu7x: two devices per chip share its figures */
    assert_int_equal(cfg_hw_load("configs", "tpu7x", 8, &hw), SIM_OK);
    assert_true(fabs(hw.peak_bf16 - 2307e12 / 2) < 1);
    assert_true(fabs(hw.hbm_bytes - 96.0 * 1073741824.0) < 1);
    /* h100: NVLink 900 GB/s bidirectional -> 450 GB/s each way */
    assert_int_equal(cfg_hw_load("configs", "h100", 8, &hw), SIM_OK);
    assert_true(hw.gpu);
    assert_true(fabs(hw.link_bw - 450e9) < 1);
    /* a float32 run without a published float32 peak says so */
    const char *note = NULL;
    assert_int_equal(cfg_hw_load("configs", "v5p", 4, &hw), SIM_OK);
    assert_true(model_hw_peak(&hw, "float32", &note) == hw.peak_bf16);
    assert_non_null(note);
    assert_true(model_hw_peak(&hw, "bfloat16", &note) == hw.peak_bf16);
    assert_null(note);
    /* a bad name lists the valid ones */
    assert_int_equal(cfg_hw_load("configs", "v9z", 4, &hw), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "v9z"));
    assert_non_null(strstr(sim_errmsg(), "v5p"));
    assert_non_null(strstr(sim_errmsg(), "h100"));
    sim_err_clear();
    assert_int_equal(cfg_hw_load("configs", "../base", 4, &hw), SIM_ERR_INPUT);
    sim_err_clear();
    /* v4 publishes no per-chip ICI bandwidth: a collective cannot be timed, and the model says so */
    assert_int_equal(cfg_hw_load("configs", "v4", 4, &hw), SIM_OK);
    model_tm_eff eff;
    assert_int_equal(model_tm_eff_load("configs", &eff), SIM_OK);
    sim_record g = gather(4, 1000, false);
    model_tm_result r;
    assert_int_equal(model_tm_device(&hw, &eff, hw.peak_bf16, 2.0, &g, 1, NULL, 0, 0, false, &r), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "ICI"));
    sim_err_clear();
}

/* train with a profile: the console estimate, run.json's step_time_model (its parts add up to
 * the step), the dry run's trace in modelled time, the profile's HBM as the capacity */
static void test_train_estimate(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_tm_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    const char *argv[] = {TINY,
                          "compile_topology=v5p-8",
                          "compile_topology_num_slices=1",
                          "ici_fsdp_parallelism=2",
                          "ici_tensor_parallelism=2",
                          od};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(strstr(r.out, "estimated step time on v5p, slice 2x2x1"));
    assert_non_null(strstr(r.out, "95.0 GiB")); /* the capacity column: hbm_limit_gb from the profile */
    assert_non_null(strstr(r.out, "slowest collectives"));
    assert_non_null(strstr(r.out, "slowest kinds of collective"));
    assert_non_null(strstr(r.out, "slowest kernels"));
    cli_capture_free(&r);
    char path[512];
    snprintf(path, sizeof path, "%s/run.json", dir);
    cfg_json *j = NULL;
    assert_int_equal(cfg_json_read_file(path, &j), SIM_OK);
    const cfg_json *tm = cfg_json_get(j, "step_time_model");
    assert_non_null(tm);
    double step = cfg_json_get(tm, "step_s")->number, comp = cfg_json_get(tm, "compute_s")->number,
           exp = cfg_json_get(tm, "exposed_communication_s")->number, opt = cfg_json_get(tm, "optimizer_s")->number;
    assert_true(step > 0 && comp > 0 && exp > 0); /* tensor=2 all-reduces activations: exposed */
    assert_true(fabs(step - (comp + exp + opt)) <= 1e-9 * step);
    assert_string_equal(cfg_json_get(tm, "hardware_profile")->str, "v5p");
    cfg_json_free(j);
    /* the optimizer phase streams AdamW's bytes (2 P + G + 2 O) and MaxText's three norms (P + 2 G)
     * at hbm_efficiency of v5p's HBM bandwidth: 10 x 4 bytes x a device's parameter elements
     * (SMALL_LLAMA_ELEMS, fsdp=2 x tensor=2 on every dim of 32 or more: a quarter of every kernel and of
     * the table; the 5 norm scales of 32, split by tensor alone, a half) */
    cfg_hw v5p;
    model_tm_eff e;
    assert_int_equal(cfg_hw_load("configs", "v5p", 4, &v5p), SIM_OK);
    assert_int_equal(model_tm_eff_load("configs", &e), SIM_OK);
    const double local = (SMALL_LLAMA_ELEMS - 5.0 * 32) / 4 + 5.0 * 32 / 2;
    assert_true(fabs(opt - 10 * 4 * local / (v5p.hbm_bw * e.hbm)) <= 1e-9 * opt);
    snprintf(path, sizeof path, "%s/trace.json", dir);
    assert_int_equal(cfg_json_read_file(path, &j), SIM_OK);
    const cfg_json *ev = cfg_json_get(j, "traceEvents");
    double end = 0;
    for (int i = 0; i < ev->n; i++) {
        const cfg_json *ts = cfg_json_get(&ev->items[i], "ts"), *dur = cfg_json_get(&ev->items[i], "dur");
        if (ts && dur && ts->number + dur->number > end) end = ts->number + dur->number;
    }
    /* the modelled timeline ends where the step ends, less the optimizer update (in microseconds) */
    assert_true(fabs(end - (step - opt) * 1e6) < 1e-3 * step * 1e6);
    cfg_json_free(j);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    /* a bad profile name exits 2 naming it and the valid ones */
    const char *bad[] = {TINY, "hardware_profile=v9", "steps=1"};
    r = cli_capture_run(cli_train, (int)(sizeof bad / sizeof bad[0]), bad);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "'v9'"));
    assert_non_null(strstr(r.err, "tpu7x"));
    cli_capture_free(&r);
}

/* The optimizer's modelled traffic (model_opt_step_bytes) is a function of the shards' sizes, per
 * optimizer: with n slots a parameter's update reads the parameter, its gradient and the slots and
 * writes the parameter and the slots (3 + 2 n shard-sized arrays: AdamW and adam_pax 7, SGD 3); a Muon
 * leaf (n = 1) also writes its float32 estimate, reads and writes it to normalise it and reads the
 * orthogonalised update (4 more: 9); MaxText's norms read every parameter once and every gradient
 * twice (3).  ZeRO-1 runs the update on the optimizer layout (here each shard halved over 'data'). */
static double opt_bytes_of(const char *const *extra, int n, int devices)
{
    const char *base[] = {SMALL_LLAMA_YML};
    model_def *def = model_run_load(base, 1, devices, extra, n, devices, 1, NULL);
    double b = model_opt_step_bytes(def);
    model_run_unload(def);
    return b;
}

/* One step of the small Llama under v5p; toggle(r) changes a memory-accounting rule before it runs.
 * The modelled optimizer time, and the grads and temporaries of device 0 at its peak. */
typedef struct {
    double opt_s, opt_s_peak_formula;
    size_t grads, temp;
} opt_run;

static void run_opt(const char *const *extra, int n, void (*toggle)(model_run *r), opt_run *out)
{
    const char *base[] = {SMALL_LLAMA_YML};
    model_run r;
    model_run_open(&r, base, 1, 2, extra, n, 2, 1);
    if (toggle) toggle(&r);
    model_run_train(&r, false);
    cfg_hw hw;
    model_tm_eff eff;
    assert_int_equal(cfg_hw_load("configs", "v5p", 2, &hw), SIM_OK);
    assert_int_equal(model_tm_eff_load("configs", &eff), SIM_OK);
    model_tm_result tm;
    assert_int_equal(model_tm_estimate(&hw, &eff, "bfloat16", r.m, 0, 0.0, model_opt_step_bytes(r.def), false, &tm),
                     SIM_OK);
    out->opt_s = tm.optimizer_s;
    sim_arena_stats st;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &st);
    out->grads = st.at_peak_by[SIM_MEM_GRADS];
    out->temp = st.at_peak_by[SIM_MEM_TEMP];
    /* what the term was when it was read off the arena at the peak: 3 P + 3 G + 2 O */
    const size_t *c = st.at_peak_by;
    out->opt_s_peak_formula =
        (3.0 * (double)c[SIM_MEM_PARAMS] + 3.0 * (double)c[SIM_MEM_GRADS] + 2.0 * (double)c[SIM_MEM_OPTIMIZER]) /
        (hw.hbm_bw * eff.hbm);
    model_run_close(&r);
}

static void no_saved_copies(model_run *r) { r->def->d.xla.saved_grad_copies = 0; }
static void muon_per_leaf(model_run *r) { ((model_muon_cfg *)(void *)r->job.opt.priv)->stacked = false; }

static void test_optimizer_traffic(void **state)
{
    (void)state;
    const double P = 4 * SMALL_LLAMA_ELEMS, M = 4 * SMALL_LLAMA_MUON_ELEMS; /* float32 bytes */
    const char *adamw[] = {"opt_type=adamw"}, *sgd[] = {"opt_type=sgd"}, *pax[] = {"opt_type=adam_pax"},
               *muon[] = {"opt_type=muon"}, *data[] = {"ici_data_parallelism=2"},
               *zero1[] = {"ici_data_parallelism=2", "shard_optimizer_over_data=true"};
    assert_true(opt_bytes_of(adamw, 1, 1) == 10 * P);
    assert_true(opt_bytes_of(pax, 1, 1) == 10 * P);
    assert_true(opt_bytes_of(sgd, 1, 1) == 6 * P);
    assert_true(opt_bytes_of(muon, 1, 1) == 12 * M + 10 * (P - M));
    assert_true(opt_bytes_of(data, 1, 2) == 10 * P); /* data parallelism replicates the state */
    assert_true(opt_bytes_of(zero1, 2, 2) == 5 * P); /* ZeRO-1: every dim of 32 or more halves over data */
    /* memory-only rules move the peak's composition, not the optimizer term: saved_product_gradient_copies
     * (remat_policy=minimal) and muon_update_buffers (stacked: the Muon gradients counted out) */
    cfg_hw hw;
    model_tm_eff eff;
    assert_int_equal(cfg_hw_load("configs", "v5p", 2, &hw), SIM_OK);
    assert_int_equal(model_tm_eff_load("configs", &eff), SIM_OK);
    const double bw = hw.hbm_bw * eff.hbm;
    const char *minimal[] = {"hardware_profile=v5p", "dtype=bfloat16", "remat_policy=minimal",
                             "ici_fsdp_parallelism=2"};
    opt_run a, b;
    run_opt(minimal, 4, NULL, &a);
    run_opt(minimal, 4, no_saved_copies, &b);
    assert_true(a.grads != b.grads);
    assert_true(a.opt_s == b.opt_s);
    /* fsdp=2 halves every parameter but the 5 norm scales of 32 (MaxText's norm rule: not split by fsdp) */
    const double half = (P - 4 * 5 * 32) / 2 + 4 * 5 * 32;
    assert_true(fabs(a.opt_s - 10 * half / bw) <= 1e-12 * a.opt_s);
    assert_true(a.opt_s_peak_formula != b.opt_s_peak_formula); /* what read the peak moved */
    /* Muon at a size where the update is the peak (width 64, 4 heads of 32, MLP 256, 8 layers, vocabulary
     * 8): 8 x (4 x 64 x 128 + 3 x 64 x 256) Muon elements, all split by fsdp; the AdamW branch: the table
     * and the logits kernel 8 x 64 each (split on emb), 17 norm scales of 64 (not split) */
    const char *mu[] = {"hardware_profile=v5p", "dtype=bfloat16",   "opt_type=muon", "ici_fsdp_parallelism=2",
                        "base_emb_dim=64",      "base_mlp_dim=256", "head_dim=32",   "base_num_decoder_layers=8",
                        "vocab_size=8"};
    run_opt(mu, 9, NULL, &a);
    run_opt(mu, 9, muon_per_leaf, &b);
    assert_true(a.grads != b.grads && a.temp != b.temp);
    assert_true(a.opt_s == b.opt_s);
    const double mm = 4.0 * 8 * (4 * 64 * 128 + 3 * 64 * 256) / 2, aw = 4.0 * 2 * 8 * 64 / 2 + 4.0 * 17 * 64;
    assert_true(fabs(a.opt_s - (12 * mm + 10 * aw) / bw) <= 1e-12 * a.opt_s);
    assert_true(a.opt_s_peak_formula != b.opt_s_peak_formula);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_roofline),
        cmocka_unit_test(test_memory_ops),
        cmocka_unit_test(test_ring_all_gather),
        cmocka_unit_test(test_overlap_rule),
        cmocka_unit_test(test_serial_weight_collectives),
        cmocka_unit_test(test_tiled_kernel),
        cmocka_unit_test(test_gmm_tiles),
        cmocka_unit_test(test_splash_blocks),
        cmocka_unit_test(test_collective_kinds),
        cmocka_unit_test(test_profiles),
        cmocka_unit_test(test_train_estimate),
        cmocka_unit_test(test_optimizer_traffic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

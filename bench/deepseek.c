/* deepseek.c — DeepSeek benchmark, in one run:
 *
 *   1. MaxText's explicit-sharding table for deepseek3-test: FSDP=4 and
 *      FSDP=2 TP=2 under the base rules, FSDP=2 TP_transpose=2 under the
 *      legacy rule set (custom_mesh_and_rule=legacy: the only one with the
 *      tensor_transpose axis), each in auto and explicit shard mode.  Per
 *      configuration: the peak memory per device at 2 layers
 *      (base_num_decoder_layers=2 first_num_dense_layers=1) and at full depth
 *      (61 layers), and the bytes each device sends per step by collective
 *      and mesh axes, for both.  The batch is per_device_batch_size=1 of
 *      max_target_length=256 (4 sequences).  Both columns come from dry runs
 *      (which account memory and traffic exactly as a real run does); with
 *      --real the 2-layer column is a real training step instead (about
 *      4.5 GiB per device, 18 GiB in all, minutes per configuration) and the
 *      table says whether it equals the dry figures.
 *   2. The deepseek3-tiny step time (full depth, 8 sequences of 64 tokens;
 *      256 tokens with --full) on 8 devices (fsdp=4 expert=2) over the step
 *      time on 1 device: target <= 1.3.  Each side trains 3 steps; the
 *      fastest after the first counts.
 *   3. Ring of experts (use_ring_of_experts=true) against the ragged
 *      all-to-all on fsdp=2 expert=4: a 4-layer deepseek3-tiny (1 dense + 3
 *      MoE) with a 2048-entry vocabulary, 8 sequences of 64 tokens, real steps; bytes each device sends
 *      in the last step by collective and mesh axes, and the step time
 *      (fastest of steps 2-3).
 *
 *   4. The batch-split schedule: deepseek3-671b against
 *      deepseek3-671b-batchsplit (batch_split_factor=2), one dry step each on
 *      256 devices (fsdp=32 expert=8), 2 sequences of 1024 tokens per device,
 *      dtype=bfloat16 (every collective counted in it): bytes each device
 *      sends per step by collective and mesh axes, and the peak memory per
 *      device.
 *
 * Benchmark, not a test: it prints the table and the ratio and exits 0
 * unless a run fails.  Usage: deepseek [table|ratio|ring|batchsplit]... [--real]
 * [--full] (no selection: all four). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_coretype.h"
#include "models/train.h"

enum { SEQ = 256, MAX_ROWS = 64 };

typedef struct {
    const char *label;
    const char *flags[4];
} mesh_case;

static const mesh_case CASES[] = {
    {"FSDP=4", {"ici_fsdp_parallelism=4"}},
    {"FSDP=2 TP=2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}},
    {"FSDP=2 TP_transpose=2 (legacy)",
     {"custom_mesh_and_rule=legacy", "ici_fsdp_parallelism=2", "ici_tensor_transpose_parallelism=2"}},
};
enum { NCASES = sizeof CASES / sizeof CASES[0] };

/* Bytes sent per device per step, by collective and axes. */
typedef struct {
    sim_op op;
    char axes[64];
    double bytes;
} traffic_row;

typedef struct {
    double peak_gib;     /* highest arena peak over devices */
    double step_s;       /* fastest step after the first (or the only one) */
    int nrows;
    traffic_row rows[MAX_ROWS];
} run_result;

static void fail(const char *what)
{
    fprintf(stderr, "bench/deepseek: %s: %s\n", what, sim_errmsg());
    exit(1);
}

static void add_traffic(run_result *r, sim_op op, const char *axes, double bytes)
{
    for (int i = 0; i < r->nrows; i++)
        if (r->rows[i].op == op && !strcmp(r->rows[i].axes, axes)) {
            r->rows[i].bytes += bytes;
            return;
        }
    if (r->nrows == MAX_ROWS) return;
    traffic_row *t = &r->rows[r->nrows++];
    t->op = op;
    snprintf(t->axes, sizeof t->axes, "%s", axes);
    t->bytes = bytes;
}

static run_result run(const char *const *words, int nwords, int steps)
{
    run_result res;
    memset(&res, 0, sizeof res);
    mesh_cfg *cfg;
    model_def *def = calloc(1, sizeof *def);
    model_data data;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m;
    if (mesh_cfg_load_argv("configs/base.yml", nwords, words, &cfg)) fail("config");
    if (model_def_from_config(cfg, def)) fail("model");
    if (model_data_from_config(cfg, &data) || model_optim_from_config(cfg, &job.opt)) fail("data/optimizer");
    if (model_machine_new(def, 0, false, &m)) fail("machine");
    job.def = def;
    job.data = &data;
    job.steps = steps;
    job.stats = calloc((size_t)steps, sizeof *job.stats);
    if (model_train(&job, m) != SIM_OK) fail("train");
    res.step_s = job.stats[0].time_s;
    for (int s = 1; s < steps; s++)
        if (s == 1 || job.stats[s].time_s < res.step_s) res.step_s = job.stats[s].time_s;
    int nd = sim_machine_num_devices(m);
    const sim_mesh_desc *md = sim_machine_mesh(m);
    size_t peak = 0;
    for (int d = 0; d < nd; d++) {
        sim_device *dev = sim_machine_device(m, d);
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(dev), &as);
        if (as.peak > peak) peak = as.peak;
        size_t n;
        const sim_record *r = sim_device_records(dev, &n);
        for (size_t i = 0; i < n; i++) {
            if (r[i].step != steps - 1) continue; /* the last step */
            char ax[64];
            sim_axes_label(md, r[i].axes, ax, sizeof ax);
            add_traffic(&res, r[i].op, ax, (double)r[i].bytes_sent / nd);
        }
    }
    res.peak_gib = (double)peak / (1024.0 * 1024.0 * 1024.0);
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(def);
    free(def);
    mesh_cfg_free(cfg);
    return res;
}

static const char *fmt_bytes(double b, char *buf, size_t cap)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4) {
        b /= 1024;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", b, unit[u]);
    return buf;
}

static const traffic_row *find_row(const run_result *r, sim_op op, const char *axes)
{
    for (int i = 0; i < r->nrows; i++)
        if (r->rows[i].op == op && !strcmp(r->rows[i].axes, axes)) return &r->rows[i];
    return NULL;
}

/* Same peak and the same bytes for every (collective, axes). */
static bool same_figures(const run_result *a, const run_result *b)
{
    if (a->peak_gib != b->peak_gib || a->nrows != b->nrows) return false;
    for (int i = 0; i < a->nrows; i++) {
        const traffic_row *r = find_row(b, a->rows[i].op, a->rows[i].axes);
        if (!r || r->bytes != a->rows[i].bytes) return false;
    }
    return true;
}

static void explicit_sharding_table(bool real_runs)
{
    printf("deepseek3-test, per_device_batch_size=1, max_target_length=%d, 4 devices\n", SEQ);
    printf("2L: 2 layers (1 dense + 1 MoE), 1 step, %s; 61L: full depth (3 dense + 58 MoE), dry_run=true\n\n",
           real_runs ? "a real step (--real)" : "dry_run=true (--real: a real step)");
    printf("%-32s %-9s %12s %12s  %-15s %-22s %14s %14s\n", "mesh", "mode", "peak/dev", "peak/dev", "collective",
           "axes", "bytes/dev/step", "bytes/dev/step");
    printf("%-32s %-9s %12s %12s  %-15s %-22s %14s %14s\n", "", "", "2L", "61L", "", "", "2L", "61L");
    for (int i = 0; i < 160; i++) putchar('-');
    putchar('\n');
    for (int c = 0; c < NCASES; c++)
        for (int mode = 0; mode < 2; mode++) {
            const char *words[24];
            int n = 0;
            words[n++] = "model_name=deepseek3-test";
            words[n++] = "per_device_batch_size=1";
            words[n++] = "max_target_length=256";
            words[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            for (int f = 0; f < 4 && CASES[c].flags[f]; f++) words[n++] = CASES[c].flags[f];
            int base = n;
            words[n++] = "override_model_config=true";
            words[n++] = "base_num_decoder_layers=2";
            words[n++] = "first_num_dense_layers=1";
            words[n++] = "steps=1";
            if (!real_runs) words[n++] = "dry_run=true";
            run_result real = run(words, n, 1);
            if (real_runs) { /* the dry run must account exactly what the real step did */
                words[n++] = "dry_run=true";
                run_result dry2 = run(words, n, 1);
                printf("%s %s: 2-layer dry run %s the real step\n", CASES[c].label, mode ? "explicit" : "auto",
                       same_figures(&real, &dry2) ? "equals" : "DIFFERS FROM");
            }
            n = base;
            words[n++] = "dry_run=true";
            words[n++] = "steps=1";
            run_result dry = run(words, n, 1);
            /* rows: the union of both runs' (collective, axes), dry order first */
            run_result all = dry;
            for (int i = 0; i < real.nrows; i++)
                if (!find_row(&all, real.rows[i].op, real.rows[i].axes)) add_traffic(&all, real.rows[i].op, real.rows[i].axes, 0);
            char p1[32], p2[32];
            snprintf(p1, sizeof p1, "%.3f GiB", real.peak_gib);
            snprintf(p2, sizeof p2, "%.3f GiB", dry.peak_gib);
            for (int i = 0; i < all.nrows; i++) {
                const traffic_row *a = find_row(&real, all.rows[i].op, all.rows[i].axes),
                                  *b = find_row(&dry, all.rows[i].op, all.rows[i].axes);
                char b1[32], b2[32];
                printf("%-32s %-9s %12s %12s  %-15s %-22s %14s %14s\n", i ? "" : CASES[c].label,
                       i ? "" : (mode ? "explicit" : "auto"), i ? "" : p1, i ? "" : p2, sim_op_name(all.rows[i].op),
                       all.rows[i].axes, fmt_bytes(a ? a->bytes : 0, b1, sizeof b1),
                       fmt_bytes(b ? b->bytes : 0, b2, sizeof b2));
            }
            if (!all.nrows) printf("%-32s %-9s %12s %12s\n", CASES[c].label, mode ? "explicit" : "auto", p1, p2);
            fflush(stdout);
        }
    printf("\n");
}

static void step_ratio(bool full)
{
    /* 64 tokens by default: the 129280-entry vocabulary makes 256-token steps take many seconds */
    int seq = full ? SEQ : 64;
    char len[48];
    snprintf(len, sizeof len, "max_target_length=%d", seq);
    const char *one[] = {"model_name=deepseek3-tiny", "per_device_batch_size=8", len, "steps=3",
                         "learning_rate=1e-4"};
    const char *eight[] = {"model_name=deepseek3-tiny", "per_device_batch_size=1", len, "steps=3",
                           "learning_rate=1e-4", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"};
    run_result a = run(one, 5, 3);
    run_result b = run(eight, 7, 3);
    printf("deepseek3-tiny (61 layers, 8 x %d tokens) step time\n", seq);
    printf("%-26s %10s\n", "mesh", "step (s)");
    printf("%-26s %10.3f\n", "1 device", a.step_s);
    printf("%-26s %10.3f\n", "8 devices fsdp=4 expert=2", b.step_s);
    printf("ratio 8 devices / 1 device: %.3f (target <= 1.3)\n", b.step_s / a.step_s);
}

static void ring_vs_ragged(void)
{
    const char *words[] = {"model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4",
                           "first_num_dense_layers=1", "vocab_size=2048", "per_device_batch_size=1", "max_target_length=64", "steps=3",
                           "learning_rate=1e-4", "ici_fsdp_parallelism=2", "ici_expert_parallelism=4",
                           "use_ring_of_experts=false"};
    enum { NW = sizeof words / sizeof words[0] };
    run_result a = run(words, NW, 3);
    words[NW - 1] = "use_ring_of_experts=true";
    run_result b = run(words, NW, 3);
    printf("deepseek3-tiny, 4 layers (1 dense + 3 MoE), vocab 2048, 8 x 64 tokens, fsdp=2 expert=4: ring of experts vs ragged "
           "all-to-all\n");
    printf("%-15s %-22s %16s %16s\n", "collective", "axes", "ragged a2a", "ring");
    printf("%-15s %-22s %16s %16s\n", "", "", "bytes/dev/step", "bytes/dev/step");
    for (int i = 0; i < 72; i++) putchar('-');
    putchar('\n');
    run_result all = a;
    for (int i = 0; i < b.nrows; i++)
        if (!find_row(&all, b.rows[i].op, b.rows[i].axes)) add_traffic(&all, b.rows[i].op, b.rows[i].axes, 0);
    double ta = 0, tb = 0;
    for (int i = 0; i < all.nrows; i++) {
        const traffic_row *x = find_row(&a, all.rows[i].op, all.rows[i].axes),
                          *y = find_row(&b, all.rows[i].op, all.rows[i].axes);
        char b1[32], b2[32];
        ta += x ? x->bytes : 0;
        tb += y ? y->bytes : 0;
        printf("%-15s %-22s %16s %16s\n", sim_op_name(all.rows[i].op), all.rows[i].axes,
               fmt_bytes(x ? x->bytes : 0, b1, sizeof b1), fmt_bytes(y ? y->bytes : 0, b2, sizeof b2));
    }
    char b1[32], b2[32];
    printf("%-15s %-22s %16s %16s\n", "total", "", fmt_bytes(ta, b1, sizeof b1), fmt_bytes(tb, b2, sizeof b2));
    printf("step time: ragged a2a %.3f s, ring %.3f s (ratio ring / ragged %.2f; wall clock on a shared machine)\n",
           a.step_s, b.step_s, b.step_s / a.step_s);
    printf("peak memory per device: ragged a2a %.2f MiB, ring %.2f MiB\n\n", a.peak_gib * 1024, b.peak_gib * 1024);
}

/* Two runs' bytes per device per step side by side, by collective and mesh axes. */
static void print_compare(const run_result *a, const run_result *b, const char *la, const char *lb)
{
    printf("%-15s %-22s %20s %20s\n", "collective", "axes", la, lb);
    printf("%-15s %-22s %20s %20s\n", "", "", "bytes/dev/step", "bytes/dev/step");
    for (int i = 0; i < 80; i++) putchar('-');
    putchar('\n');
    run_result all = *a;
    for (int i = 0; i < b->nrows; i++)
        if (!find_row(&all, b->rows[i].op, b->rows[i].axes)) add_traffic(&all, b->rows[i].op, b->rows[i].axes, 0);
    double ta = 0, tb = 0;
    char b1[32], b2[32];
    for (int i = 0; i < all.nrows; i++) {
        const traffic_row *x = find_row(a, all.rows[i].op, all.rows[i].axes),
                          *y = find_row(b, all.rows[i].op, all.rows[i].axes);
        if ((!x || x->bytes == 0) && (!y || y->bytes == 0)) continue;
        ta += x ? x->bytes : 0;
        tb += y ? y->bytes : 0;
        printf("%-15s %-22s %20s %20s\n", sim_op_name(all.rows[i].op), all.rows[i].axes,
               fmt_bytes(x ? x->bytes : 0, b1, sizeof b1), fmt_bytes(y ? y->bytes : 0, b2, sizeof b2));
    }
    printf("%-15s %-22s %20s %20s\n", "total", "", fmt_bytes(ta, b1, sizeof b1), fmt_bytes(tb, b2, sizeof b2));
    printf("%-15s %-22s %17.2f GiB %17.2f GiB\n", "peak memory/dev", "", a->peak_gib, b->peak_gib);
}

static void batchsplit_vs_plain(void)
{
    const char *words[] = {"model_name=deepseek3-671b", "dry_run=true", "ici_fsdp_parallelism=32",
                           "ici_expert_parallelism=8", "per_device_batch_size=2", "max_target_length=1024",
                           "dtype=bfloat16", "sharding_tolerance=1", "steps=1", "batch_split_factor=1"};
    enum { NW = sizeof words / sizeof words[0] };
    run_result a = run(words, NW, 1);
    words[0] = "model_name=deepseek3-671b-batchsplit";
    words[NW - 1] = "batch_split_factor=2";
    run_result b = run(words, NW, 1);
    printf("deepseek3-671b (61 layers, 256 experts), 256 devices fsdp=32 expert=8, 2 x 1024 tokens per device, dry: "
           "plain schedule vs batch split\n");
    print_compare(&a, &b, "deepseek3-671b", "...-batchsplit");
    printf("(bytes counted in dtype=bfloat16 on both sides)\n\n");
}

int main(int argc, char **argv)
{
    printf("OpenBLAS kernels: %s\n", bk_coretype_current()->summary);
    bool table = false, ratio = false, ring = false, split = false, real_runs = false, full = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "table")) table = true;
        else if (!strcmp(argv[i], "ratio")) ratio = true;
        else if (!strcmp(argv[i], "ring")) ring = true;
        else if (!strcmp(argv[i], "batchsplit")) split = true;
        else if (!strcmp(argv[i], "--real")) real_runs = true;
        else if (!strcmp(argv[i], "--full")) full = true;
        else {
            fprintf(stderr, "bench/deepseek: unknown argument '%s'; usage: deepseek [table|ratio|ring|batchsplit]... [--real] "
                    "[--full]\n",
                    argv[i]);
            return 2;
        }
    }
    if (!table && !ratio && !ring && !split) table = ratio = ring = split = true;
    if (table) explicit_sharding_table(real_runs);
    if (ratio) step_ratio(full);
    if (ring) ring_vs_ragged();
    if (split) batchsplit_vs_plain();
    return 0;
}

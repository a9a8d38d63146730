/* deepseek.c — DeepSeek benchmark: one table of rows, each row one training
 * run (dry or real) given as key=value words on top of configs/base.yml.
 * Per row: the peak memory per device (the highest arena peak), the step
 * time for real rows (the fastest step after the first), that time over an
 * earlier row's (`vs`), and the bytes each device sends per step by
 * collective and mesh axes (the last step).  A run shardsim refuses prints
 * the first line of its message (and whether MaxText fails there too)
 * instead of figures: refusals are part of the table's meaning.
 *
 * Rows today:
 *   1. MaxText's explicit-sharding table for deepseek3-test (4 devices,
 *      per_device_batch_size=1 of 256 tokens): FSDP=4 and FSDP=2 TP=2 under
 *      the base rules, FSDP=2 TP_transpose=2 under the legacy rule set (the
 *      only one with the tensor_transpose axis), each in auto and explicit
 *      shard mode, at 2 layers (1 dense + 1 MoE) and at full depth (61),
 *      all dry runs (which account memory and traffic exactly as a real run
 *      does).  With --real the 2-layer rows also run a real step (about
 *      4.5 GiB per device, minutes each) and say whether it equals the dry
 *      figures.  MLA in explicit mode with tensor>1 fails in MaxText 0.2.5
 *      (the q_norm einsum's ShardingTypeError), and so here.
 *   2. deepseek3-tiny step time, 8 devices (fsdp=4 expert=2) over 1 device,
 *      8 sequences of 64 tokens: target <= 1.3.  By default the model is cut
 *      to 6 layers (3 dense + 3 MoE: every layer kind and the 129280-entry
 *      vocabulary stay, so the ratio measures the same work per layer); with
 *      --long the full 61 layers and 256 tokens (tens of minutes).
 *   3. Ring of experts (use_ring_of_experts=true) against the ragged
 *      all-to-all on fsdp=2 expert=4: a 4-layer deepseek3-tiny (1 dense + 3
 *      MoE) with a 2048-entry vocabulary, 8 sequences of 64 tokens, real
 *      steps (the fastest of steps 2-3); the ring's time over the ragged one.
 *
 * To add a row, append to ROWS (keep it dry or small: `make bench` runs the
 * default rows in a few minutes; long rows take ROW_LONG).
 *
 * Benchmark, not a test: it prints the table and exits 0 unless a run fails
 * for a reason other than a refusal of its configuration.
 * Usage: deepseek [--real] [--long] [MATCH] — MATCH keeps the rows whose
 * group or label contains it. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/lib/bench_host.h"
#include "bench/lib/bench_run.h"
#include "models/core/train.h"

enum { MAX_WORDS = 24 };

enum {
    ROW_LONG = 1, /* only with --long */
    ROW_REAL = 2, /* a dry row that --real also runs as a real step, compared with the dry figures */
};

typedef struct {
    const char *group;            /* section heading, printed when it changes */
    const char *label;            /* unique among the rows (`vs` names it) */
    const char *words[MAX_WORDS]; /* key=value words over configs/base.yml, NULL-terminated */
    int steps;                    /* training steps (timed rows: >= 2, the fastest after the first counts) */
    const char *vs;               /* label of an earlier row: print step time / that row's, or NULL */
    unsigned flags;               /* ROW_* */
} bench_row;

#define DS_TEST "model_name=deepseek3-test", "per_device_batch_size=1", "max_target_length=256"
#define TWO_LAYERS "override_model_config=true", "base_num_decoder_layers=2", "first_num_dense_layers=1"
#define FSDP4 "ici_fsdp_parallelism=4"
#define FSDP2_TP2 "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"
#define FSDP2_TPT2 "custom_mesh_and_rule=legacy", "ici_fsdp_parallelism=2", "ici_tensor_transpose_parallelism=2"
#define EXPLICIT_TABLE                                                                                                 \
    "deepseek3-test, 4 devices, per_device_batch_size=1 x 256 tokens, dry runs (MaxText's explicit-sharding table)"
#define TINY "model_name=deepseek3-tiny", "learning_rate=1e-4", "steps=3"
#define TINY_SHORT "max_target_length=64", "override_model_config=true", "base_num_decoder_layers=6"
#define TINY_TABLE "deepseek3-tiny step time, 8 x 64 tokens, 6 layers (3 dense + 3 MoE); target 8 devices / 1 <= 1.3"
#define TINY_LONG_TABLE "deepseek3-tiny step time, 8 x 256 tokens, 61 layers (--long); target 8 devices / 1 <= 1.3"
#define RING                                                                                                           \
    "model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4",                            \
        "first_num_dense_layers=1", "vocab_size=2048", "per_device_batch_size=1", "max_target_length=64",              \
        "learning_rate=1e-4", "ici_fsdp_parallelism=2", "ici_expert_parallelism=4"
#define BSPLIT                                                                                                         \
    "dry_run=true", "ici_fsdp_parallelism=32", "ici_expert_parallelism=8", "per_device_batch_size=2",                  \
        "max_target_length=1024", "dtype=bfloat16", "sharding_tolerance=1", "steps=1"
#define BSPLIT_TABLE                                                                                                   \
    "deepseek3-671b (61 layers, 256 experts), 256 devices fsdp=32 expert=8, 2 x 1024 tokens per device, dry, "         \
    "dtype=bfloat16: plain schedule vs batch split"
#define RING_TABLE                                                                                                     \
    "deepseek3-tiny 4 layers (1 dense + 3 MoE), vocab 2048, 8 x 64 tokens, fsdp=2 expert=4: ring of experts vs "       \
    "ragged all-to-all"

static const bench_row ROWS[] = {
    {EXPLICIT_TABLE,
     "FSDP=4 auto 2L",
     {DS_TEST, FSDP4, "shard_mode=auto", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     ROW_REAL},
    {EXPLICIT_TABLE, "FSDP=4 auto 61L", {DS_TEST, FSDP4, "shard_mode=auto", "dry_run=true"}, 1, NULL, 0},
    {EXPLICIT_TABLE,
     "FSDP=4 explicit 2L",
     {DS_TEST, FSDP4, "shard_mode=explicit", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     ROW_REAL},
    {EXPLICIT_TABLE, "FSDP=4 explicit 61L", {DS_TEST, FSDP4, "shard_mode=explicit", "dry_run=true"}, 1, NULL, 0},
    {EXPLICIT_TABLE,
     "FSDP=2 TP=2 auto 2L",
     {DS_TEST, FSDP2_TP2, "shard_mode=auto", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     ROW_REAL},
    {EXPLICIT_TABLE, "FSDP=2 TP=2 auto 61L", {DS_TEST, FSDP2_TP2, "shard_mode=auto", "dry_run=true"}, 1, NULL, 0},
    {EXPLICIT_TABLE,
     "FSDP=2 TP=2 explicit 2L",
     {DS_TEST, FSDP2_TP2, "shard_mode=explicit", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     0},
    {EXPLICIT_TABLE,
     "FSDP=2 TP_transpose=2 (legacy) auto 2L",
     {DS_TEST, FSDP2_TPT2, "shard_mode=auto", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     ROW_REAL},
    {EXPLICIT_TABLE,
     "FSDP=2 TP_transpose=2 (legacy) auto 61L",
     {DS_TEST, FSDP2_TPT2, "shard_mode=auto", "dry_run=true"},
     1,
     NULL,
     0},
    {EXPLICIT_TABLE,
     "FSDP=2 TP_transpose=2 (legacy) explicit 2L",
     {DS_TEST, FSDP2_TPT2, "shard_mode=explicit", TWO_LAYERS, "dry_run=true"},
     1,
     NULL,
     ROW_REAL},
    {EXPLICIT_TABLE,
     "FSDP=2 TP_transpose=2 (legacy) explicit 61L",
     {DS_TEST, FSDP2_TPT2, "shard_mode=explicit", "dry_run=true"},
     1,
     NULL,
     0},
    {TINY_TABLE, "tiny 1 device", {TINY, TINY_SHORT, "per_device_batch_size=8"}, 3, NULL, 0},
    {TINY_TABLE,
     "tiny fsdp=4 expert=2",
     {TINY, TINY_SHORT, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"},
     3,
     "tiny 1 device",
     0},
    {RING_TABLE, "ragged all-to-all", {RING, "use_ring_of_experts=false"}, 3, NULL, 0},
    {RING_TABLE, "ring of experts", {RING, "use_ring_of_experts=true"}, 3, "ragged all-to-all", 0},
    {BSPLIT_TABLE, "deepseek3-671b", {"model_name=deepseek3-671b", BSPLIT, "batch_split_factor=1"}, 1, NULL, 0},
    {BSPLIT_TABLE,
     "deepseek3-671b-batchsplit",
     {"model_name=deepseek3-671b-batchsplit", BSPLIT, "batch_split_factor=2"},
     1,
     NULL,
     0},
    {TINY_LONG_TABLE,
     "tiny 61L 1 device",
     {TINY, "max_target_length=256", "per_device_batch_size=8"},
     3,
     NULL,
     ROW_LONG},
    {TINY_LONG_TABLE,
     "tiny 61L fsdp=4 expert=2",
     {TINY, "max_target_length=256", "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"},
     3,
     "tiny 61L 1 device",
     ROW_LONG},
};
enum { NROWS = sizeof ROWS / sizeof ROWS[0] };

typedef struct {
    bool ran;       /* false: not run (filtered out or not yet) */
    bench_result b; /* refusal, peak, fastest step after the first, the last step's traffic */
} run_result;

/* Runs the words (without dry_run=true when real); a refusal (bad or
 * unsupported configuration) is returned in the result, any other failure
 * exits. */
static void run(const bench_row *row, bool real, run_result *res)
{
    memset(res, 0, sizeof *res);
    res->ran = true;
    const char *words[MAX_WORDS + 1];
    int n = 0;
    bool dry = false;
    for (int i = 0; i < MAX_WORDS && row->words[i]; i++) {
        if (!strcmp(row->words[i], "dry_run=true")) {
            dry = true;
            if (real) continue;
        }
        words[n++] = row->words[i];
    }
    char st[32];
    snprintf(st, sizeof st, "steps=%d", row->steps);
    words[n++] = st;
    char who[160];
    snprintf(who, sizeof who, "bench/deepseek: %s", row->label);
    bench_run(who, words, n, row->steps, &res->b);
    if (dry && !real) res->b.step_s = 0;
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

/* Same peak and the same bytes for every (collective, axes). */
static bool same_figures(const run_result *a, const run_result *b)
{
    if (a->b.peak != b->b.peak || a->b.nrows != b->b.nrows) return false;
    for (int i = 0; i < a->b.nrows; i++) {
        const bench_traffic *r = bench_find_traffic(&b->b, a->b.rows[i].op, a->b.rows[i].axes);
        if (!r || r->bytes != a->b.rows[i].bytes) return false;
    }
    return true;
}

static int find_row(const char *label)
{
    for (int i = 0; i < NROWS; i++)
        if (!strcmp(ROWS[i].label, label)) return i;
    return -1;
}

static void print_result(const bench_row *row, const run_result *r, const run_result *ref)
{
    if (r->b.refused) {
        /* the first line of the message, and MaxText's verdict when the message gives it */
        const char *nl = strchr(r->b.why, '\n');
        int len = nl ? (int)(nl - r->b.why) : (int)strlen(r->b.why);
        printf("%-44s refused: %.*s\n", row->label, len > 150 ? 150 : len, r->b.why);
        const char *mt = strstr(r->b.why, "MaxText 0.2.5 fails");
        if (mt) {
            nl = strchr(mt, '\n');
            printf("%-44s   (%.*s)\n", "", nl ? (int)(nl - mt) : (int)strlen(mt), mt);
        }
        return;
    }
    char peak[32], step[32] = "dry", ratio[32] = "";
    snprintf(peak, sizeof peak, "%.3f GiB", (double)r->b.peak / (1024.0 * 1024.0 * 1024.0));
    if (r->b.step_s > 0) snprintf(step, sizeof step, "%.3f", r->b.step_s);
    if (ref && ref->ran && !ref->b.refused && ref->b.step_s > 0 && r->b.step_s > 0)
        snprintf(ratio, sizeof ratio, "%.3f", r->b.step_s / ref->b.step_s);
    for (int i = 0; i < (r->b.nrows ? r->b.nrows : 1); i++) {
        char b[32] = "";
        if (r->b.nrows) fmt_bytes(r->b.rows[i].bytes, b, sizeof b);
        printf("%-44s %12s %9s %8s  %-18s %-22s %14s\n", i ? "" : row->label, i ? "" : peak, i ? "" : step,
               i ? "" : ratio, r->b.nrows ? sim_op_name(r->b.rows[i].op) : "", r->b.nrows ? r->b.rows[i].axes : "", b);
    }
    if (r->b.nrows > 1) {
        double total = 0;
        char b[32];
        for (int i = 0; i < r->b.nrows; i++) total += r->b.rows[i].bytes;
        printf("%-44s %12s %9s %8s  %-18s %-22s %14s\n", "", "", "", "", "total", "", fmt_bytes(total, b, sizeof b));
    }
}

int main(int argc, char **argv)
{
    bool real = false, lng = false;
    const char *match = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--real")) real = true;
        else if (!strcmp(argv[i], "--long")) lng = true;
        else if (argv[i][0] != '-' && !match) match = argv[i];
        else {
            fprintf(stderr, "bench/deepseek: unknown argument '%s'; usage: deepseek [--real] [--long] [MATCH]\n",
                    argv[i]);
            return 2;
        }
    }
    for (int i = 0; i < NROWS; i++) /* a `vs` must name an earlier row */
        if (ROWS[i].vs && (find_row(ROWS[i].vs) < 0 || find_row(ROWS[i].vs) >= i)) {
            fprintf(stderr, "bench/deepseek: row '%s' compares with '%s', which is not an earlier row\n", ROWS[i].label,
                    ROWS[i].vs);
            return 2;
        }
    bench_host_print(stdout);
    static run_result results[NROWS];
    const char *group = NULL;
    for (int i = 0; i < NROWS; i++) {
        const bench_row *row = &ROWS[i];
        if ((row->flags & ROW_LONG) && !lng) continue;
        if (match && !strstr(row->label, match) && !strstr(row->group, match)) continue;
        if (!group || strcmp(group, row->group)) {
            group = row->group;
            printf("\n%s\n", group);
            printf("%-44s %12s %9s %8s  %-18s %-22s %14s\n", "run", "peak/dev", "step (s)", "/vs", "collective", "axes",
                   "bytes/dev/step");
            for (int k = 0; k < 137; k++) putchar('-');
            putchar('\n');
        }
        run(row, false, &results[i]);
        print_result(row, &results[i], row->vs ? &results[find_row(row->vs)] : NULL);
        if (real && (row->flags & ROW_REAL) && !results[i].b.refused) {
            run_result *r = malloc(sizeof *r);
            run(row, true, r);
            printf("%-44s   a real step %s these dry figures\n", "",
                   r->b.refused                   ? "was refused; unlike"
                   : same_figures(r, &results[i]) ? "equals"
                                                  : "DIFFERS FROM");
            free(r);
        }
        fflush(stdout);
    }
    return 0;
}

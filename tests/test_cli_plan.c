/* test_cli_plan.c — `shardsim plan` on the built-in small Llama (configs/small.yml) over 2 and 4
 * simulated devices with the v5p profile: the enumeration counts against a count by hand, the
 * rejection reasons, the top candidate's command line run through `train` (the same step time and
 * peak), every ranked candidate's figures against train's dry run of its command, determinism, and bad input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/plan.h"
#include "tests/cli_capture.h"

typedef cli_capture result;

/* The base rules' mesh axes that configs/plan.yml varies for a dense model: data, stage, fsdp,
 * fsdp_transpose, context, tensor, tensor_sequence (expert only with experts; sequence and
 * tensor_transpose exist in the legacy rules only). */
enum { DENSE_AXES = 7 };

#define SMALL "configs/small.yml", "hardware_profile=v5p"
/* one rule set, one mode, one remat policy, no accumulation: meshes x ZeRO-1 x microbatches only */
#define FIXED "custom_mesh_and_rule=", "shard_mode=auto", "remat_policy=full", "gradient_accumulation_steps=1"

static result plan(int argc, const char **argv) { return cli_capture_run(cli_plan, argc, argv); }

static long long after(const char *text, const char *label)
{
    const char *p = strstr(text, label);
    if (!p) return -1;
    /* the number just before the label */
    while (p > text && p[-1] == ' ') p--;
    const char *q = p;
    while (q > text && q[-1] >= '0' && q[-1] <= '9') q--;
    return q < p ? atoll(q) : -1;
}

static void test_count_meshes(void **state)
{
    (void)state;
    /* 4 devices over 3 axes, at most 2 split: (4,1,1) in 3 places, (2,2,1) in 3 -> 6 */
    assert_int_equal(cli_plan_count_meshes(4, 3, 2), 6);
    /* 8 over 3 axes: one axis 8 (3), two axes 2x4 or 4x2 (3 pairs x 2 = 6), three axes 2x2x2 (1) */
    assert_int_equal(cli_plan_count_meshes(8, 3, 2), 9);
    assert_int_equal(cli_plan_count_meshes(8, 3, 3), 10);
    /* a prime: one axis holds it */
    assert_int_equal(cli_plan_count_meshes(7, 4, 2), 4);
    assert_int_equal(cli_plan_count_meshes(1, 5, 2), 1);
}

/* 2 devices: each of the 7 axes holds both (7 meshes); data=2 adds a ZeRO-1 structure (8
 * structures); stage=2 has two microbatch counts (stages x 1, x 2): 9 candidates. */
static void test_enumeration_two_devices(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=2", FIXED};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    assert_int_equal(after(r.out, "candidates considered"), 9);
    assert_int_equal(after(r.out, "structures ("), 8);
    assert_int_equal(after(r.out, "meshes x"), DENSE_AXES);
    /* every candidate of the small model fits in v5p's HBM, none is refused: all 9 ranked */
    assert_int_equal(after(r.out, "fit and are ranked"), 9);
    assert_int_equal(after(r.out, "rejected by the checks"), 0);
    cli_capture_free(&r);
}

/* plan_global_batch: 8 rows over 2 devices are 4 per device on every command line */
static void test_global_batch(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=2", FIXED, "plan_global_batch=8", "plan_top=1"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "8 rows x 64 tokens per step"));
    assert_non_null(strstr(r.out, " per_device_batch_size=4"));
    cli_capture_free(&r);
}

/* 4 devices, at most 2 split axes: 7 meshes with one axis of 4 and 21 pairs of axes of 2 (28).
 * data=2 with fsdp=2 or fsdp_transpose=2 under ZeRO-1 is refused as MaxText refuses it; stage=2
 * with context=2 is refused (not implemented). */
static void test_rejection_reasons(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=4", FIXED, "plan_dry_runs=4"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    assert_int_equal(after(r.out, "meshes x"), cli_plan_count_meshes(4, DENSE_AXES, 2));
    assert_int_equal(after(r.out, "meshes x"), 28);
    const char *z = strstr(r.out, "shard_optimizer_over_data=true (ZeRO-1) cannot be combined with FSDP");
    assert_non_null(z);
    /* its count: the number on the line */
    const char *line = z;
    while (line > r.out && line[-1] != '\n') line--;
    assert_int_equal(atoll(line), 2);
    assert_non_null(strstr(r.out, "with pipeline parallelism is not implemented yet"));
    /* the budget is said */
    assert_non_null(strstr(r.out, "beyond the budget plan_dry_runs=4"));
    cli_capture_free(&r);
}

/* Splits "$ shardsim train w1 w2 ..." (the line after `marker`) into words. */
static int command_words(const char *text, const char *marker, char *buf, size_t cap, const char **w, int maxw)
{
    const char *p = strstr(text, marker);
    if (!p) return -1;
    p = strstr(p, "$ shardsim train ");
    if (!p) return -1;
    p += strlen("$ shardsim train ");
    size_t n = strcspn(p, "\n");
    if (n >= cap) return -1;
    memcpy(buf, p, n);
    buf[n] = '\0';
    int k = 0;
    for (char *t = strtok(buf, " "); t && k < maxw; t = strtok(NULL, " ")) w[k++] = t;
    return k;
}

static double number_after(const char *text, const char *label)
{
    const char *p = strstr(text, label);
    return p ? atof(p + strlen(label)) : -1;
}

/* The top candidate's line runs as is with train (a dry run: dry_run=true is on the line), and
 * train's modelled step time and peak are the plan's (the top one is dry-run in full). */
static void test_top_command_runs(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=4", "custom_mesh_and_rule=", "plan_dry_runs=8", "plan_top=1"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "[full dry run]"));
    char buf[4096];
    const char *w[64];
    int n = command_words(r.out, "  #1 ", buf, sizeof buf, w, 64);
    assert_true(n > 0);
    result t = cli_capture_run(cli_train, n, w);
    assert_int_equal(t.rc, 0);
    double plan_ms = number_after(strstr(r.out, "  #1 "), "  #1 ");
    double train_ms = number_after(strstr(t.out, "estimated step time"), "  step ");
    assert_true(plan_ms > 0);
    assert_float_equal(plan_ms, train_ms, 0.0005 + 1e-9);
    cli_capture_free(&t);
    cli_capture_free(&r);
}

/* A 6-layer model: each ranked candidate's figures (a dry run of one stack simulates three layers and
 * accounts the rest, model_layers_bounded) are those `train` prints for its command line: the step
 * time and the peak.  (That the bounded dry run equals one simulating every layer is
 * test_models_dryrun_bound's.) */
static void test_figures_match_train(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "base_num_decoder_layers=6", "num_devices=2", FIXED, "plan_verify=0", "plan_top=9"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    int checked = 0;
    for (int k = 1; k <= 9; k++) {
        char marker[16];
        snprintf(marker, sizeof marker, "  #%d ", k);
        const char *blk = strstr(r.out, marker);
        if (!blk) break;
        char buf[4096];
        const char *w[64];
        int n = command_words(r.out, marker, buf, sizeof buf, w, 64);
        result t = cli_capture_run(cli_train, n, w);
        assert_int_equal(t.rc, 0);
        if (fabs(number_after(blk, marker) - number_after(strstr(t.out, "estimated step time"), "  step ")) > 0.0005)
            fail_msg("%s: plan %.3f ms, train %.3f ms", buf, number_after(blk, marker),
                     number_after(strstr(t.out, "estimated step time"), "  step "));
        /* the peak as both print it */
        char want[32] = "", got[32] = "";
        sscanf(strstr(blk, "peak ") + 5, "%31[^p]", want);
        const char *row = strstr(t.out, "\n     0 ");
        assert_non_null(row);
        const char *end = strchr(row + 1, '\n'), *q = end;
        for (int sp = 0; sp < 2; q--)
            if (q[-1] == ' ' && q[0] != ' ') sp++;
        snprintf(got, sizeof got, "%.*s ", (int)(end - q - 1), q + 1);
        assert_string_equal(want, got);
        assert_float_equal(number_after(blk, marker), number_after(strstr(t.out, "estimated step time"), "  step "),
                           0.0005 + 1e-9);
        cli_capture_free(&t);
        checked++;
    }
    assert_true(checked >= 5);
    cli_capture_free(&r);
}

/* Everything but the wall-clock line is the same on a second run. */
static void strip_timing(char *s)
{
    char *p = strstr(s, "\ndry runs: ");
    if (p) {
        char *e = strchr(p + 1, '\n');
        memmove(p, e ? e : p + strlen(p), strlen(e ? e : p + strlen(p)) + 1);
    }
}

static void test_deterministic(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=4", "custom_mesh_and_rule=", "plan_dry_runs=10", "plan_verify=0"};
    result a = plan(sizeof argv / sizeof argv[0], argv), b = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(a.rc, 0);
    assert_int_equal(b.rc, 0);
    strip_timing(a.out);
    strip_timing(b.out);
    assert_string_equal(a.out, b.out);
    cli_capture_free(&a);
    cli_capture_free(&b);
}

static void test_explain(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=2", FIXED, "--explain", "2"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "why #2 ranks #2 of 9"));
    assert_non_null(strstr(r.out, "against #1 (the best"));
    assert_non_null(strstr(r.out, "against #3 (the one below"));
    cli_capture_free(&r);
}

#define EXPECT_BAD(argv, needle) expect_bad(argv, (int)(sizeof argv / sizeof argv[0]), needle)
static void expect_bad(const char **argv, int argc, const char *needle)
{
    result r = plan(argc, argv);
    if (r.rc != 2) fail_msg("exit %d for '%s ...' (wanted 2): %s%s", r.rc, argv[argc - 1], r.err, r.out);
    if (!strstr(r.err, needle)) fail_msg("stderr lacks '%s': %s", needle, r.err);
    assert_string_equal(r.out, "");
    cli_capture_free(&r);
}

static void test_bad_input(void **state)
{
    (void)state;
    const char *topo[] = {SMALL, "compile_topology=v5p-7", "compile_topology_num_slices=1"};
    EXPECT_BAD(topo, "v5p-7");
    const char *zero[] = {SMALL, "num_devices=2", "per_device_batch_size=0"};
    EXPECT_BAD(zero, "per_device_batch_size=0");
    const char *nodev[] = {"configs/small.yml"};
    EXPECT_BAD(nodev, "plan needs the devices");
    const char *noprof[] = {"configs/small.yml", "num_devices=2"};
    EXPECT_BAD(noprof, "hardware profile");
    const char *noexp[] = {SMALL, "num_devices=2", "--explain"};
    EXPECT_BAD(noexp, "--explain needs");
    const char *badexp[] = {SMALL, "num_devices=2", "explain_candidate=-1"};
    EXPECT_BAD(badexp, "explain_candidate");
}

/* explain_candidate beyond the ranked ones: the plan is printed, then exit 2 naming the key */
static void test_explain_out_of_range(void **state)
{
    (void)state;
    const char *argv[] = {SMALL, "num_devices=2", FIXED, "explain_candidate=50"};
    result r = plan(sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "explain_candidate=50: only 9 candidates are ranked"));
    cli_capture_free(&r);
}

/* remat_policy=none recomputes a scanned stack as full does (MaxText's get_remat_policy gives both
 * policy None), so plan.yml leaves it out; with scan_layers=false MaxText 0.2.5 wraps no layer under
 * none, which keeps every activation, and plan tries it as a fourth policy beside plan.yml's three
 * (full, save_dot_except_mlp, minimal): 4/3 of the candidates.  0.2.0 wraps every block: no change. */
static void test_none_when_unscanned(void **state)
{
    (void)state;
    const char *base[] = {SMALL, "num_devices=2", "custom_mesh_and_rule=", "shard_mode=auto",
                          "gradient_accumulation_steps=1"};
    const char *unscanned[] = {SMALL,
                               "num_devices=2",
                               "custom_mesh_and_rule=",
                               "shard_mode=auto",
                               "gradient_accumulation_steps=1",
                               "scan_layers=false"};
    result a = plan(sizeof base / sizeof base[0], base), b = plan(sizeof unscanned / sizeof unscanned[0], unscanned);
    assert_int_equal(a.rc, 0);
    assert_int_equal(b.rc, 0);
    long long na = after(a.out, "candidates considered"), nb = after(b.out, "candidates considered");
    assert_true(na > 0);
    assert_int_equal(nb * 3, na * 4);
    assert_null(strstr(a.out, "remat=none"));
    assert_non_null(strstr(b.out, "remat=none"));
    cli_capture_free(&a);
    cli_capture_free(&b);
    const char *old[] = {SMALL, "num_devices=2", "shard_mode=auto", "gradient_accumulation_steps=1",
                         "maxtext_release=0.2.0"};
    const char *old_unscanned[] = {SMALL,
                                   "num_devices=2",
                                   "shard_mode=auto",
                                   "gradient_accumulation_steps=1",
                                   "maxtext_release=0.2.0",
                                   "scan_layers=false"};
    a = plan(sizeof old / sizeof old[0], old);
    b = plan(sizeof old_unscanned / sizeof old_unscanned[0], old_unscanned);
    assert_int_equal(a.rc, 0);
    assert_int_equal(b.rc, 0);
    assert_true(after(a.out, "candidates considered") > 0);
    assert_int_equal(after(b.out, "candidates considered"), after(a.out, "candidates considered"));
    assert_null(strstr(b.out, "remat=none"));
    cli_capture_free(&a);
    cli_capture_free(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_count_meshes),        cmocka_unit_test(test_enumeration_two_devices),
        cmocka_unit_test(test_global_batch),        cmocka_unit_test(test_rejection_reasons),
        cmocka_unit_test(test_top_command_runs),    cmocka_unit_test(test_figures_match_train),
        cmocka_unit_test(test_deterministic),       cmocka_unit_test(test_explain),
        cmocka_unit_test(test_bad_input),           cmocka_unit_test(test_explain_out_of_range),
        cmocka_unit_test(test_none_when_unscanned),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

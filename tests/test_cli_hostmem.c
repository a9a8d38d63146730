/* test_cli_hostmem.c — the host-memory check before a real run
 * (cli/hostmem.h), with the available figure injected through
 * SHARDSIM_HOST_MEMORY_BYTES:
 *   - the comparison: a need fits exactly at its total, not one byte below;
 *   - train refuses (exit 2, nothing trained) a run below a hand-derived lower
 *     bound of its need — one device holds the parameters, their gradients
 *     and both Adam moments: 16 bytes per parameter — with the figures and
 *     what to change; runs with room; a dry run is never refused;
 *   - remat's forward values kept for the recomputation (remat_recompute) add exactly their
 *     hand-counted bytes to the need; auto recomputes (and says so) where only they do not fit,
 *     never is refused there;
 *   - parity refuses a configuration that cannot fit before running it;
 *   - a malformed override is an error naming it;
 *   - without the override the machine's figure is read (Linux). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/hostmem.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

/* tests/data/small-llama.yml (emb 32, 4 heads of 8, mlp 64, 2 layers, vocab 256), two rows per device,
 * two steps */
#define SMALL SMALL_LLAMA_YML, "per_device_batch_size=2", "steps=2"

/* Parameters of SMALL: embedding 256x32, per layer q,k,v,o 4 x (32x4x8), wi_0, wi_1, wo 3 x (32x64), two
 * norms of 32; final norm 32; logits 32x256. */
static const uint64_t SMALL_PARAMS = 256 * 32 + 2 * (4 * 32 * 4 * 8 + 3 * 32 * 64 + 2 * 32) + 32 + 32 * 256;

static void test_compare(void **state)
{
    (void)state;
    cli_host_need n = {2, 3000, 2000, 375, 100, 0};
    assert_int_equal(cli_host_need_total(&n), 3475);
    assert_int_equal(cli_host_memory_check(&n, 3475, "test"), SIM_OK);
    assert_int_equal(cli_host_memory_check(&n, 3474, "test"), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "(test)"));
    assert_non_null(strstr(sim_errmsg(), "2 devices"));
    assert_non_null(strstr(sim_errmsg(), "dry_run=true"));
}

static cli_capture train_with(const char *avail, const char *extra)
{
    setenv("SHARDSIM_HOST_MEMORY_BYTES", avail, 1);
    /* `extra` is one key=value or two separated by a space */
    char first[128];
    snprintf(first, sizeof first, "%s", extra);
    char *sp = strchr(first, ' ');
    if (sp) *sp = '\0';
    const char *a[] = {SMALL, first, sp ? sp + 1 : NULL};
    int n = (int)(sizeof a / sizeof a[0]) - (sp ? 0 : 1);
    cli_capture r = cli_capture_run(cli_train, n, a);
    unsetenv("SHARDSIM_HOST_MEMORY_BYTES");
    return r;
}

static void test_train_refused(void **state)
{
    (void)state;
    char below[32];
    snprintf(below, sizeof below, "%llu", (unsigned long long)(16 * SMALL_PARAMS - 1));
    cli_capture r = train_with(below, "shard_mode=auto");
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "host memory"));
    assert_non_null(strstr(r.err, "SHARDSIM_HOST_MEMORY_BYTES"));
    assert_non_null(strstr(r.err, "1 device holding"));
    assert_non_null(strstr(r.err, "dry_run=true"));
    assert_null(strstr(r.out, "\n     0 ")); /* no step ran */
    cli_capture_free(&r);
    r = train_with("100000000000", "shard_mode=auto");
    if (r.rc) fail_msg("with room: %s", r.err);
    assert_non_null(strstr(r.out, "\n     1 "));
    cli_capture_free(&r);
    r = train_with("1", "dry_run=true");
    if (r.rc) fail_msg("dry run: %s", r.err);
    cli_capture_free(&r);
    r = train_with("12GB", "shard_mode=auto");
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "SHARDSIM_HOST_MEMORY_BYTES=12GB"));
    cli_capture_free(&r);
}

/* Runs SMALL with `avail` bytes of host memory and the word `extra`. */
static cli_capture train_avail(uint64_t avail, const char *extra)
{
    char a[32];
    snprintf(a, sizeof a, "%llu", (unsigned long long)avail);
    return train_with(a, extra);
}

/* The fewest bytes of host memory SMALL trains in with the word `extra` (bisection on the exit code). */
static uint64_t least_fitting(const char *extra)
{
    uint64_t lo = 0, hi = 1ull << 32; /* lo is refused, hi fits */
    cli_capture r = train_avail(hi, extra);
    if (r.rc) fail_msg("%s with 4 GiB: %s", extra, r.err);
    cli_capture_free(&r);
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        r = train_avail(mid, extra);
        if (r.rc != 0 && r.rc != 2) fail_msg("%s: exit %d: %s", extra, r.rc, r.err);
        if (r.rc == 0) hi = mid;
        else lo = mid;
        cli_capture_free(&r);
    }
    return hi;
}

/* remat's values kept for the recomputation (remat_recompute) are in the need: SMALL's one device keeps,
 * per layer, the products and attention of its forward in float32 (B=2 rows of T=16 tokens, width 32, 4
 * heads, MLP 64; 16 tokens is dot-product attention, which keeps its probabilities):
 *   q, k, v, attention out, out projection: 5 x B T 32; wi_0, wi_1: 2 x B T 64; wo: B T 32;
 *   probabilities: B x 4 x T x T. */
static void test_remat_values(void **state)
{
    (void)state;
    const uint64_t B = 2, T = 16, per_layer = 6 * B * T * 32 + 2 * B * T * 64 + B * 4 * T * T;
    const uint64_t values = 2 * per_layer * sizeof(float);
    uint64_t always = least_fitting("remat_recompute=always"), never = least_fitting("remat_recompute=never");
    assert_int_equal(never - always, values);
    /* auto: with room for the values they are kept (nothing said), else the layers are recomputed and
     * one line says so */
    cli_capture r = train_avail(never, "remat_recompute=auto");
    if (r.rc) fail_msg("auto with room: %s", r.err);
    assert_null(strstr(r.err, "remat_recompute"));
    cli_capture_free(&r);
    r = train_avail(never - 1, "remat_recompute=auto");
    if (r.rc) fail_msg("auto without room for the values: %s", r.err);
    assert_non_null(strstr(r.err, "shardsim: remat_recompute=auto:"));
    assert_non_null(strstr(r.err, "computed again"));
    assert_non_null(strstr(r.out, "\n     1 "));
    cli_capture_free(&r);
    /* never: refused, the values named with the way out */
    r = train_avail(never - 1, "remat_recompute=never");
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "remat_recompute=always computes them again"));
    cli_capture_free(&r);
    /* remat_policy=none over unscanned layers (MaxText 0.2.5 calls them without jax.checkpoint)
     * recomputes nothing and keeps nothing on the host, even where nothing else fits */
    r = train_avail(least_fitting("remat_policy=none scan_layers=false"), "remat_policy=none scan_layers=false");
    assert_int_equal(r.rc, 0);
    assert_null(strstr(r.err, "remat_recompute"));
    cli_capture_free(&r);
    /* over scanned layers none is full remat: it keeps the values for the recomputation as full does */
    assert_int_equal(least_fitting("remat_policy=none"), least_fitting("remat_policy=full"));
}

/* parity checks each configuration before running it (with the gradient copies it keeps) */
static void test_parity_refused(void **state)
{
    (void)state;
    setenv("SHARDSIM_HOST_MEMORY_BYTES", "1000", 1);
    const char *a[] = {SMALL, "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2"};
    cli_capture r = cli_capture_run(cli_cmd_parity, (int)(sizeof a / sizeof a[0]), a);
    unsetenv("SHARDSIM_HOST_MEMORY_BYTES");
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "host memory"));
    assert_non_null(strstr(r.err, "(parity configuration '1 device auto')"));
    assert_null(strstr(r.out, "[2/2]"));
    cli_capture_free(&r);
}

static void test_machine_figure(void **state)
{
    (void)state;
    unsetenv("SHARDSIM_HOST_MEMORY_BYTES");
    uint64_t b = 0;
    char src[128];
    int known = 0;
    assert_int_equal(cli_host_memory_available(&b, src, sizeof src, &known), SIM_OK);
    assert_true(known);
    assert_true(b > 0);
    assert_non_null(strstr(src, "/"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_compare),
        cmocka_unit_test(test_train_refused),
        cmocka_unit_test(test_remat_values),
        cmocka_unit_test(test_parity_refused),
        cmocka_unit_test(test_machine_figure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

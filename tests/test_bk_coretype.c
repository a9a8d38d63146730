/* test_bk_coretype.c — the OpenBLAS kernel selection: the pure choice (CPU features x detected core
 * x failed cores -> core), the start-up check and its injected failure, and end to end the built
 * `shardsim` started from a pretended generic (Prescott) detection: it re-executes itself with the
 * core the features allow, reports it in run.json, and computes bit for bit what a run started
 * directly with that core computes; an injected check failure makes it fall back one core. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blas_kernels/bk_coretype.h"
#include "config/json.h"
#include "tests/helpers.h"

char *openblas_get_corename(void);

static bk_cpu_features feats(const char *what, bool amd)
{
    bk_cpu_features f = {0};
    f.amd = amd;
    int level = !strcmp(what, "sse3")     ? 1
                : !strcmp(what, "sse42")  ? 2
                : !strcmp(what, "avx")    ? 3
                : !strcmp(what, "avx2")   ? 4
                : !strcmp(what, "avx512") ? 5
                : !strcmp(what, "bf16")   ? 6
                                          : 0;
    f.sse3 = level >= 1;
    f.sse42 = level >= 2;
    f.avx = level >= 3;
    f.avx2 = f.fma = level >= 4;
    f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = level >= 5;
    f.avx512bf16 = level >= 6;
    return f;
}

static void expect_choice(const char *cpu, bool amd, const char *detected, const char *failed, const char *want)
{
    bk_cpu_features f = feats(cpu, amd);
    const char *got = bk_coretype_choose(&f, detected, failed);
    if (want == NULL ? got != NULL : (got == NULL || strcmp(got, want)))
        fail_msg("cpu %s%s, detected %s, failed '%s': got %s, expected %s", cpu, amd ? " (AMD)" : "", detected,
                 failed ? failed : "", got ? got : "NULL", want ? want : "NULL");
}

static void test_levels(void **state)
{
    (void)state;
    assert_int_equal(bk_coretype_level("Prescott"), 1);
    assert_int_equal(bk_coretype_level("prescott"), 1); /* OPENBLAS_CORETYPE is case-insensitive */
    assert_int_equal(bk_coretype_level("Nehalem"), 2);
    assert_int_equal(bk_coretype_level("Sandybridge"), 3);
    assert_int_equal(bk_coretype_level("Haswell"), 4);
    assert_int_equal(bk_coretype_level("Zen"), 4);
    assert_int_equal(bk_coretype_level("SKYLAKEX"), 5);
    assert_int_equal(bk_coretype_level("Cooperlake"), 6);
    assert_int_equal(bk_coretype_level("NoSuchLake"), -1);
    assert_int_equal(bk_coretype_level(NULL), -1);
}

static void test_choose_upgrades_a_generic_detection(void **state)
{
    (void)state;
    /* the machine: AVX-512 Xeon, OpenBLAS 0.3.21 falls back to Prescott */
    expect_choice("avx512", false, "Prescott", NULL, "SkylakeX");
    expect_choice("bf16", false, "Prescott", NULL, "Cooperlake");
    expect_choice("bf16", true, "Prescott", "", "Cooperlake");
    expect_choice("avx2", false, "Prescott", NULL, "Haswell");
    expect_choice("avx2", true, "Prescott", NULL, "Zen"); /* AMD's AVX2 level is OpenBLAS's Zen */
    expect_choice("avx", false, "Core2", NULL, "Sandybridge");
    expect_choice("sse42", false, "Prescott", NULL, "Nehalem");
    expect_choice("avx512", true, "Zen", NULL, "SkylakeX"); /* Zen 4 seen as Zen: AVX-512 kernels */
}

static void test_choose_keeps_a_good_detection(void **state)
{
    (void)state;
    expect_choice("bf16", true, "Cooperlake", NULL, "Cooperlake");
    expect_choice("avx2", false, "Haswell", NULL, "Haswell");
    expect_choice("avx2", true, "Haswell", NULL, "Haswell");    /* same level: OpenBLAS's choice stands */
    expect_choice("avx2", false, "SkylakeX", NULL, "SkylakeX"); /* above what we see: not ours to lower */
    expect_choice("sse3", false, "Prescott", NULL, "Prescott");
    expect_choice("none", false, "Katmai", NULL, "Katmai");
    expect_choice("avx512", false, "FutureLake", NULL, "FutureLake"); /* a newer OpenBLAS knows better */
}

static void test_choose_skips_failed_cores(void **state)
{
    (void)state;
    expect_choice("bf16", false, "Prescott", "Cooperlake", "SkylakeX");
    expect_choice("bf16", false, "Prescott", "Cooperlake,SkylakeX", "Haswell");
    expect_choice("bf16", false, "Prescott", "cooperlake,skylakex,haswell,sandybridge,nehalem", "Prescott");
    /* OpenBLAS's own choice failed too: the best lower core */
    expect_choice("bf16", false, "Prescott", "Cooperlake,SkylakeX,Haswell,Sandybridge,Nehalem,Prescott", NULL);
    expect_choice("bf16", true, "Cooperlake", "Cooperlake", "SkylakeX");
    expect_choice("avx2", false, "Haswell", "Haswell", "Sandybridge");
    expect_choice("avx512", false, "FutureLake", "FutureLake", "SkylakeX");
    /* a name that only starts like a failed one is not failed */
    expect_choice("avx512", false, "Prescott", "Skylake", "SkylakeX");
}

static void test_check_and_injected_failure(void **state)
{
    (void)state;
    /* this process's kernels were checked at start-up and pass again now */
    const bk_coretype_info *k = bk_coretype_current();
    assert_true(k->checked);
    assert_string_equal(k->core, openblas_get_corename());
    assert_true(bk_coretype_check());
    setenv("SHARDSIM_BLAS_FAIL_CHECK", openblas_get_corename(), 1);
    assert_false(bk_coretype_check());
    setenv("SHARDSIM_BLAS_FAIL_CHECK", "NoSuchLake", 1);
    assert_true(bk_coretype_check());
    unsetenv("SHARDSIM_BLAS_FAIL_CHECK");
}

/* ---- end to end: the built shardsim ---------------------------------------------------------- */

#define MODEL                                                                                                          \
    "train model_name=llama2-7b override_model_config=true base_num_decoder_layers=1 base_emb_dim=64 "                 \
    "base_num_query_heads=2 base_num_kv_heads=2 head_dim=32 base_mlp_dim=128 vocab_size=256 max_target_length=32 "     \
    "per_device_batch_size=1 steps=3 checkpoint_period=3"

/* build/shardsim next to this test binary (build/tests/test_bk_coretype). */
static void shardsim_path(char *out, size_t cap)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(n > 0);
    self[n] = '\0';
    snprintf(out, cap, "%s/../shardsim", dirname(self));
    if (access(out, X_OK) != 0) fail_msg("%s is not built (make builds it before the tests)", out);
}

/* Runs shardsim with `env` (assignments) in a clean BLAS environment into a fresh directory;
 * returns its stderr text (caller frees) and the directory in dir. */
static char *run_shardsim(const char *env, char dir[64])
{
    char bin[PATH_MAX + 16], cmd[2 * PATH_MAX + 1024];
    shardsim_path(bin, sizeof bin);
    snprintf(dir, 64, "/tmp/shardsim_coretype_XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd,
             "env -u OPENBLAS_CORETYPE -u SHARDSIM_BLAS_SELECTION -u SHARDSIM_BLAS_PRETEND_DETECTED "
             "-u SHARDSIM_BLAS_FAIL_CHECK %s %s " MODEL " output_dir=%s checkpoint_dir=%s/ck 2>&1 >/dev/null",
             env, bin, dir, dir);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, len = 0;
    char *err = calloc(cap, 1);
    size_t got;
    while ((got = fread(err + len, 1, cap - 1 - len, p)) > 0) len += got;
    int rc = pclose(p);
    if (rc != 0) fail_msg("%s\nexit %d: %s", cmd, rc, err);
    return err;
}

static void expect_kernels(const char *dir, const char *core, const char *summary)
{
    cfg_json *run = helper_read_json(dir, "run.json");
    const cfg_json *k = cfg_json_get(run, "blas_kernels");
    assert_non_null(k);
    assert_string_equal(cfg_json_get(k, "core")->str, core);
    assert_string_equal(cfg_json_get(k, "summary")->str, summary);
    cfg_json_free(run);
}

/* Same bits: the trained parameters (checkpoint after the last of 3 steps, step 2) and every step's loss. */
static void expect_same_results(const char *a, const char *b)
{
    size_t na, nb;
    char *ca = helper_read_in(a, "ck/step_2.safetensors", &na), *cb = helper_read_in(b, "ck/step_2.safetensors", &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(ca, cb, na);
    free(ca), free(cb);
    cfg_json *ma = helper_read_json(a, "metrics.json"), *mb = helper_read_json(b, "metrics.json");
    const cfg_json *sa = cfg_json_get(ma, "steps"), *sb = cfg_json_get(mb, "steps");
    assert_int_equal(sa->n, 3);
    assert_int_equal(sb->n, 3);
    for (int i = 0; i < 3; i++) /* the number's text: 17 significant digits, exact for a float */
        assert_string_equal(cfg_json_get(&sa->items[i], "loss")->str, cfg_json_get(&sb->items[i], "loss")->str);
    cfg_json_free(ma), cfg_json_free(mb);
}

static void test_end_to_end_upgrade_from_generic(void **state)
{
    (void)state;
    bk_cpu_features f;
    bk_cpu_features_detect(&f);
    const char *best = bk_coretype_choose(&f, "Prescott", NULL);
    assert_non_null(best);
    if (!strcmp(best, "Prescott")) skip(); /* a CPU without anything above SSE3: nothing to upgrade */
    char up[64], direct[64], sum[256];
    char *err = run_shardsim("OPENBLAS_CORETYPE=Prescott SHARDSIM_BLAS_PRETEND_DETECTED=1", up);
    assert_string_equal(err, ""); /* an upgrade is silent: the config box and run.json tell it */
    free(err);
    snprintf(sum, sizeof sum, "%s (OpenBLAS detected Prescott; chosen from CPU features; checked)", best);
    expect_kernels(up, best, sum);
    char env[64];
    snprintf(env, sizeof env, "OPENBLAS_CORETYPE=%s", best);
    free(run_shardsim(env, direct));
    snprintf(sum, sizeof sum, "%s (OPENBLAS_CORETYPE set by the user; checked)", best);
    expect_kernels(direct, best, sum);
    expect_same_results(up, direct);
    helper_rm_rf(up), helper_rm_rf(direct);
}

static void test_end_to_end_fallback_when_check_fails(void **state)
{
    (void)state;
    bk_cpu_features f;
    bk_cpu_features_detect(&f);
    const char *best = bk_coretype_choose(&f, "Prescott", NULL);
    if (!strcmp(best, "Prescott")) skip();
    const char *next = bk_coretype_choose(&f, "Prescott", best);
    char dir[64], env[160], sum[256];
    snprintf(env, sizeof env, "OPENBLAS_CORETYPE=Prescott SHARDSIM_BLAS_PRETEND_DETECTED=1 SHARDSIM_BLAS_FAIL_CHECK=%s",
             best);
    char *err = run_shardsim(env, dir);
    char note[160];
    snprintf(note, sizeof note, "OpenBLAS's %s kernels fail the start-up sgemm check on this CPU; falling back to %s",
             best, next);
    if (!strstr(err, note)) fail_msg("stderr lacks \"%s\": %s", note, err);
    free(err);
    snprintf(sum, sizeof sum, "%s (OpenBLAS detected Prescott; %s failed the start-up check; checked)", next, best);
    expect_kernels(dir, next, sum);
    helper_rm_rf(dir);
}

/* The benchmark header's CPU line, from fixed /proc/cpuinfo texts: the model name and the speed flags
 * in a fixed order, whole words only (avx512fx is not avx512f); the live one names the model. */
static void test_cpu_describe(void **state)
{
    (void)state;
    char buf[512];
    const char *spr = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
                      "flags\t\t: fpu sse4_2 avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
                      "processor\t: 1\nmodel name\t: second CPU\n";
    assert_string_equal(bk_cpu_describe_cpuinfo(spr, buf, sizeof buf),
                        "Intel(R) Xeon(R) Platinum 8481C; sse4_2 fma avx2 avx512f avx512bw avx512_bf16 amx_tile "
                        "amx_bf16 amx_int8");
    assert_string_equal(bk_cpu_describe_cpuinfo("model name : Old\nflags : fpu sse2 avx512fx xavx2\n", buf, sizeof buf),
                        "Old; no AVX");
    assert_string_equal(bk_cpu_describe_cpuinfo("", buf, sizeof buf), "unknown model; no flags line");
    char small[16];
    bk_cpu_describe_cpuinfo(spr, small, sizeof small); /* truncated, terminated */
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_true(strlen(bk_cpu_describe(buf, sizeof buf)) > 0);
    assert_non_null(strchr(buf, ';'));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_levels),
        cmocka_unit_test(test_cpu_describe),
        cmocka_unit_test(test_choose_upgrades_a_generic_detection),
        cmocka_unit_test(test_choose_keeps_a_good_detection),
        cmocka_unit_test(test_choose_skips_failed_cores),
        cmocka_unit_test(test_check_and_injected_failure),
        cmocka_unit_test(test_end_to_end_upgrade_from_generic),
        cmocka_unit_test(test_end_to_end_fallback_when_check_fails),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

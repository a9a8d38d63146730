/* test_cli_install.c — the built program finds its data (configs/) when it is
 * installed as `make install` lays it out (<prefix>/bin/shardsim beside
 * <prefix>/share/shardsim/configs), and a copy without its data says how to
 * point it at configs/ instead of failing on a bare missing file.
 *
 * The program is run as a child process (its data lookup starts from
 * /proc/self/exe), from a working directory that holds no configs/.
 *
 * Also: the top-level ./shardsim link names the normal build (build/shardsim) and a sanitizer
 * build leaves it alone.  That is checked on make's dry run of `make asan` / `make ubsan` (the
 * commands their sub-make would run, printed in a fraction of a second, no sanitizer build) and on
 * the link itself where one exists, so the asan build's own run of this test sees the link as
 * `make asan` left it. */
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/helpers.h"

static char repo[1024];     /* the repository root (the test runs from it) */
static const char *program; /* the shardsim of this test's own build (build/ or build/asan/ ...) */
static char prefix[256];    /* a temporary install prefix */

static void run(const char *cmd, int *rc, char *out, size_t cap) { *rc = helper_run_shell(cmd, out, cap); }

static int setup(void **state)
{
    (void)state;
    if (!getcwd(repo, sizeof repo)) return -1;
    program = helper_program();
    if (!program) {
        fprintf(stderr, "test_cli_install: no program beside this test's build: build it first\n");
        return -1;
    }
    snprintf(prefix, sizeof prefix, "/tmp/shardsim-install-test-%d", (int)getpid());
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "rm -rf %s && mkdir -p %s/bin %s/share/shardsim %s/cwd && cp %s %s/bin/ && "
             "cp -R %s/configs %s/share/shardsim/configs",
             prefix, prefix, prefix, prefix, program, prefix, repo, prefix);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", prefix);
    return system(cmd) == 0 ? 0 : -1;
}

/* A dry run of a small model from a directory without configs/: the data
 * comes from <prefix>/share/shardsim/configs. */
static void test_installed_program_finds_its_data(void **state)
{
    (void)state;
    char cmd[8192], out[1 << 16];
    int rc;
    snprintf(cmd, sizeof cmd,
             "cd %s/cwd && env -u SHARDSIM_CONFIGS %s/bin/shardsim train dry_run=true steps=1 "
             "base_num_decoder_layers=1 base_emb_dim=64 base_num_query_heads=2 base_num_kv_heads=2 head_dim=32 "
             "base_mlp_dim=128 vocab_size=256 max_target_length=32 per_device_batch_size=1 2>&1",
             prefix, prefix);
    run(cmd, &rc, out, sizeof out);
    if (rc != 0) fprintf(stderr, "%s\n", out);
    assert_int_equal(rc, 0);
}

/* Without its data the program exits 2 and names SHARDSIM_CONFIGS; with
 * SHARDSIM_CONFIGS pointing at the data it runs again. */
static void test_copy_without_data_says_how_to_fix(void **state)
{
    (void)state;
    char cmd[8192], out[1 << 16];
    int rc;
    snprintf(cmd, sizeof cmd, "mv %s/share %s/share.off", prefix, prefix);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "cd %s/cwd && env -u SHARDSIM_CONFIGS %s/bin/shardsim train dry_run=true 2>&1", prefix,
             prefix);
    run(cmd, &rc, out, sizeof out);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "SHARDSIM_CONFIGS"));
    assert_non_null(strstr(out, "make install"));

    snprintf(cmd, sizeof cmd,
             "cd %s/cwd && SHARDSIM_CONFIGS=%s/share.off/shardsim/configs %s/bin/shardsim train dry_run=true "
             "steps=1 base_num_decoder_layers=1 base_emb_dim=64 base_num_query_heads=2 base_num_kv_heads=2 "
             "head_dim=32 base_mlp_dim=128 vocab_size=256 max_target_length=32 per_device_batch_size=1 2>&1",
             prefix, prefix, prefix);
    run(cmd, &rc, out, sizeof out);
    if (rc != 0) fprintf(stderr, "%s\n", out);
    assert_int_equal(rc, 0);

    snprintf(cmd, sizeof cmd, "cd %s/cwd && SHARDSIM_CONFIGS=/nonexistent %s/bin/shardsim train dry_run=true 2>&1",
             prefix, prefix);
    run(cmd, &rc, out, sizeof out);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "SHARDSIM_CONFIGS=/nonexistent"));
    snprintf(cmd, sizeof cmd, "mv %s/share.off %s/share", prefix, prefix);
    assert_int_equal(system(cmd), 0);
}

/* The lines of `make -n -B <args>` run from the repository root that call ln; empty when none.
 * -B prints every command whatever is built already.  make's own variables are cleared: a test run
 * by `make asan` inherits MAKEFLAGS with that build's BUILD=build/asan and jobserver. */
static void ln_lines_of_dry_run(const char *args, char *out, size_t cap)
{
    char cmd[2048], all[1 << 18];
    int rc;
    snprintf(cmd, sizeof cmd, "cd %s && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -n -B %s 2>&1", repo, args);
    run(cmd, &rc, all, sizeof all);
    if (rc != 0) fprintf(stderr, "%s\n", all);
    assert_int_equal(rc, 0);
    size_t n = 0;
    out[0] = '\0';
    for (char *line = strtok(all, "\n"); line; line = strtok(NULL, "\n")) {
        const char *p = line + strspn(line, " \t");
        if (strncmp(p, "ln ", 3) != 0) continue;
        n += (size_t)snprintf(out + n, cap - n, "%s\n", p);
        assert_true(n < cap);
    }
}

/* make's dry run of the normal build links ./shardsim to build/shardsim (the form the checks below
 * look for), and the sanitizer targets' dry runs run no ln at all. */
static void test_sanitizer_builds_leave_the_link_alone(void **state)
{
    (void)state;
    char lines[4096];
    ln_lines_of_dry_run("link", lines, sizeof lines);
    assert_string_equal(lines, "ln -sfn build/shardsim shardsim 2>/dev/null || true\n");
    const char *targets[] = {"asan", "ubsan"};
    for (size_t i = 0; i < sizeof targets / sizeof *targets; i++) {
        ln_lines_of_dry_run(targets[i], lines, sizeof lines);
        if (lines[0]) fail_msg("make %s would run: %s(./shardsim must keep naming build/shardsim)", targets[i], lines);
    }
}

/* Where the checkout has ./shardsim, it names build/shardsim, whichever build ran this test. */
static void test_link_names_the_normal_build(void **state)
{
    (void)state;
    char path[1100], target[1100];
    snprintf(path, sizeof path, "%s/shardsim", repo);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0 && errno == ENOENT) skip(); /* e.g. a clean clone where only `make asan` ran */
    assert_true(n > 0);
    target[n] = '\0';
    if (strcmp(target, "build/shardsim") != 0)
        fail_msg("./shardsim -> %s, expected build/shardsim (run `make` to relink)", target);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_installed_program_finds_its_data),
        cmocka_unit_test(test_copy_without_data_says_how_to_fix),
        cmocka_unit_test(test_sanitizer_builds_leave_the_link_alone),
        cmocka_unit_test(test_link_names_the_normal_build),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

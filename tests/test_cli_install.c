/* test_cli_install.c — the built program finds its data (configs/) when it is
 * installed as `make install` lays it out (<prefix>/bin/shardsim beside
 * <prefix>/share/shardsim/configs), and a copy without its data says how to
 * point it at configs/ instead of failing on a bare missing file.
 *
 * The program is run as a child process (its data lookup starts from
 * /proc/self/exe), from a working directory that holds no configs/. */
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

static char repo[1024];     /* the repository root (the test runs from it) */
static char program[1024];  /* the shardsim of this test's own build (build/ or build/asan/ ...) */
static char prefix[256]; /* a temporary install prefix */

/* <build>/tests/test_cli_install -> <build>/shardsim: a sanitizer build tests its own program,
 * and needs no plain build beside it. */
static int own_program(void)
{
    ssize_t n = readlink("/proc/self/exe", program, sizeof program - 1);
    if (n <= 0 || (size_t)n >= sizeof program - 1) return -1;
    program[n] = '\0';
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(program, '/');
        if (!slash) return -1;
        *slash = '\0';
    }
    if (strlen(program) + sizeof "/shardsim" > sizeof program) return -1;
    strcat(program, "/shardsim");
    return access(program, X_OK) == 0 ? 0 : -1;
}

static void run(const char *cmd, int *rc, char *out, size_t cap)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    *rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int setup(void **state)
{
    (void)state;
    if (!getcwd(repo, sizeof repo)) return -1;
    if (own_program()) {
        fprintf(stderr, "test_cli_install: no program beside this test's build (%s): build it first\n", program);
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
    snprintf(cmd, sizeof cmd, "cd %s/cwd && env -u SHARDSIM_CONFIGS %s/bin/shardsim train dry_run=true 2>&1",
             prefix, prefix);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_installed_program_finds_its_data),
        cmocka_unit_test(test_copy_without_data_says_how_to_fix),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* test_cli_main.c — cli/main.c, the `shardsim` program's dispatcher, run as a child process (the
 * program of this test's build):
 *   - no command: the usage on stderr, exit 2; an unknown command: named, exit 2;
 *   - --version and version print the version; help and --help list every command with its summary;
 *   - `help COMMAND` and `COMMAND --help` print that command's usage; help of an unknown command
 *     exits 2;
 *   - commands reach their implementation: `keys ici_fsdp` lists that key, `models block=llama2`
 *     lists llama2-7b, `explain` without its arguments exits 2 naming what is missing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "cli/artifacts.h"
#include "tests/helpers.h"

static char out[1 << 16];

/* `shardsim ARGS` with stderr joined to stdout; returns the exit code. */
static int shardsim(const char *args)
{
    const char *p = helper_program();
    if (!p) fail_msg("no program beside this test's build: build it first");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", p, args);
    return helper_run_shell(cmd, out, sizeof out);
}

static const char *const COMMANDS[] = {"train",  "parity", "dump",        "explain", "keys",
                                       "models", "demo",   "collectives", "help"};
enum { NCOMMANDS = sizeof COMMANDS / sizeof COMMANDS[0] };

static void test_usage_and_version(void **state)
{
    (void)state;
    assert_int_equal(shardsim(""), 2);
    assert_contains(out, "usage: shardsim COMMAND");
    assert_int_equal(shardsim("frobnicate"), 2);
    assert_contains(out, "unknown command 'frobnicate'");
    assert_int_equal(shardsim("--version"), 0);
    char v[64];
    snprintf(v, sizeof v, "%s\n", CLI_SHARDSIM_VERSION);
    assert_string_equal(out, v);
    assert_int_equal(shardsim("version"), 0);
    assert_string_equal(out, v);
    for (int h = 0; h < 3; h++) {
        assert_int_equal(shardsim(h == 0 ? "help" : h == 1 ? "--help" : "-h"), 0);
        for (int i = 0; i < NCOMMANDS; i++) {
            char line[64];
            snprintf(line, sizeof line, "\n  %s ", COMMANDS[i]);
            assert_contains(out, line);
        }
    }
}

static void test_command_help(void **state)
{
    (void)state;
    for (int i = 0; i < NCOMMANDS; i++) {
        char args[64], usage[64];
        snprintf(usage, sizeof usage, "usage: shardsim %s", COMMANDS[i]);
        snprintf(args, sizeof args, "help %s", COMMANDS[i]);
        assert_int_equal(shardsim(args), 0);
        assert_contains(out, usage);
        if (strcmp(COMMANDS[i], "help")) {
            snprintf(args, sizeof args, "%s --help", COMMANDS[i]);
            assert_int_equal(shardsim(args), 0);
            assert_contains(out, usage);
        }
    }
    assert_int_equal(shardsim("help frobnicate"), 2);
    assert_contains(out, "unknown command 'frobnicate'");
}

static void test_dispatch(void **state)
{
    (void)state;
    assert_int_equal(shardsim("keys ici_fsdp_parallelism"), 0);
    assert_contains(out, "ici_fsdp_parallelism");
    assert_int_equal(shardsim("models block=llama2"), 0);
    assert_contains(out, "llama2-7b");
    assert_int_equal(shardsim("explain"), 2);
    assert_contains(out, "shape");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_usage_and_version),
        cmocka_unit_test(test_command_help),
        cmocka_unit_test(test_dispatch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_cli_models.c — cli/models.c, `shardsim models [pattern|block=NAME]`, against the files of
 * configs/models read here directly (names from the folder, blocks from each file's
 * decoder_block line):
 *   - a pattern lists exactly the names that contain it, each once, with its file's block; the
 *     Llama 2 files are simulated;
 *   - block=gemma lists exactly the files whose decoder_block is gemma, each refused with the
 *     block's description, and the summary counts them;
 *   - a pattern nothing matches and two patterns exit 2 saying why. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

enum { MAX_FILES = 256 };

typedef struct {
    char name[MAX_FILES][96];
    char block[MAX_FILES][32];
    int n;
} model_files;

/* Every YAML file of configs/models: the name and the decoder_block the file sets (its own line). */
static void read_model_files(model_files *f)
{
    memset(f, 0, sizeof *f);
    DIR *d = opendir("configs/models");
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) && f->n < MAX_FILES) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".yml")) continue;
        char path[512];
        snprintf(path, sizeof path, "configs/models/%s", e->d_name);
        char *text = helper_read_file(path, NULL);
        const char *at = strstr(text, "\ndecoder_block:");
        if (at && sscanf(at, "\ndecoder_block: \"%31[^\"]\"", f->block[f->n]) == 1) {
            snprintf(f->name[f->n], sizeof f->name[0], "%.*s", (int)(len - 4), e->d_name);
            f->n++;
        }
        free(text);
    }
    closedir(d);
    assert_true(f->n > 10);
}

/* The row of `name` in out ("" when absent), and how many rows start with it. */
static int row_of(const char *out, const char *name, char *row, size_t cap)
{
    int n = 0;
    row[0] = '\0';
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    for (const char *at = strstr(out, key); at; at = strstr(at + 1, key)) {
        n++;
        const char *eol = strchr(at + 1, '\n');
        snprintf(row, cap, "%.*s", (int)(eol ? eol - at - 1 : (long)strlen(at + 1)), at + 1);
    }
    return n;
}

/* `shardsim models <pattern>` (exit 0) and the model files to check its rows against. */
static cli_capture models(const char *pattern, model_files *f)
{
    read_model_files(f);
    const char *argv[] = {pattern};
    cli_capture r = cli_capture_run(cli_models, 1, argv);
    assert_int_equal(r.rc, 0);
    return r;
}

static void test_pattern(void **state)
{
    (void)state;
    static model_files f;
    cli_capture r = models("llama2", &f);
    int want = 0;
    for (int i = 0; i < f.n; i++) {
        char row[1024];
        int rows = row_of(r.out, f.name[i], row, sizeof row);
        if (!strstr(f.name[i], "llama2")) {
            assert_int_equal(rows, 0);
            continue;
        }
        want++;
        if (rows != 1) fail_msg("%s listed %d times:\n%s", f.name[i], rows, r.out);
        assert_contains(row, f.block[i]);
        if (!strcmp(f.block[i], "llama2")) assert_contains(row, "simulated");
    }
    char summary[64];
    snprintf(summary, sizeof summary, "\n%d models: ", want);
    assert_contains(r.out, summary);
    cli_capture_free(&r);
}

static void test_block(void **state)
{
    (void)state;
    static model_files f;
    cli_capture r = models("block=gemma", &f);
    int want = 0;
    for (int i = 0; i < f.n; i++) {
        char row[1024];
        int rows = row_of(r.out, f.name[i], row, sizeof row);
        assert_int_equal(rows, !strcmp(f.block[i], "gemma"));
        if (rows) {
            want++;
            assert_contains(row, "refused: block not simulated -- models/gemma.py");
        }
    }
    assert_true(want >= 1);
    char summary[160];
    snprintf(summary, sizeof summary,
             "\n%d model%s: 0 simulated, 0 refused by a key of the model file or a setting it needs, %d refused by "
             "decoder block",
             want, want == 1 ? "" : "s", want);
    assert_contains(r.out, summary);
    cli_capture_free(&r);
}

static void test_refusals(void **state)
{
    (void)state;
    const char *none[] = {"no-such-model"};
    cli_capture r = cli_capture_run(cli_models, 1, none);
    assert_int_equal(r.rc, 2);
    assert_contains(r.err, "no model matches 'no-such-model'");
    cli_capture_free(&r);
    const char *two[] = {"llama", "gemma"};
    r = cli_capture_run(cli_models, 2, two);
    assert_int_equal(r.rc, 2);
    assert_contains(r.err, "one pattern at most");
    cli_capture_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pattern),
        cmocka_unit_test(test_block),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_cli_artifacts.c — cli/artifacts.h: the files a run leaves in output_dir, written
 * atomically, and the sharding dump in MaxText's format.
 *   - a writer that fails leaves nothing (an earlier complete file stays); an output_dir that is a
 *     file is an I/O error naming it;
 *   - the MaxText dump writer is fed the entries of MaxText's own golden dumps and must reproduce
 *     them byte for byte (and as parsed JSON), as given and as a whole train state rebuilt from the
 *     parameters alone; parameter paths become JAX key strings.
 * The reference directory is $SHARDSIM_REFERENCE, else tests/data in the repo; a missing one fails
 * the test.  The CSV files, metrics.json, run.json and trace.json of a machine's run are
 * test_cli_report's (they check the console report's figures too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/artifacts.h"
#include "config/json.h"
#include "tests/helpers.h"

enum { PATH_CAP = 1024 };

/* ======================================================================== */
/* atomic writes and errors                                                 */
/* ======================================================================== */

static sim_status write_then_fail(FILE *f, void *arg)
{
    (void)arg;
    fputs("partial", f);
    return sim_err(SIM_ERR_INTERNAL, "writer gave up");
}

static sim_status write_hello(FILE *f, void *arg)
{
    fputs(arg, f);
    return SIM_OK;
}

static void test_atomic_write(void **state)
{
    (void)state;
    char *dir = helper_tmpdir("test_cli_artifacts");
    /* a failing writer leaves nothing, and an earlier complete file stays */
    assert_int_equal(cli_artifact_write(dir, "a.txt", write_hello, "hello"), SIM_OK);
    assert_int_equal(cli_artifact_write(dir, "a.txt", write_then_fail, NULL), SIM_ERR_INTERNAL);
    assert_int_equal(helper_count_entries(dir), 1);
    char p[PATH_CAP];
    snprintf(p, sizeof p, "%s/a.txt", dir);
    char *s = helper_read_file(p, NULL);
    assert_string_equal(s, "hello");
    free(s);
    /* an output_dir that is a file: SIM_ERR_IO naming it */
    char bad[PATH_CAP];
    snprintf(bad, sizeof bad, "%s/a.txt/sub", dir);
    cli_step_metrics one = {1, 1, 1, 1, 1, 1, 1, false, 0, false, 1};
    assert_int_equal(cli_write_metrics_json(bad, &one, 1, NULL, 0), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "a.txt");
    assert_int_equal(cli_artifacts_mkdir(p), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "not a directory");
    assert_int_equal(helper_count_entries(dir), 1);
    helper_rm_rf(dir);
    free(dir);
}

/* ======================================================================== */
/* MaxText sharding dump                                                    */
/* ======================================================================== */

enum { MAX_ENTRIES = 512 };

/* The inputs a golden directory gives the writer. */
typedef struct {
    cfg_json *named, *logical, *inputs;
    mesh_shape mesh;
    int n;
    cli_dump_param p[MAX_ENTRIES];
    int na;
    cli_dump_activation a[MAX_ENTRIES];
    char names[MAX_ENTRIES][256]; /* activation name and dtype text */
    char dtypes[MAX_ENTRIES][32];
    char logical_text[MAX_ENTRIES][8][64];
} golden;

/* "('a', None, 'b')" -> names; "Unknown" -> not known. */
static void parse_logic(const char *s, cli_dump_activation *a, char (*store)[64])
{
    if (!strcmp(s, "Unknown")) {
        a->logical_known = false;
        return;
    }
    a->logical_known = true;
    int d = 0;
    for (const char *c = s; *c; c++) {
        if (*c == '\'') {
            const char *e = strchr(c + 1, '\'');
            snprintf(store[d], 64, "%.*s", (int)(e - c - 1), c + 1);
            a->logical[d] = store[d];
            d++;
            c = e;
        } else if (!strncmp(c, "None", 4)) {
            a->logical[d++] = NULL;
            c += 3;
        }
    }
    assert_int_equal(d, a->rank);
}

static void golden_load(const char *path, golden *g)
{
    memset(g, 0, sizeof *g);
    g->named = helper_read_json(path, "named_shardings.json");
    g->logical = helper_read_json(path, "logical_shardings.json");
    g->inputs = helper_read_json(path, "input_shardings.json");
    /* the mesh from the first entry's mesh block */
    const cfg_json *mb = helper_json_get(&g->named->items[0], "mesh");
    const cfg_json *an = helper_json_get(mb, "axis_names"), *sh = helper_json_get(mb, "shape");
    const char *names[MESH_MAX_AXES];
    int sizes[MESH_MAX_AXES];
    for (int i = 0; i < an->n; i++) {
        names[i] = an->items[i].str;
        sizes[i] = (int)helper_json_get(sh, names[i])->number;
    }
    assert_int_equal(mesh_shape_init(&g->mesh, an->n, names, sizes), SIM_OK);

    assert_true(g->named->n <= MAX_ENTRIES);
    g->n = g->named->n;
    for (int i = 0; i < g->n; i++) {
        cli_dump_param *p = &g->p[i];
        const char *key = g->named->keys[i];
        const cfg_json *n = &g->named->items[i], *l = helper_json_get(g->logical, key);
        const cfg_json *shape = helper_json_get(n, "shape"), *lspec = helper_json_get(l, "partition_spec");
        p->path = key;
        p->rank = shape->n;
        for (int d = 0; d < p->rank; d++) {
            p->shape[d] = (int64_t)shape->items[d].number;
            p->logical[d] = lspec->items[d].kind == CFG_JSON_STRING ? lspec->items[d].str : NULL;
        }
        if (mesh_spec_from_json(helper_json_get(n, "partition_spec"), &g->mesh, key, &p->spec) != SIM_OK)
            fail_msg("%s: %s", key, sim_errmsg());
    }

    const cfg_json *list = helper_json_get(g->inputs, "Activation Sharding Dump");
    assert_true(list->n <= MAX_ENTRIES);
    g->na = list->n;
    for (int i = 0; i < g->na; i++) {
        cli_dump_activation *a = &g->a[i];
        const char *key = list->items[i].keys[0];
        const cfg_json *v = &list->items[i].items[0];
        /* "module/var: dtype[d0,d1,...]" */
        const char *colon = strstr(key, ": "), *br = strchr(colon, '[');
        snprintf(g->names[i], sizeof g->names[i], "%.*s", (int)(colon - key), key);
        snprintf(g->dtypes[i], sizeof g->dtypes[i], "%.*s", (int)(br - colon - 2), colon + 2);
        a->name = g->names[i];
        a->dtype = g->dtypes[i];
        for (const char *c = br + 1; *c && *c != ']';) {
            a->shape[a->rank++] = strtoll(c, (char **)&c, 10);
            if (*c == ',') c++;
        }
        parse_logic(helper_json_get(v, "logic_axes")->str, a, g->logical_text[i]);
        if (mesh_spec_parse(helper_json_get(v, "PartitionSpec")->str, &g->mesh, &a->spec) != SIM_OK)
            fail_msg("%s: %s", key, sim_errmsg());
    }
}

static void golden_free(golden *g)
{
    cfg_json_free(g->named);
    cfg_json_free(g->logical);
    cfg_json_free(g->inputs);
}

/* The file in `dir` must equal the golden's, as bytes and as parsed JSON. */
static void same_file(const char *golden_dir, const char *dir, const char *name)
{
    char a[PATH_CAP], b[PATH_CAP];
    snprintf(a, sizeof a, "%s/%s", golden_dir, name);
    snprintf(b, sizeof b, "%s/%s", dir, name);
    cfg_json *ja = helper_read_json(golden_dir, name), *jb = helper_read_json(dir, name);
    if (!cfg_json_equal(ja, jb)) fail_msg("%s differs from %s as JSON", b, a);
    /* same key order too */
    assert_int_equal(ja->n, jb->n);
    for (int i = 0; i < ja->n && ja->kind == CFG_JSON_OBJECT; i++) assert_string_equal(ja->keys[i], jb->keys[i]);
    cfg_json_free(ja);
    cfg_json_free(jb);
    size_t la, lb;
    char *sa = helper_read_file(a, &la), *sb = helper_read_file(b, &lb);
    if (la != lb || memcmp(sa, sb, la)) {
        size_t i = 0;
        while (i < la && i < lb && sa[i] == sb[i]) i++;
        fail_msg("%s differs from %s at byte %zu: '%.40s' vs '%.40s'", b, a, i, sa + i, sb + i);
    }
    free(sa);
    free(sb);
}

/* Writes the dump of golden directory `path` as given and checks all three files. */
static void check_golden_dir(const char *path, const char *dir)
{
    golden *g = malloc(sizeof *g);
    golden_load(path, g);
    if (cli_write_sharding_dump(dir, &g->mesh, g->p, g->n, CLI_DUMP_AS_GIVEN, g->a, g->na) != SIM_OK)
        fail_msg("%s: %s", path, sim_errmsg());
    same_file(path, dir, "named_shardings.json");
    same_file(path, dir, "logical_shardings.json");
    same_file(path, dir, "input_shardings.json");
    golden_free(g);
    free(g);
}

static void test_dump_keystr(void **state)
{
    (void)state;
    char buf[256];
    const char *want = ".params/['params']/['decoder']/['layers']/['mlp']/['wi_0']/['kernel']";
    assert_int_equal(cli_dump_keystr("params.decoder.layers.mlp.wi_0.kernel", buf, sizeof buf), (int)strlen(want));
    assert_string_equal(buf, want);
    cli_dump_keystr("decoder/layers/mlp/wi_0/kernel", buf, sizeof buf);
    assert_string_equal(buf, want);
    cli_dump_keystr(".opt_state/[0]/.count", buf, sizeof buf);
    assert_string_equal(buf, ".opt_state/[0]/.count");
    cli_dump_keystr("params_extra.x", buf, sizeof buf); /* "params" only as a whole component */
    assert_string_equal(buf, ".params/['params']/['params_extra']/['x']");
    /* truncation reports the length needed */
    assert_int_equal(cli_dump_keystr("params.decoder.layers.mlp.wi_0.kernel", buf, 8), (int)strlen(want));
    assert_int_equal(strlen(buf), 7);
}

/* deepseek2-16b / tpu7x-16 / pure-fsdp: the writer reproduces the golden from
 * its own entries, and the whole train state from the parameters alone. */
static void test_dump_golden_pure_fsdp(void **state)
{
    (void)state;
    char path[PATH_CAP];
    snprintf(path, sizeof path, "%s/maxtext/goldens/deepseek2-16b/tpu7x-16/slice_1/rule_pure-fsdp",
             helper_reference_dir());
    struct stat st;
    if (stat(path, &st) != 0) fail_msg("golden directory '%s' is missing", path);
    char *dir = helper_tmpdir("test_cli_artifacts");
    check_golden_dir(path, dir);

    /* train-state mode: only the parameters, as dotted paths, shuffled */
    golden *g = malloc(sizeof *g);
    golden_load(path, g);
    static char dotted[MAX_ENTRIES][512];
    cli_dump_param *params = calloc(MAX_ENTRIES, sizeof *params);
    int np = 0;
    const char *prefix = ".params/['params']";
    for (int i = 0; i < g->n; i++) {
        if (strncmp(g->p[i].path, prefix, strlen(prefix))) continue;
        /* .params/['params']/['a']/['b'] -> params.a.b */
        char *o = dotted[np];
        size_t n = (size_t)snprintf(o, 512, "params");
        for (const char *c = g->p[i].path + strlen(prefix); *c; c++)
            if (!strncmp(c, "/['", 3)) {
                o[n++] = '.';
                c += 2;
            } else if (*c != '\'' && *c != ']') {
                o[n++] = *c;
            }
        o[n] = '\0';
        params[np] = g->p[i];
        params[np].path = dotted[np];
        np++;
    }
    assert_int_equal(np, 27);
    /* shuffle: a fixed permutation (stride coprime with 27) */
    cli_dump_param *shuf = calloc((size_t)np, sizeof *shuf);
    for (int i = 0; i < np; i++) shuf[i] = params[(i * 7 + 3) % np];
    char dir2[PATH_CAP];
    snprintf(dir2, sizeof dir2, "%s/state", dir);
    if (cli_write_sharding_dump(dir2, &g->mesh, shuf, np, CLI_DUMP_TRAIN_STATE, g->a, g->na) != SIM_OK)
        fail_msg("%s", sim_errmsg());
    same_file(path, dir2, "named_shardings.json");
    same_file(path, dir2, "logical_shardings.json");
    same_file(path, dir2, "input_shardings.json");

    /* ZeRO-1 style: Adam moments with their own spec */
    shuf[0].has_opt_spec = true;
    mesh_spec_init(&shuf[0].opt_spec, shuf[0].rank);
    FILE *f = tmpfile();
    assert_int_equal(cli_dump_named(f, &g->mesh, shuf, np, CLI_DUMP_TRAIN_STATE), SIM_OK);
    fclose(f);

    /* bad input: a spec of the wrong rank names the entry */
    shuf[1].spec.rank = shuf[1].rank + 1;
    f = tmpfile();
    assert_int_equal(cli_dump_named(f, &g->mesh, shuf, np, CLI_DUMP_TRAIN_STATE), SIM_ERR_INPUT);
    fclose(f);
    assert_contains(sim_errmsg(), "['params']");
    /* a non-parameter path in train-state mode */
    shuf[1] = params[0];
    shuf[1].path = ".opt_state/[0]/.count";
    f = tmpfile();
    assert_int_equal(cli_dump_logical(f, shuf, np, CLI_DUMP_TRAIN_STATE), SIM_ERR_INPUT);
    fclose(f);

    /* activations are logged once per "name: dtype[shape]" */
    cli_dump_activation twice[2] = {g->a[0], g->a[0]};
    char *out = NULL;
    size_t len = 0;
    f = open_memstream(&out, &len);
    assert_int_equal(cli_dump_inputs(f, &g->mesh, twice, 2), SIM_OK);
    fclose(f);
    assert_non_null(strstr(out, "deepseek/inputs"));
    assert_null(strstr(strstr(out, "deepseek/inputs") + 1, "deepseek/inputs"));
    free(out);

    free(shuf);
    free(params);
    golden_free(g);
    free(g);
    helper_rm_rf(dir);
    free(dir);
}

/* Every golden directory round-trips byte for byte. */
static void walk_goldens(const char *path, const char *tmp, int depth, int *count)
{
    char f[PATH_CAP];
    snprintf(f, sizeof f, "%s/named_shardings.json", path);
    struct stat st;
    if (stat(f, &st) == 0) {
        char out[PATH_CAP];
        snprintf(out, sizeof out, "%s/%d", tmp, *count);
        check_golden_dir(path, out);
        (*count)++;
        return;
    }
    if (depth > 5) return;
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char sub[PATH_CAP];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        if (stat(sub, &st) == 0 && S_ISDIR(st.st_mode)) walk_goldens(sub, tmp, depth + 1, count);
    }
    closedir(d);
}

static void test_dump_all_goldens(void **state)
{
    (void)state;
    char path[PATH_CAP];
    snprintf(path, sizeof path, "%s/maxtext/goldens", helper_reference_dir());
    char *dir = helper_tmpdir("test_cli_artifacts");
    int count = 0;
    walk_goldens(path, dir, 0, &count);
    assert_true(count >= 1);
    helper_rm_rf(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_atomic_write),
        cmocka_unit_test(test_dump_keystr),
        cmocka_unit_test(test_dump_golden_pure_fsdp),
        cmocka_unit_test(test_dump_all_goldens),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

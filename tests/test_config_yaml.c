/* test_config_yaml.c — YAML files and command-line overrides read into values (config/yaml.c):
 * bounded input (alias expansion, a second document, size, a directory, 40k keys in linear
 * time, duplicate keys naming both lines), and the three forms of an override value (a flow
 * list or map, a quoted string, any other text verbatim). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/config.h"
#include "tests/config_fixture.h"

static void test_yaml_bounds(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_cfglim_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    cfg_config *cfg;

    /* billion laughs: 9 levels of 9 aliases = 9^9 strings; refused, not expanded */
    snprintf(path, sizeof path, "%s/laugh.yml", dir);
    free(cfgt_write(dir, strrchr(path, '/') + 1,
                    "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                    "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
                    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
                    "f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
                    "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\n"
                    "h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\n"
                    "i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]\n"));
    assert_int_equal(cfgt_load(NULL, path, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), path);
    assert_contains(sim_errmsg(), "expands to more than");
    /* the same through a command-line value */
    const char *o[] = {"logical_axis_rules=[&a [x, x, x, x, x, x, x, x], &b [*a, *a, *a, *a, *a, *a, *a, *a], "
                       "&c [*b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c], "
                       "&e [*d, *d, *d, *d, *d, *d, *d, *d], &f [*e, *e, *e, *e, *e, *e, *e, *e], "
                       "&g [*f, *f, *f, *f, *f, *f, *f, *f]]"};
    assert_int_equal(cfgt_load(NULL, NULL, 1, o, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "expands to more than");
    /* and as the base config (model and custom files go through the same reader) */
    assert_int_equal(cfgt_load(path, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "expands to more than");

    /* a second document is refused, not dropped */
    snprintf(path, sizeof path, "%s/multi.yml", dir);
    free(cfgt_write(dir, strrchr(path, '/') + 1, "steps: 3\n---\nsteps: 5\n"));
    assert_int_equal(cfgt_load(NULL, path, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), path);
    assert_contains(sim_errmsg(), "second document");
    /* one document with an explicit start and end marker is fine */
    free(cfgt_write(dir, strrchr(path, '/') + 1, "---\nsteps: 3\n...\n"));
    if (cfgt_load(NULL, path, 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    cfg_free(cfg);

    /* a directory is not a config file */
    assert_int_equal(cfgt_load(NULL, dir, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "not a regular file");

    /* model_name cannot leave models/ (../base would load configs/base.yml as a model) */
    const char *names[] = {"model_name=../base", "model_name=../../../../etc/passwd", "model_name=.hidden",
                           "model_name=a/b"};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(cfgt_load(NULL, NULL, 1, &names[i], &cfg), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), names[i]);
        assert_contains(sim_errmsg(), "not a model name");
        assert_contains(sim_errmsg(), "llama2-7b"); /* the available names */
    }

    /* 40,000 keys: a base config of that size loads, every key in place */
    snprintf(path, sizeof path, "%s/big.yml", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 40000; i++) fprintf(f, "key_%d: %d\n", i, i);
    fclose(f);
    if (cfgt_load(path, NULL, 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(cfg->n, 40000);
    assert_string_equal(cfg->entries[39999].key, "key_39999");
    assert_string_equal(cfg->entries[39999].value.text, "39999");
    cfg_free(cfg);
    /* and a duplicate among them is still found, naming both lines */
    f = fopen(path, "a");
    fprintf(f, "key_17: 1\n");
    fclose(f);
    assert_int_equal(cfgt_load(path, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'key_17' appears twice (first at line 18)");

    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* key=value: [ or { starts a YAML flow value, quotes make a string, anything else is the text
 * itself (a path with ':' and '#' stays whole); `key=` is the empty string, not null. */
static void test_override_forms(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", "rules: [[a, b]]\nname: x\ncount: 1\nmaybe: null\n");
    const char *o[] = {"rules=[[c, [d, e]], [f, []]]", "name=/a b:c#d", "count='7'", "maybe="};
    cfg_config *cfg;
    /* count='7' is a string where the base has an int: refused with both written */
    assert_int_equal(cfgt_load(base, NULL, 4, o, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'count' = '7' is a string, expected an integer");
    o[2] = "count=7";
    cfg = cfgt_load_ok(base, 4, o);
    const cfg_value *r = &cfg_find(cfg, "rules")->value;
    assert_int_equal(r->kind, CFG_LIST);
    assert_int_equal(r->n, 2);
    assert_int_equal(r->items[0].items[1].kind, CFG_LIST);
    assert_string_equal(r->items[0].items[1].items[1].text, "e");
    assert_int_equal(r->items[1].items[1].n, 0);
    assert_string_equal(cfg_find(cfg, "name")->value.text, "/a b:c#d");
    assert_int_equal(cfg_scalar_type(&cfg_find(cfg, "name")->value), CFG_STRING);
    const cfg_value *m = &cfg_find(cfg, "maybe")->value;
    assert_string_equal(m->text, "");
    assert_int_equal(cfg_scalar_type(m), CFG_STRING);
    assert_string_equal(cfg_find(cfg, "count")->where, "command line");
    cfg_free(cfg);
    /* not key=value, and a bad flow value, name the argument */
    const char *bad[] = {"rules=[[a, b]"};
    assert_int_equal(cfgt_load(base, NULL, 1, bad, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "command-line value \"[[a, b]\"");
    assert_contains(sim_errmsg(), "(in rules=[[a, b]");
    assert_int_equal(cfg_load_argv(base, 1, (const char *const[]){"steps"}, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "argument 'steps' is neither a config file");
    free(base);
    cfgt_rmdir(dir);
}

/* Every value keeps the line its key was written on. */
static void test_lines(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", "# a comment\n\na: 1\nb:\n  - x\n  - y\nc: {k: v}\n");
    cfg_config *cfg;
    assert_int_equal(cfg_load_file(base, &cfg), SIM_OK);
    assert_int_equal(cfg_find(cfg, "a")->value.line, 3);
    assert_int_equal(cfg_find(cfg, "b")->value.line, 4);
    assert_int_equal(cfg_find(cfg, "b")->value.items[1].line, 6);
    assert_int_equal(cfg_find(cfg, "c")->value.line, 7);
    char where[256];
    cfg_value_where(&cfg_find(cfg, "a")->value, where, sizeof where);
    assert_contains(where, "base.yml:3");
    cfg_free(cfg);
    /* a top level that is not a map */
    char *list = cfgt_write(dir, "list.yml", "- a\n- b\n");
    assert_int_equal(cfg_load_file(list, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "must be a map");
    free(list);
    free(base);
    cfgt_rmdir(dir);
}

/* A file read twice parses once (config/yaml.c keeps the values by path and bytes): the second
 * load gives the same values, lines and file names; a file rewritten with other bytes of the same
 * length (as fast as a file system's clock cannot tell apart) is read again. */
static void test_reread(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", "a: 1\nb: [x, y]\n");
    for (int k = 0; k < 2; k++) {
        cfg_config *cfg;
        assert_int_equal(cfg_load_file(base, &cfg), SIM_OK);
        assert_string_equal(cfg_find(cfg, "a")->value.text, "1");
        assert_int_equal(cfg_find(cfg, "b")->value.items[1].line, 2);
        char where[256];
        cfg_value_where(&cfg_find(cfg, "b")->value.items[1], where, sizeof where);
        assert_contains(where, "base.yml:2");
        cfg_free(cfg);
    }
    free(cfgt_write(dir, "base.yml", "a: 7\nb: [x, z]\n"));
    cfg_config *cfg;
    assert_int_equal(cfg_load_file(base, &cfg), SIM_OK);
    assert_string_equal(cfg_find(cfg, "a")->value.text, "7");
    assert_string_equal(cfg_find(cfg, "b")->value.items[1].text, "z");
    cfg_free(cfg);
    free(cfgt_write(dir, "base.yml", "a: [\n"));
    assert_int_equal(cfg_load_file(base, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "invalid YAML");
    free(base);
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_yaml_bounds),
        cmocka_unit_test(test_override_forms),
        cmocka_unit_test(test_lines),
        cmocka_unit_test(test_reread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

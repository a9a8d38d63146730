/* test_mesh_goldens.c — conformance with MaxText's own sharding dumps.
 *
 * For every directory <model>/<topology>/slice_<n>/rule_<name>[_<k=v>...] under
 * $SHARDSIM_REFERENCE/maxtext/goldens (walked, not listed here), the project's
 * configs/ are loaded with that model, device count, slice count, rule set and
 * overrides; the mesh is built and must equal the dump's mesh; every entry of
 * logical_shardings.json is resolved and must equal the partition_spec of the
 * same key in named_shardings.json (size-1 axes kept, as the Linen dump keeps
 * them), in JSON form too; every activation of input_shardings.json with known
 * logical axes is resolved and must print exactly its PartitionSpec text.
 * Directory names follow MaxText's sharding_dump.py: the topology's trailing
 * number is the device count (tpu7x-16 = 16, tpu7x-8 = 8, as maxtext-facts.md
 * §10.1 lists), overrides are the literal key=value strings joined by '_'. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "config/config.h"
#include "config/json.h"
#include "mesh/mesh_shape.h"
#include "mesh/rules.h"
#include "mesh/spec.h"
#include "tests/helpers.h"

enum { MAX_DIRS = 256, PATH_CAP = 1024, MAX_OVR = 32, OVR_CAP = 600 };

static char goldens_root[PATH_CAP];
static char *dirs[MAX_DIRS];
static int n_dirs;

static int is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* Collects every directory under `path` holding named_shardings.json. */
static void walk(const char *path, int depth)
{
    char f[PATH_CAP];
    snprintf(f, sizeof f, "%s/named_shardings.json", path);
    if (is_file(f)) {
        assert_true(n_dirs < MAX_DIRS);
        dirs[n_dirs++] = strdup(path);
        return;
    }
    if (depth > 6) return;
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char sub[PATH_CAP];
        snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
        if (is_dir(sub)) walk(sub, depth + 1);
    }
    closedir(d);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int setup(void **state)
{
    (void)state;
    const char *env = getenv("SHARDSIM_REFERENCE");
    const char *ref = env && *env ? env : "tests/data";
    snprintf(goldens_root, sizeof goldens_root, "%s/maxtext/goldens", ref);
    if (!is_dir(goldens_root)) {
        fprintf(stderr,
                "MaxText goldens not found at '%s' (set SHARDSIM_REFERENCE to the directory "
                "holding maxtext/goldens)\n",
                goldens_root);
        return -1;
    }
    walk(goldens_root, 0);
    qsort(dirs, (size_t)n_dirs, sizeof dirs[0], cmp_str);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < n_dirs; i++) free(dirs[i]);
    return 0;
}

/* ---- directory name -> overrides ----------------------------------------- */

/* Splits "k1=v1_k2=v2" into overrides; a key boundary is the '_' after which
 * the text up to the next '=' is a known config key. */
static void split_overrides(const cfg_config *base, const char *s, char ovr[][OVR_CAP], int *n)
{
    size_t len = strlen(s), key_start = 0;
    while (key_start < len) {
        const char *eq = strchr(s + key_start, '=');
        if (!eq) fail_msg("override text '%s' has no '=' after position %zu", s, key_start);
        size_t e = (size_t)(eq - s);
        const char *next_eq = strchr(s + e + 1, '=');
        size_t value_end = len, next_key = len;
        if (next_eq) {
            size_t ne = (size_t)(next_eq - s);
            int found = 0;
            for (size_t p = e + 1; p < ne && !found; p++) {
                if (s[p] != '_') continue;
                char key[256];
                snprintf(key, sizeof key, "%.*s", (int)(ne - p - 1), s + p + 1);
                if (cfg_find(base, key)) {
                    value_end = p;
                    next_key = p + 1;
                    found = 1;
                }
            }
            if (!found) fail_msg("cannot split overrides '%s': no known key before position %zu", s, ne);
        }
        assert_true(*n < MAX_OVR);
        snprintf(ovr[*n], OVR_CAP, "%.*s", (int)(value_end - key_start), s + key_start);
        (*n)++;
        key_start = next_key;
    }
}

/* ---- helpers ------------------------------------------------------------- */

/* Compact JSON of a partition_spec list, to compare the dump form exactly. */
static void json_compact(const cfg_json *v, char *buf, size_t cap)
{
    size_t k = strlen(buf);
    if (v->kind == CFG_JSON_NULL) snprintf(buf + k, cap - k, "null");
    else if (v->kind == CFG_JSON_STRING) snprintf(buf + k, cap - k, "\"%s\"", v->str);
    else if (v->kind == CFG_JSON_ARRAY) {
        snprintf(buf + k, cap - k, "[");
        for (int i = 0; i < v->n; i++) {
            if (i) snprintf(buf + strlen(buf), cap - strlen(buf), ", ");
            json_compact(&v->items[i], buf, cap);
        }
        snprintf(buf + strlen(buf), cap - strlen(buf), "]");
    } else fail_msg("unexpected %s in a partition_spec", cfg_json_kind_name(v->kind));
}

/* Python tuple repr of logical names: "('a', 'b', None)" or "('a',)". */
static int parse_logic_axes(const char *text, char names[][128], const char **ptrs)
{
    int n = 0;
    const char *p = text;
    while (*p == ' ') p++;
    if (*p++ != '(') fail_msg("logic_axes '%s' is not a tuple", text);
    for (;;) {
        while (*p == ' ' || *p == ',') p++;
        if (*p == ')') break;
        assert_true(n < MESH_SPEC_MAX_RANK);
        if (!strncmp(p, "None", 4)) {
            ptrs[n++] = NULL;
            p += 4;
        } else if (*p == '\'' || *p == '"') {
            char q = *p++;
            const char *end = strchr(p, q);
            if (!end) fail_msg("logic_axes '%s': unterminated name", text);
            snprintf(names[n], 128, "%.*s", (int)(end - p), p);
            ptrs[n] = names[n];
            n++;
            p = end + 1;
        } else {
            fail_msg("logic_axes '%s': unexpected text at '%s'", text, p);
        }
    }
    return n;
}

/* "moe/inputs: bfloat16[192,2048,2048]" -> shape. */
static int parse_shape(const char *key, int64_t *shape)
{
    const char *b = strrchr(key, '[');
    if (!b) return -1;
    int n = 0;
    for (const char *p = b + 1; *p && *p != ']';) {
        shape[n++] = strtoll(p, (char **)&p, 10);
        if (*p == ',') p++;
    }
    return n;
}

static void check_mesh(const cfg_json *jm, const mesh_shape *m, const char *where)
{
    const cfg_json *names = cfg_json_get(jm, "axis_names"), *shape = cfg_json_get(jm, "shape");
    assert_non_null(names);
    assert_non_null(shape);
    char built[512];
    mesh_shape_format(m, built, sizeof built);
    if (names->n != m->n_axes) fail_msg("%s: dump mesh has %d axes, built mesh %s", where, names->n, built);
    for (int i = 0; i < m->n_axes; i++) {
        const cfg_json *sz = cfg_json_get(shape, m->names[i]);
        if (strcmp(names->items[i].str, m->names[i]) != 0 || !sz || (int)sz->number != m->sizes[i])
            fail_msg("%s: dump mesh axis %d is %s=%d, built mesh %s", where, i, names->items[i].str,
                     sz ? (int)sz->number : -1, built);
    }
}

/* ---- the test ----------------------------------------------------------- */

static void check_directory(const cfg_config *base, const char *dir)
{
    const char *rel = dir + strlen(goldens_root) + 1;
    char model[256], topo[256], slice[256], rule[512];
    if (sscanf(rel, "%255[^/]/%255[^/]/%255[^/]/%511[^/]", model, topo, slice, rule) != 4)
        fail_msg("golden directory '%s' is not <model>/<topology>/slice_<n>/rule_<...>", rel);
    const char *dash = strrchr(topo, '-');
    int devices = dash ? atoi(dash + 1) : 0;
    int slices = strncmp(slice, "slice_", 6) == 0 ? atoi(slice + 6) : 0;
    if (devices <= 0 || slices <= 0 || strncmp(rule, "rule_", 5) != 0)
        fail_msg("cannot read devices/slices/rule from '%s'", rel);

    /* rule set: "default" or the longest prefix naming a project custom file */
    const char *rest = rule + 5;
    char custom[256] = "";
    size_t used = 0;
    if (!strncmp(rest, "default", 7) && (rest[7] == '\0' || rest[7] == '_')) {
        used = 7;
    } else {
        for (size_t k = 1; k <= strlen(rest); k++) {
            if (rest[k] != '\0' && rest[k] != '_') continue;
            char f[PATH_CAP];
            snprintf(f, sizeof f, "configs/custom_mesh_and_rule/%.*s.yml", (int)k, rest);
            if (is_file(f)) {
                snprintf(custom, sizeof custom, "%.*s", (int)k, rest);
                used = k;
            }
        }
        if (!used) fail_msg("%s: no configs/custom_mesh_and_rule file matches '%s'", rel, rest);
    }
    char ovr[MAX_OVR][OVR_CAP];
    int n_ovr = 0;
    snprintf(ovr[n_ovr++], OVR_CAP, "model_name=%s", model);
    snprintf(ovr[n_ovr++], OVR_CAP, "num_devices=%d", devices);
    snprintf(ovr[n_ovr++], OVR_CAP, "num_slices=%d", slices);
    if (custom[0]) snprintf(ovr[n_ovr++], OVR_CAP, "custom_mesh_and_rule=%s", custom);
    if (rest[used] == '_') split_overrides(base, rest + used + 1, ovr, &n_ovr);
    const char *ovr_ptrs[MAX_OVR];
    for (int i = 0; i < n_ovr; i++) ovr_ptrs[i] = ovr[i];

    cfg_args args = {NULL, NULL, NULL, 0, ovr_ptrs, n_ovr};
    cfg_config *cfg = NULL;
    if (cfg_load(&args, &cfg) != SIM_OK) fail_msg("%s: config: %s", rel, sim_errmsg());
    mesh_shape m;
    if (mesh_shape_from_config(cfg, &m) != SIM_OK) fail_msg("%s: mesh: %s", rel, sim_errmsg());
    mesh_rules rules;
    if (mesh_rules_from_config(cfg, &rules) != SIM_OK) fail_msg("%s: rules: %s", rel, sim_errmsg());
    cfg_free(cfg);

    /* parameters and optimizer state */
    cfg_json *named = helper_read_json(dir, "named_shardings.json");
    cfg_json *logical = helper_read_json(dir, "logical_shardings.json");
    assert_int_equal(named->kind, CFG_JSON_OBJECT);
    assert_int_equal(logical->kind, CFG_JSON_OBJECT);
    if (named->n != logical->n) fail_msg("%s: %d named vs %d logical entries", rel, named->n, logical->n);
    int n_named = 0;
    for (int i = 0; i < logical->n; i++) {
        const char *key = logical->keys[i];
        const cfg_json *lp = cfg_json_get(&logical->items[i], "partition_spec");
        const cfg_json *ls = cfg_json_get(&logical->items[i], "shape");
        const cfg_json *ne = cfg_json_get(named, key);
        if (!ne) fail_msg("%s: key %s missing from named_shardings.json", rel, key);
        check_mesh(cfg_json_get(ne, "mesh"), &m, key);
        const cfg_json *np = cfg_json_get(ne, "partition_spec");
        assert_non_null(lp);
        assert_non_null(np);
        char names_buf[MESH_SPEC_MAX_RANK][128];
        const char *names[MESH_SPEC_MAX_RANK];
        assert_true(lp->n <= MESH_SPEC_MAX_RANK);
        for (int d = 0; d < lp->n; d++) {
            if (lp->items[d].kind == CFG_JSON_NULL) names[d] = NULL;
            else {
                snprintf(names_buf[d], 128, "%s", lp->items[d].str);
                names[d] = names_buf[d];
            }
        }
        mesh_resolved res;
        if (mesh_rules_resolve(&rules, &m, key, lp->n, names, &res) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        mesh_spec want;
        if (mesh_spec_from_json(np, &m, key, &want) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        char ours[512], theirs[512] = "";
        mesh_spec_format_json(&res.unpruned, &m, ours, sizeof ours);
        json_compact(np, theirs, sizeof theirs);
        if (!mesh_spec_equal(&res.unpruned, &want) || strcmp(ours, theirs) != 0)
            fail_msg("%s\n  %s\n  resolved %s\n  golden   %s", rel, key, ours, theirs);
        /* the shapes divide by the final sharding */
        int64_t shape[MESH_SPEC_MAX_RANK];
        assert_int_equal(ls->n, lp->n);
        for (int d = 0; d < ls->n; d++) shape[d] = (int64_t)ls->items[d].number;
        if (mesh_spec_check_shape(&res.spec, &m, ls->n, shape, key) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        n_named++;
    }
    cfg_json_free(named);
    cfg_json_free(logical);

    /* activations */
    cfg_json *input = helper_read_json(dir, "input_shardings.json");
    const cfg_json *dump = cfg_json_get(input, "Activation Sharding Dump");
    assert_non_null(dump);
    int n_act = 0, n_unknown = 0;
    for (int i = 0; i < dump->n; i++) {
        const cfg_json *entry = &dump->items[i];
        assert_int_equal(entry->kind, CFG_JSON_OBJECT);
        assert_int_equal(entry->n, 1);
        const char *key = entry->keys[0];
        const cfg_json *la = cfg_json_get(&entry->items[0], "logic_axes");
        const cfg_json *ps = cfg_json_get(&entry->items[0], "PartitionSpec");
        assert_non_null(la);
        assert_non_null(ps);
        /* the golden text itself parses and prints back unchanged */
        mesh_spec golden;
        if (mesh_spec_parse(ps->str, &m, &golden) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        char text[512];
        mesh_spec_format(&golden, &m, text, sizeof text);
        if (strcmp(text, ps->str) != 0) fail_msg("%s: %s reprinted as %s", rel, ps->str, text);
        if (strcmp(la->str, "Unknown") == 0) {
            n_unknown++;
            continue;
        }
        char names_buf[MESH_SPEC_MAX_RANK][128];
        const char *names[MESH_SPEC_MAX_RANK];
        int rank = parse_logic_axes(la->str, names_buf, names);
        int64_t shape[MESH_SPEC_MAX_RANK];
        assert_int_equal(parse_shape(key, shape), rank);
        mesh_resolved res;
        if (mesh_rules_resolve(&rules, &m, key, rank, names, &res) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        mesh_spec_format(&res.spec, &m, text, sizeof text);
        if (strcmp(text, ps->str) != 0)
            fail_msg("%s\n  %s %s\n  resolved %s\n  golden   %s", rel, key, la->str, text, ps->str);
        if (mesh_spec_check_shape(&res.spec, &m, rank, shape, key) != SIM_OK) fail_msg("%s: %s", rel, sim_errmsg());
        n_act++;
    }
    cfg_json_free(input);
    mesh_rules_free(&rules);

    char mdesc[512];
    printf("golden %s\n  mesh %s; %d/%d named specs, %d/%d activation specs matched "
           "(%d activations with logic_axes Unknown: text parsed and reprinted only)\n",
           rel, mesh_shape_format(&m, mdesc, sizeof mdesc), n_named, n_named, n_act, n_act, n_unknown);
    if (n_named == 0 || n_act == 0) fail_msg("%s: nothing compared", rel);
}

static void test_goldens(void **state)
{
    (void)state;
    if (n_dirs == 0) fail_msg("no golden directories under %s", goldens_root);
    cfg_args args = {NULL, NULL, NULL, 0, NULL, 0};
    cfg_config *base = NULL;
    if (cfg_load(&args, &base) != SIM_OK) fail_msg("%s", sim_errmsg());
    for (int i = 0; i < n_dirs; i++) check_directory(base, dirs[i]);
    cfg_free(base);
    printf("%d golden directories checked\n", n_dirs);
}

/* The directory-name reader on names MaxText uses elsewhere. */
static void test_override_split(void **state)
{
    (void)state;
    cfg_args args = {NULL, NULL, NULL, 0, NULL, 0};
    cfg_config *base = NULL;
    assert_int_equal(cfg_load(&args, &base), SIM_OK);
    char ovr[MAX_OVR][OVR_CAP];
    int n = 0;
    split_overrides(base, "ici_fsdp_parallelism=-1_ici_expert_parallelism=2_use_ring_of_experts=true", ovr, &n);
    assert_int_equal(n, 3);
    assert_string_equal(ovr[0], "ici_fsdp_parallelism=-1");
    assert_string_equal(ovr[1], "ici_expert_parallelism=2");
    assert_string_equal(ovr[2], "use_ring_of_experts=true");
    n = 0;
    split_overrides(base, "run_name=a_b_steps=3", ovr, &n);
    assert_int_equal(n, 2);
    assert_string_equal(ovr[0], "run_name=a_b");
    assert_string_equal(ovr[1], "steps=3");
    cfg_free(base);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_override_split),
        cmocka_unit_test(test_goldens),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

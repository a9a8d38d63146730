/* test_layers.c — the layer rules of the source tree, read from its #include "..." lines (the tests
 * run from the repository root; a private header, x_priv.h, is part of module x):
 *   (a) no include cycle between modules (a module is a .c and its .h: models/core/model.{c,h});
 *   (b) no layer includes a layer above it.  The order, bottom first: blas_kernels, sim, config,
 *       mesh, models/core, models/blocks, models/families and models/optimizers (one level), cli.
 * tests/ and bench/ may include anything and are not read.  The checks are exercised on small
 * made-up trees first, so a broken checker cannot pass the real tree silently. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

enum { MAX_MODS = 512, MAX_PATH = 256 };

static const struct {
    const char *dir;
    int level;
} LAYERS[] = {
    {"blas_kernels", 0}, {"sim", 1},           {"config", 2},          {"mesh", 3},
    {"models/core", 4},  {"models/blocks", 5}, {"models/families", 6}, {"models/optimizers", 6},
    {"cli", 7},
};
enum { N_LAYERS = sizeof LAYERS / sizeof LAYERS[0] };

/* Edges the tree still has that break rule (b), each with its reason; a new one fails the test. */
static const struct {
    const char *from, *to, *why;
} KNOWN[] = {
    {NULL, NULL, NULL}, /* none left (core reaches the optimizers through models/core/optimizer.h) */
};
enum { N_KNOWN = 0 };

/* Edges that close an include cycle the tree still has, each with its reason: the cycle search
 * leaves them out, so any other cycle fails the test. */
static const struct {
    const char *from, *to, *why;
} KNOWN_CYCLE[] = {
    {"config/config", "config/release",
     "loading a config applies its release (keys it lacks, its base rules), a release file is read as a config"},
};
enum { N_KNOWN_CYCLE = sizeof KNOWN_CYCLE / sizeof KNOWN_CYCLE[0] };

typedef struct {
    int n;
    char name[MAX_MODS][MAX_PATH]; /* module: path without its extension */
    unsigned char edge[MAX_MODS][MAX_MODS];
} graph;

/* The layer of a path ("models/core/model"), or -1 outside every layer. */
static int layer_of(const char *mod)
{
    int best = -1;
    size_t best_len = 0;
    for (int i = 0; i < N_LAYERS; i++) {
        size_t n = strlen(LAYERS[i].dir);
        if (!strncmp(mod, LAYERS[i].dir, n) && mod[n] == '/' && !strchr(mod + n + 1, '/') && n > best_len) {
            best = i;
            best_len = n;
        }
    }
    return best;
}

static int module(graph *g, const char *path)
{
    char m[MAX_PATH];
    snprintf(m, sizeof m, "%s", path);
    char *dot = strrchr(m, '.');
    if (dot && (!strcmp(dot, ".c") || !strcmp(dot, ".h"))) *dot = '\0';
    size_t n = strlen(m); /* a private header (machine_priv.h) belongs to its module */
    if (n > 5 && !strcmp(m + n - 5, "_priv")) m[n - 5] = '\0';
    for (int i = 0; i < g->n; i++)
        if (!strcmp(g->name[i], m)) return i;
    assert_true(g->n < MAX_MODS);
    snprintf(g->name[g->n], MAX_PATH, "%s", m);
    return g->n++;
}

static void add_edge(graph *g, const char *from_file, const char *to_file)
{
    int a = module(g, from_file), b = module(g, to_file);
    if (a != b) g->edge[a][b] = 1;
}

/* Reads `root/rel`'s #include "..." lines into g. */
static void read_file(graph *g, const char *root, const char *rel)
{
    char path[2 * MAX_PATH];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    module(g, rel);
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '#') continue;
        p++;
        while (*p == ' ' || *p == '\t') p++;
        if (strncmp(p, "include", 7)) continue;
        p += 7;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '"') continue;
        const char *e = strchr(p + 1, '"');
        if (!e) continue;
        char inc[MAX_PATH];
        snprintf(inc, sizeof inc, "%.*s", (int)(e - p - 1), p + 1);
        add_edge(g, rel, inc);
    }
    fclose(f);
}

/* Every .c and .h directly in each layer folder of root (missing folders are skipped). */
static void read_tree(graph *g, const char *root)
{
    memset(g, 0, sizeof *g);
    for (int i = 0; i < N_LAYERS; i++) {
        char dir[2 * MAX_PATH];
        snprintf(dir, sizeof dir, "%s/%s", root, LAYERS[i].dir);
        DIR *d = opendir(dir);
        if (!d) continue;
        struct dirent *de;
        while ((de = readdir(d))) {
            size_t n = strlen(de->d_name);
            if (n < 3 || (strcmp(de->d_name + n - 2, ".c") && strcmp(de->d_name + n - 2, ".h"))) continue;
            char rel[MAX_PATH];
            snprintf(rel, sizeof rel, "%s/%s", LAYERS[i].dir, de->d_name);
            read_file(g, root, rel);
        }
        closedir(d);
    }
}

static bool known(const char *from, const char *to)
{
    for (int i = 0; i < N_KNOWN; i++)
        if (!strcmp(KNOWN[i].from, from) && !strcmp(KNOWN[i].to, to)) return true;
    return false;
}

/* Rule (b): the edges going up, written into msg; their count (known ones left out when skip_known). */
static int upward_edges(const graph *g, bool skip_known, char *msg, size_t cap)
{
    int bad = 0;
    size_t o = 0;
    msg[0] = '\0';
    for (int a = 0; a < g->n; a++)
        for (int b = 0; b < g->n; b++) {
            if (!g->edge[a][b]) continue;
            int la = layer_of(g->name[a]), lb = layer_of(g->name[b]);
            if (la < 0 || lb < 0 || LAYERS[lb].level <= LAYERS[la].level) continue;
            if (skip_known && known(g->name[a], g->name[b])) continue;
            bad++;
            if (o < cap)
                o += (size_t)snprintf(msg + o, cap - o, "  %s includes %s (layer %s above %s)\n", g->name[a],
                                      g->name[b], LAYERS[lb].dir, LAYERS[la].dir);
        }
    return bad;
}

/* Rule (a): a cycle of modules, written into msg as "a -> b -> a"; 0 when there is none. */
static int find_cycle(const graph *g, char *msg, size_t cap)
{
    static int state[MAX_MODS], parent[MAX_MODS], stack[MAX_MODS], next[MAX_MODS];
    memset(state, 0, sizeof state);
    for (int s = 0; s < g->n; s++) {
        if (state[s]) continue;
        int top = 0;
        stack[top++] = s;
        state[s] = 1;
        next[s] = 0;
        parent[s] = -1;
        while (top) {
            int u = stack[top - 1];
            if (next[u] >= g->n) {
                state[u] = 2;
                top--;
                continue;
            }
            int v = next[u]++;
            if (!g->edge[u][v]) continue;
            if (state[v] == 1) { /* back edge: the cycle is v .. u -> v */
                int path[MAX_MODS], n = 0;
                for (int w = u; w != v; w = parent[w]) path[n++] = w;
                path[n++] = v;
                size_t o = (size_t)snprintf(msg, cap, "%s", g->name[v]);
                for (int i = n - 2; i >= 0 && o < cap; i--)
                    o += (size_t)snprintf(msg + o, cap - o, " -> %s", g->name[path[i]]);
                if (o < cap) snprintf(msg + o, cap - o, " -> %s", g->name[v]);
                return 1;
            }
            if (state[v] == 0) {
                state[v] = 1;
                parent[v] = u;
                next[v] = 0;
                stack[top++] = v;
            }
        }
    }
    msg[0] = '\0';
    return 0;
}

/* ------------------------------------------------------------ the checker on made-up trees */

static void write_file(const char *root, const char *rel, const char *text)
{
    char path[2 * MAX_PATH], dir[2 * MAX_PATH];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    snprintf(dir, sizeof dir, "%s", path);
    for (char *s = dir + strlen(root) + 1; (s = strchr(s, '/')); s++) {
        *s = '\0';
        mkdir(dir, 0755);
        *s = '/';
    }
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_checker_finds_what_it_must(void **state)
{
    (void)state;
    char root[] = "/tmp/shardsim-layers-XXXXXX";
    assert_non_null(mkdtemp(root));
    static graph g;
    char msg[4096];
    /* a clean tree: mesh below models/core below models/blocks; a module's .c includes its .h */
    write_file(root, "mesh/a.h", "#include <stdio.h>\n");
    write_file(root, "mesh/a.c", "#include \"mesh/a.h\"\n");
    write_file(root, "models/core/m.h", "#include \"mesh/a.h\"\n");
    write_file(root, "models/core/m.c", "  #  include \"models/core/m.h\"\n");
    write_file(root, "models/blocks/b.c", "#include \"models/core/m.h\"\n#include \"mesh/a.h\"\n");
    read_tree(&g, root);
    assert_int_equal(g.n, 3);
    assert_int_equal(upward_edges(&g, false, msg, sizeof msg), 0);
    assert_int_equal(find_cycle(&g, msg, sizeof msg), 0);
    /* core reaching up into blocks: one upward edge, and with b.c -> m.h a cycle m -> b -> m */
    write_file(root, "models/core/m.c", "#include \"models/core/m.h\"\n#include \"models/blocks/b.h\"\n");
    write_file(root, "models/blocks/b.h", "\n");
    read_tree(&g, root);
    assert_int_equal(upward_edges(&g, false, msg, sizeof msg), 1);
    assert_non_null(strstr(msg, "models/core/m includes models/blocks/b"));
    assert_int_equal(find_cycle(&g, msg, sizeof msg), 1);
    assert_non_null(strstr(msg, "models/core/m"));
    assert_non_null(strstr(msg, "models/blocks/b"));
    /* a cycle inside one layer (no upward edge): two families including each other's header */
    write_file(root, "models/core/m.c", "#include \"models/core/m.h\"\n");
    write_file(root, "models/families/x.c", "#include \"models/families/y.h\"\n");
    write_file(root, "models/families/y.c", "#include \"models/families/x.h\"\n");
    write_file(root, "models/families/x.h", "\n");
    write_file(root, "models/families/y.h", "\n");
    read_tree(&g, root);
    assert_int_equal(upward_edges(&g, false, msg, sizeof msg), 0);
    assert_int_equal(find_cycle(&g, msg, sizeof msg), 1);
    assert_non_null(strstr(msg, "models/families/x"));
    assert_non_null(strstr(msg, "models/families/y"));
    /* families and optimizers are one level: neither is above the other */
    write_file(root, "models/families/y.c", "#include \"models/optimizers/o.h\"\n");
    write_file(root, "models/optimizers/o.h", "\n");
    write_file(root, "models/optimizers/o.c", "#include \"models/blocks/b.h\"\n");
    read_tree(&g, root);
    assert_int_equal(upward_edges(&g, false, msg, sizeof msg), 0);
    assert_int_equal(find_cycle(&g, msg, sizeof msg), 0);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    assert_int_equal(system(cmd), 0);
}

/* ------------------------------------------------------------ the real tree */

static void test_no_layer_includes_one_above_it(void **state)
{
    (void)state;
    static graph g;
    read_tree(&g, ".");
    assert_true(g.n > 50); /* run from the repository root: the tree was read */
    char msg[8192];
    int bad = upward_edges(&g, true, msg, sizeof msg);
    if (bad) fail_msg("%d include(s) reach a layer above their own:\n%s", bad, msg);
    /* the known ones are still known for a reason: each is still in the tree */
    for (int i = 0; i < N_KNOWN; i++) {
        int a = -1, b = -1;
        for (int m = 0; m < g.n; m++) {
            if (!strcmp(g.name[m], KNOWN[i].from)) a = m;
            if (!strcmp(g.name[m], KNOWN[i].to)) b = m;
        }
        if (a < 0 || b < 0 || !g.edge[a][b])
            print_message("  (known upward include %s -> %s is gone: drop it from KNOWN)\n", KNOWN[i].from,
                          KNOWN[i].to);
        else print_message("  known upward include %s -> %s: %s\n", KNOWN[i].from, KNOWN[i].to, KNOWN[i].why);
    }
}

static void test_no_include_cycle_between_modules(void **state)
{
    (void)state;
    static graph g;
    read_tree(&g, ".");
    assert_true(g.n > 50);
    for (int i = 0; i < N_KNOWN_CYCLE; i++) {
        int a = -1, b = -1;
        for (int m = 0; m < g.n; m++) {
            if (!strcmp(g.name[m], KNOWN_CYCLE[i].from)) a = m;
            if (!strcmp(g.name[m], KNOWN_CYCLE[i].to)) b = m;
        }
        if (a >= 0 && b >= 0 && g.edge[a][b]) {
            print_message("  known cycle %s <-> %s: %s\n", KNOWN_CYCLE[i].from, KNOWN_CYCLE[i].to, KNOWN_CYCLE[i].why);
            g.edge[a][b] = 0;
        } else {
            print_message("  (known cycle %s <-> %s is gone: drop it from KNOWN_CYCLE)\n", KNOWN_CYCLE[i].from,
                          KNOWN_CYCLE[i].to);
        }
    }
    char msg[4096];
    if (find_cycle(&g, msg, sizeof msg)) fail_msg("include cycle between modules: %s", msg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checker_finds_what_it_must),
        cmocka_unit_test(test_no_layer_includes_one_above_it),
        cmocka_unit_test(test_no_include_cycle_between_modules),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* helpers.c — test support shared by the test files (see helpers.h). */
#include "tests/helpers.h"

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
#include <sys/wait.h>
#include <unistd.h>

#include "cli/common.h"

char *helper_read_file_opt(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s) rewind(f);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    fclose(f);
    if (!s) return NULL;
    s[n] = '\0';
    if (len) *len = (size_t)n;
    return s;
}

char *helper_read_file(const char *path, size_t *len)
{
    char *s = helper_read_file_opt(path, len);
    if (!s) fail_msg("cannot read %s", path);
    return s;
}

char *helper_read_in(const char *dir, const char *name, size_t *len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return helper_read_file(path, len);
}

void helper_write_file(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s", path);
    assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

void helper_rm_rf(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (d) {
            struct dirent *e;
            while ((e = readdir(d))) {
                if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
                char p[4096];
                snprintf(p, sizeof p, "%s/%s", path, e->d_name);
                helper_rm_rf(p);
            }
            closedir(d);
        }
        rmdir(path);
    } else {
        unlink(path);
    }
}

cfg_json *helper_read_json(const char *dir, const char *name)
{
    char path[4096];
    if (dir) snprintf(path, sizeof path, "%s/%s", dir, name);
    else snprintf(path, sizeof path, "%s", name);
    cfg_json *j = NULL;
    if (cfg_json_read_file(path, &j) != SIM_OK) fail_msg("cannot read %s: %s", path, sim_errmsg());
    return j;
}

const char *helper_program(void)
{
    static char program[1024];
    ssize_t n = readlink("/proc/self/exe", program, sizeof program - 1);
    if (n <= 0 || (size_t)n >= sizeof program - 1) return NULL;
    program[n] = '\0';
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(program, '/');
        if (!slash) return NULL;
        *slash = '\0';
    }
    if (strlen(program) + sizeof "/shardsim" > sizeof program) return NULL;
    strcat(program, "/shardsim");
    return access(program, X_OK) == 0 ? program : NULL;
}

int helper_run_shell(const char *cmd, char *out, size_t cap)
{
    FILE *p = popen(cmd, "r");
    if (!p) fail_msg("cannot run %s", cmd);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

const cfg_json *helper_json_get(const cfg_json *v, const char *key)
{
    const cfg_json *x = cfg_json_get(v, key);
    if (!x) fail_msg("key '%s' missing", key);
    return x;
}

char *helper_tmpdir(const char *tag)
{
    char tmpl[256];
    snprintf(tmpl, sizeof tmpl, "/tmp/shardsim_%s.XXXXXX", tag);
    char *d = mkdtemp(tmpl);
    if (!d) fail_msg("cannot make a folder from %s", tmpl);
    return strdup(d);
}

int helper_count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) fail_msg("cannot open %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

const char *helper_reference_dir(void)
{
    static char dir[4096];
    const char *env = getenv("SHARDSIM_REFERENCE");
    struct stat st;
    if (env && *env) {
        snprintf(dir, sizeof dir, "%s", env);
    } else {
        char root[2048];
        snprintf(root, sizeof root, "%s", cli_configs_dir());
        char *slash = strrchr(root, '/');
        if (slash) *slash = '\0';
        else snprintf(root, sizeof root, ".");
        snprintf(dir, sizeof dir, "%s/tests/data", root);
        if (stat(dir, &st) != 0) snprintf(dir, sizeof dir, "tests/data");
    }
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        fail_msg("MaxText reference data not found at '%s' (set SHARDSIM_REFERENCE to the directory holding "
                 "maxtext/configs and maxtext/goldens)",
                 dir);
    return dir;
}

mesh_shape helper_mesh(int n, const char *const *names, const int *sizes)
{
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, n, names, sizes), SIM_OK);
    return m;
}

mesh_spec helper_spec(const mesh_shape *m, const char *text)
{
    mesh_spec s;
    if (mesh_spec_parse(text, m, &s) != SIM_OK) fail_msg("parse %s: %s", text, sim_errmsg());
    return s;
}

static sim_machine *machine_of(const sim_mesh_desc *md, sim_machine_opts o)
{
    o.quiet = true;
    sim_machine *mach = NULL;
    assert_int_equal(sim_machine_new(md, &o, &mach), SIM_OK);
    return mach;
}

static sim_machine_opts dry_opts(bool dry)
{
    sim_machine_opts o = {0};
    o.dry_run = dry;
    return o;
}

sim_machine *helper_machine(const mesh_shape *m, bool dry)
{
    sim_mesh_desc md;
    assert_int_equal(mesh_shape_to_sim(m, &md), SIM_OK);
    return machine_of(&md, dry_opts(dry));
}

sim_machine *helper_sim_machine_opts(int naxes, const char *const *names, const int *sizes, sim_machine_opts o)
{
    sim_mesh_desc md;
    assert_int_equal(sim_mesh_desc_make(naxes, names, sizes, &md), SIM_OK);
    return machine_of(&md, o);
}

sim_machine *helper_sim_machine(int naxes, const char *const *names, const int *sizes, bool dry)
{
    return helper_sim_machine_opts(naxes, names, sizes, dry_opts(dry));
}

helper_sum helper_sum_records(sim_machine *m, int d, sim_op op, sim_phase ph, const char *prefix)
{
    /* the records as read back: a dry run's repeated microbatches expanded */
    sim_walk w;
    sim_walk_device(&w, sim_machine_device(m, d));
    helper_sum s = {0, 0};
    for (const sim_record *r; (r = sim_walk_next_record(&w));)
        if (r->op == op && r->phase == ph && (!prefix || !strncmp(r->tag, prefix, strlen(prefix)))) {
            s.bytes += r->bytes_sent;
            s.calls++;
        }
    return s;
}

uint64_t helper_rng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

mesh_spec helper_random_spec(const mesh_shape *m, int rank, uint64_t *rng, bool allow_partial)
{
    mesh_spec s;
    mesh_spec_init(&s, rank);
    for (int a = 0; a < m->n_axes; a++) {
        int r = (int)(helper_rng_next(rng) % (uint64_t)(rank + 2));
        if (r == rank) continue;
        if (r == rank + 1) {
            if (allow_partial) s.partial |= 1u << a;
            continue;
        }
        int pos = (int)(helper_rng_next(rng) % (uint64_t)(s.n_axes[r] + 1));
        for (int i = s.n_axes[r]; i > pos; i--) s.axes[r][i] = s.axes[r][i - 1];
        s.axes[r][pos] = (int8_t)a;
        s.n_axes[r]++;
    }
    return s;
}

float helper_det_val(uint32_t i, float scale)
{
    i = i * 2654435761u + 12345u;
    i ^= i >> 13;
    i *= 0x5bd1e995u;
    i ^= i >> 15;
    return ((float)(i % 2001) / 1000.0f - 1.0f) * scale;
}

/* ------------------------------------------------------------ HTML reports */

static const char *headless_browser(void)
{
    const char *browsers[] = {"chromium", "chromium-browser", "google-chrome"};
    char cmd[256];
    for (size_t i = 0; i < sizeof browsers / sizeof browsers[0]; i++) {
        snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", browsers[i]);
        if (system(cmd) == 0) return browsers[i];
    }
    return NULL;
}

char *helper_render_html(const char *workdir, const char *html)
{
    const char *found = headless_browser();
    if (!found) {
        print_message("rendering %s skipped: no headless browser (chromium); bash .ci/install-deps installs it\n",
                      html);
        skip();
        return NULL;
    }
    char out[700], cmd[2400];
    snprintf(out, sizeof out, "%s/dom.html", workdir);
    snprintf(cmd, sizeof cmd,
             "timeout 120 %s --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir=%s/profile "
             "--dump-dom file://%s > %s 2>/dev/null",
             found, workdir, html, out);
    int rc = system(cmd);
    assert_int_equal(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, 0);
    char *dom = helper_read_file_opt(out, NULL);
    assert_non_null(dom);
    return dom;
}

void helper_assert_self_contained(const char *html)
{
    assert_null(strstr(html, "<script src"));
    assert_null(strstr(html, "<link"));
    assert_null(strstr(html, "src=\"http"));
    assert_null(strstr(html, "href=\"http"));
    assert_null(strstr(html, "@import"));
    assert_null(strstr(html, "url("));
}

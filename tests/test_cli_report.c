/* test_cli_report.c — console reports and run artifacts.
 *
 * An 8-device machine (data=2 x fsdp=4) runs a few tagged collectives over
 * three steps and allocates in its arenas, so the traffic pivot, the CSV
 * files, metrics.json and the memory table are checked against real records
 * and real arena statistics (sums recomputed here from the records).  The
 * MaxText dump writer is fed the entries of MaxText's own golden dumps and
 * must reproduce them byte for byte (and as parsed JSON) — as given, and as
 * a whole train state rebuilt from the parameters alone.  The reference
 * directory is $SHARDSIM_REFERENCE, else tests/data in the repo;
 * a missing one fails the test. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/artifacts.h"
#include "cli/common.h"
#include "cli/report.h"
#include "config/json.h"
#include "mesh/rules.h"
#include "sim/collectives.h"

#define assert_contains(hay, needle)                                                    \
    do {                                                                                \
        if (!strstr((hay), (needle))) fail_msg("'%s' not found in:\n%s", (needle), (hay)); \
    } while (0)

enum { PATH_CAP = 1024, NDEV = 8, MIB = 1 << 20 };

/* ======================================================================== */
/* helpers                                                                  */
/* ======================================================================== */

static char *make_tmpdir(void)
{
    char tmpl[] = "/tmp/shardsim_test_cli_report.XXXXXX";
    char *d = mkdtemp(tmpl);
    assert_non_null(d);
    return strdup(d);
}

static void rm_rf(const char *path)
{
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char p[PATH_CAP];
            snprintf(p, sizeof p, "%s/%s", path, e->d_name);
            rm_rf(p);
        }
        closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot read %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return s;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static mesh_json *parse_file(const char *dir, const char *name)
{
    char p[PATH_CAP];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    mesh_json *j = NULL;
    if (mesh_json_read_file(p, &j) != SIM_OK) fail_msg("%s does not parse: %s", p, sim_errmsg());
    return j;
}

static const mesh_json *get(const mesh_json *v, const char *key)
{
    const mesh_json *x = mesh_json_get(v, key);
    if (!x) fail_msg("key '%s' missing", key);
    return x;
}


/* The reference directory: $SHARDSIM_REFERENCE, else tests/data in the
 * repository (the parent of configs/), else from the cwd. */
static const char *reference_dir(void)
{
    static char dir[PATH_CAP];
    const char *env = getenv("SHARDSIM_REFERENCE");
    struct stat st;
    if (env && *env) {
        snprintf(dir, sizeof dir, "%s", env);
    } else {
        char root[PATH_CAP / 2];
        snprintf(root, sizeof root, "%s", cli_configs_dir());
        char *slash = strrchr(root, '/');
        if (slash) *slash = '\0';
        else snprintf(root, sizeof root, ".");
        snprintf(dir, sizeof dir, "%s/tests/data", root);
        if (stat(dir, &st) != 0) snprintf(dir, sizeof dir, "tests/data");
    }
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        fail_msg("reference directory '%s' not found (set SHARDSIM_REFERENCE to the directory holding "
                 "maxtext/goldens)", dir);
    return dir;
}

/* ======================================================================== */
/* the test machine                                                         */
/* ======================================================================== */

enum { AX_DATA = 0, AX_FSDP = 1, RECS_PER_DEV = 8 };

/* Device program: three steps of tagged collectives, arena allocations that
 * differ between devices 0-3 and 4-7. */
static sim_status run_device(sim_device *d, void *arg)
{
    (void)arg;
    int id = sim_device_id(d);
    sim_arena *a = sim_device_arena(d);
    void *w, *g, *m, *t, *act, *comm;
    SIM_TRY(sim_arena_alloc(a, MIB, SIM_MEM_PARAMS, "w", true, &w));
    SIM_TRY(sim_arena_alloc(a, MIB, SIM_MEM_GRADS, "g", true, &g));
    SIM_TRY(sim_arena_alloc(a, 2 * MIB, SIM_MEM_OPTIMIZER, "m", true, &m));
    /* a temporary freed before the peak: counts in peak_by, not at_peak_by */
    SIM_TRY(sim_arena_alloc(a, MIB, SIM_MEM_TEMP, "t", true, &t));
    sim_arena_release(a, t, MIB, SIM_MEM_TEMP);
    size_t actb = (size_t)(id < 4 ? 3 : 5) * MIB;
    SIM_TRY(sim_arena_alloc(a, actb, SIM_MEM_ACTIVATIONS, "act", true, &act));
    SIM_TRY(sim_arena_alloc(a, 4096, SIM_MEM_COMM, "buf", true, &comm));

    float send[256], recv[1024];
    for (int i = 0; i < 256; i++) send[i] = (float)(id * 256 + i);
    sim_axes fsdp = sim_axes_1(AX_FSDP), data = sim_axes_1(AX_DATA), both = sim_axes_2(AX_DATA, AX_FSDP);
    int perm[4] = {1, 2, 3, -1}; /* rank 3 sends nothing: bytes differ per device */

    sim_device_set_step(d, 1);
    sim_device_set_phase(d, SIM_PHASE_FORWARD);
    SIM_TRY(sim_all_gather(d, send, recv, 16, SIM_F32, fsdp, sim_meta_tag("layer_0/mlp/wi_0")));
    SIM_TRY(sim_all_gather(d, send, recv, 16, SIM_F32, fsdp, sim_meta_tag("layer_1/mlp/wi_0")));
    sim_device_set_phase(d, SIM_PHASE_BACKWARD);
    SIM_TRY(sim_reduce_scatter(d, send, recv, 64, SIM_F32, fsdp, sim_meta_tag("layer_0/mlp/wi_0.grad")));
    SIM_TRY(sim_all_reduce(d, send, recv, 32, SIM_F32, both, sim_meta_tag("grads/norm")));
    SIM_TRY(sim_ppermute(d, send, recv, 8, perm, SIM_F32, fsdp, sim_meta_tag("pipeline/shift,\"odd\"")));

    sim_device_set_step(d, 2);
    sim_device_set_phase(d, SIM_PHASE_FORWARD);
    SIM_TRY(sim_all_to_all(d, send, recv, 32, SIM_F32, fsdp, sim_meta_implicit("moe/dispatch")));
    SIM_TRY(sim_all_gather(d, send, recv, 8, SIM_BF16, data, sim_meta_tag("embed/lookup")));

    sim_device_set_step(d, 3);
    sim_device_set_phase(d, SIM_PHASE_OPTIMIZER);
    SIM_TRY(sim_all_reduce(d, send, recv, 4, SIM_F32, data, sim_meta_tag("optimizer/count")));

    sim_arena_release(a, comm, 4096, SIM_MEM_COMM);
    sim_arena_release(a, act, actb, SIM_MEM_ACTIVATIONS);
    sim_arena_release(a, m, 2 * MIB, SIM_MEM_OPTIMIZER);
    sim_arena_release(a, g, MIB, SIM_MEM_GRADS);
    sim_arena_release(a, w, MIB, SIM_MEM_PARAMS);
    return SIM_OK;
}

static sim_machine *run_machine(bool trace)
{
    const char *names[] = {"data", "fsdp"};
    int sizes[] = {2, 4};
    sim_mesh_desc md;
    assert_int_equal(sim_mesh_desc_make(2, names, sizes, &md), SIM_OK);
    sim_machine_opts o = {0};
    o.quiet = true;
    o.trace = trace;
    sim_machine *m = NULL;
    assert_int_equal(sim_machine_new(&md, &o, &m), SIM_OK);
    if (sim_machine_run(m, run_device, NULL) != SIM_OK) fail_msg("machine run failed: %s", sim_errmsg());
    return m;
}

/* ======================================================================== */
/* traffic pivot                                                            */
/* ======================================================================== */

/* Checks t against sums recomputed from the records. */
static void check_pivot(const cli_records *r, const cli_traffic *t, cli_step_range steps)
{
    uint64_t n_in = 0, bytes_in = 0, calls_rows = 0, bytes_rows = 0;
    for (int d = 0; d < r->n_devices; d++)
        for (size_t i = 0; i < r->n[d]; i++)
            if (r->recs[d][i].step >= steps.first && r->recs[d][i].step <= steps.last) {
                n_in++;
                bytes_in += r->recs[d][i].bytes_sent;
            }
    double share = 0;
    for (int k = 0; k < t->n_rows; k++) {
        const cli_traffic_row *row = &t->rows[k];
        calls_rows += row->calls;
        bytes_rows += row->bytes;
        share += row->share;
        /* the row's own sums, recomputed */
        uint64_t calls = 0, bytes = 0, mx = 0, mn = UINT64_MAX;
        for (int d = 0; d < r->n_devices; d++) {
            uint64_t b = 0;
            for (size_t i = 0; i < r->n[d]; i++) {
                const sim_record *x = &r->recs[d][i];
                if (x->step < steps.first || x->step > steps.last || x->op != row->op ||
                    x->phase != row->phase || x->axes.n != row->axes.n ||
                    memcmp(x->axes.axis, row->axes.axis, (size_t)x->axes.n))
                    continue;
                calls++;
                b += x->bytes_sent;
            }
            bytes += b;
            if (b > mx) mx = b;
            if (b < mn) mn = b;
        }
        assert_int_equal(row->calls, calls);
        assert_int_equal(row->bytes, bytes);
        assert_int_equal(row->bytes_max, mx);
        assert_int_equal(row->bytes_min, mn);
        assert_true(fabs(row->bytes_mean - (double)bytes / r->n_devices) < 1e-9);
        if (k) { /* sorted by bytes, then calls */
            const cli_traffic_row *prev = &t->rows[k - 1];
            assert_true(prev->bytes > row->bytes || (prev->bytes == row->bytes && prev->calls >= row->calls));
        }
    }
    assert_int_equal(calls_rows, n_in);
    assert_int_equal(bytes_rows, bytes_in);
    assert_int_equal(t->total.calls, n_in);
    assert_int_equal(t->total.bytes, bytes_in);
    if (bytes_in) assert_true(fabs(share - 1.0) < 1e-12);
}

static void test_traffic_pivot(void **state)
{
    (void)state;
    sim_machine *m = run_machine(false);
    cli_records r;
    cli_records_from_machine(m, &r);
    assert_int_equal(r.n_devices, NDEV);
    for (int d = 0; d < NDEV; d++) assert_int_equal(r.n[d], RECS_PER_DEV);

    cli_traffic t;
    assert_int_equal(cli_traffic_build(&r, cli_steps_all(), &t), SIM_OK);
    assert_int_equal(t.n_rows, 7); /* 8 calls, the two fsdp all-gathers share a cell */
    check_pivot(&r, &t, cli_steps_all());
    /* the ppermute cell: ranks 0-2 send 8 floats, rank 3 nothing */
    int found = 0;
    for (int k = 0; k < t.n_rows; k++) {
        if (t.rows[k].op != SIM_OP_PPERMUTE) continue;
        found = 1;
        assert_int_equal(t.rows[k].bytes_max, 32);
        assert_int_equal(t.rows[k].bytes_min, 0);
        assert_int_equal(t.rows[k].calls, NDEV);
    }
    assert_true(found);
    assert_int_equal(t.total.calls_max, RECS_PER_DEV);

    /* the console table: header, one line per row, a rule, a total line */
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    cli_report_traffic(f, &t);
    fclose(f);
    assert_contains(out, "all steps, 8 devices");
    assert_contains(out, "calls/dev");
    assert_contains(out, "mean/device");
    assert_contains(out, " B "); /* under 1 KiB per device in all: printed in bytes */
    assert_contains(out, "data+fsdp");
    assert_contains(out, "\ntotal ");
    assert_contains(out, "\naxes: the mesh axes"); /* the legend */
    assert_int_equal(count_lines(out), 1 + 1 + 1 + t.n_rows + 1 + 1 + 3);
    /* the largest row comes first */
    char first[64];
    snprintf(first, sizeof first, "\n%s", sim_op_name(t.rows[0].op));
    assert_contains(out, first);
    free(out);
    cli_traffic_free(&t);

    /* a step range: step 1 only */
    assert_int_equal(cli_traffic_build(&r, cli_steps(1, 1), &t), SIM_OK);
    assert_int_equal(t.n_rows, 4);
    check_pivot(&r, &t, cli_steps(1, 1));
    assert_int_equal(t.total.calls, 5 * NDEV);
    f = open_memstream(&out, &len);
    cli_report_traffic(f, &t);
    fclose(f);
    assert_contains(out, "step 1,");
    free(out);
    cli_traffic_free(&t);

    assert_int_equal(cli_traffic_build(&r, cli_steps(2, 3), &t), SIM_OK);
    check_pivot(&r, &t, cli_steps(2, 3));
    assert_int_equal(t.total.calls, 3 * NDEV);
    cli_traffic_free(&t);
    sim_machine_free(m);
}

/* ======================================================================== */
/* CSV files                                                                */
/* ======================================================================== */

static void test_csv_files(void **state)
{
    (void)state;
    sim_machine *m = run_machine(false);
    cli_records r;
    cli_records_from_machine(m, &r);
    char *dir = make_tmpdir();
    char sub[PATH_CAP / 2], p[PATH_CAP];
    snprintf(sub, sizeof sub, "%s/out/run1", dir); /* missing parents are created */

    assert_int_equal(cli_write_collectives_csv(sub, &r, cli_steps_all(), 0), SIM_OK);
    snprintf(p, sizeof p, "%s/collectives.csv", sub);
    char *csv = read_all(p, NULL);
    assert_int_equal(count_lines(csv), 1 + NDEV * RECS_PER_DEV);
    const char *hdr =
        "device,step,phase,tag,op,mesh_axes,group_size,dtype,elements,bytes_sent,bytes_recv,kind,bytes_sent_dcn\n";
    assert_true(!strncmp(csv, hdr, strlen(hdr)));
    /* device 0's first call: all-gather of 16 floats over fsdp (k=4): 3*64 bytes */
    assert_contains(csv, "\n0,1,forward,layer_0/mlp/wi_0,all-gather,fsdp,4,float32,16,192,192,explicit,0\n");
    assert_contains(csv, ",all-reduce,data+fsdp,8,float32,32,");
    assert_contains(csv, "moe/dispatch,all-to-all,fsdp,4,float32,32,96,96,implicit,0\n");
    assert_contains(csv, ",\"pipeline/shift,\"\"odd\"\"\",ppermute,");
    free(csv);

    assert_int_equal(cli_write_collectives_csv(sub, &r, cli_steps(3, 3), 0), SIM_OK);
    csv = read_all(p, NULL);
    assert_int_equal(count_lines(csv), 1 + NDEV);
    free(csv);

    cli_traffic t;
    assert_int_equal(cli_traffic_build(&r, cli_steps_all(), &t), SIM_OK);
    assert_int_equal(cli_write_traffic_csv(sub, &t), SIM_OK);
    snprintf(p, sizeof p, "%s/traffic.csv", sub);
    csv = read_all(p, NULL);
    assert_int_equal(count_lines(csv), 1 + t.n_rows); /* a header and the rows: no total row */
    assert_contains(csv, "op,mesh_axes,phase,calls,calls_per_device,bytes_per_device_mean,bytes_per_device_max,"
                         "bytes_total,share,bytes_per_device_dcn_mean\n");
    assert_null(strstr(csv, "\ntotal,"));
    /* the rows' bytes_total column sums to every byte recorded */
    uint64_t sum = 0;
    const char *line = strchr(csv, '\n') + 1;
    for (int k = 0; k < t.n_rows; k++) {
        const char *c = line;
        for (int field = 0; field < 7; field++) c = strchr(c, ',') + 1;
        sum += strtoull(c, NULL, 10);
        line = strchr(line, '\n') + 1;
    }
    assert_int_equal(sum, t.total.bytes);
    free(csv);
    /* only the two files, no temporaries left */
    assert_int_equal(count_entries(sub), 2);
    cli_traffic_free(&t);
    rm_rf(dir);
    free(dir);
    sim_machine_free(m);
}

/* ======================================================================== */
/* metrics.json and the memory table                                        */
/* ======================================================================== */

static void test_metrics_and_memory(void **state)
{
    (void)state;
    sim_machine *m = run_machine(false);
    sim_arena_stats st[NDEV];
    cli_memory_collect(m, st);
    for (int d = 0; d < NDEV; d++) {
        size_t act = (size_t)(d < 4 ? 3 : 5) * MIB;
        assert_int_equal(st[d].peak, 4 * MIB + act + 4096);
        assert_int_equal(st[d].at_peak_by[SIM_MEM_ACTIVATIONS], act);
        assert_int_equal(st[d].at_peak_by[SIM_MEM_TEMP], 0);
        assert_int_equal(st[d].peak_by[SIM_MEM_TEMP], MIB);
    }
    assert_int_equal(cli_memory_max_peak(m), 9 * MIB + 4096);

    cli_step_metrics steps[3] = {
        {1, 10.5, 2.25, 3e-4, 0.5, 4096, 11 * MIB, false, 0, false, 2.25},
        {2, 9.75, 1.5, 3e-4, 0.25, 8192, 11 * MIB, false, 0, false, 6.5}, /* clipped to 1.5 */
        {3, NAN, 0, 3e-4, 0.25, 8192, 11 * MIB, true, 0, false, 0},
    };
    char *dir = make_tmpdir();
    assert_int_equal(cli_write_metrics_json(dir, steps, 3, st, NDEV), SIM_OK);
    mesh_json *j = parse_file(dir, "metrics.json");
    const mesh_json *s = get(j, "steps");
    assert_int_equal(s->n, 3);
    assert_true(get(&s->items[0], "loss")->number == 10.5);
    assert_true(get(&s->items[1], "grad_norm")->number == 1.5);
    assert_true(get(&s->items[1], "raw_grad_norm")->number == 6.5);
    assert_int_equal(get(&s->items[2], "raw_grad_norm")->kind, MESH_JSON_NULL);
    assert_true(get(&s->items[1], "lr")->number == 3e-4);
    assert_true(get(&s->items[1], "time_s")->number == 0.25);
    assert_int_equal(get(&s->items[2], "step")->number, 3);
    assert_int_equal(get(&s->items[2], "loss")->kind, MESH_JSON_NULL);
    assert_int_equal(get(&s->items[2], "tokens_per_s")->kind, MESH_JSON_NULL); /* a dry step */
    assert_true(get(&s->items[1], "tokens_per_s")->number > 0);
    const mesh_json *mem = get(j, "memory");
    const mesh_json *peak = get(mem, "per_device_peak_bytes");
    assert_int_equal(peak->n, NDEV);
    const mesh_json *by = get(mem, "by_category");
    assert_int_equal(by->n, SIM_NMEM);
    for (int d = 0; d < NDEV; d++) {
        assert_true(peak->items[d].number == (double)st[d].peak);
        double sum = 0;
        for (int c = 0; c < SIM_NMEM; c++) {
            const mesh_json *cat = get(by, sim_mem_cat_name((sim_mem_cat)c));
            assert_int_equal(cat->n, NDEV);
            assert_true(cat->items[d].number == (double)st[d].at_peak_by[c]);
            sum += cat->items[d].number;
        }
        assert_true(sum == (double)st[d].peak); /* the breakdown at peak adds up to the peak */
    }
    assert_true(get(by, "params")->items[5].number == MIB);
    mesh_json_free(j);
    rm_rf(dir);
    free(dir);

    /* memory table: devices 0-3 and 4-7 collapse into two rows */
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    cli_report_memory(f, st, NDEV);
    fclose(f);
    assert_contains(out, " MiB"); /* each figure in the unit that fits it */
    assert_contains(out, "\n0-3 ");
    assert_contains(out, "\n4-7 ");
    assert_contains(out, "activations");
    assert_contains(out, "temporaries");
    assert_contains(out, "\ndevices: devices with identical figures share a row"); /* the legend */
    assert_int_equal(count_lines(out), 3 + 2 + 4); /* title, header, rule; two rows; the 4-line legend */
    free(out);

    /* all equal: one row "0-7"; scattered: "0,2,4,6" */
    sim_arena_stats same[NDEV];
    for (int d = 0; d < NDEV; d++) same[d] = st[0];
    f = open_memstream(&out, &len);
    cli_report_memory(f, same, NDEV);
    fclose(f);
    assert_contains(out, "\n0-7 ");
    assert_int_equal(count_lines(out), 3 + 1 + 4); /* title, header, rule; one row; the 4-line legend */
    free(out);
    for (int d = 1; d < NDEV; d += 2) same[d] = st[7];
    f = open_memstream(&out, &len);
    cli_report_memory(f, same, NDEV);
    fclose(f);
    assert_contains(out, "\n0,2,4,6 ");
    assert_contains(out, "\n1,3,5,7 ");
    free(out);
    sim_machine_free(m);
}

/* ======================================================================== */
/* console lines                                                            */
/* ======================================================================== */

static void test_console(void **state)
{
    (void)state;
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    cli_kv rows[] = {
        {"model", "llama2-7b"},
        {"mesh", "data=2 fsdp=4 (8 devices)"},
        {"batch", "16 x 2048"},
        {"rules", "a very long value that goes on and on, listing rule after rule, "
                  "until it has to wrap onto a second line of the box, and even a third one maybe"},
    };
    cli_report_config_box(f, "shardsim train", rows, 4);
    fclose(f);
    /* every line of the box has the same width */
    int lines = 0;
    size_t w = 0;
    for (char *s = out; *s;) {
        char *e = strchr(s, '\n');
        assert_non_null(e);
        size_t l = (size_t)(e - s);
        if (!w) w = l;
        assert_int_equal(l, w);
        lines++;
        s = e + 1;
    }
    assert_int_equal(lines, 3 + 1 + 4 + 1); /* rules, title, rows, one continuation line */
    assert_contains(out, "| model ");
    assert_contains(out, "llama2-7b");
    assert_contains(out, "| shardsim train ");
    free(out);

    /* step header and lines have the same width; dry runs print '-' */
    f = open_memstream(&out, &len);
    cli_report_step_header(f);
    cli_step_metrics s1 = {12, 2.345678, 0.5, 1e-4, 1.25, 32768, 3 * MIB / 2, false, 0, false, 7.25};
    cli_step_metrics s2 = {13, 0, 0, 1e-4, 1.25, 32768, 3 * MIB / 2, true, 0, false, 0};
    cli_report_step_line(f, &s1);
    cli_report_step_line(f, &s2);
    fclose(f);
    char *l1 = strchr(out, '\n') + 1, *l2 = strchr(l1, '\n') + 1;
    assert_int_equal(l1 - out, l2 - l1);
    assert_int_equal(strlen(l2), (size_t)(l1 - out));
    assert_contains(out, "peak/device");
    assert_contains(out, "tokens/s");
    assert_contains(l1, "2.34568");
    assert_contains(l1, " 5.0000e-01  7.2500e+00 "); /* grad norm (clipped), then raw norm */
    assert_contains(out, "grad norm    raw norm");
    assert_contains(l1, " 32768 ");    /* tokens/s of a real step */
    assert_contains(l1, " 1.50 MiB\n");
    assert_contains(l2, " - ");
    assert_null(strstr(l2, "32768")); /* a dry run has no throughput */
    free(out);

    /* bytes in the unit that fits them */
    char bb[32];
    assert_string_equal(cli_bytes_text(48, bb, sizeof bb), "48 B");
    assert_string_equal(cli_bytes_text(1023, bb, sizeof bb), "1023 B");
    assert_string_equal(cli_bytes_text(1024, bb, sizeof bb), "1.00 KiB");
    assert_string_equal(cli_bytes_text(336.0 * 1024, bb, sizeof bb), "336 KiB");
    assert_string_equal(cli_bytes_text(1.5 * 1024 * 1024, bb, sizeof bb), "1.50 MiB");
    assert_string_equal(cli_bytes_text(25.5 * 1024 * 1024 * 1024, bb, sizeof bb), "25.5 GiB");
    assert_string_equal(cli_bytes_text(3.0 * 1024 * 1024 * 1024 * 1024, bb, sizeof bb), "3.00 TiB");

    char buf[256];
    assert_string_equal(cli_progress_format(0.42, "compiling", buf, sizeof buf),
                        "[============>                 ]  42% compiling");
    assert_string_equal(cli_progress_format(1.0, NULL, buf, sizeof buf),
                        "[==============================] 100%");
    assert_string_equal(cli_progress_format(-1, "x", buf, sizeof buf),
                        "[>                             ]   0% x");
    /* not a terminal: nothing */
    f = open_memstream(&out, &len);
    cli_progress(f, 0.5, "work");
    cli_progress_done(f);
    fclose(f);
    assert_int_equal(len, 0);
    free(out);

    mesh_shape ms;
    const char *names[] = {"data", "stage", "fsdp", "tensor"};
    int sizes[] = {2, 1, 4, 1};
    assert_int_equal(mesh_shape_init(&ms, 4, names, sizes), SIM_OK);
    assert_string_equal(cli_mesh_summary(&ms, buf, sizeof buf), "data=2 fsdp=4 (8 devices)");
    int ones[] = {1, 1, 1, 1};
    assert_int_equal(mesh_shape_init(&ms, 4, names, ones), SIM_OK);
    assert_string_equal(cli_mesh_summary(&ms, buf, sizeof buf), "1 device");
}

/* ======================================================================== */
/* run.json and trace.json                                                  */
/* ======================================================================== */

static void test_run_and_trace(void **state)
{
    (void)state;
    const char *ovr[] = {"ici_fsdp_parallelism=4", "ici_data_parallelism=2", "per_device_batch_size=2"};
    mesh_cfg_args args = {cli_base_config(), NULL, NULL, 0, ovr, 3};
    mesh_cfg *cfg = NULL;
    if (mesh_cfg_load(&args, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    mesh_shape ms;
    if (mesh_shape_from_config(cfg, &ms) != SIM_OK) fail_msg("mesh: %s", sim_errmsg());
    mesh_rules rules;
    mesh_rules_init(&rules);
    assert_int_equal(mesh_rules_from_config(cfg, &rules), SIM_OK);

    char *dir = make_tmpdir();
    const char *argv[] = {"train", "ici_fsdp_parallelism=4"};
    cli_run_info info = {"train", 2, argv, cfg, &ms, &rules, NULL, (time_t)1700000000, NULL, NULL, NULL, NULL, NULL};
    assert_int_equal(cli_write_run_json(dir, &info), SIM_OK);
    mesh_json *j = parse_file(dir, "run.json");
    assert_string_equal(get(j, "shardsim_version")->str, CLI_SHARDSIM_VERSION);
    assert_string_equal(get(j, "time")->str, "2023-11-14T22:13:20Z");
    assert_string_equal(get(j, "command")->str, "train");
    assert_int_equal(get(j, "argv")->n, 2);
    const mesh_json *mesh = get(j, "mesh");
    assert_int_equal(get(mesh, "axis_names")->n, ms.n_axes);
    assert_int_equal(get(get(mesh, "shape"), "fsdp")->number, 4);
    assert_int_equal(get(get(mesh, "shape"), "data")->number, 2);
    assert_int_equal(get(mesh, "num_devices")->number, 8);
    const mesh_json *rl = get(j, "logical_axis_rules");
    assert_int_equal(rl->n, rules.n);
    assert_string_equal(rl->items[0].items[0].str, rules.rules[0].name);
    assert_int_equal(rl->items[0].items[1].n, rules.rules[0].n_axes);
    const mesh_json *c = get(j, "config");
    assert_int_equal(c->n, cfg->n);
    const mesh_json *fsdp = get(c, "ici_fsdp_parallelism");
    assert_int_equal(get(fsdp, "value")->kind, MESH_JSON_NUMBER);
    assert_int_equal(get(fsdp, "value")->number, 4);
    assert_string_equal(get(fsdp, "source")->str, mesh_cfg_find(cfg, "ici_fsdp_parallelism")->where);
    const mesh_json *pdbs = get(c, "per_device_batch_size");
    assert_true(get(pdbs, "value")->number == 2);
    assert_contains(get(get(c, "base_emb_dim"), "source")->str, "base.yml:");
    assert_int_equal(get(get(c, "logical_axis_rules"), "value")->kind, MESH_JSON_ARRAY);
    assert_int_equal(get(get(c, "mesh_axes"), "value")->n, ms.n_axes);
    mesh_json_free(j);
    mesh_rules_free(&rules);
    mesh_cfg_free(cfg);

    /* trace.json is the machine's Chrome trace */
    sim_machine *m = run_machine(true);
    assert_int_equal(cli_write_trace_json(dir, m, 0), SIM_OK);
    j = parse_file(dir, "trace.json");
    assert_true(j->kind == MESH_JSON_OBJECT || j->kind == MESH_JSON_ARRAY);
    mesh_json_free(j);
    sim_machine_free(m);
    assert_int_equal(count_entries(dir), 2);
    rm_rf(dir);
    free(dir);
}

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
    char *dir = make_tmpdir();
    /* a failing writer leaves nothing, and an earlier complete file stays */
    assert_int_equal(cli_artifact_write(dir, "a.txt", write_hello, "hello"), SIM_OK);
    assert_int_equal(cli_artifact_write(dir, "a.txt", write_then_fail, NULL), SIM_ERR_INTERNAL);
    assert_int_equal(count_entries(dir), 1);
    char p[PATH_CAP];
    snprintf(p, sizeof p, "%s/a.txt", dir);
    char *s = read_all(p, NULL);
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
    assert_int_equal(count_entries(dir), 1);
    rm_rf(dir);
    free(dir);
}

/* ======================================================================== */
/* parity                                                                   */
/* ======================================================================== */

static void test_parity(void **state)
{
    (void)state;
    double l0[4] = {10.0, 9.0, 8.0, 7.0};
    double l1[4] = {10.0, 9.0 * (1 + 1e-6), 8.0, 7.0};
    double l2[4] = {10.0, 9.0, 8.0 * (1 + 1e-3), 7.1};
    cli_parity_config cfg[3] = {{"base", "", l0}, {"fsdp=4", "ici_fsdp_parallelism=4", l1},
                                {"tp=2", "ici_tensor_parallelism=2", l2}};
    cli_parity p = {3, cfg, 4, 1, 1e-4, -1, NULL, NULL};
    assert_int_equal(cli_parity_first_failure(&p), 2);
    int worst;
    assert_true(fabs(cli_parity_step_diff(&p, 1, &worst) - 1e-6) < 1e-12);
    assert_int_equal(worst, 1);
    assert_true(cli_parity_step_diff(&p, 0, &worst) == 0);

    char *dir = make_tmpdir();
    p.diverge_param = "params.decoder.layers.mlp.wo.kernel";
    assert_int_equal(cli_write_parity_json(dir, &p), SIM_OK);
    mesh_json *j = parse_file(dir, "parity.json");
    assert_int_equal(get(j, "pass")->boolean, 0);
    assert_int_equal(get(j, "first_diverging_step")->number, 3); /* first_step 1 + index 2 */
    assert_string_equal(get(j, "first_diverging_config")->str, "tp=2");
    assert_string_equal(get(j, "first_diverging_param")->str, "params.decoder.layers.mlp.wo.kernel");
    assert_string_equal(get(j, "reference")->str, "base");
    assert_int_equal(get(j, "configs")->n, 3);
    assert_string_equal(get(&get(j, "configs")->items[2], "overrides")->str, "ici_tensor_parallelism=2");
    const mesh_json *st = get(j, "steps");
    assert_int_equal(st->n, 4);
    assert_int_equal(get(&st->items[1], "pass")->boolean, 1);
    assert_int_equal(get(&st->items[2], "pass")->boolean, 0);
    assert_true(get(&st->items[2], "losses")->items[2].number == l2[2]);
    assert_true(fabs(get(&st->items[3], "max_rel_diff")->number - 0.1 / 7.0) < 1e-12);
    assert_true(fabs(get(j, "max_rel_diff")->number - 0.1 / 7.0) < 1e-12);
    mesh_json_free(j);

    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    cli_report_parity(f, &p);
    fclose(f);
    assert_contains(out, "FAIL: first diverging step 3 (config 'tp=2')");
    assert_contains(out, "params.decoder.layers.mlp.wo.kernel");
    assert_contains(out, " tp=2"); /* configurations by label; their overrides were listed as they ran */
    assert_null(strstr(out, "parity: "));
    free(out);

    /* a passing run */
    cli_parity ok = {2, cfg, 4, 0, 1e-4, -1, NULL, NULL};
    assert_int_equal(cli_write_parity_json(dir, &ok), SIM_OK);
    j = parse_file(dir, "parity.json");
    assert_int_equal(get(j, "pass")->boolean, 1);
    assert_int_equal(get(j, "first_diverging_step")->kind, MESH_JSON_NULL);
    assert_int_equal(get(j, "first_diverging_param")->kind, MESH_JSON_NULL);
    mesh_json_free(j);
    f = open_memstream(&out, &len);
    cli_report_parity(f, &ok);
    fclose(f);
    assert_contains(out, "PASS");
    free(out);
    /* a NaN loss never passes */
    assert_true(isinf(cli_rel_diff(NAN, 1.0)));
    assert_true(cli_rel_diff(0.5, 0.0) == 0.5);
    rm_rf(dir);
    free(dir);
}

/* ======================================================================== */
/* MaxText sharding dump                                                    */
/* ======================================================================== */

enum { MAX_ENTRIES = 512 };

/* The inputs a golden directory gives the writer. */
typedef struct {
    mesh_json *named, *logical, *inputs;
    mesh_shape mesh;
    int n;
    cli_dump_param p[MAX_ENTRIES];
    int na;
    cli_dump_activation a[MAX_ENTRIES];
    char names[MAX_ENTRIES][256];  /* activation name and dtype text */
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
    g->named = parse_file(path, "named_shardings.json");
    g->logical = parse_file(path, "logical_shardings.json");
    g->inputs = parse_file(path, "input_shardings.json");
    /* the mesh from the first entry's mesh block */
    const mesh_json *mb = get(&g->named->items[0], "mesh");
    const mesh_json *an = get(mb, "axis_names"), *sh = get(mb, "shape");
    const char *names[MESH_MAX_AXES];
    int sizes[MESH_MAX_AXES];
    for (int i = 0; i < an->n; i++) {
        names[i] = an->items[i].str;
        sizes[i] = (int)get(sh, names[i])->number;
    }
    assert_int_equal(mesh_shape_init(&g->mesh, an->n, names, sizes), SIM_OK);

    assert_true(g->named->n <= MAX_ENTRIES);
    g->n = g->named->n;
    for (int i = 0; i < g->n; i++) {
        cli_dump_param *p = &g->p[i];
        const char *key = g->named->keys[i];
        const mesh_json *n = &g->named->items[i], *l = get(g->logical, key);
        const mesh_json *shape = get(n, "shape"), *lspec = get(l, "partition_spec");
        p->path = key;
        p->rank = shape->n;
        for (int d = 0; d < p->rank; d++) {
            p->shape[d] = (int64_t)shape->items[d].number;
            p->logical[d] = lspec->items[d].kind == MESH_JSON_STRING ? lspec->items[d].str : NULL;
        }
        if (mesh_spec_from_json(get(n, "partition_spec"), &g->mesh, key, &p->spec) != SIM_OK)
            fail_msg("%s: %s", key, sim_errmsg());
    }

    const mesh_json *list = get(g->inputs, "Activation Sharding Dump");
    assert_true(list->n <= MAX_ENTRIES);
    g->na = list->n;
    for (int i = 0; i < g->na; i++) {
        cli_dump_activation *a = &g->a[i];
        const char *key = list->items[i].keys[0];
        const mesh_json *v = &list->items[i].items[0];
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
        parse_logic(get(v, "logic_axes")->str, a, g->logical_text[i]);
        if (mesh_spec_parse(get(v, "PartitionSpec")->str, &g->mesh, &a->spec) != SIM_OK)
            fail_msg("%s: %s", key, sim_errmsg());
    }
}

static void golden_free(golden *g)
{
    mesh_json_free(g->named);
    mesh_json_free(g->logical);
    mesh_json_free(g->inputs);
}

/* The file in `dir` must equal the golden's, as bytes and as parsed JSON. */
static void same_file(const char *golden_dir, const char *dir, const char *name)
{
    char a[PATH_CAP], b[PATH_CAP];
    snprintf(a, sizeof a, "%s/%s", golden_dir, name);
    snprintf(b, sizeof b, "%s/%s", dir, name);
    mesh_json *ja = parse_file(golden_dir, name), *jb = parse_file(dir, name);
    if (!mesh_json_equal(ja, jb)) fail_msg("%s differs from %s as JSON", b, a);
    /* same key order too */
    assert_int_equal(ja->n, jb->n);
    for (int i = 0; i < ja->n && ja->kind == MESH_JSON_OBJECT; i++) assert_string_equal(ja->keys[i], jb->keys[i]);
    mesh_json_free(ja);
    mesh_json_free(jb);
    size_t la, lb;
    char *sa = read_all(a, &la), *sb = read_all(b, &lb);
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
             reference_dir());
    struct stat st;
    if (stat(path, &st) != 0) fail_msg("golden directory '%s' is missing", path);
    char *dir = make_tmpdir();
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
    rm_rf(dir);
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
    snprintf(path, sizeof path, "%s/maxtext/goldens", reference_dir());
    char *dir = make_tmpdir();
    int count = 0;
    walk_goldens(path, dir, 0, &count);
    assert_true(count >= 1);
    rm_rf(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traffic_pivot),
        cmocka_unit_test(test_csv_files),
        cmocka_unit_test(test_metrics_and_memory),
        cmocka_unit_test(test_console),
        cmocka_unit_test(test_run_and_trace),
        cmocka_unit_test(test_atomic_write),
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_dump_keystr),
        cmocka_unit_test(test_dump_golden_pure_fsdp),
        cmocka_unit_test(test_dump_all_goldens),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_cli_report.c — console reports and the run artifacts they come with.
 *
 * An 8-device machine (data=2 x fsdp=4) runs a few tagged collectives over
 * three steps and allocates in its arenas, so the traffic pivot, the CSV
 * files, metrics.json and the memory table are checked against real records
 * and real arena statistics (sums recomputed here from the records); the
 * parity figures and parity.json from hand-made losses.  Atomic writes and
 * the MaxText sharding dump are test_cli_artifacts's. */
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
#include "tests/helpers.h"

enum { PATH_CAP = 1024, NDEV = 8, MIB = 1 << 20 };

/* ======================================================================== */
/* helpers                                                                  */
/* ======================================================================== */

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
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
                if (x->step < steps.first || x->step > steps.last || x->op != row->op || x->phase != row->phase ||
                    x->axes.n != row->axes.n || memcmp(x->axes.axis, row->axes.axis, (size_t)x->axes.n))
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
    char *dir = helper_tmpdir("test_cli_report");
    char sub[PATH_CAP / 2], p[PATH_CAP];
    snprintf(sub, sizeof sub, "%s/out/run1", dir); /* missing parents are created */

    assert_int_equal(cli_write_collectives_csv(sub, &r, cli_steps_all(), 0), SIM_OK);
    snprintf(p, sizeof p, "%s/collectives.csv", sub);
    char *csv = helper_read_file(p, NULL);
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
    csv = helper_read_file(p, NULL);
    assert_int_equal(count_lines(csv), 1 + NDEV);
    free(csv);

    cli_traffic t;
    assert_int_equal(cli_traffic_build(&r, cli_steps_all(), &t), SIM_OK);
    assert_int_equal(cli_write_traffic_csv(sub, &t), SIM_OK);
    snprintf(p, sizeof p, "%s/traffic.csv", sub);
    csv = helper_read_file(p, NULL);
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
    assert_int_equal(helper_count_entries(sub), 2);
    cli_traffic_free(&t);
    helper_rm_rf(dir);
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
    char *dir = helper_tmpdir("test_cli_report");
    assert_int_equal(cli_write_metrics_json(dir, steps, 3, st, NDEV), SIM_OK);
    cfg_json *j = helper_read_json(dir, "metrics.json");
    const cfg_json *s = helper_json_get(j, "steps");
    assert_int_equal(s->n, 3);
    assert_true(helper_json_get(&s->items[0], "loss")->number == 10.5);
    assert_true(helper_json_get(&s->items[1], "grad_norm")->number == 1.5);
    assert_true(helper_json_get(&s->items[1], "raw_grad_norm")->number == 6.5);
    assert_int_equal(helper_json_get(&s->items[2], "raw_grad_norm")->kind, CFG_JSON_NULL);
    assert_true(helper_json_get(&s->items[1], "lr")->number == 3e-4);
    assert_true(helper_json_get(&s->items[1], "time_s")->number == 0.25);
    assert_int_equal(helper_json_get(&s->items[2], "step")->number, 3);
    assert_int_equal(helper_json_get(&s->items[2], "loss")->kind, CFG_JSON_NULL);
    assert_int_equal(helper_json_get(&s->items[2], "tokens_per_s")->kind, CFG_JSON_NULL); /* a dry step */
    assert_true(helper_json_get(&s->items[1], "tokens_per_s")->number > 0);
    const cfg_json *mem = helper_json_get(j, "memory");
    const cfg_json *peak = helper_json_get(mem, "per_device_peak_bytes");
    assert_int_equal(peak->n, NDEV);
    const cfg_json *by = helper_json_get(mem, "by_category");
    assert_int_equal(by->n, SIM_NMEM);
    for (int d = 0; d < NDEV; d++) {
        assert_true(peak->items[d].number == (double)st[d].peak);
        double sum = 0;
        for (int c = 0; c < SIM_NMEM; c++) {
            const cfg_json *cat = helper_json_get(by, sim_mem_cat_name((sim_mem_cat)c));
            assert_int_equal(cat->n, NDEV);
            assert_true(cat->items[d].number == (double)st[d].at_peak_by[c]);
            sum += cat->items[d].number;
        }
        assert_true(sum == (double)st[d].peak); /* the breakdown at peak adds up to the peak */
    }
    assert_true(helper_json_get(by, "params")->items[5].number == MIB);
    cfg_json_free(j);
    helper_rm_rf(dir);
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
    assert_contains(l1, " 32768 "); /* tokens/s of a real step */
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
    assert_string_equal(cli_progress_format(1.0, NULL, buf, sizeof buf), "[==============================] 100%");
    assert_string_equal(cli_progress_format(-1, "x", buf, sizeof buf), "[>                             ]   0% x");
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
    cfg_args args = {cli_base_config(), NULL, NULL, 0, ovr, 3};
    cfg_config *cfg = NULL;
    if (cfg_load(&args, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    mesh_shape ms;
    if (mesh_shape_from_config(cfg, &ms) != SIM_OK) fail_msg("mesh: %s", sim_errmsg());
    mesh_rules rules;
    mesh_rules_init(&rules);
    assert_int_equal(mesh_rules_from_config(cfg, &rules), SIM_OK);

    char *dir = helper_tmpdir("test_cli_report");
    const char *argv[] = {"train", "ici_fsdp_parallelism=4"};
    cli_run_info info = {"train", 2, argv, cfg, &ms, &rules, NULL, (time_t)1700000000, NULL, NULL, NULL, NULL, NULL};
    assert_int_equal(cli_write_run_json(dir, &info), SIM_OK);
    cfg_json *j = helper_read_json(dir, "run.json");
    assert_string_equal(helper_json_get(j, "shardsim_version")->str, CLI_SHARDSIM_VERSION);
    assert_string_equal(helper_json_get(j, "time")->str, "2023-11-14T22:13:20Z");
    assert_string_equal(helper_json_get(j, "command")->str, "train");
    assert_int_equal(helper_json_get(j, "argv")->n, 2);
    const cfg_json *mesh = helper_json_get(j, "mesh");
    assert_int_equal(helper_json_get(mesh, "axis_names")->n, ms.n_axes);
    assert_int_equal(helper_json_get(helper_json_get(mesh, "shape"), "fsdp")->number, 4);
    assert_int_equal(helper_json_get(helper_json_get(mesh, "shape"), "data")->number, 2);
    assert_int_equal(helper_json_get(mesh, "num_devices")->number, 8);
    const cfg_json *rl = helper_json_get(j, "logical_axis_rules");
    assert_int_equal(rl->n, rules.n);
    assert_string_equal(rl->items[0].items[0].str, rules.rules[0].name);
    assert_int_equal(rl->items[0].items[1].n, rules.rules[0].n_axes);
    const cfg_json *c = helper_json_get(j, "config");
    assert_int_equal(c->n, cfg->n);
    const cfg_json *fsdp = helper_json_get(c, "ici_fsdp_parallelism");
    assert_int_equal(helper_json_get(fsdp, "value")->kind, CFG_JSON_NUMBER);
    assert_int_equal(helper_json_get(fsdp, "value")->number, 4);
    assert_string_equal(helper_json_get(fsdp, "source")->str, cfg_find(cfg, "ici_fsdp_parallelism")->where);
    const cfg_json *pdbs = helper_json_get(c, "per_device_batch_size");
    assert_true(helper_json_get(pdbs, "value")->number == 2);
    assert_contains(helper_json_get(helper_json_get(c, "base_emb_dim"), "source")->str, "base.yml:");
    assert_int_equal(helper_json_get(helper_json_get(c, "logical_axis_rules"), "value")->kind, CFG_JSON_ARRAY);
    assert_int_equal(helper_json_get(helper_json_get(c, "mesh_axes"), "value")->n, ms.n_axes);
    cfg_json_free(j);
    mesh_rules_free(&rules);
    cfg_free(cfg);

    /* trace.json is the machine's Chrome trace */
    sim_machine *m = run_machine(true);
    assert_int_equal(cli_write_trace_json(dir, m, 0), SIM_OK);
    j = helper_read_json(dir, "trace.json");
    assert_true(j->kind == CFG_JSON_OBJECT || j->kind == CFG_JSON_ARRAY);
    cfg_json_free(j);
    sim_machine_free(m);
    assert_int_equal(helper_count_entries(dir), 2);
    helper_rm_rf(dir);
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
    cli_parity_config cfg[3] = {{.label = "base", .overrides = "", .losses = l0},
                                {.label = "fsdp=4", .overrides = "ici_fsdp_parallelism=4", .losses = l1},
                                {.label = "tp=2", .overrides = "ici_tensor_parallelism=2", .losses = l2}};
    cli_parity p = {3, cfg, 4, 1, 1e-4, -1, NULL, NULL};
    assert_int_equal(cli_parity_first_failure(&p), 2);
    int worst;
    assert_true(fabs(cli_parity_step_diff(&p, 1, &worst) - 1e-6) < 1e-12);
    assert_int_equal(worst, 1);
    assert_true(cli_parity_step_diff(&p, 0, &worst) == 0);

    char *dir = helper_tmpdir("test_cli_report");
    p.diverge_param = "params.decoder.layers.mlp.wo.kernel";
    assert_int_equal(cli_write_parity_json(dir, &p), SIM_OK);
    cfg_json *j = helper_read_json(dir, "parity.json");
    assert_int_equal(helper_json_get(j, "pass")->boolean, 0);
    assert_int_equal(helper_json_get(j, "first_diverging_step")->number, 3); /* first_step 1 + index 2 */
    assert_string_equal(helper_json_get(j, "first_diverging_config")->str, "tp=2");
    assert_string_equal(helper_json_get(j, "first_diverging_param")->str, "params.decoder.layers.mlp.wo.kernel");
    assert_string_equal(helper_json_get(j, "reference")->str, "base");
    assert_int_equal(helper_json_get(j, "configs")->n, 3);
    assert_string_equal(helper_json_get(&helper_json_get(j, "configs")->items[2], "overrides")->str,
                        "ici_tensor_parallelism=2");
    const cfg_json *st = helper_json_get(j, "steps");
    assert_int_equal(st->n, 4);
    assert_int_equal(helper_json_get(&st->items[1], "pass")->boolean, 1);
    assert_int_equal(helper_json_get(&st->items[2], "pass")->boolean, 0);
    assert_true(helper_json_get(&st->items[2], "losses")->items[2].number == l2[2]);
    assert_true(fabs(helper_json_get(&st->items[3], "max_rel_diff")->number - 0.1 / 7.0) < 1e-12);
    assert_true(fabs(helper_json_get(j, "max_rel_diff")->number - 0.1 / 7.0) < 1e-12);
    cfg_json_free(j);

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
    j = helper_read_json(dir, "parity.json");
    assert_int_equal(helper_json_get(j, "pass")->boolean, 1);
    assert_int_equal(helper_json_get(j, "first_diverging_step")->kind, CFG_JSON_NULL);
    assert_int_equal(helper_json_get(j, "first_diverging_param")->kind, CFG_JSON_NULL);
    cfg_json_free(j);
    f = open_memstream(&out, &len);
    cli_report_parity(f, &ok);
    fclose(f);
    assert_contains(out, "PASS");
    free(out);
    /* a NaN loss never passes */
    assert_true(isinf(cli_rel_diff(NAN, 1.0)));
    assert_true(cli_rel_diff(0.5, 0.0) == 0.5);
    helper_rm_rf(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traffic_pivot),      cmocka_unit_test(test_csv_files),
        cmocka_unit_test(test_metrics_and_memory), cmocka_unit_test(test_console),
        cmocka_unit_test(test_run_and_trace),      cmocka_unit_test(test_parity),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

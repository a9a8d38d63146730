/* test_cli_train.c — the train command end to end: every artifact of output_dir is written and
 * parses, bad input exits 2 naming it, gradient clipping, limits on the artifacts, resuming (the
 * parity command is test_cli_parity's). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"
#include "config/json.h"

/* tests/data/small-llama.yml: 2 layers of width 32, 4 heads of 8, vocabulary 256, 16 tokens */
#define SMALL SMALL_LLAMA_YML

typedef cli_capture result;

static result run(cli_command cmd, int argc, const char **argv) { return cli_capture_run(cmd, argc, argv); }
static void done(result *r) { cli_capture_free(r); }

static void test_train_artifacts(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_train_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    const char *argv[] = {
        SMALL, "per_device_batch_size=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "steps=2", od};
    result r = run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(strstr(r.out, "traffic over 2 steps"));
    assert_non_null(strstr(r.out, "memory at peak"));
    /* metrics.json: steps with the six fields, memory per device and by category */
    cfg_json *m = helper_read_json(dir, "metrics.json");
    const cfg_json *steps = cfg_json_get(m, "steps"), *mem = cfg_json_get(m, "memory");
    assert_non_null(steps);
    assert_int_equal(steps->n, 2);
    const char *fields[] = {"step", "loss", "grad_norm", "raw_grad_norm", "lr", "time_s"};
    for (int i = 0; i < 6; i++) assert_non_null(cfg_json_get(&steps->items[1], fields[i]));
    assert_non_null(mem);
    assert_int_equal(cfg_json_get(mem, "per_device_peak_bytes")->n, 4);
    assert_non_null(cfg_json_get(cfg_json_get(mem, "by_category"), "params"));
    cfg_json_free(m);
    /* the other JSON artifacts parse and hold what they should */
    cfg_json *run_json = helper_read_json(dir, "run.json");
    assert_non_null(cfg_json_get(cfg_json_get(run_json, "config"), "base_emb_dim"));
    cfg_json_free(run_json);
    cfg_json *trace = helper_read_json(dir, "trace.json");
    const cfg_json *ev = cfg_json_get(trace, "traceEvents");
    assert_true(ev->n > 10);
    int compute = 0, collective = 0; /* both lanes have spans */
    for (int i = 0; i < ev->n; i++) {
        const cfg_json *cat = cfg_json_get(&ev->items[i], "cat");
        if (cat && !strcmp(cat->str, "compute")) compute++;
        if (cat && !strcmp(cat->str, "collective")) collective++;
    }
    assert_true(compute > 10 && collective > 10);
    cfg_json_free(trace);
    cfg_json *sh = helper_read_json(dir, "shardings.json");
    assert_non_null(cfg_json_get(sh, "named_shardings"));
    assert_non_null(cfg_json_get(sh, "input_shardings"));
    cfg_json_free(sh);
    const char *files[] = {"named_shardings.json", "logical_shardings.json", "input_shardings.json"};
    for (int i = 0; i < 3; i++) cfg_json_free(helper_read_json(dir, files[i]));
    /* the CSVs: a header and rows */
    char path[512], line[1024];
    snprintf(path, sizeof path, "%s/collectives.csv", dir);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof line, f));
    assert_non_null(strstr(line, "bytes_sent"));
    int rows = 0;
    while (fgets(line, sizeof line, f)) rows++;
    fclose(f);
    assert_true(rows > 20);
    done(&r);
    const char *all[] = {"metrics.json",         "run.json",
                         "trace.json",           "shardings.json",
                         "named_shardings.json", "logical_shardings.json",
                         "input_shardings.json", "collectives.csv",
                         "traffic.csv",          "report.html"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, all[i]);
        assert_int_equal(unlink(path), 0);
    }
    assert_int_equal(rmdir(dir), 0); /* nothing else was left behind (no temp files) */
}

/* Sum of a numeric column of a CSV artifact (rows whose first field is `first`, or every row when NULL). */
static double csv_sum(const char *dir, const char *file, const char *column, const char *first)
{
    char path[512], line[2048];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof line, f));
    int col = -1, k = 0;
    for (char *save = NULL, *t = strtok_r(line, ",\n", &save); t; t = strtok_r(NULL, ",\n", &save), k++)
        if (!strcmp(t, column)) col = k;
    assert_true(col >= 0);
    double sum = 0;
    while (fgets(line, sizeof line, f)) {
        char *fields[32];
        int n = 0;
        for (char *p = line; n < 32;) { /* no quoted commas in these columns */
            fields[n++] = p;
            char *c = strchr(p, ',');
            if (!c) break;
            *c = '\0';
            p = c + 1;
        }
        if (col < n && (!first || !strcmp(fields[0], first))) sum += strtod(fields[col], NULL);
    }
    fclose(f);
    return sum;
}

/* A hardware profile sets the dtype weight gathers and gradient reductions move in: the config box and
 * run.json say which rule applied, and the CSVs agree byte for byte under it (collectives.csv's records
 * sum to traffic.csv's totals); without a profile the rule is XLA:CPU's (weight_dtype). */
static void test_wire_rule_artifacts(void **state)
{
    (void)state;
    static const char *const profile[2] = {"hardware_profile=v5p", "hardware_profile="};
    static const char *const gather[2] = {"bfloat16", "float32"};
    double total[2];
    for (int i = 0; i < 2; i++) {
        char dir[] = "/tmp/shardsim_wire_XXXXXX";
        assert_non_null(mkdtemp(dir));
        char od[300];
        snprintf(od, sizeof od, "output_dir=%s", dir);
        const char *argv[] = {SMALL,
                              "per_device_batch_size=1",
                              "ici_fsdp_parallelism=4",
                              "dtype=bfloat16",
                              "weight_dtype=float32",
                              "steps=1",
                              profile[i],
                              od};
        result r = run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
        if (r.rc) fail_msg("train failed: %s", r.err);
        assert_non_null(strstr(r.out, "weight collectives"));
        cfg_json *rj = helper_read_json(dir, "run.json");
        const cfg_json *w = cfg_json_get(rj, "weight_collective_dtypes");
        assert_non_null(w);
        assert_string_equal(cfg_json_get(w, "weight_gather")->str, gather[i]);
        assert_string_equal(cfg_json_get(w, "gradient_reduction")->str, gather[i]);
        assert_non_null(strstr(cfg_json_get(w, "rule")->str, i == 0 ? "as XLA:TPU" : "as XLA:CPU"));
        /* the compiler's transformations in force: v5p's (configs/hardware/v5p.yml), none without a profile */
        const char *rules = cfg_json_get(rj, "compiler_rules")->str;
        assert_non_null(strstr(rules, i == 0 ? "hoisted weight copies" : "none"));
        assert_true(i == 0 ? strstr(rules, "windowed einsums over >= 8 devices") != NULL
                           : strstr(rules, "windowed") == NULL);
        assert_non_null(strstr(r.out, "compiler rules"));
        cfg_json_free(rj);
        total[i] = csv_sum(dir, "traffic.csv", "bytes_total", NULL);
        assert_true(total[i] > 0);
        assert_true(csv_sum(dir, "collectives.csv", "bytes_sent", NULL) == total[i]);
        done(&r);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        assert_int_equal(system(cmd), 0);
    }
    assert_true(total[0] < total[1]); /* the weights' bytes halve, the activations' stay */
}

/* trace.json and collectives.csv keep whole devices from device 0 within
 * their limits; every collective event carries its record, every step starts
 * with a marker. */
static void test_artifact_limits(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_limits_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    /* each device makes the same calls: a limit of one row/event keeps device 0 only */
    const char *argv[] = {
        SMALL,     "per_device_batch_size=1", "ici_fsdp_parallelism=2",     "ici_tensor_parallelism=2",
        "steps=3", "trace_max_events=1",      "collectives_csv_max_rows=1", "trace_steps=all",
        od};
    result r = run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(
        strstr(r.out, "limited artifacts: collectives.csv holds devices 0-0 and trace.json devices 0-0 of 4"));
    cfg_json *t = helper_read_json(dir, "trace.json");
    assert_int_equal(cfg_json_get(cfg_json_get(t, "otherData"), "devices_traced")->number, 1);
    const cfg_json *ev = cfg_json_get(t, "traceEvents");
    int markers = 0, collectives = 0;
    for (int i = 0; i < ev->n; i++) {
        const cfg_json *e = &ev->items[i], *cat = cfg_json_get(e, "cat");
        assert_int_equal(cfg_json_get(e, "pid")->number, 0); /* device 0 only */
        if (cat && !strcmp(cat->str, "step")) markers++;
        if (cat && !strcmp(cat->str, "collective")) {
            const cfg_json *a = cfg_json_get(e, "args");
            const char *fields[] = {"op", "mesh_axes", "group_size", "dtype", "bytes_sent", "phase", "kind"};
            for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++)
                if (!cfg_json_get(a, fields[f])) fail_msg("collective event without '%s'", fields[f]);
            /* the name is the op and the tag */
            const char *op = cfg_json_get(a, "op")->str, *name = cfg_json_get(e, "name")->str;
            assert_true(!strncmp(name, op, strlen(op)) && name[strlen(op)] == ' ' && name[strlen(op) + 1]);
            collectives++;
        }
    }
    assert_int_equal(markers, 3); /* one per step */
    assert_true(collectives > 10);
    cfg_json_free(t);
    char path[512], line[1024];
    snprintf(path, sizeof path, "%s/collectives.csv", dir);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(line, sizeof line, f)); /* header */
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        assert_true(!strncmp(line, "0,", 2)); /* device 0's rows only */
        rows++;
    }
    fclose(f);
    assert_true(rows > 10);
    done(&r);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    assert_int_equal(system(path), 0);
}

/* On two slices (data across them, fsdp within), the traffic table splits
 * off what crosses slices: all of data's all-reduce, none of fsdp's gathers. */
static void test_dcn_traffic(void **state)
{
    (void)state;
    const char *argv[] = {SMALL,          "per_device_batch_size=1", "dcn_data_parallelism=2",
                          "num_slices=2", "ici_fsdp_parallelism=2",  "steps=1"};
    result r = run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(strstr(r.out, "dcn/device"));
    const char *ar = strstr(r.out, "\nall-reduce         data       backward"),
               *ag = strstr(r.out, "\nall-gather         fsdp       forward");
    assert_non_null(ar);
    assert_non_null(ag);
    /* columns: op axes phase calls mean max dcn share; compare mean and dcn as printed */
    char op[32], axes[32], phase[32], mean[16], mean_u[8], max[16], dcn[16], dcn_u[8];
    int calls;
    assert_int_equal(sscanf(ar + 1, "%31s %31s %31s %d %15s %7s %15s %15s %7s", op, axes, phase, &calls, mean, mean_u,
                            max, dcn, dcn_u),
                     9);
    assert_string_equal(mean, dcn); /* every byte of the data all-reduce crosses slices */
    assert_string_equal(mean_u, dcn_u);
    assert_int_equal(sscanf(ag + 1, "%31s %31s %31s %d %15s %7s %15s %15s %7s", op, axes, phase, &calls, mean, mean_u,
                            max, dcn, dcn_u),
                     9);
    assert_string_equal(dcn, "0"); /* fsdp stays within a slice */
    assert_string_equal(dcn_u, "B");
    done(&r);
}

/* The two norms of each step, as metrics_file (learning/grad_norm, learning/raw_grad_norm) and
 * metrics.json (grad_norm, raw_grad_norm) give them, of a 2-step run with `threshold`
 * (gradient_clipping_threshold, printed with %.17g so it reaches the config exactly). */
typedef struct {
    double file_gn[2], file_raw[2]; /* metrics_file */
    double json_gn[2], json_raw[2]; /* metrics.json */
} norms;

static norms run_norms(double threshold)
{
    char dir[] = "/tmp/shardsim_norms_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300], mf[300], thr[80], path[320];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    snprintf(mf, sizeof mf, "metrics_file=%s/m.jsonl", dir);
    snprintf(thr, sizeof thr, "gradient_clipping_threshold=%.17g", threshold);
    const char *argv[] = {SMALL, "per_device_batch_size=1", "ici_fsdp_parallelism=2", "steps=2", od, mf, thr};
    result r = run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    done(&r);
    norms n;
    snprintf(path, sizeof path, "%s/m.jsonl", dir);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[2048];
    for (int s = 0; s < 2; s++) {
        assert_non_null(fgets(line, sizeof line, f));
        cfg_json *j = NULL;
        if (cfg_json_parse(line, strlen(line), "metrics_file", &j) != SIM_OK) fail_msg("%s", sim_errmsg());
        n.file_gn[s] = cfg_json_get(j, "learning/grad_norm")->number;
        n.file_raw[s] = cfg_json_get(j, "learning/raw_grad_norm")->number;
        cfg_json_free(j);
    }
    fclose(f);
    cfg_json *m = helper_read_json(dir, "metrics.json");
    const cfg_json *steps = cfg_json_get(m, "steps");
    assert_int_equal(steps->n, 2);
    for (int s = 0; s < 2; s++) {
        n.json_gn[s] = cfg_json_get(&steps->items[s], "grad_norm")->number;
        n.json_raw[s] = cfg_json_get(&steps->items[s], "raw_grad_norm")->number;
    }
    cfg_json_free(m);
    snprintf(path, sizeof path, "rm -rf '%s'", dir);
    assert_int_equal(system(path), 0);
    return n;
}

/* MaxText's learning/grad_norm is the norm of the gradients after clip_by_global_norm and
 * learning/raw_grad_norm the one before.  Without clipping they are equal; with a threshold a quarter
 * of step 0's raw norm, grad_norm is the threshold itself (to float32 rounding) and raw_grad_norm is
 * the raw norm of the unclipped run (step 0's gradients do not depend on the threshold). */
static void test_grad_norm_after_clipping(void **state)
{
    (void)state;
    const norms off = run_norms(0);
    for (int s = 0; s < 2; s++) {
        assert_true(off.file_raw[s] > 0);
        assert_true(off.file_gn[s] == off.file_raw[s]);
        assert_true(off.json_gn[s] == off.json_raw[s]);
        assert_true(fabs(off.json_raw[s] - off.file_raw[s]) <= 1e-8 * off.file_raw[s]); /* %.9g in the file */
    }
    const double thr = off.json_raw[0] / 4;
    const norms on = run_norms(thr);
    assert_true(on.json_raw[0] == off.json_raw[0]);
    assert_true(on.file_raw[0] == off.file_raw[0]);
    for (int s = 0; s < 2; s++) {
        assert_true(on.json_raw[s] > thr); /* clipping applies at both steps */
        if (fabs(on.json_gn[s] - thr) > 1e-6 * thr || fabs(on.file_gn[s] - thr) > 1e-6 * thr)
            fail_msg("step %d: grad_norm %.9g (file %.9g), want the threshold %.9g; raw %.9g", s, on.json_gn[s],
                     on.file_gn[s], thr, on.json_raw[s]);
    }
}

/* With no arguments, train runs the built-in small model (configs/small.yml:
 * emb 128, 2 layers, vocab 256, 20 steps) instead of MaxText's 1 B default. */
static void test_train_without_arguments(void **state)
{
    (void)state;
    result r = run(cli_train, 0, NULL);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "no arguments: training the built-in small Llama"));
    assert_non_null(strstr(r.out, "emb 128, heads 8 (kv 4) x 16, mlp 384, layers 2, vocab 256"));
    assert_non_null(strstr(r.out, "\n    19 ")); /* steps 0..19 */
    done(&r);
}

static void test_train_bad_input(void **state)
{
    (void)state;
    const char *a1[] = {SMALL, "ici_fsdp_paralelism=2"};
    result r = run(cli_train, (int)(sizeof a1 / sizeof a1[0]), a1);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "ici_fsdp_parallelism"));
    assert_string_equal(r.out, "");
    done(&r);
    /* a missing checkpoint is refused before anything is printed or created */
    const char *a3[] = {SMALL, "load_parameters_path=/nonexistent/ckpt.safetensors",
                        "output_dir=/tmp/shardsim_never_made_dir"};
    r = run(cli_train, (int)(sizeof a3 / sizeof a3[0]), a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "load_parameters_path=/nonexistent/ckpt.safetensors"));
    assert_string_equal(r.out, "");
    assert_int_equal(access("/tmp/shardsim_never_made_dir", F_OK), -1);
    done(&r);
    const char *a2[] = {SMALL, "shard_mode=explicitly"};
    r = run(cli_train, (int)(sizeof a2 / sizeof a2[0]), a2);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "shard_mode"));
    done(&r);
}

/* The loss printed on step s's line ("" when there is no such line). */
static void step_loss(const char *out, int s, char *buf, size_t cap)
{
    char head[32];
    snprintf(head, sizeof head, "\n%6d ", s);
    const char *p = strstr(out, head);
    buf[0] = '\0';
    if (p) sscanf(p + strlen(head), "%31s", buf);
    (void)cap;
}

/* Resume through the CLI, as MaxText decides it: this run's checkpoint_dir
 * first (latest step; load_parameters_path then not read; temporary files
 * never candidates), then load_full_state_path; a run whose steps are all
 * done, a damaged latest checkpoint and load_full_state_path without
 * checkpointing are refused (exit 2) naming the file or the keys. */
static void test_resume(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_resume_cli_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char ck[300], p0[300], p2[300], p3[300], tmp6[300], bad8[300], lp[340], lfs[340];
    snprintf(ck, sizeof ck, "checkpoint_dir=%s", dir);
    snprintf(p0, sizeof p0, "%s/step_0.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/step_2.safetensors", dir);
    snprintf(p3, sizeof p3, "%s/step_3.safetensors", dir);
    snprintf(tmp6, sizeof tmp6, "%s/step_6.safetensors.tmp", dir);
    snprintf(bad8, sizeof bad8, "%s/step_8.safetensors", dir);
    const char *a[] = {SMALL, "per_device_batch_size=2", "steps=4", "checkpoint_period=2", "learning_rate=3e-4", ck};
    int na = (int)(sizeof a / sizeof a[0]);
    result r = run(cli_train, na, a);
    if (r.rc) fail_msg("train failed: %s", r.err);
    char ref3[32], got[32];
    step_loss(r.out, 3, ref3, sizeof ref3);
    assert_true(ref3[0]);
    done(&r);
    /* MaxText's schedule: after steps 0 and 2 (period 2) and after the last one */
    assert_int_equal(access(p0, F_OK), 0);
    assert_int_equal(access(p2, F_OK), 0);
    assert_int_equal(access(p3, F_OK), 0);
    snprintf(lp, sizeof lp, "%s/step_1.safetensors", dir);
    assert_int_equal(access(lp, F_OK), -1);
    /* every step done: nothing left to train */
    r = run(cli_train, na, a);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, p3));
    assert_non_null(strstr(r.err, "steps above 4"));
    done(&r);
    /* interrupted after step 2 (step 3's checkpoint never written, a killed save's temporary file left) */
    assert_int_equal(unlink(p3), 0);
    FILE *f = fopen(tmp6, "w");
    fputs("half a file", f);
    fclose(f);
    snprintf(lp, sizeof lp, "load_parameters_path=%s", p0);
    const char *b[] = {SMALL,
                       "per_device_batch_size=1",
                       "ici_fsdp_parallelism=2",
                       "steps=4",
                       "checkpoint_period=2",
                       "learning_rate=3e-4",
                       ck,
                       lp};
    r = run(cli_train, (int)(sizeof b / sizeof b[0]), b);
    if (r.rc) fail_msg("resume failed: %s", r.err);
    assert_non_null(strstr(r.out, "resuming from this run's checkpoint"));
    assert_non_null(strstr(r.out, p2));
    assert_non_null(strstr(r.out, "load_parameters_path is not read"));
    assert_non_null(strstr(r.out, "1 temporary file"));
    step_loss(r.out, 2, got, sizeof got);
    assert_string_equal(got, ""); /* steps 0 to 2 are not trained again */
    step_loss(r.out, 3, got, sizeof got);
    assert_string_equal(got, ref3); /* another mesh: the same loss to the printed digits */
    assert_non_null(strstr(r.out, "traffic over 1 step:"));
    assert_int_equal(access(tmp6, F_OK), -1); /* the next save removed it */
    assert_int_equal(access(p3, F_OK), 0);
    done(&r);
    /* load_full_state_path, outside any checkpoint_dir */
    snprintf(lfs, sizeof lfs, "load_full_state_path=%s", p2);
    const char *c[] = {SMALL, "per_device_batch_size=2", "steps=4", "learning_rate=3e-4", lfs};
    r = run(cli_train, (int)(sizeof c / sizeof c[0]), c);
    if (r.rc) fail_msg("load_full_state_path failed: %s", r.err);
    assert_non_null(strstr(r.out, "resuming from load_full_state_path"));
    step_loss(r.out, 3, got, sizeof got);
    assert_string_equal(got, ref3);
    done(&r);
    const char *d[] = {SMALL, "steps=4", "enable_checkpointing=false", lfs};
    r = run(cli_train, (int)(sizeof d / sizeof d[0]), d);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "load_full_state_path"));
    assert_non_null(strstr(r.err, "enable_checkpointing=false"));
    done(&r);
    /* a damaged latest checkpoint is never resumed from, nor silently passed over */
    f = fopen(bad8, "w");
    fputs("not a safetensors file", f);
    fclose(f);
    const char *e[] = {SMALL, "per_device_batch_size=2", "steps=10", "checkpoint_period=2", ck};
    r = run(cli_train, (int)(sizeof e / sizeof e[0]), e);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, bad8));
    assert_null(strstr(r.out, "resuming"));
    done(&r);
    unlink(bad8);
    /* save_checkpoint_on_start=false: none after step 0; save_checkpoint_on_completion=false: none after
     * the last step (3) off the period (2) */
    unlink(p0);
    unlink(p2);
    unlink(p3);
    const char *g[] = {SMALL,
                       "per_device_batch_size=2",
                       "steps=4",
                       "checkpoint_period=2",
                       ck,
                       "save_checkpoint_on_start=false",
                       "save_checkpoint_on_completion=false"};
    r = run(cli_train, (int)(sizeof g / sizeof g[0]), g);
    if (r.rc) fail_msg("train failed: %s", r.err);
    done(&r);
    assert_int_equal(access(p0, F_OK), -1);
    assert_int_equal(access(p2, F_OK), 0);
    assert_int_equal(access(p3, F_OK), -1);
    /* a pipeline's checkpoints are not simulated: the directory base_output_directory implies is refused too */
    char bo[340];
    snprintf(bo, sizeof bo, "base_output_directory=%s", dir);
    const char *pp[] = {SMALL, "per_device_batch_size=2", "steps=1", "ici_pipeline_parallelism=2", bo, "run_name=pp"};
    r = run(cli_train, (int)(sizeof pp / sizeof pp[0]), pp);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "enable_checkpointing=true with base_output_directory and pipeline parallelism"));
    done(&r);
    unlink(p0);
    unlink(p2);
    unlink(p3);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_artifacts), cmocka_unit_test(test_grad_norm_after_clipping),
        cmocka_unit_test(test_artifact_limits), cmocka_unit_test(test_wire_rule_artifacts),
        cmocka_unit_test(test_dcn_traffic),     cmocka_unit_test(test_train_without_arguments),
        cmocka_unit_test(test_train_bad_input), cmocka_unit_test(test_resume),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

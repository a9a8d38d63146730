/* test_cli_trace.c — trace.json's size and its steps.
 *
 *   - the bound: the README's 20-step run of the small Llama on fsdp=4 x tensor=2
 *     writes a trace under 1 MB with the default trace_steps=first,last, one
 *     process per device;
 *   - the selection: trace_steps=2,5-6 keeps exactly those steps' spans (the same
 *     spans, by name and lane, as trace_steps=all holds for them) and the trace's
 *     otherData and stdout say how many steps and spans were left out, counted
 *     here from the trace_steps=all run;
 *   - bad values exit 2 naming trace_steps, before anything is written;
 *   - atomicity: a trace.json that cannot be put in place (a directory of that
 *     name), or whose writing fails half-way (a file-size limit, RLIMIT_FSIZE,
 *     below the trace's size and above every file written before it), fails the
 *     run and leaves no partial or temporary file: an earlier trace.json stays
 *     whole.  For the run's trace and the modelled timeline of a dry run with a
 *     hardware profile alike. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/cli.h"
#include "config/json.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

#define SMALL                                                                                                          \
    "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=8", "base_mlp_dim=64",               \
        "base_num_decoder_layers=2", "vocab_size=256", "max_target_length=16", "per_device_batch_size=1"

static long file_size(const char *dir, const char *name)
{
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    return stat(p, &st) == 0 ? (long)st.st_size : -1;
}

static double meta(const cfg_json *t, const char *key)
{
    const cfg_json *v = cfg_json_get(cfg_json_get(t, "otherData"), key);
    if (!v) fail_msg("trace.json's otherData has no '%s'", key);
    return v->number;
}

/* Files in dir whose name starts with prefix. */
static int count_prefixed(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
    closedir(d);
    return n;
}

/* The trace's events of each device, walked in file order (the writer writes a device's spans in
 * record order, each step after its marker): per step (-1: before the first marker), the spans
 * and markers, and a digest of their names and lanes. */
enum { MAX_STEPS = 24, MAX_DEV = 8 };
typedef struct {
    long events[MAX_DEV][MAX_STEPS + 1]; /* [device][step + 1]: "X" and "i" events */
    unsigned long digest[MAX_DEV][MAX_STEPS + 1];
    int markers[MAX_DEV][MAX_STEPS]; /* marker seen for the step */
    int pids[MAX_DEV];               /* process_name events per device */
} by_step;

static unsigned long hash_str(unsigned long h, const char *s)
{
    for (; *s; s++) h = h * 131 + (unsigned char)*s;
    return h;
}

static void walk(const cfg_json *t, by_step *b)
{
    memset(b, 0, sizeof *b);
    const cfg_json *ev = cfg_json_get(t, "traceEvents");
    int cur[MAX_DEV];
    for (int d = 0; d < MAX_DEV; d++) cur[d] = -1;
    for (int i = 0; i < ev->n; i++) {
        const cfg_json *e = &ev->items[i];
        int pid = (int)cfg_json_get(e, "pid")->number;
        assert_true(pid >= 0 && pid < MAX_DEV);
        const char *ph = cfg_json_get(e, "ph")->str, *name = cfg_json_get(e, "name")->str;
        if (!strcmp(ph, "M") && !strcmp(name, "process_name")) b->pids[pid]++;
        if (!strcmp(ph, "i")) {
            int step = atoi(name + 5); /* "step N" */
            assert_true(!strncmp(name, "step ", 5) && step >= 0 && step < MAX_STEPS);
            cur[pid] = step;
            b->markers[pid][step]++;
        }
        if (strcmp(ph, "X") && strcmp(ph, "i")) continue;
        b->events[pid][cur[pid] + 1]++;
        const cfg_json *tid = cfg_json_get(e, "tid");
        b->digest[pid][cur[pid] + 1] =
            hash_str(b->digest[pid][cur[pid] + 1] * 7 + (tid ? (unsigned long)tid->number : 0), name);
    }
}

/* The README's 8-device run: 20 steps, a trace of the first and the last under 1 MB, every device
 * a process of its own, and a line on stdout saying what was left out. */
static void test_trace_bound(void **state)
{
    (void)state;
    char *dir = helper_tmpdir("trace"), od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    const char *argv[] = {"configs/small.yml", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "steps=20", od};
    cli_capture r = cli_capture_run(cli_train, 5, argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    long size = file_size(dir, "trace.json");
    assert_true(size > 100000);  /* it holds the two steps of 8 devices */
    assert_true(size < 1000000); /* under 1 MB */
    assert_non_null(strstr(r.out, "trace.json: steps 0, 19 of 20 (trace_steps=first,last); left out 18 steps"));
    cli_capture_free(&r);
    cfg_json *t = helper_read_json(dir, "trace.json");
    assert_int_equal((int)meta(t, "steps_traced"), 2);
    assert_int_equal((int)meta(t, "steps_left_out"), 18);
    assert_true(meta(t, "spans_left_out") > 0);
    assert_string_equal(cfg_json_get(cfg_json_get(t, "otherData"), "trace_steps")->str, "first,last");
    by_step b;
    walk(t, &b);
    for (int d = 0; d < 8; d++) {
        assert_int_equal(b.pids[d], 1); /* one process per device */
        for (int s = 0; s < MAX_STEPS; s++)
            assert_int_equal(b.markers[d][s], s == 0 || s == 19); /* steps 1..18 left out */
        assert_true(b.events[d][1] > 10);
    }
    cfg_json_free(t);
    helper_rm_rf(dir);
    free(dir);
}

/* trace_steps=2,5-6 of 8 steps keeps what trace_steps=all holds for those steps, and counts
 * what it left out as the full trace shows it. */
static void test_trace_selection(void **state)
{
    (void)state;
    char *all = helper_tmpdir("trace"), *some = helper_tmpdir("trace"), od[300];
    snprintf(od, sizeof od, "output_dir=%s", all);
    const char *a1[] = {SMALL, "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "steps=8", "trace_steps=all", od};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof a1 / sizeof a1[0]), a1);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_null(strstr(r.out, "trace.json: steps")); /* nothing left out, nothing said */
    cli_capture_free(&r);
    snprintf(od, sizeof od, "output_dir=%s", some);
    const char *a2[] = {SMALL,     "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                        "steps=8", "trace_steps=2, 5-6",     od};
    r = cli_capture_run(cli_train, (int)(sizeof a2 / sizeof a2[0]), a2);
    if (r.rc) fail_msg("train failed: %s", r.err);
    cli_capture_free(&r);

    cfg_json *ta = helper_read_json(all, "trace.json"), *ts = helper_read_json(some, "trace.json");
    by_step ba, bs;
    walk(ta, &ba);
    walk(ts, &bs);
    long left = 0;
    for (int d = 0; d < 4; d++) {
        /* setup spans (before step 0's marker) are always kept */
        assert_int_equal(bs.events[d][0], ba.events[d][0]);
        assert_int_equal(bs.digest[d][0], ba.digest[d][0]);
        for (int s = 0; s < 8; s++) {
            bool kept = s == 2 || s == 5 || s == 6;
            assert_int_equal(ba.markers[d][s], 1);
            assert_int_equal(bs.markers[d][s], kept ? 1 : 0);
            if (kept) {
                assert_int_equal(bs.events[d][s + 1], ba.events[d][s + 1]);
                assert_int_equal(bs.digest[d][s + 1], ba.digest[d][s + 1]);
            } else {
                assert_int_equal(bs.events[d][s + 1], 0);
                left += ba.events[d][s + 1];
            }
        }
    }
    assert_int_equal((int)meta(ts, "steps_traced"), 3);
    assert_int_equal((int)meta(ts, "steps_left_out"), 5);
    assert_int_equal((long)meta(ts, "spans_left_out"), left);
    const cfg_json *kept = cfg_json_get(cfg_json_get(ts, "otherData"), "steps_kept");
    assert_int_equal(kept->n, 2);
    assert_int_equal((int)kept->items[1].items[0].number, 5);
    assert_int_equal((int)kept->items[1].items[1].number, 6);
    assert_int_equal((int)meta(ta, "steps_left_out"), 0);
    assert_int_equal((int)meta(ta, "spans_left_out"), 0);
    assert_true(file_size(some, "trace.json") < file_size(all, "trace.json"));
    cfg_json_free(ta);
    cfg_json_free(ts);
    helper_rm_rf(all);
    helper_rm_rf(some);
    free(all);
    free(some);
}

/* Bad trace_steps: exit 2 naming the key and the item, nothing written. */
static void test_trace_steps_refused(void **state)
{
    (void)state;
    const char *bad[][2] = {
        {"trace_steps=3", "step 3 is not a step of this run"},
        {"trace_steps=first,,last", "an empty item"},
        {"trace_steps=lastt", "'lastt' is not a step"},
        {"trace_steps=2-1", "the range 2-1 is empty"},
        {"trace_steps=-1", "'' is not a step"},
        {"trace_steps=0-99999999999999999999", "is not a step"},
        {"trace_steps=", "an empty item"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *dir = helper_tmpdir("trace"), od[300];
        snprintf(od, sizeof od, "output_dir=%s/out", dir);
        const char *argv[] = {SMALL, "steps=3", bad[i][0], od};
        cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
        assert_int_equal(r.rc, 2);
        if (!strstr(r.err, "trace_steps=") || !strstr(r.err, bad[i][1]))
            fail_msg("%s: expected '%s' in: %s", bad[i][0], bad[i][1], r.err);
        assert_string_equal(r.out, "");
        assert_int_equal(count_prefixed(dir, "out"), 0); /* output_dir not even made */
        cli_capture_free(&r);
        helper_rm_rf(dir);
        free(dir);
    }
    /* more items than the limit: say so */
    char many[600] = "trace_steps=0";
    for (int i = 0; i < 70; i++) strcat(many, ",0");
    const char *argv[] = {SMALL, "steps=3", many};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "more than 64 items"));
    cli_capture_free(&r);
}

/* trace.json cannot replace a directory of that name: the run fails, the directory stays, no
 * temporary file is left; the run's trace and the modelled one alike. */
static void test_trace_atomic(void **state)
{
    (void)state;
    for (int modelled = 0; modelled < 2; modelled++) {
        char *dir = helper_tmpdir("trace"), od[300], sub[400];
        snprintf(sub, sizeof sub, "%s/trace.json", dir);
        assert_int_equal(mkdir(sub, 0755), 0);
        snprintf(od, sizeof od, "output_dir=%s", dir);
        const char *real[] = {SMALL, "ici_fsdp_parallelism=2", "steps=2", od};
        const char *dry[] = {SMALL, "ici_fsdp_parallelism=2", "steps=1", "dry_run=true", "hardware_profile=v5p", od};
        cli_capture r = modelled ? cli_capture_run(cli_train, (int)(sizeof dry / sizeof dry[0]), dry)
                                 : cli_capture_run(cli_train, (int)(sizeof real / sizeof real[0]), real);
        assert_int_not_equal(r.rc, 0);
        assert_non_null(strstr(r.err, "trace.json"));
        if (modelled) assert_null(strstr(r.out, "trace.json: the modelled timeline")); /* not claimed */
        cli_capture_free(&r);
        struct stat st;
        assert_int_equal(stat(sub, &st), 0);
        assert_true(S_ISDIR(st.st_mode));
        assert_int_equal(count_prefixed(dir, ".trace.json"), 0); /* no temporary left behind */
        assert_int_equal(count_prefixed(sub, ""), 2);            /* ".", ".." : nothing written into it */
        helper_rm_rf(dir);
        free(dir);
    }
}

/* A write that fails half-way: the child process may write files of at most 160 kB (run.json, the
 * largest written before trace.json, is ~120 kB; both traces are larger); an earlier trace.json
 * must come out of it unchanged. */
static void test_trace_atomic_midwrite(void **state)
{
    (void)state;
    for (int modelled = 0; modelled < 2; modelled++) {
        char *dir = helper_tmpdir("trace"), od[300], path[400];
        snprintf(path, sizeof path, "%s/trace.json", dir);
        helper_write_file(path, "{\"previous\": true}\n", 19);
        snprintf(od, sizeof od, "output_dir=%s", dir);
        const char *real[] = {"base_emb_dim=32",
                              "base_num_query_heads=4",
                              "base_num_kv_heads=4",
                              "head_dim=8",
                              "base_mlp_dim=64",
                              "base_num_decoder_layers=2",
                              "vocab_size=256",
                              "max_target_length=16",
                              "per_device_batch_size=1",
                              "ici_fsdp_parallelism=2",
                              "ici_tensor_parallelism=2",
                              "steps=8",
                              "trace_steps=all",
                              "collectives_csv_max_rows=100",
                              od};
        const char *dry[] = {"base_emb_dim=32",
                             "base_num_query_heads=4",
                             "base_num_kv_heads=4",
                             "head_dim=8",
                             "base_mlp_dim=64",
                             "base_num_decoder_layers=32",
                             "vocab_size=256",
                             "max_target_length=16",
                             "per_device_batch_size=1",
                             "ici_fsdp_parallelism=2",
                             "steps=1",
                             "dry_run=true",
                             "hardware_profile=v5p",
                             "collectives_csv_max_rows=100",
                             od};
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            signal(SIGXFSZ, SIG_IGN); /* a write past the limit fails with EFBIG instead of killing */
            struct rlimit rl = {160000, 160000};
            if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(5);
            cli_capture r = modelled ? cli_capture_run(cli_train, (int)(sizeof dry / sizeof dry[0]), dry)
                                     : cli_capture_run(cli_train, (int)(sizeof real / sizeof real[0]), real);
            if (r.rc && !strstr(r.err, "trace.json")) fprintf(stderr, "%s", r.err);
            _exit(r.rc == 0 ? 0 : strstr(r.err, "trace.json") ? 3 : 4);
        }
        int ws = 0;
        assert_int_equal(waitpid(pid, &ws, 0), pid);
        assert_true(WIFEXITED(ws));
        assert_int_equal(WEXITSTATUS(ws), 3); /* failed, naming trace.json */
        char *after = helper_read_file(path, NULL);
        assert_string_equal(after, "{\"previous\": true}\n");
        free(after);
        assert_int_equal(count_prefixed(dir, ".trace.json"), 0);
        helper_rm_rf(dir);
        free(dir);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_bound),           cmocka_unit_test(test_trace_selection),
        cmocka_unit_test(test_trace_steps_refused),   cmocka_unit_test(test_trace_atomic),
        cmocka_unit_test(test_trace_atomic_midwrite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* test_cli_mpi.c — `mpirun -np R shardsim train` is the one-process run, bit for bit: the same
 * step lines (loss, grad norms, peak memory), the same traffic and memory tables, and the same
 * collectives.csv, traffic.csv and metrics.json (record for record), for a Llama over fsdp x tensor
 * (R = 2, 3, 4: groups inside a rank, spanning ranks, and rank blocks that cut groups unevenly), a
 * pipeline whose stages sit on different ranks, ZeRO-1 with gradient accumulation, and a DeepSeek
 * with expert parallelism (ragged all-to-all across ranks); `parity` gives the one-process
 * table.  A failure on every rank (a simulated OOM) ends the job with its exit code and the message
 * printed once; a rank killed mid-run ends the job at once.  A checkpoint saved under 4 ranks is the
 * one-process file byte for byte, and resumes in one process, as a one-process save does under 2.
 *
 * The program runs as a child process under Open MPI's mpirun with the environment measured to
 * work on this machine kind as root, oversubscribed and unbound (../shared/reference/mpi-notes.md).
 * Skipped, with a message, where the build has no MPI or mpirun is missing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "sim/xrank.h"
#include "tests/helpers.h"

#define MPIRUN                                                                                           \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "    \
    "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_hwloc_base_binding_policy=none "            \
    "timeout 120 mpirun"

static char program[1024]; /* the shardsim of this test's own build */
static char tmp[128];      /* this test's scratch directory */
static const char *skip_why;

#define LLAMA_BASE "configs/small.yml ici_fsdp_parallelism=4 ici_tensor_parallelism=2"
static const char LLAMA[] = LLAMA_BASE " steps=3";
static const char PIPELINE[] = "base_num_decoder_layers=8 base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 "
                               "head_dim=16 base_mlp_dim=128 vocab_size=128 max_target_length=32 per_device_batch_size=4 "
                               "ici_pipeline_parallelism=4 ici_fsdp_parallelism=2 num_pipeline_microbatches=8 steps=2";
static const char ZERO1[] = "configs/small.yml ici_data_parallelism=4 ici_tensor_parallelism=2 "
                            "shard_optimizer_over_data=true gradient_accumulation_steps=2 steps=2";
static const char DEEPSEEK[] = "model_name=deepseek3-tiny override_model_config=true base_num_decoder_layers=3 "
                               "first_num_dense_layers=1 vocab_size=512 max_target_length=128 per_device_batch_size=1 "
                               "ici_fsdp_parallelism=4 ici_expert_parallelism=2 steps=2";

static int setup(void **state)
{
    (void)state;
    ssize_t n = readlink("/proc/self/exe", program, sizeof program - 1);
    if (n <= 0) return -1;
    program[n] = '\0';
    for (int up = 0; up < 2; up++) *strrchr(program, '/') = '\0';
    strcat(program, "/shardsim");
    if (access(program, X_OK) != 0) {
        fprintf(stderr, "test_cli_mpi: no program beside this test's build (%s): build it first\n", program);
        return -1;
    }
    if (!sim_xrank_built())
        skip_why = "this build has no MPI (SHARDSIM_MPI=0, or no libopenmpi-dev): install it with .ci/install-deps";
    else if (system("command -v mpirun > /dev/null 2>&1") != 0)
        skip_why = "mpirun is not installed (openmpi-bin): install it with .ci/install-deps";
    snprintf(tmp, sizeof tmp, "/tmp/shardsim-mpi-test-%d", (int)getpid());
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", tmp, tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static void skip_without_mpi(void)
{
    if (!skip_why) return;
    fprintf(stderr, "test_cli_mpi: skipped: %s\n", skip_why);
    skip();
}

/* Runs cmd; returns its exit code. */
static int sh(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The console output with what may differ between runs taken out: the step lines' time and tokens/s
 * columns (the 6th and 7th fields), the pipeline bubbles' measured share, the MPI section (only under
 * mpirun) and the artifacts line. */
static char *normalised(const char *path)
{
    char *s = helper_read_file_opt(path, NULL);
    assert_non_null(s);
    char *out = calloc(strlen(s) + 1, 1);
    assert_non_null(out);
    size_t o = 0;
    bool in_mpi = false, in_steps = false;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "MPI: ", 5)) in_mpi = true;
        else if (in_mpi && line[0] != ' ') in_mpi = false;
        if (in_mpi || !strncmp(line, "artifacts written to", 20)) continue;
        if (in_steps && line[0] != ' ') in_steps = false;
        char *measured = strstr(line, "; measured on device 0:"); /* the pipeline bubbles' timing */
        if (measured) *measured = '\0';
        int step;
        char f[8][32];
        if (in_steps && sscanf(line, " %d %31s %31s %31s %31s %31s %31s %31s %31s", &step, f[0], f[1], f[2], f[3], f[4], f[5], f[6],
                   f[7]) == 9)
            o += (size_t)sprintf(out + o, "%d %s %s %s %s %s %s\n", step, f[0], f[1], f[2], f[3], f[6], f[7]);
        else
            o += (size_t)sprintf(out + o, "%s\n", line);
        if (strstr(line, "tokens/s")) in_steps = true;
    }
    free(s);
    return out;
}

/* metrics.json without its timing lines. */
static char *metrics_values(const char *dir)
{
    char path[512];
    snprintf(path, sizeof path, "%s/metrics.json", dir);
    char *s = helper_read_file_opt(path, NULL);
    assert_non_null(s);
    char *out = calloc(strlen(s) + 1, 1);
    assert_non_null(out);
    size_t o = 0;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
        if (!strstr(line, "time") && !strstr(line, "tokens_per_s")) o += (size_t)sprintf(out + o, "%s\n", line);
    free(s);
    return out;
}

static void assert_same_file(const char *a, const char *b, const char *name)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", a, name);
    snprintf(pb, sizeof pb, "%s/%s", b, name);
    char *x = helper_read_file_opt(pa, NULL), *y = helper_read_file_opt(pb, NULL);
    assert_non_null(x);
    assert_non_null(y);
    if (strcmp(x, y)) fail_msg("%s differs between %s and %s", name, a, b);
    free(x);
    free(y);
}

/* The one-process run of `args` and the runs under mpirun -np R for each R of nps: equal outputs. */
static void check_same_as_one_process(const char *name, const char *args, const int *nps, int n)
{
    char cmd[8192], one[256], onetxt[300];
    snprintf(one, sizeof one, "%s/%s-1", tmp, name);
    snprintf(onetxt, sizeof onetxt, "%s.txt", one);
    snprintf(cmd, sizeof cmd, "%s train %s output_dir=%s > %s 2>&1", program, args, one, onetxt);
    assert_int_equal(sh(cmd), 0);
    char *ref = normalised(onetxt), *ref_metrics = metrics_values(one);
    for (int i = 0; i < n; i++) {
        char dir[256], txt[300], err[300];
        snprintf(dir, sizeof dir, "%s/%s-np%d", tmp, name, nps[i]);
        snprintf(txt, sizeof txt, "%s.txt", dir);
        snprintf(err, sizeof err, "%s.err", dir);
        snprintf(cmd, sizeof cmd, MPIRUN " -np %d %s train %s output_dir=%s > %s 2> %s", nps[i], program, args, dir, txt,
                 err);
        int rc = sh(cmd);
        if (rc) {
            char *e = helper_read_file_opt(err, NULL);
            fail_msg("mpirun -np %d exited %d: %s", nps[i], rc, e ? e : "");
        }
        char *got = normalised(txt);
        if (strcmp(ref, got)) fail_msg("mpirun -np %d: the console differs from the one-process run:\n%s\n---\n%s", nps[i], ref, got);
        char *mv = metrics_values(dir);
        if (strcmp(ref_metrics, mv)) fail_msg("mpirun -np %d: metrics.json differs", nps[i]);
        assert_same_file(one, dir, "collectives.csv");
        assert_same_file(one, dir, "traffic.csv");
        /* the ranks did talk: their bytes are reported, apart from the simulated traffic */
        char *raw = helper_read_file_opt(txt, NULL);
        assert_non_null(strstr(raw, "MPI: "));
        free(raw);
        free(got);
        free(mv);
    }
    free(ref);
    free(ref_metrics);
}

static void test_llama_is_the_one_process_run(void **state)
{
    (void)state;
    skip_without_mpi();
    const int nps[] = {2, 3, 4};
    check_same_as_one_process("llama", LLAMA, nps, 3);
}

/* pipeline stages on different ranks: the ppermute shifts cross them */
static void test_pipeline_is_the_one_process_run(void **state)
{
    (void)state;
    skip_without_mpi();
    const int nps[] = {2};
    check_same_as_one_process("pipeline", PIPELINE, nps, 1);
}

/* ZeRO-1 with gradient accumulation: the optimizer-layout reduce-scatters and gathers over data */
static void test_zero1_is_the_one_process_run(void **state)
{
    (void)state;
    skip_without_mpi();
    const int nps[] = {4};
    check_same_as_one_process("zero1", ZERO1, nps, 1);
}

static void test_deepseek_expert_parallel_is_the_one_process_run(void **state)
{
    (void)state;
    skip_without_mpi();
    const int nps[] = {2};
    check_same_as_one_process("deepseek", DEEPSEEK, nps, 1);
}

/* parity under mpirun: configurations spread over the ranks (ZeRO-1 among them) and one too small to
 * spread (1 device: every rank runs it whole) give the one-process table, losses and the largest
 * gradient difference (the gradients are gathered from every rank). */
static void test_parity_is_the_one_process_parity(void **state)
{
    (void)state;
    skip_without_mpi();
    static const char args[] =
        "configs/small.yml per_device_batch_size=8 steps=3 learning_rate=3e-4 configs=\"ici_fsdp_parallelism=1;"
        "ici_fsdp_parallelism=4 ici_tensor_parallelism=2 shard_mode=explicit;"
        "ici_data_parallelism=4 ici_tensor_parallelism=2 shard_optimizer_over_data=true\"";
    char cmd[8192], one[256], two[256];
    snprintf(one, sizeof one, "%s/parity-1.txt", tmp);
    snprintf(two, sizeof two, "%s/parity-np2.txt", tmp);
    snprintf(cmd, sizeof cmd, "%s parity %s > %s 2>&1", program, args, one);
    assert_int_equal(sh(cmd), 0);
    snprintf(cmd, sizeof cmd, MPIRUN " -np 2 %s parity %s > %s 2>&1", program, args, two);
    assert_int_equal(sh(cmd), 0);
    char *a = helper_read_file_opt(one, NULL), *b = helper_read_file_opt(two, NULL);
    assert_non_null(a);
    assert_non_null(b);
    /* "3 steps in 0.2 s, last loss ...": the time differs */
    for (char *s = a; (s = strstr(s, " in ")) != NULL; s++) memset(s, ' ', strcspn(s, ",\n"));
    for (char *s = b; (s = strstr(s, " in ")) != NULL; s++) memset(s, ' ', strcspn(s, ",\n"));
    if (strcmp(a, b)) fail_msg("parity under mpirun -np 2 differs from the one-process parity:\n%s\n---\n%s", a, b);
    assert_non_null(strstr(a, "PASS"));
    free(a);
    free(b);
}

/* Checkpoints: saved under mpirun -np 4 the file is byte for byte the one-process save, and a
 * one-process run resumes from it as from its own; a one-process save resumes under -np 2 the same. */
static void test_checkpoints_across_rank_counts(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192];
    const char *a = LLAMA_BASE;
    /* one process: save after step 2, then resume to step 4 */
    snprintf(cmd, sizeof cmd, "%s train %s steps=3 checkpoint_dir=%s/ck1 > /dev/null 2>&1 && "
             "cp -r %s/ck1 %s/ck2 && %s train %s steps=5 checkpoint_dir=%s/ck1 output_dir=%s/r1 > /dev/null 2>&1",
             program, a, tmp, tmp, tmp, program, a, tmp, tmp);
    assert_int_equal(sh(cmd), 0);
    /* saved under 4 ranks, resumed in one process */
    snprintf(cmd, sizeof cmd, MPIRUN " -np 4 %s train %s steps=3 checkpoint_dir=%s/ck4 > /dev/null 2>&1", program, a,
             tmp);
    assert_int_equal(sh(cmd), 0);
    char one[256], four[256];
    snprintf(one, sizeof one, "%s/ck2", tmp);
    snprintf(four, sizeof four, "%s/ck4", tmp);
    assert_same_file(one, four, "step_2.safetensors");
    snprintf(cmd, sizeof cmd, "%s train %s steps=5 checkpoint_dir=%s/ck4 output_dir=%s/r4 > /dev/null 2>&1", program,
             a, tmp, tmp);
    assert_int_equal(sh(cmd), 0);
    /* saved in one process, resumed under 2 ranks */
    snprintf(cmd, sizeof cmd, MPIRUN " -np 2 %s train %s steps=5 checkpoint_dir=%s/ck2 output_dir=%s/r2 > /dev/null 2>&1",
             program, a, tmp, tmp);
    assert_int_equal(sh(cmd), 0);
    char r[3][256];
    const char *names[3] = {"r1", "r4", "r2"};
    for (int i = 0; i < 3; i++) snprintf(r[i], sizeof r[i], "%s/%s", tmp, names[i]);
    char *m1 = metrics_values(r[0]);
    for (int i = 1; i < 3; i++) {
        char *mi = metrics_values(r[i]);
        if (strcmp(m1, mi)) fail_msg("the resumed run %s differs from the one-process resume", names[i]);
        free(mi);
    }
    free(m1);
}

/* A simulated OOM on every rank: exit 1, the message once (rank 0's; the others are ended first). */
static void test_failure_ends_every_rank_once(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192], err[256];
    snprintf(err, sizeof err, "%s/oom.err", tmp);
    snprintf(cmd, sizeof cmd, MPIRUN " -np 2 %s train %s hbm_limit_gb=0.002 > /dev/null 2> %s", program, LLAMA, err);
    assert_int_equal(sh(cmd), 1);
    char *e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    const char *first = strstr(e, "is out of memory");
    if (!first) fail_msg("no OOM message: %s", e);
    if (strstr(first + 1, "is out of memory")) fail_msg("the OOM message is printed more than once: %s", e);
    free(e);
}

/* The ranks mpirun `pid` started (its children), up to cap; how many. */
static int children_of(pid_t pid, pid_t *out, int cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)pid, (int)pid);
    FILE *f = fopen(path, "r");
    int n = 0, c;
    while (f && n < cap && fscanf(f, "%d", &c) == 1) out[n++] = (pid_t)c;
    if (f) fclose(f);
    return n;
}

/* A rank killed mid-run (SIGKILL: no chance to say anything): mpirun ends the job, non-zero, at once. */
static void test_killed_rank_ends_the_job(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "exec env " MPIRUN " -np 2 %s train configs/small.yml ici_fsdp_parallelism=4 "
             "ici_tensor_parallelism=2 steps=100000 > /dev/null 2>&1", program);
    fflush(stdout);
    pid_t mp = fork();
    if (mp == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    assert_true(mp > 0);
    /* exec env ... timeout 120 mpirun: mpirun is timeout's child, the ranks are mpirun's */
    pid_t kids[8], ranks[8];
    int nr = 0;
    for (int i = 0; i < 200 && nr < 2; i++) { /* up to 20 s for both ranks to start */
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
        int nk = children_of(mp, kids, 8);
        nr = nk ? children_of(kids[0], ranks, 8) : 0;
    }
    if (nr < 2) {
        kill(mp, SIGKILL);
        waitpid(mp, NULL, 0);
        fail_msg("the two ranks did not start");
    }
    struct timespec settle = {1, 0}; /* into the steps */
    nanosleep(&settle, NULL);
    kill(ranks[1], SIGKILL);
    int status = 0;
    double waited = 0;
    while (waitpid(mp, &status, WNOHANG) == 0 && waited < 30) {
        struct timespec ts = {0, 50000000};
        nanosleep(&ts, NULL);
        waited += 0.05;
    }
    if (waited >= 30) {
        kill(mp, SIGKILL);
        waitpid(mp, NULL, 0);
        fail_msg("the job still ran 30 s after a rank was killed");
    }
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (rc == 0 || rc == 124) fail_msg("the job exited %d after a rank was killed", rc);
}

/* Too many ranks for the mesh: exit 2 naming the limit. */
static void test_more_ranks_than_devices(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192], err[256];
    snprintf(err, sizeof err, "%s/ranks.err", tmp);
    snprintf(cmd, sizeof cmd, MPIRUN " -np 3 %s train configs/small.yml ici_fsdp_parallelism=2 steps=1 > /dev/null 2> %s",
             program, err);
    assert_int_equal(sh(cmd), 2);
    char *e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    if (!strstr(e, "3 MPI ranks for a mesh of 2 devices")) fail_msg("unexpected message: %s", e);
    free(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_is_the_one_process_run),
        cmocka_unit_test(test_pipeline_is_the_one_process_run),
        cmocka_unit_test(test_zero1_is_the_one_process_run),
        cmocka_unit_test(test_deepseek_expert_parallel_is_the_one_process_run),
        cmocka_unit_test(test_parity_is_the_one_process_parity),
        cmocka_unit_test(test_checkpoints_across_rank_counts),
        cmocka_unit_test(test_failure_ends_every_rank_once),
        cmocka_unit_test(test_killed_rank_ends_the_job),
        cmocka_unit_test(test_more_ranks_than_devices),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

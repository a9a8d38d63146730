/* test_cli_mpi.c — `mpirun -np R shardsim train` is the one-process run, bit for bit: the same
 * step lines (loss, grad norms, peak memory), the same traffic and memory tables, and the same
 * collectives.csv, traffic.csv and metrics.json (record for record), for a Llama over fsdp x tensor
 * (R = 2, 3, 4: groups inside a rank, spanning ranks, and rank blocks that cut groups unevenly), a
 * pipeline whose stages sit on different ranks, ZeRO-1 with gradient accumulation, and a DeepSeek
 * with expert parallelism (ragged all-to-all across ranks); `parity` gives the one-process
 * table.  A failure on every rank (a simulated OOM), or on one rank alone before its run while the
 * others wait for it, ends the job with its exit code and the message printed once, by rank 0, with
 * no MPI_Abort notice; a rank killed mid-run ends the job at once.  A checkpoint saved under 4 ranks is the
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
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "sim/xrank.h"
#include "tests/helpers.h"

#define MPIRUN                                                                                                         \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "                   \
    "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_hwloc_base_binding_policy=none "                           \
    "timeout 120 mpirun"

static char program[1024]; /* the shardsim of this test's own build */
static char tmp[128];      /* this test's scratch directory */
static const char *skip_why;
/* Extra mpirun options, and the network namespace mpirun runs in ("": none), for the two-host test. */
static char mpirun_extra[1024], launch_ns[64];
static char ns_cleanup[512]; /* removes the two-host test's namespaces (teardown, when it failed midway) */

#define LLAMA_BASE "configs/small.yml ici_fsdp_parallelism=4 ici_tensor_parallelism=2"
static const char LLAMA[] = LLAMA_BASE " steps=3";
static const char PIPELINE[] =
    "base_num_decoder_layers=8 base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 "
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
    if (ns_cleanup[0] && system(ns_cleanup) != 0) ns_cleanup[0] = '\0';
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

static void assert_once(const char *err, const char *what);

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
        if (in_steps && sscanf(line, " %d %31s %31s %31s %31s %31s %31s %31s %31s", &step, f[0], f[1], f[2], f[3], f[4],
                               f[5], f[6], f[7]) == 9)
            o += (size_t)sprintf(out + o, "%d %s %s %s %s %s %s\n", step, f[0], f[1], f[2], f[3], f[6], f[7]);
        else o += (size_t)sprintf(out + o, "%s\n", line);
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
    char cmd[16384], one[256], onetxt[300];
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
        char run[8192];
        snprintf(run, sizeof run, MPIRUN " %s -np %d %s train %s output_dir=%s", mpirun_extra, nps[i], program, args,
                 dir);
        if (*launch_ns) /* mpirun itself in the first "host"'s namespace, with that host's name */
            snprintf(cmd, sizeof cmd, "ip netns exec %s unshare --uts sh -c 'hostname %s && %s' > %s 2> %s", launch_ns,
                     launch_ns, run, txt, err);
        else snprintf(cmd, sizeof cmd, "%s > %s 2> %s", run, txt, err);
        int rc = sh(cmd);
        if (rc) {
            char *e = helper_read_file_opt(err, NULL);
            fail_msg("mpirun -np %d exited %d: %s", nps[i], rc, e ? e : "");
        }
        char *got = normalised(txt);
        if (strcmp(ref, got))
            fail_msg("mpirun -np %d: the console differs from the one-process run:\n%s\n---\n%s", nps[i], ref, got);
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

/* rank_placement=axis:fsdp keeps the fsdp groups inside a rank (devices 0,2,4,6 and 1,3,5,7: the
 * tensor pairs span the ranks instead): the same run, bit for bit, as one process (which ignores
 * the placement); the MPI section names the placement's device lists. */
static void test_llama_axis_placement_is_the_one_process_run(void **state)
{
    (void)state;
    skip_without_mpi();
    const int nps[] = {2};
    check_same_as_one_process("placed", LLAMA_BASE " steps=2 rank_placement=axis:fsdp", nps, 1);
    char path[512];
    snprintf(path, sizeof path, "%s/placed-np2.txt", tmp);
    char *t = helper_read_file_opt(path, NULL);
    assert_non_null(t);
    if (!strstr(t, "MPI: 2 ranks, devices 0,2,4,6; 1,3,5,7 (rank_placement=axis:fsdp)"))
        fail_msg("the MPI section does not name the placement's devices: %s", t);
    free(t);
}

/* A placement the ranks cannot split, or an axis the mesh lacks: exit 2 naming the key, once (the
 * job's message is the first rank's to fail: rank 0's, or "MPI rank r: ..." when another told it). */
static void test_bad_placement(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192], err[256];
    snprintf(err, sizeof err, "%s/placement.err", tmp);
    snprintf(cmd, sizeof cmd, MPIRUN " -q -np 3 %s train %s rank_placement=axis:tensor > /dev/null 2> %s", program,
             LLAMA, err);
    assert_int_equal(sh(cmd), 2);
    char *e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    /* every rank sees it; the first to tell the others is named when it is not rank 0 */
    assert_once(e, "rank_placement=axis:tensor keeps each group of 2 devices inside one rank, but 4 groups "
                   "cannot be split evenly over 3 ranks");
    free(e);
    snprintf(cmd, sizeof cmd, MPIRUN " -q -np 2 %s train %s rank_placement=axis:tensr > /dev/null 2> %s", program,
             LLAMA, err);
    assert_int_equal(sh(cmd), 2);
    e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    assert_once(e, "rank_placement=axis:tensr: the mesh has no axis 'tensr'");
    free(e);
}

/* Two "hosts" on this machine (../shared/reference/mpi-notes.md): two network namespaces joined by
 * a veth pair, each with its own host name (unshare --uts), mpirun started in the first and
 * reaching the second through an rsh agent that enters its namespace (no sshd).  Open MPI groups
 * ranks by host name, so the two ranks talk over TCP across the veth: the Llama run is still the
 * one-process run bit for bit, and the veth carried at least one step's MPI bytes.  Skipped, with
 * a message, where namespaces cannot be made (not root, no `ip`, no CAP_NET_ADMIN/CAP_SYS_ADMIN:
 * an unprivileged container); every command runs under a timeout and the namespaces are removed
 * whatever happens. */
static void test_llama_across_two_hosts_over_tcp(void **state)
{
    (void)state;
    skip_without_mpi();
    int pid = (int)getpid();
    char a[32], b[32], va[32], vb[32], cmd[8192], agent[256];
    snprintf(a, sizeof a, "ssha%d", pid);
    snprintf(b, sizeof b, "sshb%d", pid);
    snprintf(va, sizeof va, "ssva%d", pid); /* interface names: at most 15 characters */
    snprintf(vb, sizeof vb, "ssvb%d", pid);
    const char *why = NULL;
    if (geteuid() != 0) why = "not root (ip netns needs CAP_NET_ADMIN and CAP_SYS_ADMIN)";
    else if (sh("command -v ip > /dev/null 2>&1 && command -v unshare > /dev/null 2>&1") != 0)
        why = "no `ip` or `unshare` (iproute2, util-linux: .ci/install-deps)";
    else if (snprintf(cmd, sizeof cmd, "timeout 10 ip netns add %s 2>/dev/null", a), sh(cmd) != 0)
        why = "`ip netns add` failed (no CAP_NET_ADMIN/CAP_SYS_ADMIN here: an unprivileged container?)";
    if (why) {
        fprintf(stderr, "test_cli_mpi: two-host test skipped: %s\n", why);
        skip();
    }
    snprintf(
        cmd, sizeof cmd,
        "timeout 20 sh -c 'ip netns add %s && ip link add %s type veth peer name %s && ip link set %s netns %s && "
        "ip link set %s netns %s && ip -n %s addr add 10.99.0.1/24 dev %s && ip -n %s addr add 10.99.0.2/24 dev %s && "
        "ip -n %s link set lo up && ip -n %s link set lo up && ip -n %s link set %s up && ip -n %s link set %s up && "
        "ip netns exec %s unshare --uts true' > /dev/null 2>&1",
        b, va, vb, va, a, vb, b, a, va, b, vb, a, b, a, va, b, vb, a);
    int made = sh(cmd);
    /* the rsh agent: skips ssh-style options, then runs the command in the namespace named as the host */
    snprintf(agent, sizeof agent, "%s/nsrsh", tmp);
    FILE *f = fopen(agent, "w");
    if (f) {
        fputs("#!/bin/sh\nwhile [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n"
              "host=$1; shift\nexec ip netns exec \"$host\" unshare --uts sh -c \"hostname $host && $*\"\n",
              f);
        fclose(f);
        chmod(agent, 0755);
    }
    snprintf(ns_cleanup, sizeof ns_cleanup, "ip netns del %s > /dev/null 2>&1; ip netns del %s > /dev/null 2>&1", a, b);
    if (made != 0 || !f) {
        sh(ns_cleanup);
        ns_cleanup[0] = '\0';
        fprintf(stderr, "test_cli_mpi: two-host test skipped: could not set up the veth pair and host names\n");
        skip();
    }
    snprintf(mpirun_extra, sizeof mpirun_extra,
             "-q --mca plm_rsh_agent %s --mca btl_tcp_if_include 10.99.0.0/24 "
             "--mca oob_tcp_if_include 10.99.0.0/24 --host %s:1,%s:1",
             agent, a, b);
    snprintf(launch_ns, sizeof launch_ns, "%s", a);
    const int nps[] = {2};
    check_same_as_one_process("hosts", LLAMA, nps, 1); /* a failure here leaves the cleanup to teardown */
    mpirun_extra[0] = launch_ns[0] = '\0';
    /* the bytes that crossed the veth (both ways, every step) against one step's MPI bytes */
    char line[256];
    unsigned long long rx = 0, tx = 0, step = 0;
    snprintf(line, sizeof line,
             "ip netns exec %s sh -c 'cat /sys/class/net/%s/statistics/rx_bytes "
             "/sys/class/net/%s/statistics/tx_bytes'",
             a, va, va);
    FILE *p = popen(line, "r");
    if (p) {
        if (fscanf(p, "%llu %llu", &rx, &tx) != 2) rx = tx = 0;
        pclose(p);
    }
    snprintf(line, sizeof line, "%s/hosts-np2.txt", tmp);
    char *t = helper_read_file_opt(line, NULL), *at = t ? strstr(t, "bytes the ranks sent each other") : NULL;
    if (at && (at = strchr(at, '\n'))) step = strtoull(at + 1, NULL, 10);
    free(t);
    sh(ns_cleanup);
    ns_cleanup[0] = '\0';
    if (!step) fail_msg("no MPI bytes per step in the two-host run's output");
    if (rx + tx < step)
        fail_msg("the veth between the hosts carried %llu bytes, less than one step's %llu MPI bytes: not over TCP",
                 rx + tx, step);
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
    snprintf(cmd, sizeof cmd,
             "%s train %s steps=3 checkpoint_dir=%s/ck1 > /dev/null 2>&1 && "
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
    snprintf(cmd, sizeof cmd, "%s train %s steps=5 checkpoint_dir=%s/ck4 output_dir=%s/r4 > /dev/null 2>&1", program, a,
             tmp, tmp);
    assert_int_equal(sh(cmd), 0);
    /* saved in one process, resumed under 2 ranks */
    snprintf(cmd, sizeof cmd,
             MPIRUN " -np 2 %s train %s steps=5 checkpoint_dir=%s/ck2 output_dir=%s/r2 > /dev/null 2>&1", program, a,
             tmp, tmp);
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

/* err holds `what` exactly once, and nothing of MPI_Abort (mpirun runs with -q: its own note that
 * a rank exited non-zero is off, so stderr is what the ranks print). */
static void assert_once(const char *err, const char *what)
{
    const char *first = strstr(err, what);
    if (!first) fail_msg("no '%s' in: %s", what, err);
    if (strstr(first + 1, what)) fail_msg("'%s' is printed more than once: %s", what, err);
    if (strstr(err, "MPI_ABORT") || strstr(err, "ORTE_ERROR_LOG")) fail_msg("MPI_Abort's notice: %s", err);
}

/* A simulated OOM on every rank: exit 1, the message once. */
static void test_failure_ends_every_rank_once(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192], err[256];
    snprintf(err, sizeof err, "%s/oom.err", tmp);
    snprintf(cmd, sizeof cmd, MPIRUN " -q -np 2 %s train %s hbm_limit_gb=0.002 > /dev/null 2> %s", program, LLAMA, err);
    assert_int_equal(sh(cmd), 1);
    char *e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    assert_once(e, "is out of memory");
    free(e);
}

/* Rank 1 alone refuses to start (its host-memory check: mpirun's second program gets a tiny
 * SHARDSIM_HOST_MEMORY_BYTES) while rank 0's devices wait for its devices in their first
 * collective: its control message ends rank 0's run; the job exits 2 with rank 1's message once,
 * printed by rank 0. */
static void test_failure_on_one_rank_reaches_the_others(void **state)
{
    (void)state;
    skip_without_mpi();
    char cmd[8192], err[256];
    snprintf(err, sizeof err, "%s/one.err", tmp);
    snprintf(cmd, sizeof cmd,
             MPIRUN " -q -np 1 %s train %s : -np 1 env SHARDSIM_HOST_MEMORY_BYTES=1000 %s train %s "
                    "> /dev/null 2> %s",
             program, LLAMA, program, LLAMA, err);
    assert_int_equal(sh(cmd), 2);
    char *e = helper_read_file_opt(err, NULL);
    assert_non_null(e);
    assert_once(e, "host memory");
    if (!strstr(e, "shardsim: MPI rank 1: this run needs")) fail_msg("not rank 1's message, printed by rank 0: %s", e);
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
    snprintf(cmd, sizeof cmd,
             "exec env " MPIRUN " -np 2 %s train configs/small.yml ici_fsdp_parallelism=4 "
             "ici_tensor_parallelism=2 steps=100000 > /dev/null 2>&1",
             program);
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
    snprintf(cmd, sizeof cmd,
             MPIRUN " -np 3 %s train configs/small.yml ici_fsdp_parallelism=2 steps=1 > /dev/null 2> %s", program, err);
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
        cmocka_unit_test(test_llama_axis_placement_is_the_one_process_run),
        cmocka_unit_test(test_bad_placement),
        cmocka_unit_test(test_llama_across_two_hosts_over_tcp),
        cmocka_unit_test(test_pipeline_is_the_one_process_run),
        cmocka_unit_test(test_zero1_is_the_one_process_run),
        cmocka_unit_test(test_deepseek_expert_parallel_is_the_one_process_run),
        cmocka_unit_test(test_parity_is_the_one_process_parity),
        cmocka_unit_test(test_checkpoints_across_rank_counts),
        cmocka_unit_test(test_failure_ends_every_rank_once),
        cmocka_unit_test(test_failure_on_one_rank_reaches_the_others),
        cmocka_unit_test(test_killed_rank_ends_the_job),
        cmocka_unit_test(test_more_ranks_than_devices),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

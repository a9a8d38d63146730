/* test_sim_xrank.c — the simulated machine spread over MPI ranks (sim/xrank.h), at the sim level.
 *
 * Each test runs this binary again under `mpirun -np R` with a case name in SHARDSIM_XRANK_CASE;
 * in that mode main runs the case on its rank instead of the cmocka tests:
 *   sums      every collective over every axis set of an 8-device mesh (data=2 fsdp=2 tensor=2)
 *             on float data of mixed magnitudes: the results equal, bit for bit, those of the same
 *             machine run whole in this process (opts.whole), and integer-valued results equal
 *             their definitions; the records match the one-process records too.  Under the
 *             contiguous placement and, with SHARDSIM_XRANK_PLACEMENT, others (axis:data puts
 *             devices 0 and 4 on one rank: every group but data's spans ranks)
 *   mismatch  device 5 gathers a different size over (data, fsdp): every rank's run fails with
 *             the one mismatch message naming device 5
 *   fail      device 6 fails alone mid-run while the others wait in collectives that span ranks:
 *             every rank stops, the job exits 3, and device 6's message is printed once, by rank 0
 *   outside   rank 1 fails before its run starts (no device of its ever arrives) while rank 0's
 *             devices wait for them: its control message ends rank 0's run, printed once by rank 0
 *   deadlock  rank 1's devices skip a collective over `data` that rank 0's make: the collective
 *             watchdog (collective_timeout_s) ends the job naming the op and the rank waited for
 * Every case ends through sim_xrank_conclude (the job's exit code agreed, the message printed once,
 * by rank 0), never MPI_Abort; mpirun runs with -q, so stderr holds only what the ranks print.
 * Assertions in the rank mode run on the main thread; device threads record into slots.
 * Skipped, with a message, without MPI or mpirun. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "sim/collectives.h"
#include "sim/machine.h"
#include "sim/xrank.h"

#define MPIRUN                                                                                                         \
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "                   \
    "OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_hwloc_base_binding_policy=none "                           \
    "timeout 60 mpirun -q"

enum { N = 8, LEN = 4096, NOUT = 12 };

/* ------------------------------------------------------------ rank mode */

typedef struct {
    const char *which;
    float out[N][NOUT][8 * LEN]; /* each device's results, in call order */
} xcase;

static float val(int dev, size_t i, bool mixed)
{
    if (!mixed) return (float)((dev * 7 + (int)(i % 1000)) % 97);
    /* magnitudes from 1e-3 to 1e3 so the order of a sum shows in its bits */
    unsigned h = (unsigned)(dev * 2654435761u) ^ (unsigned)(i * 40503u);
    float m = (float)(h % 1000) / 997.0f;
    return ((h >> 10) & 1 ? -m : m) * ((h >> 11) % 3 == 0 ? 1e3f : (h >> 11) % 3 == 1 ? 1.0f : 1e-3f);
}

static sim_status case_device(sim_device *d, void *arg)
{
    xcase *xc = arg;
    int id = sim_device_id(d);
    float x[8 * LEN], y[8 * LEN];
    for (size_t i = 0; i < 8 * LEN; i++) x[i] = val(id, i, true);
    sim_axes data = sim_axes_1(0), fsdp = sim_axes_1(1), tensor = sim_axes_1(2), df = sim_axes_2(0, 1),
             all = sim_axes_3(0, 1, 2), ft = sim_axes_2(1, 2), fd = sim_axes_2(1, 0);
    if (!strcmp(xc->which, "mismatch")) {
        size_t n = id == 5 ? LEN / 2 : LEN;
        return sim_all_gather(d, x, y, n, SIM_F32, df, sim_meta_tag("odd/gather"));
    }
    if (!strcmp(xc->which, "deadlock"))
        return id < N / 2 ? sim_all_reduce(d, x, y, LEN, SIM_F32, data, sim_meta_tag("lonely")) : SIM_OK;
    if (!strcmp(xc->which, "fail")) {
        SIM_TRY(sim_all_reduce(d, x, y, LEN, SIM_F32, all, sim_meta_tag("first")));
        if (id == 6) return sim_err(SIM_ERR_CHECK, "device 6 failed on purpose");
        return sim_all_reduce(d, x, y, LEN, SIM_F32, all, sim_meta_tag("never"));
    }
    int o = 0;
    memset(y, 0, sizeof y);
    SIM_TRY(sim_all_gather(d, x, y, LEN, SIM_F32, df, sim_meta_tag("ag")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_all_gather(d, x, y, 2 * LEN, SIM_F32, tensor, sim_meta_tag("ag-tensor")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_reduce_scatter(d, x, y, 2 * LEN, SIM_F32, fsdp, sim_meta_tag("rs-fsdp")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_reduce_scatter(d, x, y, 8 * LEN, SIM_F32, all, sim_meta_tag("rs")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_reduce_scatter_dim(d, x, y, 64, 4, LEN / 64, SIM_F32, fd, sim_meta_tag("rs-rows")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_all_reduce(d, x, y, 3 * LEN + 5, SIM_F32, data, sim_meta_tag("ar")));
    memcpy(xc->out[id][o++], y, sizeof y);
    memcpy(y, x, sizeof y); /* in place */
    SIM_TRY(sim_all_reduce(d, y, y, 8 * LEN, SIM_F32, all, sim_meta_tag("ar-in-place")));
    memcpy(xc->out[id][o++], y, sizeof y);
    SIM_TRY(sim_all_to_all(d, x, y, 4 * LEN, SIM_F32, ft, sim_meta_tag("a2a")));
    memcpy(xc->out[id][o++], y, sizeof y);
    int perm[4] = {2, 0, 3, -1};
    memset(y, 0, sizeof y);
    SIM_TRY(sim_ppermute(d, x, y, LEN, perm, SIM_F32, df, sim_meta_tag("ppermute")));
    memcpy(xc->out[id][o++], y, sizeof y);
    int r = sim_device_group_rank(d, ft);
    size_t so[4], sn[4], ro[4], rn[4], st = 0, rt = 0;
    for (int q = 0; q < 4; q++) {
        sn[q] = (size_t)(r + 2 * q + 1) * 128;
        rn[q] = (size_t)(q + 2 * r + 1) * 128;
        so[q] = st;
        ro[q] = rt;
        st += sn[q];
        rt += rn[q];
    }
    memset(y, 0, sizeof y);
    SIM_TRY(sim_ragged_all_to_all(d, x, y, 8 * LEN, so, sn, ro, rn, SIM_F32, ft, sim_meta_tag("ragged")));
    memcpy(xc->out[id][o++], y, sizeof y);
    const void *shared = NULL;
    SIM_TRY(sim_all_gather_dim_shared(d, x, (void **)&shared, 16, 2, LEN / 32, SIM_F32, all, sim_meta_tag("shared")));
    memcpy(xc->out[id][o++], shared, 8 * LEN * sizeof(float));
    sim_shared_release(d, shared);
    SIM_TRY(sim_device_barrier(d));
    return SIM_OK;
}

static sim_machine *new_machine(bool whole)
{
    const char *names[] = {"data", "fsdp", "tensor"};
    int sizes[] = {2, 2, 2};
    sim_mesh_desc md;
    sim_machine *m = NULL;
    sim_machine_opts o = {0};
    o.whole = whole;
    o.quiet = true;
    if (sim_mesh_desc_make(3, names, sizes, &md) || sim_machine_new(&md, &o, &m)) return NULL;
    return m;
}

/* Ends the rank (sim_xrank_conclude): rank 0 prints the job's failure once; the job's exit code. */
static int end_rank(int rc, const char *msg)
{
    static char out[16384];
    int job = sim_xrank_conclude(rc, msg, out, sizeof out);
    if (out[0]) fprintf(stderr, "rank %d: %s\n", sim_xrank_rank(), out);
    sim_xrank_finalize();
    return job;
}

/* Exit codes of the rank mode: 0 pass, 1 a wrong result, 3 the run failed (message on stderr). */
static int rank_main(const char *which)
{
    if (sim_xrank_init() != SIM_OK) {
        fprintf(stderr, "%s\n", sim_errmsg());
        return 1;
    }
    int me = sim_xrank_rank();
    const char *placement = getenv("SHARDSIM_XRANK_PLACEMENT");
    if (placement && sim_xrank_set_placement(placement) != SIM_OK) return end_rank(3, sim_errmsg());
    static xcase spread, whole;
    spread.which = whole.which = which;
    if (!strcmp(which, "outside")) { /* rank 1 fails before its run; rank 0 runs the sums */
        if (me == 1) return end_rank(3, "rank 1 failed before its run");
        spread.which = whole.which = "sums";
    }
    sim_machine *m = new_machine(false);
    if (!m) return end_rank(3, sim_errmsg());
    if (!strcmp(which, "deadlock")) sim_machine_set_collective_timeout(m, 1.0);
    if (sim_machine_run(m, case_device, &spread) != SIM_OK) {
        int rc = end_rank(3, sim_errmsg());
        sim_machine_free(m);
        return rc;
    }
    /* the same machine whole in this process: the reference bits */
    sim_machine *w = new_machine(true);
    if (!w || sim_machine_run(w, case_device, &whole) != SIM_OK) return end_rank(3, sim_errmsg());
    int ids[N], nids = 0, bad = 0;
    if (sim_machine_rank_ids(m, sim_xrank_size(), me, ids, &nids) != SIM_OK) return end_rank(3, sim_errmsg());
    /* axis:data over 4 ranks: rank r runs the data pair (r, r + 4) (data is the outermost axis, stride 4) */
    if (placement && !strcmp(placement, "axis:data") && sim_xrank_size() == 4 &&
        (nids != 2 || ids[0] != me || ids[1] != me + 4)) {
        fprintf(stderr, "rank %d: axis:data placed devices %d, %d (%d of them), not %d and %d\n", me, ids[0], ids[1],
                nids, me, me + 4);
        bad++;
    }
    for (int i = 0; i < nids; i++)
        for (int o = 0, id = ids[i]; o < NOUT; o++)
            if (memcmp(spread.out[id][o], whole.out[id][o], sizeof spread.out[id][o])) {
                fprintf(stderr, "rank %d: device %d, collective %d: bits differ from the one-process run\n", me, id, o);
                bad++;
            }
    for (int id = 0; id < N; id++) { /* records of every device, gathered: those of the one-process run */
        size_t na, nb;
        const sim_record *ra = sim_device_records(sim_machine_device(m, id), &na);
        const sim_record *rb = sim_device_records(sim_machine_device(w, id), &nb);
        if (na != nb || memcmp(ra, rb, na * sizeof *ra)) {
            fprintf(stderr, "rank %d: device %d: records differ from the one-process run\n", me, id);
            bad++;
        }
    }
    int nsteps = 0;
    const uint64_t *xb = sim_machine_xrank_bytes(m, &nsteps);
    if (sim_xrank_size() > 1 && (nsteps < 1 || !xb[0])) {
        fprintf(stderr, "rank %d: no bytes between ranks counted\n", me);
        bad++;
    }
    sim_machine_free(m);
    sim_machine_free(w);
    return end_rank(bad ? 1 : 0, bad ? "bits or records differ from the one-process run" : NULL);
}

/* ------------------------------------------------------------ cmocka side */

static char program[1024];
static const char *skip_why;

static int setup(void **state)
{
    (void)state;
    ssize_t n = readlink("/proc/self/exe", program, sizeof program - 1);
    if (n <= 0) return -1;
    program[n] = '\0';
    if (!sim_xrank_built())
        skip_why = "this build has no MPI (SHARDSIM_MPI=0, or no libopenmpi-dev): install it with .ci/install-deps";
    else if (system("command -v mpirun > /dev/null 2>&1") != 0)
        skip_why = "mpirun is not installed (openmpi-bin): install it with .ci/install-deps";
    return 0;
}

static void skip_without_mpi(void)
{
    if (!skip_why) return;
    fprintf(stderr, "test_sim_xrank: skipped: %s\n", skip_why);
    skip();
}

/* Runs the case under mpirun -np R; returns the exit code, stderr in err. */
static int run_placed(const char *which, const char *placement, int np, char *err, size_t cap)
{
    char cmd[2048], path[64];
    snprintf(path, sizeof path, "/tmp/test_sim_xrank.%d.err", (int)getpid());
    snprintf(cmd, sizeof cmd, "SHARDSIM_XRANK_CASE=%s SHARDSIM_XRANK_PLACEMENT=%s " MPIRUN " -np %d %s 2> %s", which,
             placement, np, program, path);
    int st = system(cmd);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(err, 1, cap - 1, f) : 0;
    err[n] = '\0';
    if (f) fclose(f);
    unlink(path);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static int run_case(const char *which, int np, char *err, size_t cap)
{
    return run_placed(which, "contiguous", np, err, cap);
}

static void assert_once_by_rank0(const char *err, const char *what);

static void test_collectives_bitwise_across_ranks(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    const int nps[] = {2, 3, 8};
    for (int i = 0; i < 3; i++) {
        int rc = run_case("sums", nps[i], err, sizeof err);
        if (rc) fail_msg("mpirun -np %d: exit %d: %s", nps[i], rc, err);
    }
}

/* rank_placement: data kept inside a rank (devices 0,4 / 1,5 / ... together: every other group
 * spans ranks, and no rank's devices are consecutive) and fsdp,tensor kept (data's groups span
 * the two ranks): the same bits.  A placement R cannot split is refused before any device runs. */
static void test_placements_bitwise(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    int rc = run_placed("sums", "axis:data", 4, err, sizeof err);
    if (rc) fail_msg("axis:data, mpirun -np 4: exit %d: %s", rc, err);
    rc = run_placed("sums", "axis:fsdp,tensor", 2, err, sizeof err);
    if (rc) fail_msg("axis:fsdp,tensor, mpirun -np 2: exit %d: %s", rc, err);
    assert_int_equal(run_placed("sums", "axis:fsdp,tensor", 4, err, sizeof err), 3);
    assert_once_by_rank0(err, "rank_placement=axis:fsdp,tensor keeps each group of 4 devices inside one rank");
}

/* The job's message: on rank 0's line, exactly once, and no MPI_Abort notice. */
static void assert_once_by_rank0(const char *err, const char *what)
{
    const char *at = strstr(err, what);
    if (!at) fail_msg("no '%s' in: %s", what, err);
    if (strstr(at + 1, what)) fail_msg("'%s' printed more than once: %s", what, err);
    if (!strncmp(err, "rank 1:", 7) || strstr(err, "\nrank 1:")) fail_msg("rank 1 printed: %s", err);
    if (strncmp(err, "rank 0:", 7) && !strstr(err, "\nrank 0:")) fail_msg("rank 0 printed nothing: %s", err);
    if (strstr(err, "MPI_ABORT") || strstr(err, "ORTE_ERROR_LOG")) fail_msg("MPI_Abort's notice: %s", err);
}

static void test_mismatch_across_ranks(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    assert_int_equal(run_case("mismatch", 2, err, sizeof err), 3);
    assert_once_by_rank0(err, "collective mismatch");
    if (!strstr(err, "device 5")) fail_msg("no mismatch message naming device 5: %s", err);
}

static void test_one_rank_fails_no_hang(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    assert_int_equal(run_case("fail", 2, err, sizeof err), 3);
    assert_once_by_rank0(err, "device 6 failed on purpose");
}

/* A rank that fails before its devices ever arrive: the others hear of it from its message alone. */
static void test_failure_outside_a_run_reaches_the_others(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    assert_int_equal(run_case("outside", 2, err, sizeof err), 3);
    assert_once_by_rank0(err, "rank 1 failed before its run");
}

static void test_watchdog_across_ranks(void **state)
{
    (void)state;
    skip_without_mpi();
    static char err[1 << 16];
    assert_int_equal(run_case("deadlock", 2, err, sizeof err), 3);
    assert_once_by_rank0(err, "collective watchdog");
    if (!strstr(err, "all-reduce over (data) (tag 'lonely')") || !strstr(err, "MPI rank 1"))
        fail_msg("no watchdog message naming the all-reduce and rank 1: %s", err);
}

int main(void)
{
    const char *which = getenv("SHARDSIM_XRANK_CASE");
    if (which && *which) return rank_main(which);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_collectives_bitwise_across_ranks),
        cmocka_unit_test(test_placements_bitwise),
        cmocka_unit_test(test_mismatch_across_ranks),
        cmocka_unit_test(test_one_rank_fails_no_hang),
        cmocka_unit_test(test_failure_outside_a_run_reaches_the_others),
        cmocka_unit_test(test_watchdog_across_ranks),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}

/* xrank.c — MPI underneath the simulated machine (see xrank.h).
 *
 * Two communicators: `coll`, where groups that span ranks exchange their calls and data (one tag
 * per group, sim/collectives.c), and `host`, for the whole-rank gathers (device records after a
 * run, the step's peak memory), so the two kinds of message can never match each other.
 *
 * Waiting: a receive blocked in Open MPI polls the network at full speed (1.4 s of CPU per 2 s
 * of waiting, measured on 2 cores), which would take a core from the simulated devices.  So every
 * batch is posted nonblocking and polled with MPI_Testall: a few quick polls, then sleeps that
 * grow from 20 us to 500 us. */
#include "sim/xrank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#ifdef SHARDSIM_MPI
#include <mpi.h>
#endif

static int xr_rank = 0, xr_size = 1;

int sim_xrank_rank(void) { return xr_rank; }

void sim_xrank_devices(int n, int R, int r, int *lo, int *hi)
{
    *lo = (int)((long)r * n / R);
    *hi = (int)((long)(r + 1) * n / R);
}
int sim_xrank_size(void) { return xr_size; }

#ifdef SHARDSIM_MPI

static bool xr_on = false;
static MPI_Comm xr_coll, xr_host;

bool sim_xrank_built(void) { return true; }

/* Set by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE), PMIx launchers (PMIX_RANK) and MPICH's hydra (PMI_SIZE). */
static bool launched(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_SIZE");
}

sim_status sim_xrank_init(void)
{
    if (xr_on || !launched()) return SIM_OK;
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        return sim_err(SIM_ERR_INTERNAL, "MPI_Init_thread failed");
    xr_on = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &xr_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &xr_size);
    if (provided < MPI_THREAD_MULTIPLE)
        return sim_err(SIM_ERR_INTERNAL, "the MPI library gives thread level %d, shardsim needs MPI_THREAD_MULTIPLE (%d): "
                       "use an MPI built with thread support", provided, MPI_THREAD_MULTIPLE);
    void *ub = NULL;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    if (flag && *(int *)ub < (1 << 26))
        return sim_err(SIM_ERR_INTERNAL, "the MPI library's largest tag is %d; shardsim needs at least %d",
                       *(int *)ub, 1 << 26);
    MPI_Comm_dup(MPI_COMM_WORLD, &xr_coll);
    MPI_Comm_dup(MPI_COMM_WORLD, &xr_host);
    return SIM_OK;
}

void sim_xrank_finalize(void)
{
    if (!xr_on) return;
    MPI_Comm_free(&xr_coll);
    MPI_Comm_free(&xr_host);
    MPI_Finalize();
    xr_on = false;
}

_Noreturn void sim_xrank_abort(int code)
{
    fflush(stdout);
    fflush(stderr);
    if (xr_on) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

/* Polls that give way (sched_yield) before the naps start: a nap costs the kernel's timer slack
 * (50 us) at least, and most exchanges complete within this. */
#define YIELD_S 200e-6

/* Largest piece of one message: MPI 3.1 counts are int. */
#define PIECE ((size_t)1 << 30)

static void nap(long ns)
{
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static sim_status exchange_on(MPI_Comm comm, sim_xmsg *msgs, int n, int tag, const atomic_bool *stop,
                              double timeout_s)
{
    double deadline = timeout_s > 0 ? now_s() + timeout_s : 0;
    int nreq = 0;
    for (int i = 0; i < n; i++) nreq += msgs[i].bytes ? (int)((msgs[i].bytes + PIECE - 1) / PIECE) : 1;
    MPI_Request one[64], *req = nreq <= 64 ? one : malloc((size_t)nreq * sizeof *req);
    SIM_ASSERT(req);
    int r = 0;
    for (int i = 0; i < n; i++) {
        size_t off = 0;
        do { /* a zero-byte message still goes: it is the synchronisation */
            size_t len = msgs[i].bytes - off < PIECE ? msgs[i].bytes - off : PIECE;
            char *p = (char *)msgs[i].buf + off;
            if (msgs[i].send)
                MPI_Isend(p, (int)len, MPI_BYTE, msgs[i].peer, tag, comm, &req[r++]);
            else
                MPI_Irecv(p, (int)len, MPI_BYTE, msgs[i].peer, tag, comm, &req[r++]);
            off += len;
        } while (off < msgs[i].bytes);
    }
    SIM_ASSERT(r == nreq);
    long sleep_ns = 20000;
    double yield_until = now_s() + YIELD_S;
    for (int polls = 0;; polls++) {
        int done = 0;
        if (MPI_Testall(nreq, req, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            if (req != one) free(req);
            return sim_err(SIM_ERR_INTERNAL, "MPI_Testall failed on tag %d", tag);
        }
        if (done) break;
        if (stop && atomic_load(stop)) {
            if (req != one) free(req);
            return sim_err(SIM_ERR_ABORTED, "a message exchange with other MPI ranks stopped: this rank failed");
        }
        if (deadline > 0 && now_s() > deadline) {
            if (req != one) free(req);
            return sim_err(SIM_ERR_DEADLOCK, "waited more than %g s for other MPI ranks", timeout_s);
        }
        if (polls < 16) continue; /* a message already on its way: no sleep */
        if (now_s() < yield_until) { /* a peer about to send: give the core to whoever needs it, not a nap */
            sched_yield();
            continue;
        }
        nap(sleep_ns);
        if (sleep_ns < 500000) sleep_ns += sleep_ns / 4;
    }
    if (req != one) free(req);
    return SIM_OK;
}

sim_status sim_xrank_exchange(sim_xmsg *msgs, int n, int tag, const atomic_bool *stop, double timeout_s)
{
    SIM_ASSERT(xr_on && tag >= 0);
    return exchange_on(xr_coll, msgs, n, tag, stop, timeout_s);
}

sim_status sim_xrank_allgatherv(const void *mine, size_t bytes, void **all, size_t *sizes)
{
    *all = NULL;
    if (!xr_on) {
        *all = malloc(bytes ? bytes : 1);
        SIM_ASSERT(*all);
        if (bytes) memcpy(*all, mine, bytes);
        sizes[0] = bytes;
        return SIM_OK;
    }
    uint64_t b = bytes, *bs = calloc((size_t)xr_size, sizeof *bs);
    SIM_ASSERT(bs);
    SIM_TRY(sim_xrank_allgather(&b, sizeof b, bs));
    size_t total = 0;
    for (int r = 0; r < xr_size; r++) {
        sizes[r] = (size_t)bs[r];
        total += sizes[r];
    }
    free(bs);
    char *out = malloc(total ? total : 1);
    SIM_ASSERT(out);
    sim_xmsg *msgs = calloc(2 * (size_t)xr_size, sizeof *msgs);
    SIM_ASSERT(msgs);
    int n = 0;
    size_t at = 0;
    for (int r = 0; r < xr_size; r++) {
        if (r == xr_rank) {
            if (bytes) memcpy(out + at, mine, bytes);
        } else {
            msgs[n++] = (sim_xmsg){r, true, (void *)mine, bytes};
            msgs[n++] = (sim_xmsg){r, false, out + at, sizes[r]};
        }
        at += sizes[r];
    }
    sim_status st = exchange_on(xr_host, msgs, n, 1, NULL, 0);
    free(msgs);
    if (st != SIM_OK) {
        free(out);
        return st;
    }
    *all = out;
    return SIM_OK;
}

sim_status sim_xrank_allgather(const void *mine, size_t bytes, void *all)
{
    if (!xr_on) {
        memcpy(all, mine, bytes);
        return SIM_OK;
    }
    sim_xmsg *msgs = calloc(2 * (size_t)xr_size, sizeof *msgs);
    SIM_ASSERT(msgs);
    int n = 0;
    for (int r = 0; r < xr_size; r++) {
        char *slot = (char *)all + (size_t)r * bytes;
        if (r == xr_rank) {
            memcpy(slot, mine, bytes);
            continue;
        }
        msgs[n++] = (sim_xmsg){r, true, (void *)mine, bytes};
        msgs[n++] = (sim_xmsg){r, false, slot, bytes};
    }
    sim_status st = exchange_on(xr_host, msgs, n, 0, NULL, 0);
    free(msgs);
    return st;
}

#else /* no MPI in this build: one rank */

bool sim_xrank_built(void) { return false; }
sim_status sim_xrank_init(void) { return SIM_OK; }
void sim_xrank_finalize(void) {}

_Noreturn void sim_xrank_abort(int code)
{
    fflush(stdout);
    fflush(stderr);
    exit(code);
}

sim_status sim_xrank_exchange(sim_xmsg *msgs, int n, int tag, const atomic_bool *stop, double timeout_s)
{
    (void)timeout_s;
    (void)msgs;
    (void)n;
    (void)tag;
    (void)stop;
    SIM_ASSERT(!"sim_xrank_exchange without MPI");
    return SIM_ERR_INTERNAL;
}

sim_status sim_xrank_allgather(const void *mine, size_t bytes, void *all)
{
    memcpy(all, mine, bytes);
    return SIM_OK;
}

sim_status sim_xrank_allgatherv(const void *mine, size_t bytes, void **all, size_t *sizes)
{
    *all = malloc(bytes ? bytes : 1);
    SIM_ASSERT(*all);
    if (bytes) memcpy(*all, mine, bytes);
    sizes[0] = bytes;
    return SIM_OK;
}

#endif

sim_status sim_xrank_max_u64(uint64_t *v)
{
    if (xr_size == 1) return SIM_OK;
    uint64_t *all = calloc((size_t)xr_size, sizeof *all);
    SIM_ASSERT(all);
    sim_status st = sim_xrank_allgather(v, sizeof *v, all);
    for (int r = 0; r < xr_size && st == SIM_OK; r++)
        if (all[r] > *v) *v = all[r];
    free(all);
    return st;
}

sim_status sim_xrank_from_rank0(void *buf, size_t bytes)
{
    if (xr_size == 1) return SIM_OK;
    char *all = malloc((size_t)xr_size * bytes + 1);
    SIM_ASSERT(all);
    sim_status st = sim_xrank_allgather(buf, bytes, all);
    if (st == SIM_OK) memcpy(buf, all, bytes);
    free(all);
    return st;
}

sim_status sim_xrank_or_merge(void *buf, size_t bytes)
{
    if (xr_size == 1) return SIM_OK;
    unsigned char *all = malloc((size_t)xr_size * bytes + 1), *b = buf;
    SIM_ASSERT(all);
    sim_status st = sim_xrank_allgather(buf, bytes, all);
    for (int r = 0; r < xr_size && st == SIM_OK; r++)
        for (size_t i = 0; i < bytes; i++) b[i] |= all[(size_t)r * bytes + i];
    free(all);
    return st;
}

/* xrank.c — MPI underneath the simulated machine (see xrank.h).
 *
 * Three communicators: `coll`, where groups that span ranks exchange their calls and data (one tag
 * per group, sim/collectives.c), `host`, for the whole-rank gathers (device records after a run,
 * the step's peak memory), and `ctl`, for failures and the job's end, so no kind of message can
 * ever match another's.
 *
 * Failure: every rank keeps a receive posted on ctl for a FAIL (status, origin, text) from any
 * rank; every poll of every exchange tests it.  A failure ends the job without MPI_Abort (whose
 * notice, and Open MPI's ORTE_ERROR_LOG, would bury the message): the ranks learn of it, unwind,
 * and meet once more in sim_xrank_conclude to agree on the exit code and on the one message.
 *
 * Waiting: a receive blocked in Open MPI polls the network at full speed (1.4 s of CPU per 2 s
 * of waiting, measured on 2 cores), which would take a core from the simulated devices.  So every
 * batch is posted nonblocking and polled with MPI_Testall: a few quick polls, then sleeps that
 * grow from 20 us to 500 us. */
#include "sim/xrank.h"

#include <pthread.h>
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

/* ---- rank_placement */

static char place_text[256] = "contiguous";
static char place_axes[SIM_MAX_AXES][SIM_AXIS_NAME_MAX];
static int place_n; /* 0: contiguous */

static const char PLACEMENT_FORMS[] =
    "expected contiguous (blocks of device ids, the default) or axis:NAME[,NAME...] (those mesh axes kept "
    "inside each rank, e.g. axis:tensor)";

sim_status sim_xrank_set_placement(const char *text)
{
    char axes[SIM_MAX_AXES][SIM_AXIS_NAME_MAX];
    int n = 0;
    if (!text || !*text || !strcmp(text, "contiguous")) {
        snprintf(place_text, sizeof place_text, "contiguous");
        place_n = 0;
        return SIM_OK;
    }
    if (strlen(text) >= sizeof place_text)
        return sim_err(SIM_ERR_INPUT, "rank_placement='%.64s...': too long; %s", text, PLACEMENT_FORMS);
    if (strncmp(text, "axis:", 5)) return sim_err(SIM_ERR_INPUT, "rank_placement='%s': %s", text, PLACEMENT_FORMS);
    for (const char *p = text + 5;;) {
        size_t len = strcspn(p, ",");
        if (len == 0)
            return sim_err(SIM_ERR_INPUT, "rank_placement='%s': an empty axis name; %s", text, PLACEMENT_FORMS);
        if (len >= SIM_AXIS_NAME_MAX || n == SIM_MAX_AXES)
            return sim_err(SIM_ERR_INPUT, "rank_placement='%s': not a list of mesh axis names; %s", text,
                           PLACEMENT_FORMS);
        memcpy(axes[n], p, len);
        axes[n][len] = '\0';
        for (int i = 0; i < n; i++)
            if (!strcmp(axes[i], axes[n]))
                return sim_err(SIM_ERR_INPUT, "rank_placement='%s': axis '%s' named twice", text, axes[n]);
        n++;
        if (!p[len]) break;
        p += len + 1;
    }
    memcpy(place_axes, axes, sizeof axes);
    place_n = n;
    snprintf(place_text, sizeof place_text, "%s", text);
    return SIM_OK;
}

const char *sim_xrank_placement(void) { return place_text; }

int sim_xrank_placement_axes(const char (**names)[SIM_AXIS_NAME_MAX])
{
    *names = (const char(*)[SIM_AXIS_NAME_MAX])place_axes;
    return place_n;
}

int sim_xrank_size(void) { return xr_size; }

#ifdef SHARDSIM_MPI

static bool xr_on = false;
static MPI_Comm xr_coll, xr_host, xr_ctl;

/* ctl's tags: a failure, and the outcomes gathered at the end */
enum { TAG_FAIL = 1, TAG_END = 2 };
/* A failure's control message: small enough to go eagerly (Open MPI's shared-memory eager limit is
 * 4 KiB), so its send completes at once whatever the receiver does; the whole text travels with the
 * outcomes at the end. */
enum { FAIL_TEXT = 2048 };
typedef struct {
    int32_t st, origin;
    char text[FAIL_TEXT];
} xr_fail;

static pthread_mutex_t ctl_lock = PTHREAD_MUTEX_INITIALIZER;
static MPI_Request ctl_req = MPI_REQUEST_NULL; /* the posted FAIL receive, into ctl_in */
static xr_fail ctl_in, remote;                 /* the last received; the first from another rank */
static atomic_bool remote_set;                 /* remote holds another rank's failure */
static bool posted, own;                       /* this rank sent its failure (own: before any arrived) */
static xr_fail fail_out;
static MPI_Request *fail_req; /* the FAIL sends, one per other rank */
static bool abort_at_end;     /* conclude gave up on the others */

/* Tests the FAIL receive (and the FAIL sends) when no other thread is at it; keeps one receive
 * posted, so every rank's FAIL is taken in (the first from another rank is the one kept). */
static void poll_ctl(void)
{
    if (pthread_mutex_trylock(&ctl_lock) != 0) return;
    for (int flag = 1; flag && ctl_req != MPI_REQUEST_NULL;) {
        flag = 0;
        MPI_Test(&ctl_req, &flag, MPI_STATUS_IGNORE);
        if (!flag) break;
        ctl_in.text[FAIL_TEXT - 1] = '\0';
        if (!atomic_load(&remote_set)) {
            remote = ctl_in;
            atomic_store(&remote_set, true);
        }
        MPI_Irecv(&ctl_in, (int)sizeof ctl_in, MPI_BYTE, MPI_ANY_SOURCE, TAG_FAIL, xr_ctl, &ctl_req);
    }
    if (fail_req) {
        int done = 0;
        MPI_Testall(xr_size, fail_req, &done, MPI_STATUSES_IGNORE);
    }
    pthread_mutex_unlock(&ctl_lock);
}

bool sim_xrank_failed_elsewhere(void)
{
    if (!xr_on) return false;
    poll_ctl();
    return atomic_load(&remote_set);
}

void sim_xrank_post_failure(sim_status st, const char *msg)
{
    if (!xr_on || xr_size < 2) return;
    pthread_mutex_lock(&ctl_lock);
    if (posted || atomic_load(&remote_set)) {
        pthread_mutex_unlock(&ctl_lock);
        return;
    }
    posted = own = true;
    fail_out.st = (int32_t)st;
    fail_out.origin = xr_rank;
    snprintf(fail_out.text, sizeof fail_out.text, "%s", msg ? msg : "");
    fail_req = malloc((size_t)xr_size * sizeof *fail_req);
    SIM_ASSERT(fail_req);
    for (int r = 0; r < xr_size; r++) {
        fail_req[r] = MPI_REQUEST_NULL;
        if (r != xr_rank) MPI_Isend(&fail_out, (int)sizeof fail_out, MPI_BYTE, r, TAG_FAIL, xr_ctl, &fail_req[r]);
    }
    pthread_mutex_unlock(&ctl_lock);
}

bool sim_xrank_built(void) { return true; }

/* Set by Open MPI's mpirun (OMPI_COMM_WORLD_SIZE), PMIx launchers (PMIX_RANK) and MPICH's hydra (PMI_SIZE). */
static bool launched(void) { return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_SIZE"); }

sim_status sim_xrank_init(void)
{
    if (xr_on || !launched()) return SIM_OK;
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        return sim_err(SIM_ERR_INTERNAL, "MPI_Init_thread failed");
    xr_on = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &xr_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &xr_size);
    /* the communicators first: a refusal below still ends the job through sim_xrank_conclude */
    MPI_Comm_dup(MPI_COMM_WORLD, &xr_coll);
    MPI_Comm_dup(MPI_COMM_WORLD, &xr_host);
    MPI_Comm_dup(MPI_COMM_WORLD, &xr_ctl);
    atomic_init(&remote_set, false);
    if (xr_size > 1) MPI_Irecv(&ctl_in, (int)sizeof ctl_in, MPI_BYTE, MPI_ANY_SOURCE, TAG_FAIL, xr_ctl, &ctl_req);
    if (provided < MPI_THREAD_MULTIPLE)
        return sim_err(SIM_ERR_INTERNAL,
                       "the MPI library gives thread level %d, shardsim needs MPI_THREAD_MULTIPLE (%d): "
                       "use an MPI built with thread support",
                       provided, MPI_THREAD_MULTIPLE);
    void *ub = NULL;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    if (flag && *(int *)ub < (1 << 26))
        return sim_err(SIM_ERR_INTERNAL, "the MPI library's largest tag is %d; shardsim needs at least %d", *(int *)ub,
                       1 << 26);
    return SIM_OK;
}

void sim_xrank_finalize(void)
{
    if (!xr_on) return;
    if (abort_at_end) sim_xrank_abort(1);
    pthread_mutex_lock(&ctl_lock);
    if (ctl_req != MPI_REQUEST_NULL) { /* an unmatched receive: cancelling it completes it at once */
        MPI_Cancel(&ctl_req);
        MPI_Wait(&ctl_req, MPI_STATUS_IGNORE);
    }
    free(fail_req); /* the FAIL sends went eagerly (conclude waited for them) */
    fail_req = NULL;
    pthread_mutex_unlock(&ctl_lock);
    MPI_Comm_free(&xr_coll);
    MPI_Comm_free(&xr_host);
    MPI_Comm_free(&xr_ctl);
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

/* Gives up on a batch: its receives are cancelled (one already matched completes, or gets a
 * second to), so no late message lands in a buffer the caller frees; an unmatched send's data is
 * never read.  Whatever is still pending after that is left to MPI_Finalize. */
static void abandon(MPI_Request *req, int n)
{
    for (int i = 0; i < n; i++) {
        if (req[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(&req[i], &done, MPI_STATUS_IGNORE);
        if (!done) MPI_Cancel(&req[i]);
    }
    double until = now_s() + 1.0;
    for (int done = 0; !done && now_s() < until;) {
        if (MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
        if (!done) nap(100000);
    }
}

/* Another rank's failure as this rank's error. */
static sim_status remote_error(void)
{
    sim_status st = (sim_status)remote.st;
    if (st == SIM_OK || st == SIM_ERR_ABORTED || st > SIM_ERR_INTERNAL) st = SIM_ERR_INTERNAL;
    return sim_err(st, "MPI rank %d failed: %s", (int)remote.origin, remote.text);
}

/* heed: another rank's failure ends the wait (every exchange but the end's own gather). */
static sim_status exchange_on(MPI_Comm comm, sim_xmsg *msgs, int n, int tag, const atomic_bool *stop, double timeout_s,
                              bool heed)
{
    if (heed && sim_xrank_failed_elsewhere()) return remote_error();
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
            if (msgs[i].send) MPI_Isend(p, (int)len, MPI_BYTE, msgs[i].peer, tag, comm, &req[r++]);
            else MPI_Irecv(p, (int)len, MPI_BYTE, msgs[i].peer, tag, comm, &req[r++]);
            off += len;
        } while (off < msgs[i].bytes);
    }
    SIM_ASSERT(r == nreq);
    long sleep_ns = 20000;
    double yield_until = now_s() + YIELD_S;
    sim_status st = SIM_OK;
    for (int polls = 0;; polls++) {
        int done = 0;
        if (MPI_Testall(nreq, req, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
            st = sim_err(SIM_ERR_INTERNAL, "MPI_Testall failed on tag %d", tag);
            break;
        }
        if (done) break;
        poll_ctl();
        if (heed && atomic_load(&remote_set)) {
            st = remote_error();
            break;
        }
        if (stop && atomic_load(stop)) {
            st = sim_err(SIM_ERR_ABORTED, "a message exchange with other MPI ranks stopped: this rank failed");
            break;
        }
        if (deadline > 0 && now_s() > deadline) {
            st = sim_err(SIM_ERR_DEADLOCK, "waited more than %g s for other MPI ranks", timeout_s);
            break;
        }
        if (polls < 16) continue;    /* a message already on its way: no sleep */
        if (now_s() < yield_until) { /* a peer about to send: give the core to whoever needs it, not a nap */
            sched_yield();
            continue;
        }
        nap(sleep_ns);
        if (sleep_ns < 500000) sleep_ns += sleep_ns / 4;
    }
    if (st != SIM_OK) abandon(req, nreq);
    if (req != one) free(req);
    return st;
}

sim_status sim_xrank_exchange(sim_xmsg *msgs, int n, int tag, const atomic_bool *stop, double timeout_s)
{
    SIM_ASSERT(xr_on && tag >= 0);
    return exchange_on(xr_coll, msgs, n, tag, stop, timeout_s, true);
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
    sim_status st = exchange_on(xr_host, msgs, n, 1, NULL, 0, true);
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
    sim_status st = exchange_on(xr_host, msgs, n, 0, NULL, 0, true);
    free(msgs);
    return st;
}

/* One rank's outcome at the end. */
typedef struct {
    int32_t rc, own;
    char msg[8192];
} xr_outcome;

int sim_xrank_conclude(int rc, const char *msg, char *out, size_t cap)
{
    out[0] = '\0';
    if (!xr_on || xr_size < 2) {
        if (rc) snprintf(out, cap, "%s", msg ? msg : "");
        return rc;
    }
    if (rc) sim_xrank_post_failure(rc == 2 ? SIM_ERR_INPUT : SIM_ERR_CHECK, msg);
    xr_outcome *all = calloc((size_t)xr_size, sizeof *all);
    sim_xmsg *msgs = calloc(2 * (size_t)xr_size, sizeof *msgs);
    SIM_ASSERT(all && msgs);
    xr_outcome *mine = &all[xr_rank];
    mine->rc = rc;
    pthread_mutex_lock(&ctl_lock);
    mine->own = rc && own;
    pthread_mutex_unlock(&ctl_lock);
    snprintf(mine->msg, sizeof mine->msg, "%s", rc && msg ? msg : "");
    int n = 0;
    for (int r = 0; r < xr_size; r++) {
        if (r == xr_rank) continue;
        msgs[n++] = (sim_xmsg){r, true, mine, sizeof *mine};
        msgs[n++] = (sim_xmsg){r, false, &all[r], sizeof all[r]};
    }
    /* a failed rank waits a minute for the others to notice; a successful one as long as they take */
    sim_status st = exchange_on(xr_ctl, msgs, n, TAG_END, NULL, rc ? 60.0 : 0, false);
    free(msgs);
    int job = rc, from = -1;
    if (st != SIM_OK) { /* a rank that never came: this one's own word, and MPI_Abort ends the rest */
        abort_at_end = true;
        if (rc && mine->own)
            snprintf(out, cap, "%s (and MPI rank%s did not answer: %s)", mine->msg, xr_size > 2 ? "s" : "",
                     sim_errmsg());
        free(all);
        return rc ? rc : 1;
    }
    for (int r = 0; r < xr_size && from < 0; r++)
        if (all[r].rc && all[r].own) from = r;
    for (int r = 0; r < xr_size && from < 0; r++)
        if (all[r].rc) from = r;
    if (from > 0 && all[0].rc && !strcmp(all[0].msg, all[from].msg)) from = 0; /* every rank saw it (a bad key) */
    if (from >= 0) {
        job = all[from].rc;
        if (xr_rank == 0 && all[from].msg[0] && from == 0) snprintf(out, cap, "%s", all[from].msg);
        else if (xr_rank == 0 && all[from].msg[0]) snprintf(out, cap, "MPI rank %d: %s", from, all[from].msg);
    }
    free(all);
    /* the FAIL sends went eagerly: complete them before MPI_Finalize */
    pthread_mutex_lock(&ctl_lock);
    for (int done = 0, i = 0; fail_req && !done && i < 1000; i++) {
        MPI_Testall(xr_size, fail_req, &done, MPI_STATUSES_IGNORE);
        if (!done) nap(1000000);
    }
    pthread_mutex_unlock(&ctl_lock);
    return job;
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

void sim_xrank_post_failure(sim_status st, const char *msg)
{
    (void)st;
    (void)msg;
}

bool sim_xrank_failed_elsewhere(void) { return false; }

int sim_xrank_conclude(int rc, const char *msg, char *out, size_t cap)
{
    out[0] = '\0';
    if (rc) snprintf(out, cap, "%s", msg ? msg : "");
    return rc;
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

/* bk_parallel.c — the worker pool behind bk_parallel_for.
 *
 * One job at a time: the caller publishes (fn, arg, n, grain) under the
 * lock, marks the pool busy and bumps a generation counter; workers that
 * wake while it is busy join it, and everybody (the caller too) claims
 * chunk indices with an atomic counter until none are left.  The job stays
 * busy until all chunks are done AND every worker that joined has left, so
 * no worker can still be inside one job when the next is published; a
 * worker that wakes after its job ended sees the pool idle and sleeps
 * again.  A second caller that finds a job running does its work inline. */
#include "blas_kernels/bk_parallel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk.h"

enum { MAX_WORKERS = 63 };

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int threads; /* caller included */
    int started; /* workers running */
    pthread_t tid[MAX_WORKERS];
    uint64_t gen; /* jobs published */
    bool busy;    /* a job is running */
    /* the job */
    bk_range_fn fn;
    void *arg;
    int64_t n, grain, nchunks;
    atomic_llong next; /* next chunk to claim */
    int64_t finished;  /* chunks done (under mu) */
    int active;        /* workers inside the job (under mu) */
} P = {PTHREAD_MUTEX_INITIALIZER,
       PTHREAD_COND_INITIALIZER,
       PTHREAD_COND_INITIALIZER,
       1,
       0,
       {0},
       0,
       false,
       NULL,
       NULL,
       0,
       0,
       0,
       0,
       0,
       0};

/* Claims and runs chunks until none are left; returns how many it ran. */
static int64_t drain(bk_range_fn fn, void *arg, int64_t n, int64_t grain, int64_t nchunks)
{
    int64_t ran = 0;
    for (;;) {
        int64_t c = atomic_fetch_add(&P.next, 1);
        if (c >= nchunks) break;
        int64_t lo = c * grain, hi = lo + grain < n ? lo + grain : n;
        fn(lo, hi, arg);
        ran++;
    }
    return ran;
}

static void *worker(void *unused)
{
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&P.mu);
    for (;;) {
        while (P.gen == seen) pthread_cond_wait(&P.work, &P.mu);
        seen = P.gen;
        if (!P.busy) continue; /* that job is over */
        P.active++;
        bk_range_fn fn = P.fn;
        void *arg = P.arg;
        int64_t n = P.n, grain = P.grain, nchunks = P.nchunks;
        pthread_mutex_unlock(&P.mu);
        int64_t ran = drain(fn, arg, n, grain, nchunks);
        pthread_mutex_lock(&P.mu);
        P.finished += ran;
        P.active--;
        if (P.finished == P.nchunks && P.active == 0) pthread_cond_signal(&P.done);
    }
    return NULL;
}

void bk_parallel_set_threads(int n)
{
    const char *env = getenv("SHARDSIM_KERNEL_THREADS"); /* override, for measurements */
    if (env && atoi(env) > 0) n = atoi(env);
    pthread_mutex_lock(&P.mu);
    if (n < 1) n = 1;
    if (n > MAX_WORKERS + 1) n = MAX_WORKERS + 1;
    while (P.started < n - 1) {
        if (pthread_create(&P.tid[P.started], NULL, worker, NULL) != 0) break;
        pthread_detach(P.tid[P.started]);
        P.started++;
    }
    P.threads = n <= P.started + 1 ? n : P.started + 1;
    pthread_mutex_unlock(&P.mu);
}

int bk_parallel_threads(void) { return P.threads; }

static void run_inline(int64_t n, int64_t grain, bk_range_fn fn, void *arg)
{
    for (int64_t lo = 0; lo < n; lo += grain) fn(lo, lo + grain < n ? lo + grain : n, arg);
}

void bk_parallel_for(int64_t n, int64_t grain, bk_range_fn fn, void *arg)
{
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int64_t nchunks = (n + grain - 1) / grain;
    if (P.threads <= 1 || nchunks < 2) {
        run_inline(n, grain, fn, arg);
        return;
    }
    pthread_mutex_lock(&P.mu);
    if (P.busy) { /* another device thread owns the pool: do it ourselves */
        pthread_mutex_unlock(&P.mu);
        run_inline(n, grain, fn, arg);
        return;
    }
    P.busy = true;
    P.fn = fn;
    P.arg = arg;
    P.n = n;
    P.grain = grain;
    P.nchunks = nchunks;
    atomic_store(&P.next, 0);
    P.finished = 0;
    P.gen++;
    pthread_cond_broadcast(&P.work);
    pthread_mutex_unlock(&P.mu);
    int64_t ran = drain(fn, arg, n, grain, nchunks);
    pthread_mutex_lock(&P.mu);
    P.finished += ran;
    while (P.finished < nchunks || P.active > 0) pthread_cond_wait(&P.done, &P.mu);
    P.busy = false;
    pthread_mutex_unlock(&P.mu);
}

enum { ZERO_GRAIN = 1 << 18 }; /* bytes per chunk of a memset or memcpy: outweighs a wake-up */

static void zero_chunk(int64_t lo, int64_t hi, void *arg) { memset((char *)arg + lo, 0, (size_t)(hi - lo)); }

void bk_parallel_zero(void *p, size_t bytes)
{
    if (!p || !bytes) return;
    bk_parallel_for((int64_t)bytes, ZERO_GRAIN, zero_chunk, p);
}

typedef struct {
    char *dst;
    const char *src;
} copy_job;

static void copy_chunk(int64_t lo, int64_t hi, void *arg)
{
    const copy_job *j = arg;
    memcpy(j->dst + lo, j->src + lo, (size_t)(hi - lo));
}

void bk_parallel_copy(void *dst, const void *src, size_t bytes)
{
    if (!dst || !src || !bytes) return;
    copy_job j = {dst, src};
    bk_parallel_for((int64_t)bytes, ZERO_GRAIN, copy_chunk, &j);
}

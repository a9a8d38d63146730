/* fiber.c — devices as fibers on a few worker threads (see fiber.h).
 *
 * Worker loop: under the worker's lock, take the next fiber of its run
 * queue and swap to it; the fiber runs until it waits (sim_fiber_wait with
 * no post pending: it parks and swaps back) or returns.  A post from any
 * thread counts on the fiber and, if the fiber is parked and not queued,
 * queues it and signals the worker should it sleep.  The fiber drops the
 * lock before it swaps out: a post that lands in between queues it on its
 * own worker, which can only resume it after the swap (it is this thread).
 * A worker whose queue is empty sleeps on its condition variable, until
 * the earliest deadline of its parked fibers when any is timed (the
 * collective watchdog), and queues the fibers whose deadline passed.
 *
 * Per-device thread-local state: the error message (sim/status.c) and the
 * slots registered with sim_device_local_register (devlocal.h) are saved
 * when a fiber swaps out and put back when it resumes; a fiber starts with
 * an empty message and every slot NULL, as a new thread would.  The rest
 * of the project's thread-locals are caches keyed by what they hold (rule
 * and plan memos) or counters that only need to be unique (array uids),
 * which devices of one thread may share. */
#include "sim/fiber.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "sim/devlocal.h"
#include "sim/status.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FIBERS_OK false
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FIBERS_OK false
#endif
#endif
#ifndef FIBERS_OK
#define FIBERS_OK true
#endif

typedef struct sim_worker sim_worker;

struct sim_fiber {
    ucontext_t ctx;
    sim_worker *w;
    int index;
    void *stack; /* mapping: a guard page, then the stack */
    size_t map_bytes;
    /* under w->lock */
    int posts;   /* pending posts (the semaphore's count) */
    bool parked; /* swapped out in sim_fiber_wait */
    bool queued; /* in w's run queue */
    bool timed;
    struct timespec deadline;
    /* the fiber's own */
    bool done;
    void *locals[SIM_DEVICE_LOCALS_MAX];
    char *err; /* SIM_ERR_STATE_BYTES: its error message while swapped out */
};

struct sim_worker {
    sim_fibers *p;
    int index;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    sim_fiber **queue; /* ring of nfib */
    int head, len;
    bool sleeping;
    int go; /* 0 wait, 1 run, -1 leave (another worker did not start) */
    int nfib, nlive;
    sim_fiber **fib; /* the worker's fibers */
    sim_fiber *cur;
    ucontext_t main;
};

struct sim_fibers {
    int n, nworkers;
    sim_fiber *fib;
    sim_worker *w;
    char *err; /* n x SIM_ERR_STATE_BYTES */
    void (*body)(void *, int);
    void *arg;
    void (*pin)(void *, int);
};

/* ------------------------------------------------------- device locals */

static void locals_save(sim_fiber *f)
{
    sim_device_locals_save(f->locals);
    sim_err_state_save(f->err);
}

static void locals_restore(const sim_fiber *f)
{
    sim_device_locals_restore(f->locals);
    sim_err_state_restore(f->err);
}

/* --------------------------------------------------------------- pool */

bool sim_fibers_available(void) { return FIBERS_OK; }

sim_fibers *sim_fibers_new(int n, int workers, size_t stack_bytes)
{
    if (!FIBERS_OK || n < 1 || workers < 1) return NULL;
    if (workers > n) workers = n;
    sim_fibers *p = calloc(1, sizeof *p);
    SIM_ASSERT(p);
    p->n = n;
    p->nworkers = workers;
    p->fib = calloc((size_t)n, sizeof *p->fib);
    p->w = calloc((size_t)workers, sizeof *p->w);
    p->err = calloc((size_t)n, SIM_ERR_STATE_BYTES); /* pages stay untouched until a device has a message */
    SIM_ASSERT(p->fib && p->w && p->err);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    stack_bytes = (stack_bytes + page - 1) / page * page;
    for (int w = 0; w < workers; w++) {
        sim_worker *wk = &p->w[w];
        wk->p = p;
        wk->index = w;
        /* held for a few instructions at a time, by its worker and by the other workers posting
         * its fibers: an adaptive lock spins that long before it sleeps in the kernel */
        pthread_mutexattr_t ma;
        pthread_mutexattr_init(&ma);
        pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ADAPTIVE_NP);
        pthread_mutex_init(&wk->lock, &ma);
        pthread_mutexattr_destroy(&ma);
        pthread_cond_init(&wk->cond, NULL);
        wk->nfib = (n - w + workers - 1) / workers;
        wk->fib = calloc((size_t)wk->nfib, sizeof *wk->fib);
        wk->queue = calloc((size_t)wk->nfib, sizeof *wk->queue);
        SIM_ASSERT(wk->fib && wk->queue);
    }
    for (int i = 0; i < n; i++) {
        sim_fiber *f = &p->fib[i];
        f->index = i;
        f->w = &p->w[i % workers];
        f->w->fib[i / workers] = f;
        f->err = p->err + (size_t)i * SIM_ERR_STATE_BYTES;
        /* reserved, not committed: a device's stack takes memory only as deep as it goes, as a
         * thread's does; the lowest page is a guard, so an overflow faults instead of writing
         * into the next device's stack */
        f->map_bytes = stack_bytes + page;
        void *s = mmap(NULL, f->map_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (s == MAP_FAILED || mprotect(s, page, PROT_NONE) != 0) {
            if (s != MAP_FAILED) munmap(s, f->map_bytes);
            f->stack = NULL;
            sim_fibers_free(p);
            return NULL;
        }
        f->stack = s;
    }
    return p;
}

sim_fiber *sim_fibers_at(sim_fibers *p, int i)
{
    SIM_ASSERT(i >= 0 && i < p->n);
    return &p->fib[i];
}

int sim_fiber_worker(const sim_fiber *f) { return f->w->index; }

void sim_fibers_free(sim_fibers *p)
{
    if (!p) return;
    for (int i = 0; i < p->n; i++)
        if (p->fib[i].stack) munmap(p->fib[i].stack, p->fib[i].map_bytes);
    for (int w = 0; w < p->nworkers; w++) {
        pthread_mutex_destroy(&p->w[w].lock);
        pthread_cond_destroy(&p->w[w].cond);
        free(p->w[w].fib);
        free(p->w[w].queue);
    }
    free(p->fib);
    free(p->w);
    free(p->err);
    free(p);
}

/* -------------------------------------------------------------- worker */

static _Thread_local sim_worker *tl_worker;

static void queue_push_locked(sim_worker *w, sim_fiber *f)
{
    SIM_ASSERT(w->len < w->nfib);
    w->queue[(w->head + w->len++) % w->nfib] = f;
    f->queued = true;
}

static void fiber_entry(void)
{
    sim_worker *w = tl_worker;
    sim_fiber *f = w->cur;
    locals_restore(f); /* every slot NULL, no message: as a fresh thread */
    w->p->body(w->p->arg, f->index);
    f->done = true;
    /* returning resumes uc_link: the worker loop */
}

static bool before(const struct timespec *a, const struct timespec *b)
{
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

static void *worker_main(void *arg)
{
    sim_worker *w = arg;
    tl_worker = w;
    pthread_mutex_lock(&w->lock);
    while (!w->go) pthread_cond_wait(&w->cond, &w->lock);
    if (w->go < 0) w->nlive = 0;
    else if (w->p->pin) w->p->pin(w->p->arg, w->index);
    while (w->nlive > 0) {
        if (w->len) {
            sim_fiber *f = w->queue[w->head];
            w->head = (w->head + 1) % w->nfib;
            w->len--;
            /* it runs from here on: a post from now counts (posts) without queueing it again.  Left
             * parked until the fiber cleared it after the swap, a post landing in between queued it a
             * second time, and the worker later resumed it where it was not parked (a finished fiber
             * ran off its start frame and exited the process; a waiting one woke with no post) */
            f->queued = f->parked = false;
            w->cur = f;
            pthread_mutex_unlock(&w->lock);
            SIM_ASSERT(swapcontext(&w->main, &f->ctx) == 0);
            pthread_mutex_lock(&w->lock);
            w->cur = NULL;
            if (f->done) w->nlive--;
            continue;
        }
        /* nothing to run: queue the timed waits that expired, else sleep until the earliest */
        const struct timespec *earliest = NULL;
        struct timespec now;
        bool have_now = false; /* the clock is read only when some fiber waits with a deadline */
        for (int i = 0; i < w->nfib; i++) {
            sim_fiber *f = w->fib[i];
            if (!f->parked || !f->timed || f->queued) continue;
            if (!have_now) clock_gettime(CLOCK_REALTIME, &now);
            have_now = true;
            if (!before(&now, &f->deadline)) queue_push_locked(w, f);
            else if (!earliest || before(&f->deadline, earliest)) earliest = &f->deadline;
        }
        if (w->len) continue;
        w->sleeping = true;
        if (earliest) pthread_cond_timedwait(&w->cond, &w->lock, earliest);
        else pthread_cond_wait(&w->cond, &w->lock);
        w->sleeping = false;
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

/* A fresh context for f that starts in fiber_entry on its own stack and returns to its worker's
 * loop (a function of its own: getcontext returns twice in principle, so a caller's loop
 * variables must not live across it). */
static __attribute__((noinline)) void fiber_context(sim_fiber *f)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    SIM_ASSERT(getcontext(&f->ctx) == 0);
    f->ctx.uc_stack.ss_sp = (char *)f->stack + page;
    f->ctx.uc_stack.ss_size = f->map_bytes - page;
    f->ctx.uc_link = &f->w->main;
    makecontext(&f->ctx, fiber_entry, 0);
}

bool sim_fibers_run(sim_fibers *p, void (*body)(void *arg, int i), void (*pin)(void *arg, int worker), void *arg)
{
    p->body = body;
    p->arg = arg;
    p->pin = pin;
    for (int w = 0; w < p->nworkers; w++) {
        sim_worker *wk = &p->w[w];
        wk->head = wk->len = 0;
        wk->nlive = wk->nfib;
        wk->sleeping = false;
        wk->go = 0;
    }
    for (int i = 0; i < p->n; i++) {
        sim_fiber *f = &p->fib[i];
        fiber_context(f);
        f->posts = 0;
        f->parked = f->queued = f->timed = f->done = false;
        memset(f->locals, 0, sizeof f->locals);
        sim_err_state_init(f->err);
        queue_push_locked(f->w, f); /* no worker runs yet */
    }
    /* every worker starts before any runs: should one not start, its fibers' peers would wait
     * for them forever, so then none runs */
    int started = 0;
    for (; started < p->nworkers; started++)
        if (pthread_create(&p->w[started].thread, NULL, worker_main, &p->w[started]) != 0) break;
    int go = started == p->nworkers ? 1 : -1;
    for (int w = 0; w < started; w++) {
        pthread_mutex_lock(&p->w[w].lock);
        p->w[w].go = go;
        pthread_cond_signal(&p->w[w].cond);
        pthread_mutex_unlock(&p->w[w].lock);
    }
    for (int w = 0; w < started; w++) pthread_join(p->w[w].thread, NULL);
    if (go < 0) return false;
    return true;
}

/* ----------------------------------------------------------- semaphore */

void sim_fiber_post(sim_fiber *f)
{
    sim_worker *w = f->w;
    pthread_mutex_lock(&w->lock);
    f->posts++;
    if (f->parked && !f->queued) {
        queue_push_locked(w, f);
        if (w->sleeping) pthread_cond_signal(&w->cond);
    }
    pthread_mutex_unlock(&w->lock);
}

int sim_fiber_wait(sim_fiber *f, const struct timespec *deadline)
{
    sim_worker *w = f->w;
    SIM_ASSERT(tl_worker == w && w->cur == f); /* only the fiber itself waits on its semaphore */
    pthread_mutex_lock(&w->lock);
    if (f->posts) {
        f->posts--;
        pthread_mutex_unlock(&w->lock);
        return 0;
    }
    f->parked = true;
    f->timed = deadline != NULL;
    if (deadline) f->deadline = *deadline;
    pthread_mutex_unlock(&w->lock);
    locals_save(f);
    SIM_ASSERT(swapcontext(&f->ctx, &w->main) == 0);
    locals_restore(f);
    pthread_mutex_lock(&w->lock);
    f->parked = false;
    int r = 0;
    if (f->posts) f->posts--;
    else r = ETIMEDOUT; /* queued by its deadline */
    pthread_mutex_unlock(&w->lock);
    return r;
}

/* machine.c — devices as threads, groups, rendezvous, failure handling.
 *
 * Run: sim_machine_run() starts one thread per device (pinned round-robin
 * when asked), each calls fn(dev, arg).  A device that fails marks the
 * machine failed; every device blocked in a rendezvous wakes up and returns
 * SIM_ERR_ABORTED, so the run always ends and reports the first failure.
 *
 * Rendezvous: a generation barrier per group under the machine lock (see
 * machine_priv.h for why the deadlock test is exact).  Collectives meet
 * once (sim_exchange): the last arriver moves the data, with helpers.
 *
 * MPI ranks (sim/xrank.h): every process knows every device (coordinates,
 * labels, groups) but runs only its own (rank_placement: a block of ids by
 * default, sim_mesh_place_ranks), as threads.  A
 * group with members on other ranks completes its local arrival as usual;
 * its last local arriver then trades the calls and the data with the other
 * ranks (exchange_spread_locked, collectives.c) while the others sleep.  The
 * deadlock test stays exact inside a rank; across ranks the watchdog
 * (collective_timeout_s) is the fallback. */
#include "sim/machine_priv.h"
#include "sim/topology.h"
#include "sim/xrank.h"

#include <cblas.h>
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- mesh */

static bool host_one_arena = true; /* sim_host_malloc_many_arenas */

void sim_host_malloc_many_arenas(void) { host_one_arena = false; }

static void tune_host_malloc_once(void)
{
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    /* one malloc arena for all threads: glibc gives each device thread its own arena made of
     * 64 MiB heaps that it unmaps and maps again as activations come and go, so blocks below
     * the mmap threshold faulted in afresh every step (62k page faults per step of the bench/step
     * model at 1 device); the main arena keeps freed memory, and steady-state steps fault none */
    if (host_one_arena) mallopt(M_ARENA_MAX, 1);
}

int sim_mesh_slice(const sim_mesh_desc *m, int id)
{
    int coords[SIM_MAX_AXES], slice = 0;
    sim_mesh_coords(m, id, coords);
    for (int a = 0; a < m->naxes; a++)
        if (m->dcn[a] > 1) slice = slice * m->dcn[a] + coords[a] / (m->sizes[a] / m->dcn[a]);
    return slice;
}

sim_status sim_mesh_desc_make(int n, const char *const *names, const int *sizes, sim_mesh_desc *out)
{
    memset(out, 0, sizeof *out);
    if (n < 1 || n > SIM_MAX_AXES) return sim_err(SIM_ERR_INPUT, "a mesh needs 1 to %d axes, got %d", SIM_MAX_AXES, n);
    long total = 1;
    for (int i = 0; i < n; i++) {
        if (!names[i] || !names[i][0] || strlen(names[i]) >= SIM_AXIS_NAME_MAX)
            return sim_err(SIM_ERR_INPUT, "mesh axis %d needs a name of 1 to %d characters", i, SIM_AXIS_NAME_MAX - 1);
        if (sizes[i] < 1)
            return sim_err(SIM_ERR_INPUT, "mesh axis '%s' has size %d; sizes must be >= 1", names[i], sizes[i]);
        for (int j = 0; j < i; j++)
            if (!strcmp(names[i], names[j])) return sim_err(SIM_ERR_INPUT, "mesh axis '%s' appears twice", names[i]);
        total *= sizes[i];
        if (total > SIM_MAX_DEVICES) {
            /* name the axes and sizes, so the user sees which flag to lower */
            char what[512];
            size_t k = 0;
            for (int j = 0; j <= i && k < sizeof what; j++)
                k += (size_t)snprintf(what + k, sizeof what - k, "%s%s=%d", j ? " x " : "", names[j], sizes[j]);
            return sim_err(SIM_ERR_INPUT,
                           "the mesh %s has more than %d devices; shardsim simulates 1 to %d: lower "
                           "the parallelism flags of these axes",
                           what, SIM_MAX_DEVICES, SIM_MAX_DEVICES);
        }
        snprintf(out->names[i], SIM_AXIS_NAME_MAX, "%s", names[i]);
        out->sizes[i] = sizes[i];
    }
    out->naxes = n;
    return SIM_OK;
}

int sim_mesh_num_devices(const sim_mesh_desc *m)
{
    int n = 1;
    for (int i = 0; i < m->naxes; i++) n *= m->sizes[i];
    return n;
}

int sim_mesh_axis_index(const sim_mesh_desc *m, const char *name)
{
    for (int i = 0; i < m->naxes; i++)
        if (!strcmp(m->names[i], name)) return i;
    return -1;
}

void sim_mesh_coords(const sim_mesh_desc *m, int id, int *coords)
{
    for (int i = m->naxes - 1; i >= 0; i--) {
        coords[i] = id % m->sizes[i];
        id /= m->sizes[i];
    }
}

int sim_mesh_device_id(const sim_mesh_desc *m, const int *coords)
{
    int id = 0;
    for (int i = 0; i < m->naxes; i++) id = id * m->sizes[i] + coords[i];
    return id;
}

int sim_mesh_group_size(const sim_mesh_desc *m, sim_axes axes)
{
    int k = 1;
    for (int i = 0; i < axes.n; i++) k *= m->sizes[axes.axis[i]];
    return k;
}

const char *sim_mesh_coord_label(const sim_mesh_desc *m, int id, char *buf, size_t cap)
{
    /* axes of size 1 say nothing about where a device is: leave them out */
    int c[SIM_MAX_AXES], shown = 0;
    sim_mesh_coords(m, id, c);
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < m->naxes && n < cap; i++) {
        if (m->sizes[i] == 1) continue;
        n += (size_t)snprintf(buf + n, cap - n, "%s%s=%d", shown++ ? ", " : "", m->names[i], c[i]);
    }
    if (!shown && n < cap) n += (size_t)snprintf(buf + n, cap - n, "single device");
    if (n < cap) snprintf(buf + n, cap - n, ")");
    return buf;
}

const char *sim_axes_label(const sim_mesh_desc *m, sim_axes axes, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < axes.n && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? ", " : "", m->names[axes.axis[i]]);
    if (n < cap) snprintf(buf + n, cap - n, ")");
    return buf;
}

unsigned sim_axes_mask(sim_axes axes)
{
    unsigned mask = 0;
    for (int i = 0; i < axes.n; i++) mask |= 1u << axes.axis[i];
    return mask;
}

/* ------------------------------------------------------------- machine */

/* Device arenas allocate and free activation-sized blocks every layer.  By
 * default glibc serves each large block with a fresh mmap, so every step
 * pays page faults and zero-filling again; keeping freed memory in the heap
 * (no mmap below 32 MiB, no trimming) lets blocks be reused instead. */
static void tune_host_malloc(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, tune_host_malloc_once);
}

sim_status sim_machine_new(const sim_mesh_desc *mesh, const sim_machine_opts *opts, sim_machine **out)
{
    *out = NULL;
    tune_host_malloc();
    sim_mesh_desc check;
    const char *names[SIM_MAX_AXES];
    for (int i = 0; i < mesh->naxes && i < SIM_MAX_AXES; i++) names[i] = mesh->names[i];
    SIM_TRY(sim_mesh_desc_make(mesh->naxes, names, mesh->sizes, &check));
    for (int i = 0; i < mesh->naxes; i++) {
        if (mesh->dcn[i] > 1 && mesh->sizes[i] % mesh->dcn[i])
            return sim_err(SIM_ERR_INPUT, "mesh axis '%s': %d slices do not divide its %d devices", mesh->names[i],
                           mesh->dcn[i], mesh->sizes[i]);
        check.dcn[i] = mesh->dcn[i];
    }

    /* a dry run moves no data: every rank runs all of it in one process (rank-0 output, per-rank
     * shares read from it: sim_machine_rank_ids) */
    bool dry = opts && opts->dry_run, whole = dry || (opts && opts->whole);
    int n = sim_mesh_num_devices(&check), nranks = whole ? 1 : sim_xrank_size();
    if (nranks > n)
        return sim_err(SIM_ERR_INPUT,
                       "%d MPI ranks for a mesh of %d devices: every rank needs a device; launch at most "
                       "%d ranks (mpirun -np %d)",
                       nranks, n, n, n);
    int *owner_of = calloc((size_t)n, sizeof *owner_of), *local = calloc((size_t)n, sizeof *local);
    SIM_ASSERT(owner_of && local);
    /* the placement is checked even run whole: a bad rank_placement fails the same with or without
     * mpirun, and a dry run under mpirun fails where its real run would */
    int R = whole && sim_xrank_size() > 1 && sim_xrank_size() <= n ? sim_xrank_size() : nranks;
    sim_status pst = sim_mesh_place_ranks(&check, R, owner_of);
    if (pst == SIM_OK && R != nranks) pst = sim_mesh_place_ranks(&check, nranks, owner_of);
    if (pst != SIM_OK) {
        free(owner_of);
        free(local);
        return pst;
    }

    sim_machine *m = calloc(1, sizeof *m);
    SIM_ASSERT(m);
    m->mesh = check;
    if (opts) m->opts = *opts;
    m->n = n;
    m->nranks = nranks;
    m->rank = whole ? 0 : sim_xrank_rank();
    m->owner_of = owner_of;
    m->local = local;
    for (int id = 0; id < n; id++)
        if (owner_of[id] == m->rank) local[m->nlocal++] = id;
    if (nranks > 1) m->opts.pin_threads = false; /* ranks share the host's cores: leave placement to the OS */
    m->workers = m->n;
    m->t_origin = sim_now_ns();
    pthread_mutex_init(&m->lock, NULL);
    pthread_mutex_init(&m->shared_lock, NULL);
    m->by_mask = calloc((size_t)1 << m->mesh.naxes, sizeof *m->by_mask);
    m->dev = calloc((size_t)m->n, sizeof *m->dev);
    SIM_ASSERT(m->by_mask && m->dev);
    for (int i = 0; i < m->n; i++) {
        sim_device *d = &m->dev[i];
        d->m = m;
        d->id = i;
        sim_mesh_coords(&m->mesh, i, d->coords);
        char c[160];
        snprintf(d->label, sizeof d->label, "device %d %s", i, sim_mesh_coord_label(&m->mesh, i, c, sizeof c));
        d->arena = sim_arena_new(d->label, m->opts.capacity_bytes, m->opts.dry_run);
        sem_init(&d->wake, 0, 0);
        atomic_init(&d->released, false);
    }
    /* a device's share of the cores goes to the kernel pool (bk_parallel, which also splits
     * large sgemms: blas_kernels/bk_gemm.c); OpenBLAS itself runs single-threaded, so its
     * yield-spinning workers never compete with the pool */
    m->blas_threads = sim_topology_blas_threads(m->n);
    m->cores = sim_topology_cores();
    openblas_set_num_threads(1);
    *out = m;
    return SIM_OK;
}

static void group_free(sim_group *g)
{
    if (!g) return;
    for (int i = 0; i < g->cap * g->k; i++) {
        free(g->posted[i].cnt);
        free(g->posted[i].perm);
    }
    free(g->posted);
    free(g->npost);
    free(g->seq);
    free(g->members);
    free(g->slot);
    free(g->byrank);
    free(g->owner);
    free(g);
}

void sim_machine_free(sim_machine *m)
{
    if (!m) return;
    unsigned nmask = 1u << m->mesh.naxes;
    for (unsigned mask = 0; mask < nmask; mask++) {
        if (!m->by_mask[mask]) continue;
        int k = 1;
        for (int a = 0; a < m->mesh.naxes; a++)
            if (mask & (1u << a)) k *= m->mesh.sizes[a];
        for (int g = 0; g < m->n / k; g++) group_free(m->by_mask[mask][g]);
        free(m->by_mask[mask]);
    }
    free(m->by_mask);
    group_free(m->world);
    for (int i = 0; i < m->n; i++) {
        sim_device *d = &m->dev[i];
        sim_arena_free_all(d->arena);
        sem_destroy(&d->wake);
        free(d->rec);
        free(d->cost);
        free(d->spans);
        free(d->reps);
    }
    free(m->dev);
    free(m->owner_of);
    free(m->local);
    free(m->xbytes);
    free(m->trace_steps);
    sim_shared_free_all(m);
    pthread_mutex_destroy(&m->shared_lock);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

int sim_machine_num_devices(const sim_machine *m) { return m->n; }
const sim_mesh_desc *sim_machine_mesh(const sim_machine *m) { return &m->mesh; }
const sim_machine_opts *sim_machine_options(const sim_machine *m) { return &m->opts; }
void sim_machine_set_collective_timeout(sim_machine *m, double seconds) { m->opts.collective_timeout_s = seconds; }
void sim_machine_set_record_costs(sim_machine *m, bool on) { m->opts.no_costs = !on; }
void sim_machine_set_shared_gathers(sim_machine *m, bool on) { m->opts.copy_gathers = !on; }
void sim_machine_set_shared_activations(sim_machine *m, bool on) { m->opts.copy_activation_gathers = !on; }
void sim_machine_set_shared_guard(sim_machine *m, bool on) { m->opts.guard_shared = on; }
int sim_machine_blas_threads(const sim_machine *m) { return m->blas_threads; }
int sim_machine_threads(const sim_machine *m) { return m->workers; }

sim_device *sim_machine_device(sim_machine *m, int id)
{
    SIM_ASSERT(id >= 0 && id < m->n);
    return &m->dev[id];
}

/* -------------------------------------------------------------- device */

int sim_device_id(const sim_device *d) { return d->id; }
int sim_device_coord(const sim_device *d, int axis) { return d->coords[axis]; }
const int *sim_device_coords(const sim_device *d) { return d->coords; }
const char *sim_device_label(const sim_device *d) { return d->label; }
sim_arena *sim_device_arena(sim_device *d) { return d->arena; }
sim_machine *sim_device_machine(sim_device *d) { return d->m; }
bool sim_device_dry(const sim_device *d) { return d->m->opts.dry_run; }

sim_dtype sim_device_counted_dtype(const sim_device *d, sim_dtype dt, sim_mem_cat cat)
{
    SIM_ASSERT(cat >= 0 && cat < SIM_NMEM);
    if (dt != SIM_F32) return dt;
    bool state = cat == SIM_MEM_PARAMS || cat == SIM_MEM_GRADS || cat == SIM_MEM_OPTIMIZER;
    return d->phase == SIM_PHASE_OPTIMIZER && !state ? d->m->opts.counted_optimizer : d->m->opts.counted[cat];
}
void sim_device_set_phase(sim_device *d, sim_phase p) { d->phase = p; }
sim_phase sim_device_phase(const sim_device *d) { return d->phase; }
void sim_device_set_step(sim_device *d, int step)
{
    if (d->m->opts.trace) { /* a marker where each step starts */
        d->step_untraced = !sim_trace_step_selected(d->m, step);
        if (d->step_untraced) d->steps_skipped++;
        else d->steps_traced++;
        sim_span s = {0};
        s.t0 = s.t1 = sim_now_ns();
        s.lane = -1;
        s.rec = -1;
        if (sim_trace_keeps(d)) snprintf(s.name, sizeof s.name, "step %d", step);
        sim_trace_add(d, &s);
    }
    d->step = step;
}
int sim_device_step(const sim_device *d) { return d->step; }

int sim_device_group_rank(const sim_device *d, sim_axes axes)
{
    int r = 0;
    for (int i = 0; i < axes.n; i++) r = r * d->m->mesh.sizes[axes.axis[i]] + d->coords[axes.axis[i]];
    return r;
}

int sim_device_group_member(const sim_device *d, sim_axes axes, int r)
{
    int c[SIM_MAX_AXES];
    memcpy(c, d->coords, sizeof c);
    for (int i = axes.n - 1; i >= 0; i--) {
        int s = d->m->mesh.sizes[axes.axis[i]];
        c[axes.axis[i]] = r % s;
        r /= s;
    }
    return sim_mesh_device_id(&d->m->mesh, c);
}

/* -------------------------------------------------------------- groups */

static sim_group *group_new(sim_machine *m, unsigned mask, const int *coords)
{
    sim_group *g = calloc(1, sizeof *g);
    SIM_ASSERT(g);
    g->mask = mask;
    g->k = 1;
    for (int a = 0; a < m->mesh.naxes; a++)
        if (mask & (1u << a)) g->k *= m->mesh.sizes[a];
    g->members = calloc((size_t)g->k, sizeof *g->members);
    g->slot = calloc((size_t)g->k, sizeof *g->slot);
    g->byrank = calloc((size_t)g->k, sizeof *g->byrank);
    SIM_ASSERT(g->members && g->slot && g->byrank);
    /* Canonical member order: mixed radix over the group's axes in mesh order. */
    int c[SIM_MAX_AXES];
    memcpy(c, coords, sizeof c);
    for (int i = 0; i < g->k; i++) {
        int r = i;
        for (int a = m->mesh.naxes - 1; a >= 0; a--) {
            if (!(mask & (1u << a))) continue;
            c[a] = r % m->mesh.sizes[a];
            r /= m->mesh.sizes[a];
        }
        g->members[i] = sim_mesh_device_id(&m->mesh, c);
    }
    g->owner = calloc((size_t)g->k, sizeof *g->owner);
    SIM_ASSERT(g->owner);
    for (int i = 0; i < g->k; i++) {
        g->owner[i] = sim_machine_owner(m, g->members[i]);
        g->local_k += g->owner[i] == m->rank;
    }
    /* a channel per group: tag 0 is the machine-wide barrier's, then (mask, group index) */
    int gi = 0;
    for (int a = 0; a < m->mesh.naxes; a++)
        if (!(mask & (1u << a))) gi = gi * m->mesh.sizes[a] + coords[a];
    g->tag = 1 + (int)mask * SIM_MAX_DEVICES + gi;
    return g;
}

/* rank_placement over a mesh (sim/xrank.h holds the setting; see sim_mesh_place_ranks in machine.h). */
sim_status sim_mesh_place_ranks(const sim_mesh_desc *mesh, int R, int *owner)
{
    int n = sim_mesh_num_devices(mesh);
    SIM_ASSERT(R >= 1);
    const char(*place_axes)[SIM_AXIS_NAME_MAX];
    int place_n = sim_xrank_placement_axes(&place_axes);
    const char *place_text = sim_xrank_placement();
    if (place_n == 0) { /* contiguous blocks: rank r runs [r*n/R, (r+1)*n/R) */
        for (int r = 0; r < R; r++)
            for (long id = (long)r * n / R; id < (long)(r + 1) * n / R; id++) owner[id] = r;
        return SIM_OK;
    }
    bool kept[SIM_MAX_AXES] = {false};
    int k = 1;
    for (int i = 0; i < place_n; i++) {
        int a = sim_mesh_axis_index(mesh, place_axes[i]);
        if (a < 0) {
            char names[SIM_MAX_AXES * (SIM_AXIS_NAME_MAX + 2)];
            size_t at = 0;
            for (int b = 0; b < mesh->naxes; b++)
                at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", b ? ", " : "", mesh->names[b]);
            return sim_err(SIM_ERR_INPUT, "rank_placement=%s: the mesh has no axis '%s' (its axes: %s)", place_text,
                           place_axes[i], names);
        }
        kept[a] = true;
        k *= mesh->sizes[a];
    }
    int groups = n / k;
    if (groups % R)
        return sim_err(SIM_ERR_INPUT,
                       "rank_placement=%s keeps each group of %d device%s inside one rank, but %d "
                       "group%s cannot be split evenly over %d ranks: launch a number of ranks that divides %d, or "
                       "use rank_placement=contiguous",
                       place_text, k, k == 1 ? "" : "s", groups, groups == 1 ? "" : "s", R, groups);
    /* the position of each device in an order with the kept axes innermost (each part in mesh
     * order), cut into R blocks of n/R */
    int per = n / R, c[SIM_MAX_AXES];
    for (int id = 0; id < n; id++) {
        sim_mesh_coords(mesh, id, c);
        long outer = 0, inner = 0;
        for (int a = 0; a < mesh->naxes; a++) {
            if (kept[a]) inner = inner * mesh->sizes[a] + c[a];
            else outer = outer * mesh->sizes[a] + c[a];
        }
        owner[id] = (int)((outer * k + inner) / per);
    }
    return SIM_OK;
}

int sim_machine_owner(const sim_machine *m, int id) { return m->owner_of[id]; }

sim_group *sim_group_of(sim_device *d, unsigned mask)
{
    sim_machine *m = d->m;
    for (unsigned i = 0; i < d->ngcache && i < 8; i++)
        if (d->gcache_mask[i] == mask) return d->gcache[i];
    /* Group index: mixed radix of the coordinates on the axes outside the group. */
    int gi = 0;
    for (int a = 0; a < m->mesh.naxes; a++)
        if (!(mask & (1u << a))) gi = gi * m->mesh.sizes[a] + d->coords[a];
    pthread_mutex_lock(&m->lock);
    if (!m->by_mask[mask]) {
        int k = 1;
        for (int a = 0; a < m->mesh.naxes; a++)
            if (mask & (1u << a)) k *= m->mesh.sizes[a];
        m->by_mask[mask] = calloc((size_t)(m->n / k), sizeof(sim_group *));
        SIM_ASSERT(m->by_mask[mask]);
    }
    sim_group *g = m->by_mask[mask][gi];
    if (!g) g = m->by_mask[mask][gi] = group_new(m, mask, d->coords);
    pthread_mutex_unlock(&m->lock);
    unsigned slot = d->ngcache++ % 8; /* only this device's thread touches its cache */
    d->gcache_mask[slot] = mask;
    d->gcache[slot] = g;
    return g;
}

int sim_group_slot(const sim_group *g, const sim_device *d)
{
    /* Canonical index = mixed radix over the group's axes in mesh order. */
    const sim_mesh_desc *mesh = &d->m->mesh;
    int r = 0;
    for (int a = 0; a < mesh->naxes; a++)
        if (g->mask & (1u << a)) r = r * mesh->sizes[a] + d->coords[a];
    return r;
}

/* --------------------------------------------------------------- failure */

/* A device's wake-up semaphore: its own in thread mode, its fiber's when it runs as a fiber. */
static void dev_wake(sim_device *d)
{
    if (d->fib) sim_fiber_post(d->fib);
    else sem_post(&d->wake);
}

/* Sleeps until d is posted (0) or the deadline (CLOCK_REALTIME, NULL: none) passed (non-zero). */
static int dev_sleep(sim_device *d, const struct timespec *deadline)
{
    if (d->fib) return sim_fiber_wait(d->fib, deadline);
    for (;;) {
        int r = deadline ? sem_timedwait(&d->wake, deadline) : sem_wait(&d->wake);
        if (r == 0) return 0;
        if (errno != EINTR) return errno;
    }
}

static void wake_all_locked(sim_machine *m)
{
    for (int j = 0; j < m->nlocal; j++) dev_wake(&m->dev[m->local[j]]);
}

static void fail_locked(sim_machine *m, sim_status st, const char *msg)
{
    if (m->failed) return;
    m->failed = true;
    atomic_store(&m->xstop, true);
    m->fail_st = st;
    snprintf(m->fail_msg, sizeof m->fail_msg, "%s", msg);
    /* the other ranks may be waiting on this one's devices: tell them now (not when another rank's
     * failure is what stopped this one) */
    if (m->nranks > 1) sim_xrank_post_failure(st, msg);
    wake_all_locked(m);
}

void sim_machine_fail(sim_machine *m, sim_status st, const char *msg)
{
    pthread_mutex_lock(&m->lock);
    fail_locked(m, st, msg);
    pthread_mutex_unlock(&m->lock);
}

static const char *kind_name(sim_rv_kind k)
{
    return k == SIM_RV_ARRIVE ? "entering" : k == SIM_RV_DEPART ? "finishing" : "barrier of";
}

/* "<device> waits entering <op> over <axes> (tag 't') for <peers>" into msg. */
static size_t describe_wait_locked(const sim_machine *m, const sim_device *d, char *msg, size_t cap)
{
    char ax[96];
    const sim_group *g = d->wait_group;
    const sim_call *c = d->wait_call;
    sim_axes axes = c ? c->axes : sim_axes_none();
    size_t n =
        (size_t)snprintf(msg, cap, "\n  %s waits %s %s over %s (tag '%s') for", d->label, kind_name(d->wait_kind),
                         c ? sim_op_name(c->op) : "a barrier",
                         c ? sim_axes_label(&m->mesh, axes, ax, sizeof ax) : "all devices", c && c->tag ? c->tag : "-");
    int missing = 0;
    for (int j = 0; j < g->k && n + 200 < cap; j++) {
        const sim_device *p = &m->dev[g->members[j]];
        if (p == d) continue;
        if (p->waiting && p->wait_group == g && p->wait_kind == d->wait_kind) continue;
        missing++;
        if (p->finished) n += (size_t)snprintf(msg + n, cap - n, " device %d (finished)", p->id);
        else if (p->waiting && p->wait_call)
            n += (size_t)snprintf(msg + n, cap - n, " device %d (in %s over %s, tag '%s')", p->id,
                                  sim_op_name(p->wait_call->op),
                                  sim_axes_label(&m->mesh, p->wait_call->axes, ax, sizeof ax),
                                  p->wait_call->tag ? p->wait_call->tag : "-");
        else n += (size_t)snprintf(msg + n, cap - n, " device %d (elsewhere)", p->id);
        if (missing >= 4) break;
    }
    return n < cap ? n : cap - 1;
}

/* Every live device is blocked: say who waits where, and for whom. */
static void deadlock_locked(sim_machine *m)
{
    char msg[8192];
    size_t n = (size_t)snprintf(msg, sizeof msg,
                                "collective deadlock: every running device waits on a collective that cannot complete");
    int shown = 0;
    for (int i = 0; i < m->n && n < sizeof msg - 200; i++) {
        const sim_device *d = &m->dev[i];
        if (!d->waiting) continue;
        if (shown++ == 16) {
            n += (size_t)snprintf(msg + n, sizeof msg - n, "\n  ...");
            break;
        }
        n += describe_wait_locked(m, d, msg + n, sizeof msg - n);
    }
    fail_locked(m, SIM_ERR_DEADLOCK, msg);
}

/* The watchdog fired for d: it waited longer than collective_timeout_s. */
static void watchdog_locked(sim_machine *m, const sim_device *d)
{
    char msg[4096];
    size_t n = (size_t)snprintf(
        msg, sizeof msg, "collective watchdog: %s waited more than %g s on one collective (collective_timeout_s)",
        d->label, m->opts.collective_timeout_s);
    n += describe_wait_locked(m, d, msg + n, sizeof msg - n);
    snprintf(msg + n, sizeof msg - n,
             "\nA peer is stuck or far slower; raise collective_timeout_s if it is only slow.");
    fail_locked(m, SIM_ERR_DEADLOCK, msg);
}

/* Sleeps until released (or, unless it waits for a DEPART, until the
 * machine fails).  Called with the lock held and d->waiting set; returns
 * with it released.  The kind is read under the lock at every wake-up: an
 * exchange turns its members' ARRIVE waits into DEPART waits while they
 * sleep (sim_exchange), and from then on they must stay until released. */
static sim_status block_locked(sim_machine *m, sim_device *d)
{
    bool must_finish = d->wait_kind == SIM_RV_DEPART;
    bool failed = m->failed && !must_finish;
    pthread_mutex_unlock(&m->lock);
    /* The watchdog is a timed wait on the semaphore: the thread sleeps until
     * posted or until the deadline, never spins.  DEPART always completes
     * (see sim_rendezvous), so it is never timed. */
    bool timed = m->opts.collective_timeout_s > 0 && !must_finish;
    struct timespec deadline = {0};
    if (timed) {
        clock_gettime(CLOCK_REALTIME, &deadline);
        double t = (double)deadline.tv_sec + deadline.tv_nsec * 1e-9 + m->opts.collective_timeout_s;
        deadline.tv_sec = (time_t)t;
        deadline.tv_nsec = (long)((t - (double)deadline.tv_sec) * 1e9);
    }
    while (!failed) {
        if (timed) {
            if (dev_sleep(d, &deadline) !=
                0) { /* the deadline passed: end the run, unless released or turned into a DEPART meanwhile */
                pthread_mutex_lock(&m->lock);
                must_finish = d->wait_kind == SIM_RV_DEPART;
                if (d->waiting && !m->failed && !must_finish) watchdog_locked(m, d);
                bool released = !d->waiting;
                failed = d->waiting && m->failed && !must_finish;
                timed = !must_finish;
                pthread_mutex_unlock(&m->lock);
                if (released) {
                    atomic_store(&d->released, false); /* this wait's release (wait_locked cleared older ones) */
                    return SIM_OK;
                }
                continue;
            }
        } else {
            (void)dev_sleep(d, NULL);
        }
        if (atomic_exchange(&d->released, false)) return SIM_OK;
        /* a failure's post, or a stale post from an earlier wake-up */
        pthread_mutex_lock(&m->lock);
        bool released = !d->waiting;
        failed = d->waiting && m->failed && d->wait_kind != SIM_RV_DEPART;
        pthread_mutex_unlock(&m->lock);
        if (released) {
            /* released under the lock: the flag was set with it (wait_locked cleared older ones) */
            atomic_store(&d->released, false);
            return SIM_OK;
        }
    }
    pthread_mutex_lock(&m->lock);
    if (d->waiting) { /* woken by a failure */
        d->waiting = false;
        m->n_blocked--;
        sim_status st = m->fail_st;
        pthread_mutex_unlock(&m->lock);
        if (st == SIM_ERR_MISMATCH || st == SIM_ERR_DEADLOCK) return sim_err(st, "%s", m->fail_msg);
        return sim_err(SIM_ERR_ABORTED, "%s stopped: another device failed first", d->label);
    }
    pthread_mutex_unlock(&m->lock);
    /* released between the failure check and the lock: a normal return */
    atomic_store(&d->released, false);
    return SIM_OK;
}

/* Marks d as waiting in g (for call, of kind) and sleeps as block_locked does:
 * called with the lock held, returns with it released.  The last device to
 * block while every live one waits is a deadlock, reported here. */
static sim_status wait_locked(sim_machine *m, sim_device *d, sim_group *g, const sim_call *call, sim_rv_kind kind)
{
    d->waiting = true;
    /* a release is for the wait it ends: any flag left from an earlier wait is dropped here, under the
     * lock, before a releaser can see `waiting`.  block_locked then returns on `!waiting` read under
     * the lock and never spins on the flag: it used to, and a fiber resumed twice (a post queued it
     * again while its worker was resuming it: sim/fiber.c) hung its worker spinning for a flag its
     * first resumption had already taken */
    atomic_store(&d->released, false);
    d->wait_group = g;
    d->wait_call = call;
    d->wait_kind = kind;
    m->n_blocked++;
    if (m->n_blocked == m->n_alive) deadlock_locked(m);
    return block_locked(m, d);
}

/* Releases every member of g that waits on it, except d (under the lock,
 * which it drops); their semaphores are posted after unlocking, so the
 * woken devices never wait for the lock. */
static void release_group_unlock(sim_machine *m, sim_group *g, const sim_device *d)
{
    int nrel = 0, rel[SIM_MAX_DEVICES];
    for (int j = 0; j < g->k; j++) {
        sim_device *p = &m->dev[g->members[j]];
        if (p == d || !p->waiting || p->wait_group != g) continue;
        p->waiting = false;
        m->n_blocked--;
        atomic_store(&p->released, true);
        rel[nrel++] = g->members[j];
    }
    pthread_mutex_unlock(&m->lock);
    for (int j = 0; j < nrel; j++) dev_wake(&m->dev[rel[j]]);
}

/* Drops the lock and reports that d stops because another device failed first. */
static sim_status aborted_unlock(sim_machine *m, const sim_device *d)
{
    pthread_mutex_unlock(&m->lock);
    return sim_err(SIM_ERR_ABORTED, "%s stopped: another device failed first", d->label);
}

/* The last arriver checks that the group's calls agree (match); on a mismatch the run
 * fails with match's explanation and the lock is dropped. */
static sim_status match_or_fail_locked(sim_machine *m, sim_group *g, sim_match_fn match)
{
    char why[6144];
    m->match_fail = SIM_OK;
    if (match(m, g, why, sizeof why)) return SIM_OK;
    sim_status st = m->match_fail ? m->match_fail : SIM_ERR_MISMATCH;
    fail_locked(m, st, why);
    pthread_mutex_unlock(&m->lock);
    return sim_err(st, "%s", why);
}

sim_status sim_rendezvous(sim_device *d, sim_group *g, sim_call *call, sim_rv_kind kind, sim_match_fn match)
{
    sim_machine *m = d->m;
    /* Every member that passed ARRIVE only copies memory before DEPART, so a
     * DEPART always completes; leaving it early on another device's failure
     * would let this device free buffers its peers are still reading. */
    bool must_finish = kind == SIM_RV_DEPART;
    pthread_mutex_lock(&m->lock);
    if (m->failed && !must_finish) return aborted_unlock(m, d);
    if (kind == SIM_RV_ARRIVE) g->slot[sim_group_slot(g, d)] = call;
    if (++g->arrived == g->local_k) {
        SIM_ASSERT(g->local_k == g->k || kind == SIM_RV_BARRIER); /* spread groups meet in sim_exchange */
        if (g->local_k < g->k) { /* the other ranks' members: a message to and from each of their ranks */
            pthread_mutex_unlock(&m->lock);
            sim_status st = sim_xgroup_sync(m, g);
            pthread_mutex_lock(&m->lock);
            if (st != SIM_OK) {
                fail_locked(m, st, sim_errmsg());
                pthread_mutex_unlock(&m->lock);
                return st;
            }
        }
        if (kind == SIM_RV_ARRIVE && match) SIM_TRY(match_or_fail_locked(m, g, match));
        g->arrived = 0;
        g->gen++;
        release_group_unlock(m, g, d);
        return SIM_OK;
    }
    return wait_locked(m, d, g, call ? call : g->slot[sim_group_slot(g, d)], kind);
}

/* Runs tasks of g's exchange until none is left; the last worker to stop
 * releases the members, the others wait for it (their tasks are done, but
 * a task still running may write into their buffers or read from them). */
static void exchange_work(sim_machine *m, sim_device *d, sim_group *g, sim_call *call)
{
    for (;;) {
        int t = atomic_fetch_add(&g->task_next, 1);
        if (t >= g->ntask) break;
        g->task_fn(m, g, t);
    }
    pthread_mutex_lock(&m->lock);
    if (--g->workers == 0) {
        g->moved++;
        release_group_unlock(m, g, d);
        return;
    }
    (void)wait_locked(m, d, g, call, SIM_RV_DEPART); /* a DEPART wait: it ends released */
}

/* A helper woken to move data (d->helper) starts: it joins the exchange unless the workers
 * already finished it (a helper runs late when its core, or its fiber's worker, was busy with
 * another device: the exchange does not wait for it), then its buffers are complete. */
static void exchange_help(sim_machine *m, sim_device *d, sim_group *g, sim_call *call)
{
    pthread_mutex_lock(&m->lock);
    if (g->moved != d->help_moved) {
        pthread_mutex_unlock(&m->lock);
        return;
    }
    g->workers++;
    pthread_mutex_unlock(&m->lock);
    exchange_work(m, d, g, call);
}

/* The last local arriver of a group spread over ranks (lock held): trades the calls with the
 * other ranks while its local peers sleep in ARRIVE (a failure may still wake them: nothing of
 * theirs is read outside the lock), matches all k calls as a one-process run would (every rank
 * reaches the same verdict and message), then moves the data itself while they sleep in DEPART. */
static sim_status exchange_spread_locked(sim_machine *m, sim_device *d, sim_group *g, sim_match_fn match)
{
    sim_xgroup_pack_calls(m, g);
    pthread_mutex_unlock(&m->lock);
    sim_status st = sim_xgroup_trade_calls(m, g);
    pthread_mutex_lock(&m->lock);
    if (st == SIM_OK && m->failed) st = SIM_ERR_ABORTED;
    if (st != SIM_OK) {
        if (st != SIM_ERR_ABORTED) fail_locked(m, st, sim_errmsg());
        g->arrived = 0;
        sim_xgroup_end(g);
        return st == SIM_ERR_ABORTED ? aborted_unlock(m, d) : (pthread_mutex_unlock(&m->lock), st);
    }
    sim_xgroup_ghosts(m, g);
    g->arrived = 0;
    m->match_fail = SIM_OK;
    char why[6144];
    if (!match(m, g, why, sizeof why)) {
        st = m->match_fail ? m->match_fail : SIM_ERR_MISMATCH;
        fail_locked(m, st, why);
        sim_xgroup_end(g);
        pthread_mutex_unlock(&m->lock);
        return sim_err(st, "%s", why);
    }
    g->gen++;
    for (int j = 0; j < g->k; j++) {
        sim_call *c = g->slot[j];
        g->byrank[sim_device_group_rank(&m->dev[c->device], c->axes)] = c;
    }
    for (int j = 0; j < g->k; j++) { /* buffers are in use from now on: no failure may wake them */
        sim_device *p = &m->dev[g->members[j]];
        if (p != d && g->owner[j] == m->rank) p->wait_kind = SIM_RV_DEPART;
    }
    pthread_mutex_unlock(&m->lock);
    st = sim_xgroup_move(m, d, g);
    pthread_mutex_lock(&m->lock);
    sim_xgroup_end(g);
    g->moved++;
    if (st != SIM_OK) { /* the data did not all arrive: the members wake to the failure, not released */
        for (int j = 0; j < g->k; j++) {
            sim_device *p = &m->dev[g->members[j]];
            if (p != d && g->owner[j] == m->rank) p->wait_kind = SIM_RV_ARRIVE;
        }
        if (st != SIM_ERR_ABORTED) fail_locked(m, st, sim_errmsg());
        pthread_mutex_unlock(&m->lock);
        for (int j = 0; j < g->k; j++) /* the failure's wake-up came while they had to stay: again */
            if (g->owner[j] == m->rank && &m->dev[g->members[j]] != d) dev_wake(&m->dev[g->members[j]]);
        return st;
    }
    release_group_unlock(m, g, d);
    return SIM_OK;
}

sim_status sim_exchange(sim_device *d, sim_group *g, sim_call *call, sim_match_fn match, sim_task_fn task, int ntask,
                        bool split)
{
    sim_machine *m = d->m;
    pthread_mutex_lock(&m->lock);
    if (m->failed) return aborted_unlock(m, d);
    g->slot[sim_group_slot(g, d)] = call;
    if (++g->arrived < g->local_k) {
        d->helper = false;
        SIM_TRY(wait_locked(m, d, g, call, SIM_RV_ARRIVE));
        if (d->helper) exchange_help(m, d, g, call); /* asked to move data; else the exchange is over */
        return SIM_OK;
    }
    if (g->local_k < g->k) return exchange_spread_locked(m, d, g, match);
    SIM_TRY(match_or_fail_locked(m, g, match));
    g->arrived = 0;
    g->gen++;
    for (int j = 0; j < g->k; j++) { /* the calls agree on their axes: rank them by those */
        sim_call *c = g->slot[j];
        g->byrank[sim_device_group_rank(&m->dev[c->device], c->axes)] = c;
    }
    g->task_fn = task;
    g->ntask = ntask;
    atomic_store(&g->task_next, 0);
    /* the other members stay asleep until the data has moved (no failure may
     * wake them: peers write into their buffers), except, when the exchange
     * is large enough to share, a helper for each other core: device threads
     * are pinned round-robin (core = id % cores), and a helper pinned to a
     * core that already works would only take turns with that worker; as
     * fibers, device id runs on worker id % workers, and a helper on the
     * worker of d (or of another helper) could only start once that one waits */
    int lanes = m->fibers ? m->workers : m->cores;
    bool placed = m->fibers || m->opts.pin_threads;
    int helpers = split ? lanes - 1 : 0, nrel = 0, rel[SIM_MAX_DEVICES];
    for (int j = 0; j < g->k; j++) {
        sim_device *p = &m->dev[g->members[j]];
        if (p == d) continue;
        SIM_ASSERT(p->waiting && p->wait_group == g);
        bool help = nrel < helpers;
        if (help && placed) {
            int lane = p->id % lanes;
            help = lane != d->id % lanes;
            for (int i = 0; i < nrel && help; i++) help = lane != rel[i] % lanes;
        }
        if (help) {
            p->waiting = false;
            p->helper = true;
            p->help_moved = g->moved;
            m->n_blocked--;
            atomic_store(&p->released, true);
            rel[nrel++] = g->members[j];
        } else {
            p->wait_kind = SIM_RV_DEPART;
        }
    }
    g->workers = 1; /* helpers join when they start (exchange_help) */
    pthread_mutex_unlock(&m->lock);
    for (int j = 0; j < nrel; j++) dev_wake(&m->dev[rel[j]]);
    exchange_work(m, d, g, call);
    return SIM_OK;
}

/* Generations a dry-run device may post ahead of the slowest member of its group. */
enum { POST_AHEAD = 64 };

/* Makes room in g's ring for generation `gen` (under the lock). */
static void post_ring_fit(sim_group *g, uint64_t gen)
{
    if (gen - g->base < (uint64_t)g->cap) return;
    int cap = g->cap ? 2 * g->cap : 8;
    while (gen - g->base >= (uint64_t)cap) cap *= 2;
    sim_posted *posted = calloc((size_t)cap * (size_t)g->k, sizeof *posted);
    int *npost = calloc((size_t)cap, sizeof *npost);
    SIM_ASSERT(posted && npost);
    for (int i = 0; i < g->cap; i++) { /* move the live generations to their new places */
        uint64_t gi = g->base + (uint64_t)i;
        memcpy(&posted[(gi % (uint64_t)cap) * (uint64_t)g->k], &g->posted[(gi % (uint64_t)g->cap) * (uint64_t)g->k],
               (size_t)g->k * sizeof *posted);
        npost[gi % (uint64_t)cap] = g->npost[gi % (uint64_t)g->cap];
    }
    for (int i = 0; i < cap * g->k; i++) { /* re-point the copies' arrays (moved entries keep theirs) */
        sim_posted *p = &posted[i];
        p->call.tag = p->tag;
        p->call.perm = p->perm;
        p->call.send_cnt = p->cnt;
        p->call.recv_cnt = p->cnt ? p->cnt + g->k : NULL;
    }
    free(g->posted);
    free(g->npost);
    g->posted = posted;
    g->npost = npost;
    g->cap = cap;
}

sim_status sim_post(sim_device *d, sim_group *g, const sim_call *call, sim_match_fn match)
{
    sim_machine *m = d->m;
    pthread_mutex_lock(&m->lock);
    if (m->failed) return aborted_unlock(m, d);
    if (!g->seq) {
        g->seq = calloc((size_t)g->k, sizeof *g->seq);
        SIM_ASSERT(g->seq);
    }
    int s = sim_group_slot(g, d), k = g->k;
    /* a device far ahead of a member of its group sleeps until that member
     * catches up half way: the ring (memory) stays bounded, and the sleeps
     * are few */
    while (g->seq[s] - g->base >= POST_AHEAD) {
        if (!g->nahead || g->seq[s] < g->ahead_gen) g->ahead_gen = g->seq[s];
        g->nahead++;
        SIM_TRY(wait_locked(m, d, g, call, SIM_RV_ARRIVE));
        pthread_mutex_lock(&m->lock);
        if (m->failed) return aborted_unlock(m, d);
    }
    uint64_t gen = g->seq[s]++;
    post_ring_fit(g, gen);
    sim_posted *p = &g->posted[(gen % (uint64_t)g->cap) * (uint64_t)k + (uint64_t)s];
    size_t *cnt = p->cnt;
    int *perm = p->perm;
    p->call = *call;
    sim_str_put(p->tag, sizeof p->tag, 0, call->tag ? call->tag : "", SIZE_MAX);
    p->call.tag = call->tag ? p->tag : NULL;
    p->call.send = NULL;
    p->call.recv = NULL;
    p->call.send_off = p->call.recv_off = NULL;
    p->call.send_cnt = p->call.recv_cnt = NULL;
    p->call.perm = NULL;
    if (call->send_cnt && call->recv_cnt) {
        if (!cnt) cnt = malloc(2 * (size_t)k * sizeof *cnt);
        SIM_ASSERT(cnt);
        memcpy(cnt, call->send_cnt, (size_t)k * sizeof *cnt);
        memcpy(cnt + k, call->recv_cnt, (size_t)k * sizeof *cnt);
        p->call.send_cnt = cnt;
        p->call.recv_cnt = cnt + k;
    }
    if (call->perm) {
        if (!perm) perm = malloc((size_t)k * sizeof *perm);
        SIM_ASSERT(perm);
        memcpy(perm, call->perm, (size_t)k * sizeof *perm);
        p->call.perm = perm;
    }
    p->cnt = cnt;
    p->perm = perm;
    uint64_t b = g->base % (uint64_t)g->cap;
    if (++g->npost[gen % (uint64_t)g->cap] == k && gen == g->base) {
        for (int j = 0; j < k; j++) g->slot[j] = &g->posted[b * (uint64_t)k + (uint64_t)j].call;
        g->npost[b] = 0; /* the generation is consumed, matching or not */
        g->base++;
        SIM_TRY(match_or_fail_locked(m, g, match));
        if (g->nahead && g->ahead_gen - g->base <= POST_AHEAD / 2) { /* wake the devices waiting ahead */
            g->nahead = 0;
            release_group_unlock(m, g, d); /* d posts: it is not among the waiters */
            return SIM_OK;
        }
    }
    pthread_mutex_unlock(&m->lock);
    return SIM_OK;
}

/* After a run: a dry run's calls that some member never matched (a
 * blocking run would have deadlocked there); then the rings restart. */
static void post_check_locked(sim_machine *m, sim_group *g)
{
    if (!g || !g->seq) return;
    int lo = 0, hi = 0;
    for (int j = 1; j < g->k; j++) {
        if (g->seq[j] < g->seq[lo]) lo = j;
        if (g->seq[j] > g->seq[hi]) hi = j;
    }
    if (g->seq[lo] != g->seq[hi] && !m->failed) {
        char msg[1024], ax[96];
        const sim_posted *p = &g->posted[(g->seq[lo] % (uint64_t)g->cap) * (uint64_t)g->k + (uint64_t)hi];
        snprintf(msg, sizeof msg,
                 "collective deadlock: device %d made %llu collective calls over %s but device %d made %llu (its "
                 "call %llu, %s tag '%s', has no partner); every device of a group must make the same collective "
                 "calls in the same order",
                 g->members[lo], (unsigned long long)g->seq[lo], sim_axes_label(&m->mesh, p->call.axes, ax, sizeof ax),
                 g->members[hi], (unsigned long long)g->seq[hi], (unsigned long long)g->seq[lo] + 1,
                 sim_op_name(p->call.op), p->call.tag ? p->call.tag : "-");
        fail_locked(m, SIM_ERR_DEADLOCK, msg);
    }
    memset(g->seq, 0, (size_t)g->k * sizeof *g->seq);
    if (g->npost) memset(g->npost, 0, (size_t)g->cap * sizeof *g->npost);
    g->base = 0;
}

sim_status sim_device_barrier(sim_device *d)
{
    sim_machine *m = d->m;
    pthread_mutex_lock(&m->lock);
    if (!m->world) {
        int c[SIM_MAX_AXES] = {0};
        m->world = group_new(m, (1u << m->mesh.naxes) - 1, c);
    }
    pthread_mutex_unlock(&m->lock);
    return sim_rendezvous(d, m->world, NULL, SIM_RV_BARRIER, NULL);
}

/* ----------------------------------------------------------------- run */

static void device_body(sim_device *d)
{
    sim_machine *m = d->m;
    sim_err_clear();
    sim_status st = m->fn(d, m->arg);
    d->st = st;
    pthread_mutex_lock(&m->lock);
    if (st != SIM_OK && st != SIM_ERR_ABORTED) fail_locked(m, st, sim_errmsg());
    d->finished = true;
    m->n_alive--;
    if (m->n_alive > 0 && m->n_blocked == m->n_alive) deadlock_locked(m);
    pthread_mutex_unlock(&m->lock);
}

/* Pins the calling thread (device thread or fiber worker i) to core i; the first one warns if it cannot. */
static void pin_self_or_warn(const sim_machine *m, int i)
{
    if (sim_topology_pin_self(i) != SIM_OK && !m->opts.quiet && i == 0)
        fprintf(stderr, "shardsim: warning: %s; device threads run unpinned\n", sim_errmsg());
}

static void *device_main(void *arg)
{
    sim_device *d = arg;
    if (d->m->opts.pin_threads) pin_self_or_warn(d->m, d->id);
    device_body(d);
    return NULL;
}

static void fiber_main(void *arg, int i)
{
    sim_machine *m = arg;
    device_body(&m->dev[i]);
}

static void pin_worker(void *arg, int w) { pin_self_or_warn(arg, w); }

/* ------------------------------------------------------------ ranks */

/* What one rank sends of each of its devices after a run, then the arrays. */
typedef struct {
    int32_t id;
    int32_t spans_dropped;
    uint64_t nrec, ncost, nspans, kept; /* kept: spans stored (0 once dropped) */
    uint64_t spans_skipped, steps_traced, steps_skipped;
    uint64_t nreps, rec_extra, cost_extra, span_extra;
    sim_op_totals totals[SIM_NOP];
    sim_arena_stats arena;
} dev_summary;

static void blob_put(char **buf, size_t *len, size_t *cap, const void *p, size_t n)
{
    if (*len + n > *cap) {
        while (*len + n > *cap) *cap = *cap ? 2 * *cap : 4096;
        *buf = realloc(*buf, *cap);
        SIM_ASSERT(*buf);
    }
    if (n) memcpy(*buf + *len, p, n);
    *len += n;
}

/* After a run spread over ranks: every rank gets every other rank's device records, kernel costs,
 * trace spans, op totals and arena figures (the same binary on every rank: plain structs travel as
 * bytes), and the bytes that crossed ranks per step summed over ranks.  So the reports read the
 * machine as after a one-process run, on any rank (rank 0 writes them). */
static sim_status gather_devices(sim_machine *m)
{
    char *blob = NULL;
    size_t len = 0, cap = 0;
    int32_t nx = m->nxbytes;
    blob_put(&blob, &len, &cap, &nx, sizeof nx);
    blob_put(&blob, &len, &cap, m->xbytes, (size_t)nx * sizeof *m->xbytes);
    for (int j = 0; j < m->nlocal; j++) {
        int i = m->local[j];
        sim_device *d = &m->dev[i];
        dev_summary s;
        memset(&s, 0, sizeof s);
        s.id = i;
        s.spans_dropped = d->spans_dropped;
        s.nrec = d->nrec;
        s.ncost = d->ncost;
        s.nreps = d->nreps;
        s.rec_extra = d->rec_extra;
        s.cost_extra = d->cost_extra;
        s.span_extra = d->span_extra;
        s.nspans = d->nspans;
        s.kept = d->spans ? d->nspans : 0;
        s.spans_skipped = d->spans_skipped;
        s.steps_traced = d->steps_traced;
        s.steps_skipped = d->steps_skipped;
        memcpy(s.totals, d->totals, sizeof s.totals);
        sim_arena_get_stats(d->arena, &s.arena);
        blob_put(&blob, &len, &cap, &s, sizeof s);
        blob_put(&blob, &len, &cap, d->rec, d->nrec * sizeof *d->rec);
        blob_put(&blob, &len, &cap, d->cost, d->ncost * sizeof *d->cost);
        blob_put(&blob, &len, &cap, d->spans, s.kept * sizeof *d->spans);
        blob_put(&blob, &len, &cap, d->reps, d->nreps * sizeof *d->reps);
    }
    void *all = NULL;
    size_t *sizes = calloc((size_t)m->nranks, sizeof *sizes);
    SIM_ASSERT(sizes);
    sim_status st = sim_xrank_allgatherv(blob, len, &all, sizes);
    free(blob);
    if (st != SIM_OK) {
        free(sizes);
        return st;
    }
    uint64_t *xb = NULL;
    int nxb = 0;
    const char *p = all;
    for (int r = 0; r < m->nranks; r++) {
        const char *end = p + sizes[r];
        int32_t n;
        memcpy(&n, p, sizeof n);
        p += sizeof n;
        if (n > nxb) {
            xb = realloc(xb, (size_t)n * sizeof *xb);
            SIM_ASSERT(xb);
            memset(xb + nxb, 0, (size_t)(n - nxb) * sizeof *xb);
            nxb = n;
        }
        for (int s = 0; s < n; s++) {
            uint64_t v;
            memcpy(&v, p + (size_t)s * sizeof v, sizeof v);
            xb[s] += v;
        }
        p += (size_t)n * sizeof(uint64_t);
        while (p < end) {
            dev_summary s;
            memcpy(&s, p, sizeof s);
            p += sizeof s;
            SIM_ASSERT(s.id >= 0 && s.id < m->n);
            sim_device *d = &m->dev[s.id];
            if (r == m->rank) { /* our own: already here */
                p += s.nrec * sizeof *d->rec + s.ncost * sizeof *d->cost + s.kept * sizeof *d->spans +
                     s.nreps * sizeof *d->reps;
                continue;
            }
            d->nrec = d->caprec = s.nrec;
            d->rec = realloc(d->rec, (s.nrec ? s.nrec : 1) * sizeof *d->rec);
            d->ncost = d->capcost = s.ncost;
            d->rec_extra = s.rec_extra;
            d->cost_extra = s.cost_extra;
            d->span_extra = s.span_extra;
            d->cost = realloc(d->cost, (s.ncost ? s.ncost : 1) * sizeof *d->cost);
            SIM_ASSERT(d->rec && d->cost);
            memcpy(d->rec, p, s.nrec * sizeof *d->rec);
            p += s.nrec * sizeof *d->rec;
            memcpy(d->cost, p, s.ncost * sizeof *d->cost);
            p += s.ncost * sizeof *d->cost;
            free(d->spans);
            d->spans = NULL;
            if (s.kept) {
                d->spans = malloc(s.kept * sizeof *d->spans);
                SIM_ASSERT(d->spans);
                memcpy(d->spans, p, s.kept * sizeof *d->spans);
            }
            p += s.kept * sizeof *d->spans;
            d->nreps = d->capreps = s.nreps;
            d->reps = realloc(d->reps, (s.nreps ? s.nreps : 1) * sizeof *d->reps);
            SIM_ASSERT(d->reps);
            memcpy(d->reps, p, s.nreps * sizeof *d->reps);
            p += s.nreps * sizeof *d->reps;
            d->nspans = s.nspans;
            d->capspans = s.kept;
            d->spans_dropped = s.spans_dropped;
            d->spans_skipped = s.spans_skipped;
            d->steps_traced = s.steps_traced;
            d->steps_skipped = s.steps_skipped;
            memcpy(d->totals, s.totals, sizeof d->totals);
            sim_arena_set_stats(d->arena, &s.arena);
        }
    }
    free(all);
    free(sizes);
    free(m->xbytes);
    m->xbytes = xb;
    m->nxbytes = nxb;
    return SIM_OK;
}

int sim_machine_ranks(const sim_machine *m) { return m->nranks; }
int sim_machine_rank(const sim_machine *m) { return m->rank; }

sim_status sim_machine_rank_ids(const sim_machine *m, int R, int r, int *ids, int *count)
{
    *count = 0;
    if (R == m->nranks) {
        for (int id = 0; id < m->n; id++)
            if (m->owner_of[id] == r) ids[(*count)++] = id;
        return SIM_OK;
    }
    int *owner = calloc((size_t)m->n, sizeof *owner);
    SIM_ASSERT(owner);
    sim_status st = sim_mesh_place_ranks(&m->mesh, R, owner);
    for (int id = 0; id < m->n && st == SIM_OK; id++)
        if (owner[id] == r) ids[(*count)++] = id;
    free(owner);
    return st;
}
bool sim_device_rank_lead(const sim_device *d) { return d->id == d->m->local[0]; }

const uint64_t *sim_machine_xrank_bytes(const sim_machine *m, int *nsteps)
{
    *nsteps = m->nxbytes;
    return m->xbytes;
}

void sim_machine_add_xrank_bytes(sim_machine *m, int step, uint64_t bytes)
{
    if (step < 0) step = 0;
    pthread_mutex_lock(&m->lock);
    if (step >= m->nxbytes) {
        int n = step + 1 > 2 * m->nxbytes ? step + 1 : 2 * m->nxbytes;
        m->xbytes = realloc(m->xbytes, (size_t)n * sizeof *m->xbytes);
        SIM_ASSERT(m->xbytes);
        memset(m->xbytes + m->nxbytes, 0, (size_t)(n - m->nxbytes) * sizeof *m->xbytes);
        m->nxbytes = n;
    }
    m->xbytes[step] += bytes;
    pthread_mutex_unlock(&m->lock);
}

/* Device stacks: as a thread's (glibc's default), reserved and touched only as deep as a device goes. */
enum { DEVICE_STACK = 8u << 20 };

sim_status sim_machine_run(sim_machine *m, sim_device_fn fn, void *arg)
{
    m->fn = fn;
    m->arg = arg;
    m->failed = false;
    atomic_store(&m->xstop, false);
    m->fail_st = SIM_OK;
    m->fail_msg[0] = '\0';
    m->n_alive = m->nlocal;
    m->n_blocked = 0;
    for (int i = 0; i < m->n; i++) {
        sim_device *d = &m->dev[i];
        d->finished = false;
        d->waiting = false;
        d->st = SIM_OK;
        d->fib = NULL;
    }
    /* more devices than cores: fibers on a worker per core (a device waiting at a collective swaps
     * to the next device of its worker; 64 device threads on 2 cores slept and woke in the kernel
     * tens of thousands of times a step) */
    int workers = m->opts.workers > 0 ? m->opts.workers : m->cores;
    /* spread over ranks, devices are threads: a fiber waiting on another rank would hold its worker */
    m->fibers = workers < m->n && m->nranks == 1 ? sim_fibers_new(m->n, workers, DEVICE_STACK) : NULL;
    m->workers = m->n;
    if (m->fibers) {
        m->workers = workers;
        for (int i = 0; i < m->n; i++) m->dev[i].fib = sim_fibers_at(m->fibers, i);
        if (!sim_fibers_run(m->fibers, fiber_main, m->opts.pin_threads ? pin_worker : NULL, m)) {
            m->failed = true;
            m->fail_st = SIM_ERR_INTERNAL;
            snprintf(m->fail_msg, sizeof m->fail_msg, "could not start %d worker threads for %d devices", workers,
                     m->n);
        }
        sim_fibers_free(m->fibers);
        m->fibers = NULL;
        for (int i = 0; i < m->n; i++) m->dev[i].fib = NULL;
    } else {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, DEVICE_STACK);
        int started = 0;
        for (int j = 0; j < m->nlocal; j++) {
            int i = m->local[j];
            if (pthread_create(&m->dev[i].thread, &attr, device_main, &m->dev[i]) != 0) {
                pthread_mutex_lock(&m->lock);
                m->n_alive -= m->nlocal - j;
                fail_locked(m, SIM_ERR_INTERNAL, "could not start a device thread");
                pthread_mutex_unlock(&m->lock);
                break;
            }
            started++;
        }
        pthread_attr_destroy(&attr);
        for (int j = 0; j < started; j++) pthread_join(m->dev[m->local[j]].thread, NULL);
    }
    /* groups restart clean after a failed run */
    unsigned nmask = 1u << m->mesh.naxes;
    for (unsigned mask = 0; mask < nmask; mask++) {
        if (!m->by_mask[mask]) continue;
        int k = 1;
        for (int a = 0; a < m->mesh.naxes; a++)
            if (mask & (1u << a)) k *= m->mesh.sizes[a];
        for (int g = 0; g < m->n / k; g++)
            if (m->by_mask[mask][g]) {
                m->by_mask[mask][g]->arrived = 0;
                post_check_locked(m, m->by_mask[mask][g]);
            }
    }
    if (m->world) m->world->arrived = 0;
    if (m->failed) return sim_err(m->fail_st, "%s", m->fail_msg);
    if (m->nranks > 1) SIM_TRY(gather_devices(m));
    return SIM_OK;
}

/* --------------------------------------------------------------- trace */

void sim_trace_add(sim_device *d, const sim_span *s)
{
    if (!d->m->opts.trace) return;
    if (d->step_untraced) { /* a step the trace leaves out: only counted apart */
        d->spans_skipped++;
        return;
    }
    if (sim_trace_keeps(d)) {
        if (d->nspans == d->capspans) {
            d->capspans = d->capspans ? 2 * d->capspans : 256;
            d->spans = realloc(d->spans, d->capspans * sizeof *d->spans);
            SIM_ASSERT(d->spans);
        }
        d->spans[d->nspans] = *s;
    }
    __atomic_store_n(&d->nspans, d->nspans + 1, __ATOMIC_RELAXED); /* read by later devices' sim_trace_keeps */
}

int sim_span_begin(sim_device *d, const char *name)
{
    if (!d->m->opts.trace) return -1;
    sim_span s = {0};
    if (!sim_trace_keeps(d)) { /* counted only: no name to copy */
        sim_trace_add(d, &s);
        return -1;
    }
    s.t0 = sim_now_ns();
    s.lane = 0;
    s.rec = -1;
    sim_str_put(s.name, sizeof s.name, 0, name, SIZE_MAX);
    sim_trace_add(d, &s);
    return d->spans ? (int)d->nspans - 1 : -1;
}

int sim_span_begin_mb(sim_device *d, const char *name, int mb)
{
    int token = sim_span_begin(d, name);
    if (token >= 0) d->spans[token].lane = SIM_LANE_MB0 + (mb < 0 ? 0 : mb > 15 ? 15 : mb);
    return token;
}

void sim_span_end(sim_device *d, int token)
{
    if (token < 0 || (size_t)token >= d->nspans || !d->spans) return; /* no spans once dropped */
    sim_span *s = &d->spans[token];
    s->t1 = sim_now_ns();
    sim_arena_stats st;
    sim_arena_get_stats(d->arena, &st);
    s->live_bytes = st.live;
}

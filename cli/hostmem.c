/* hostmem.c — the host-memory check before a real run (see hostmem.h). */
#include "cli/hostmem.h"
#include "sim/xrank.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t cli_host_need_total(const cli_host_need *n)
{
    return n->device_peaks + n->reuse_cache + n->host_buffers + n->remat_values;
}

/* The first line of path as an unsigned count; false when missing or not
 * a number ("max": no cgroup limit). */
static int read_count(const char *path, uint64_t *v)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[64];
    int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    if (!ok) return 0;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(line, &end, 10);
    if (end == line || errno || (*end && *end != '\n')) return 0;
    *v = x;
    return 1;
}

/* MemAvailable of /proc/meminfo, in bytes. */
static int meminfo_available(uint64_t *v)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    int ok = 0;
    unsigned long long kb;
    while (!ok && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) ok = 1;
    fclose(f);
    if (ok) *v = (uint64_t)kb * 1024;
    return ok;
}

sim_status cli_host_memory_available(uint64_t *bytes, char *source, size_t cap, int *known)
{
    *known = 0;
    const char *env = getenv("SHARDSIM_HOST_MEMORY_BYTES");
    if (env && *env) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(env, &end, 10);
        if (*env < '0' || *env > '9' || *end || errno)
            return sim_err(SIM_ERR_INPUT,
                           "SHARDSIM_HOST_MEMORY_BYTES=%s: expected a decimal byte count (e.g. "
                           "8000000000), or unset it to measure the machine",
                           env);
        *bytes = v;
        snprintf(source, cap, "SHARDSIM_HOST_MEMORY_BYTES");
        *known = 1;
        return SIM_OK;
    }
    uint64_t avail;
    if (meminfo_available(&avail)) {
        *bytes = avail;
        snprintf(source, cap, "MemAvailable in /proc/meminfo");
        *known = 1;
    }
    /* a container's limit: cgroup v2, then v1; the room left is limit - usage */
    static const char *const lim[2] = {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
    static const char *const use[2] = {"/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"};
    for (int i = 0; i < 2; i++) {
        uint64_t l, u;
        if (!read_count(lim[i], &l) || !read_count(use[i], &u)) continue;
        uint64_t room = l > u ? l - u : 0;
        if (!*known || room < *bytes) {
            *bytes = room;
            snprintf(source, cap, "the cgroup limit %s less its usage", lim[i]);
            *known = 1;
        }
        break;
    }
    return SIM_OK;
}

/* "1.25 GiB" or "310.4 MiB" */
static const char *human(uint64_t b, char *buf, size_t cap)
{
    if (b >= (1ull << 30)) snprintf(buf, cap, "%.2f GiB", (double)b / (double)(1ull << 30));
    else snprintf(buf, cap, "%.1f MiB", (double)b / (double)(1ull << 20));
    return buf;
}

sim_status cli_host_memory_check(const cli_host_need *need, uint64_t avail, const char *source)
{
    uint64_t total = cli_host_need_total(need);
    if (total <= avail) return SIM_OK;
    char t[32], a[32], p[32], mx[32], rc[32], hb[32], rv[32], remat[160] = "";
    if (need->remat_values)
        snprintf(remat, sizeof remat,
                 ", %s of forward values remat keeps for its recomputation (remat_recompute=always computes "
                 "them again instead)",
                 human(need->remat_values, rv, sizeof rv));
    return sim_err(SIM_ERR_INPUT,
                   "this run needs about %s of host memory but %s is available (%s): %d device%s holding %s at "
                   "%s (largest %s, as a dry run accounts them), %s of released blocks the arenas keep for "
                   "reuse, %s of host buffers%s; make it smaller (fewer layers: base_num_decoder_layers with "
                   "override_model_config=true, a smaller per_device_batch_size or max_target_length, fewer "
                   "devices), free memory, or size it without computing with dry_run=true",
                   human(total, t, sizeof t), human(avail, a, sizeof a), source, need->devices,
                   need->devices == 1 ? "" : "s", human(need->device_peaks, p, sizeof p),
                   need->devices == 1 ? "its peak" : "their peaks", human(need->max_peak, mx, sizeof mx),
                   human(need->reuse_cache, rc, sizeof rc), human(need->host_buffers, hb, sizeof hb), remat);
}

/* Before a real run: one dry step of the same model, optimizer and data
 * (the accounting a dry run does: every device's arena peak) plus the host
 * buffers around it, against the memory available (cli/hostmem.h).  The
 * arena's reuse cache keeps at most 1/8 of a device's peak (and 1 GiB);
 * checkpoint I/O moves data through one bounce buffer of about 4 MiB per
 * device.  A dry step that runs out of simulated memory (hbm_limit_gb) is
 * the real run's OOM too, and is returned as such.  See hostmem.h. */
sim_status cli_host_memory_fits(model_def *def, const model_train_job *job, double hbm, bool ckpt_io,
                                uint64_t extra_host, FILE *err)
{
    uint64_t avail;
    char source[128];
    int known;
    SIM_TRY(cli_host_memory_available(&avail, source, sizeof source, &known));
    if (!known) return SIM_OK; /* no Linux /proc: nothing to compare with */
    model_def *dry = malloc(sizeof *dry);
    if (!dry) return sim_err(SIM_ERR_INTERNAL, "train: out of host memory");
    *dry = *def; /* a shallow copy: the dry step reads the same tables */
    dry->d.dry_run = true;
    /* the device peaks are those of two microbatches (the second adds to the gradient sinks the
     * first allocated; every later one repeats it): test_models_train checks 2, 3 and 5, so the
     * check costs two microbatches whatever gradient_accumulation_steps says */
    if (dry->d.ga > 2) dry->d.ga = 2;
    sim_machine *m = NULL;
    model_step_stats one;
    model_train_job j;
    memset(&j, 0, sizeof j);
    j.def = dry;
    j.data = job->data;
    j.opt = job->opt;
    j.steps = 1;
    j.stats = &one;
    sim_status st = model_machine_new(dry, hbm, false, &m);
    if (st == SIM_OK) st = model_train(&j, m);
    cli_host_need need = {0};
    if (st == SIM_OK) {
        /* under mpirun this rank's share: the devices it will run (the dry run ran them all) */
        int n = sim_machine_num_devices(m), R = sim_xrank_size() <= n ? sim_xrank_size() : 1, cnt = 0;
        int *ids = calloc((size_t)n, sizeof *ids);
        SIM_ASSERT(ids);
        st = sim_machine_rank_ids(m, R, R > 1 ? sim_xrank_rank() : 0, ids, &cnt);
        need.devices = cnt;
        for (int i = 0; i < cnt; i++) {
            sim_arena_stats as;
            sim_arena_get_stats(sim_device_arena(sim_machine_device(m, ids[i])), &as);
            need.device_peaks += as.peak;
            if (as.peak > need.max_peak) need.max_peak = as.peak;
            need.reuse_cache += as.peak / 8 < (1ull << 30) ? as.peak / 8 : (1ull << 30);
            if (def->d.remat_replay) need.remat_values += as.host_peak;
        }
        free(ids);
        uint64_t tokens = (uint64_t)(def->d.rows_loaded * def->d.ga * def->d.seq);
        need.host_buffers = 3 * tokens * sizeof(int32_t) * (def->d.ga > 1 ? 2 : 1) +
                            (ckpt_io ? (uint64_t)need.devices * (4u << 20) : 0) + extra_host;
    }
    sim_machine_free(m);
    free(dry);
    SIM_TRY(st);
    if (cli_host_need_total(&need) <= avail) return SIM_OK;
    if (need.remat_values && def->d.remat_recompute == MODEL_RECOMPUTE_AUTO &&
        cli_host_need_total(&need) - need.remat_values <= avail) {
        /* the same run without the values: slower, the same bits */
        char rv[32], a[32];
        def->d.remat_replay = false;
        fprintf(err,
                "shardsim: remat_recompute=auto: the %s of forward values remat would keep for its recomputation "
                "do not fit in host memory (%s available, %s): the layers are computed again (the same results, "
                "more time)\n",
                human(need.remat_values, rv, sizeof rv), human(avail, a, sizeof a), source);
        return SIM_OK;
    }
    return cli_host_memory_check(&need, avail, source);
}

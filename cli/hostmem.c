/* hostmem.c — the host-memory check before a real run (see hostmem.h). */
#include "cli/hostmem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t cli_host_need_total(const cli_host_need *n) { return n->device_peaks + n->reuse_cache + n->host_buffers; }

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
            return sim_err(SIM_ERR_INPUT, "SHARDSIM_HOST_MEMORY_BYTES=%s: expected a decimal byte count (e.g. "
                                          "8000000000), or unset it to measure the machine", env);
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
    char t[32], a[32], p[32], mx[32], rc[32], hb[32];
    return sim_err(SIM_ERR_INPUT,
                   "this run needs about %s of host memory but %s is available (%s): %d device%s holding %s at "
                   "%s (largest %s, as a dry run accounts them), %s of released blocks the arenas keep for "
                   "reuse, %s of host buffers; make it smaller (fewer layers: base_num_decoder_layers with "
                   "override_model_config=true, a smaller per_device_batch_size or max_target_length, fewer "
                   "devices), free memory, or size it without computing with dry_run=true",
                   human(total, t, sizeof t), human(avail, a, sizeof a), source, need->devices,
                   need->devices == 1 ? "" : "s", human(need->device_peaks, p, sizeof p), need->devices == 1 ? "its peak" : "their peaks",
                   human(need->max_peak, mx, sizeof mx), human(need->reuse_cache, rc, sizeof rc),
                   human(need->host_buffers, hb, sizeof hb));
}

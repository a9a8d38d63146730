/* arena.c — per-device allocator with accounting.
 *
 * Each real block carries a 64-byte header (size, category, links) so that
 * the arena can check releases and free whatever is left when it is torn
 * down.  Blocks are linked in a doubly linked list; no search is ever needed
 * because the header sits right before the pointer handed out.
 *
 * Released blocks of 16 KiB and more are kept in a small cache and handed
 * out again to a request of exactly the same size (the sizes repeat layer
 * after layer): a very large block would come from a fresh mmap in glibc
 * (page faults and kernel zero-filling again, every layer of every step), a
 * mid-sized one from glibc's bins, whose searches, splits and merges were
 * ~3% of a step's CPU with 64 devices of tens to hundreds of KiB each.  The
 * cache is searched by size bucket (cache_bucket), holds at most 1/8 of the
 * arena's peak (and 1 GiB), oldest evicted first.  It is invisible to the
 * accounting: simulated bytes are counted at alloc and release as before.
 *
 * Accounting and storage are separate steps (admit + account_add, take_block;
 * account_sub, the block's release): a dry run does the accounting only, and
 * so does a charge (sim_arena_charge), for bytes the device holds in storage
 * that is not the arena's (a group's shared all-gather buffer). */
#include "sim/arena.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { HDR = 64, ALIGN = 64 };
#define CACHE_MIN ((size_t)16 << 10) /* blocks at least this large are reused */
enum { CACHE_BUCKETS = 64 };           /* size buckets of the cache (cache_bucket takes 6 bits) */
#define CACHE_MAX ((size_t)1 << 30) /* and never more than this many bytes kept */
/* blocks this large are always fresh mmaps in glibc (sim/machine.c raises its threshold to 32 MiB,
 * the most it allows): evicted last, since a smaller one comes back from the heap without faults */
#define MMAP_MIN ((size_t)32 << 20)
#define ARENA_MAGIC 0x5348415244415245ull  /* "SHARDARE": a live block */
#define CACHED_MAGIC 0x534841524443414eull /* a released block kept for reuse */
#define HOST_MAGIC 0x5348415244484f53ull   /* "SHARDHOS": a host block, no arena's (sim_arena_block_new) */

typedef struct block {
    uint64_t magic;
    size_t bytes;
    int cat;
    struct block *prev, *next;   /* the live list, or the cache (newest first) */
    struct block *sprev, *snext; /* a cached block: its size bucket's list (newest first) */
} block;
_Static_assert(sizeof(block) <= HDR, "block header must fit in HDR bytes");

struct sim_arena {
    char label[128];
    bool dry;
    sim_arena_stats st;
    block head;    /* sentinel of the live list */
    block cache;   /* sentinel of the released large blocks, newest first */
    size_t cached; /* bytes in the cache */
    block bucket[CACHE_BUCKETS]; /* sentinels of the cached blocks by size (cache_bucket) */
};

/* The cache is searched by exact size: a bucket holds the cached blocks of the sizes that hash to it. */
static block *cache_bucket(sim_arena *a, size_t bytes)
{
    return &a->bucket[(bytes / ALIGN * 0x9E3779B97F4A7C15ull) >> 58]; /* the top 6 bits: 64 buckets */
}

sim_arena *sim_arena_new(const char *label, size_t capacity, bool dry_run)
{
    sim_arena *a = calloc(1, sizeof *a);
    SIM_ASSERT(a);
    snprintf(a->label, sizeof a->label, "%s", label ? label : "device");
    a->dry = dry_run;
    a->st.capacity = capacity;
    a->head.prev = a->head.next = &a->head;
    a->cache.prev = a->cache.next = &a->cache;
    for (int i = 0; i < CACHE_BUCKETS; i++) a->bucket[i].sprev = a->bucket[i].snext = &a->bucket[i];
    return a;
}

static void unlink_block(block *b)
{
    b->prev->next = b->next;
    b->next->prev = b->prev;
}

static void push_front(block *list, block *b)
{
    b->next = list->next;
    b->prev = list;
    list->next->prev = b;
    list->next = b;
}

/* A cached block into (push) or out of (unlink) the cache: its list and its size's bucket. */
static void cache_push(sim_arena *a, block *b)
{
    push_front(&a->cache, b);
    block *s = cache_bucket(a, b->bytes);
    b->snext = s->snext;
    b->sprev = s;
    s->snext->sprev = b;
    s->snext = b;
    a->cached += b->bytes;
}

static void cache_unlink(sim_arena *a, block *b)
{
    unlink_block(b);
    b->sprev->snext = b->snext;
    b->snext->sprev = b->sprev;
    a->cached -= b->bytes;
}

static void free_list(block *list)
{
    block *b = list->next;
    while (b != list) {
        block *n = b->next;
        free(b);
        b = n;
    }
}

void sim_arena_free_all(sim_arena *a)
{
    if (!a) return;
    free_list(&a->head);
    free_list(&a->cache);
    free(a);
}

const char *sim_fmt_bytes(double bytes, char *buf, size_t cap)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) {
        bytes /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, cap, "%.0f B", bytes);
    else snprintf(buf, cap, "%.2f %s", bytes, unit[u]);
    return buf;
}

static sim_status arena_oom(const sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name)
{
    char b1[32], b2[32], b3[32];
    sim_err(SIM_ERR_OOM,
            "%s is out of memory: '%s' asks for %s (%s) with %s of %s in use; in use by category:", a->label,
            name ? name : "?", sim_fmt_bytes((double)bytes, b1, sizeof b1), sim_mem_cat_name(cat),
            sim_fmt_bytes((double)a->st.live, b2, sizeof b2), sim_fmt_bytes((double)a->st.capacity, b3, sizeof b3));
    for (int c = 0; c < SIM_NMEM; c++)
        sim_err_append(" %s %s%s", sim_mem_cat_name((sim_mem_cat)c),
                       sim_fmt_bytes((double)a->st.live_by[c], b1, sizeof b1), c + 1 < SIM_NMEM ? "," : "");
    sim_err_append(". Raise hbm_limit_gb, shard the tensor over more devices, or use remat.");
    return SIM_ERR_OOM;
}

static void account_add(sim_arena *a, size_t bytes, sim_mem_cat cat)
{
    sim_arena_stats *s = &a->st;
    s->live += bytes;
    s->live_by[cat] += bytes;
    s->n_allocs++;
    if (s->live_by[cat] > s->peak_by[cat]) s->peak_by[cat] = s->live_by[cat];
    if (s->live > s->peak) {
        s->peak = s->live;
        memcpy(s->at_peak_by, s->live_by, sizeof s->at_peak_by);
    }
}

sim_status sim_arena_alloc(sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name, bool zero, void **out)
{
    return sim_arena_alloc_counted(a, bytes, bytes, cat, name, zero, out);
}

/* The capacity check of an allocation of `counted` bytes (a simulated OOM). */
static sim_status admit(const sim_arena *a, size_t counted, sim_mem_cat cat, const char *name)
{
    SIM_ASSERT(cat >= 0 && cat < SIM_NMEM);
    if (a->st.capacity && counted > a->st.capacity - (a->st.live < a->st.capacity ? a->st.live : a->st.capacity))
        return arena_oom(a, counted, cat, name);
    return SIM_OK;
}

/* Host storage for a block of `bytes` (none in dry run: *out stays NULL); no accounting. */
static sim_status take_block(sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name, bool zero, void **out)
{
    *out = NULL;
    if (a->dry) return SIM_OK;
    block *b = NULL;
    if (bytes >= CACHE_MIN) { /* a released block of the same size: no fresh pages to fault in */
        block *s = cache_bucket(a, bytes);
        for (block *c = s->snext; c != s && !b; c = c->snext)
            if (c->bytes == bytes) b = c;
    }
    if (b) {
        cache_unlink(a, b);
        b->magic = ARENA_MAGIC;
        b->cat = cat;
        push_front(&a->head, b);
        *out = (char *)b + HDR;
        if (zero) memset(*out, 0, bytes);
        return SIM_OK;
    }
    size_t total = HDR + ((bytes + ALIGN - 1) / ALIGN) * ALIGN;
    b = aligned_alloc(ALIGN, total);
    if (!b) {
        char buf[32];
        return sim_err(SIM_ERR_INTERNAL, "%s: the host could not allocate %s for '%s'", a->label,
                       sim_fmt_bytes((double)bytes, buf, sizeof buf), name ? name : "?");
    }
    b->magic = ARENA_MAGIC;
    b->bytes = bytes;
    b->cat = cat;
    push_front(&a->head, b);
    *out = (char *)b + HDR;
    if (zero && bytes) memset(*out, 0, bytes);
    return SIM_OK;
}

sim_status sim_arena_alloc_counted(sim_arena *a, size_t bytes, size_t counted, sim_mem_cat cat, const char *name,
                                   bool zero, void **out)
{
    SIM_ASSERT(a && out);
    *out = NULL;
    SIM_TRY(admit(a, counted, cat, name));
    SIM_TRY(take_block(a, bytes, cat, name, zero, out));
    account_add(a, counted, cat);
    return SIM_OK;
}

sim_status sim_arena_charge(sim_arena *a, size_t counted, sim_mem_cat cat, const char *name)
{
    SIM_ASSERT(a);
    SIM_TRY(admit(a, counted, cat, name));
    account_add(a, counted, cat);
    return SIM_OK;
}

sim_status sim_arena_back(sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name, void **out)
{
    SIM_ASSERT(a && out);
    return take_block(a, bytes, cat, name, false, out);
}

void sim_arena_release(sim_arena *a, void *p, size_t bytes, sim_mem_cat cat)
{
    sim_arena_release_counted(a, p, bytes, bytes, cat);
}

static void account_sub(sim_arena *a, size_t counted, sim_mem_cat cat)
{
    SIM_ASSERT(a->st.live >= counted && a->st.live_by[cat] >= counted);
    a->st.live -= counted;
    a->st.live_by[cat] -= counted;
}

/* The storage of block b (unlinked from the live list) goes to the cache or back to the host. */
static void drop_storage(sim_arena *a, block *b, size_t bytes)
{
    size_t cap = a->st.peak / 8 < CACHE_MAX ? a->st.peak / 8 : CACHE_MAX;
    if (bytes >= CACHE_MIN && bytes <= cap) {
        b->magic = CACHED_MAGIC; /* a second release of it fails sim_arena_release_counted's check */
        cache_push(a, b);
        while (a->cached > cap) { /* evict the oldest, sparing blocks glibc would mmap afresh */
            block *old = a->cache.prev;
            for (block *c = old; c != &a->cache && old->bytes >= MMAP_MIN; c = c->prev)
                if (c->bytes < MMAP_MIN) old = c;
            cache_unlink(a, old);
            old->magic = 0;
            free(old);
        }
    } else {
        b->magic = 0;
        free(b);
    }
}

void sim_arena_release_counted(sim_arena *a, void *p, size_t bytes, size_t counted, sim_mem_cat cat)
{
    SIM_ASSERT(a && cat >= 0 && cat < SIM_NMEM);
    if (!a->dry) {
        SIM_ASSERT(p != NULL);
        block *b = (block *)((char *)p - HDR);
        SIM_ASSERT(b->magic == ARENA_MAGIC && b->bytes == bytes && b->cat == (int)cat);
        unlink_block(b);
        drop_storage(a, b, bytes);
    }
    account_sub(a, counted, cat);
}

void *sim_arena_block_new(size_t bytes)
{
    block *b = aligned_alloc(ALIGN, HDR + ((bytes + ALIGN - 1) / ALIGN) * ALIGN);
    if (!b) return NULL;
    memset(b, 0, sizeof *b);
    b->magic = HOST_MAGIC;
    b->bytes = bytes;
    return (char *)b + HDR;
}

void sim_arena_block_free(void *p)
{
    if (!p) return;
    block *b = (block *)((char *)p - HDR);
    SIM_ASSERT(b->magic == HOST_MAGIC);
    b->magic = 0;
    free(b);
}

void sim_arena_swap(sim_arena *a, void **p, void *host, size_t bytes)
{
    SIM_ASSERT(a && !a->dry && p && *p && host);
    block *old = (block *)((char *)*p - HDR), *b = (block *)((char *)host - HDR);
    SIM_ASSERT(old->magic == ARENA_MAGIC && old->bytes == bytes && b->magic == HOST_MAGIC && b->bytes == bytes);
    b->magic = ARENA_MAGIC;
    b->cat = old->cat;
    b->prev = old->prev; /* b takes old's place in the live list */
    b->next = old->next;
    b->prev->next = b;
    b->next->prev = b;
    drop_storage(a, old, bytes);
    *p = host;
}

void sim_arena_discharge(sim_arena *a, size_t counted, sim_mem_cat cat)
{
    SIM_ASSERT(a && cat >= 0 && cat < SIM_NMEM);
    account_sub(a, counted, cat);
}

void sim_arena_recount(sim_arena *a, size_t from, size_t to, sim_mem_cat cat)
{
    SIM_ASSERT(cat >= 0 && cat < SIM_NMEM);
    account_sub(a, from, cat);
    account_add(a, to, cat);
    a->st.n_allocs--; /* the same block */
}

void sim_arena_get_stats(const sim_arena *a, sim_arena_stats *out) { *out = a->st; }

void sim_arena_set_stats(sim_arena *a, const sim_arena_stats *st) { a->st = *st; }

void sim_arena_host(sim_arena *a, ptrdiff_t delta)
{
    SIM_ASSERT(delta >= 0 || (size_t)-delta <= a->st.host_live);
    a->st.host_live = (size_t)((ptrdiff_t)a->st.host_live + delta);
    if (a->st.host_live > a->st.host_peak) a->st.host_peak = a->st.host_live;
}

void sim_arena_reset_peak(sim_arena *a)
{
    a->st.host_peak = a->st.host_live;
    a->st.peak = a->st.live;
    memcpy(a->st.peak_by, a->st.live_by, sizeof a->st.peak_by);
    memcpy(a->st.at_peak_by, a->st.live_by, sizeof a->st.at_peak_by);
}

bool sim_arena_dry(const sim_arena *a) { return a->dry; }

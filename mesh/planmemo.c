/* planmemo.c — see planmemo.h. */
#include "mesh/planmemo.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- decisions shared by the devices ----------------------------------------
 * Open addressing over a fixed table of pointers to immutable entries: a
 * writer fills an entry, then publishes it with a compare-and-swap into an
 * empty slot (release); a reader loads the slot (acquire) and compares the
 * whole key.  Entries are never removed, so a pointer once read stays valid. */

enum { MM_SLOTS = 8192, MM_PROBES = 32, MM_MESHES = 64 };

typedef struct {
    uint64_t hash;
    int key_len, val_len;
    unsigned char bytes[]; /* the key, then the value */
} mm_entry;

static mm_entry *mm_slots[MM_SLOTS];
static bool mm_off; /* mesh_memo_set_enabled(false) */

void mesh_memo_set_enabled(bool on) { __atomic_store_n(&mm_off, !on, __ATOMIC_RELAXED); }

static pthread_mutex_t mm_mesh_lock = PTHREAD_MUTEX_INITIALIZER;
static mesh_shape mm_meshes[MM_MESHES]; /* seen so far; index = id */
static int mm_nmeshes;
static _Thread_local const mesh_shape *mm_last_at; /* this thread's last answer, checked by content */
static _Thread_local mesh_shape mm_last;
static _Thread_local int mm_last_id = -1;

int mesh_memo_mesh_id(const mesh_shape *m)
{
    if (mm_last_id >= 0 && mm_last_at == m && !memcmp(&mm_last, m, sizeof *m)) return mm_last_id;
    int id = -1;
    pthread_mutex_lock(&mm_mesh_lock);
    for (int i = 0; i < mm_nmeshes && id < 0; i++)
        if (!memcmp(&mm_meshes[i], m, sizeof *m)) id = i;
    if (id < 0 && mm_nmeshes < MM_MESHES) {
        id = mm_nmeshes++;
        mm_meshes[id] = *m;
    }
    pthread_mutex_unlock(&mm_mesh_lock);
    if (id >= 0) {
        mm_last_at = m;
        mm_last = *m;
        mm_last_id = id;
    }
    return id;
}

/* 64-bit hash, 8 bytes a step (keys are a few hundred bytes, looked up on every einsum) */
static uint64_t mm_hash(const unsigned char *k, int n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, k + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, k + i, (size_t)(n - i));
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 29);
}

static bool mm_same(const mm_entry *e, uint64_t h, const unsigned char *key, int key_len)
{
    return e->hash == h && e->key_len == key_len && !memcmp(e->bytes, key, (size_t)key_len);
}

const void *mesh_memo_find(const void *key, int key_len, int *val_len)
{
    if (__atomic_load_n(&mm_off, __ATOMIC_RELAXED)) return NULL;
    uint64_t h = mm_hash(key, key_len);
    for (int i = 0; i < MM_PROBES; i++) {
        mm_entry *e = __atomic_load_n(&mm_slots[(h + (uint64_t)i) % MM_SLOTS], __ATOMIC_ACQUIRE);
        if (!e) return NULL;
        if (mm_same(e, h, key, key_len)) {
            *val_len = e->val_len;
            return e->bytes + key_len;
        }
    }
    return NULL;
}

bool mesh_memo_get(const void *key, int key_len, void *val, int val_len)
{
    int len;
    const void *v = mesh_memo_find(key, key_len, &len);
    if (!v) return false;
    SIM_ASSERT(len == val_len);
    memcpy(val, v, (size_t)val_len);
    return true;
}

int mesh_memo_key_bytes(unsigned char *k, int n, int cap, const void *v, int len)
{
    if (n < 0 || len < 0 || n + len > cap) return -1;
    memcpy(k + n, v, (size_t)len);
    return n + len;
}

int mesh_memo_key_spec(unsigned char *k, int n, int cap, const mesh_spec *s)
{
    if (s->rank < 0 || s->rank > MESH_SPEC_MAX_RANK) return -1;
    unsigned char b[1 + MESH_SPEC_MAX_RANK * (1 + MESH_MAX_AXES) + 4];
    int m = 0;
    b[m++] = (unsigned char)s->rank;
    for (int d = 0; d < s->rank; d++) {
        if (s->n_axes[d] < 0 || s->n_axes[d] > MESH_MAX_AXES) return -1;
        b[m++] = (unsigned char)s->n_axes[d];
        for (int i = 0; i < s->n_axes[d]; i++) b[m++] = (unsigned char)s->axes[d][i];
    }
    memcpy(b + m, &s->partial, 4);
    return mesh_memo_key_bytes(k, n, cap, b, m + 4);
}

void mesh_memo_put(const void *key, int key_len, const void *val, int val_len)
{
    if (__atomic_load_n(&mm_off, __ATOMIC_RELAXED)) return;
    uint64_t h = mm_hash(key, key_len);
    mm_entry *mine = NULL;
    for (int i = 0; i < MM_PROBES; i++) {
        mm_entry **slot = &mm_slots[(h + (uint64_t)i) % MM_SLOTS];
        mm_entry *e = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (!e) {
            if (!mine) {
                mine = malloc(sizeof *mine + (size_t)key_len + (size_t)val_len);
                SIM_ASSERT(mine);
                mine->hash = h;
                mine->key_len = key_len;
                mine->val_len = val_len;
                memcpy(mine->bytes, key, (size_t)key_len);
                memcpy(mine->bytes + key_len, val, (size_t)val_len);
            }
            if (__atomic_compare_exchange_n(slot, &e, mine, false, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) return;
            /* another thread took the slot first: e is its entry */
        }
        if (mm_same(e, h, key, key_len)) break; /* already there */
    }
    free(mine); /* a full neighbourhood or a key already stored */
}

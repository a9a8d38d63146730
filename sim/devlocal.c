/* devlocal.c — see devlocal.h.  The registry only grows; readers load its count with acquire
 * ordering, so a save or restore on a fiber's swap takes no lock. */
#include "sim/devlocal.h"

#include <pthread.h>
#include <stdbool.h>

#include "sim/status.h"

static struct {
    void *(*get)(void);
    void (*set)(void *);
} locals[SIM_DEVICE_LOCALS_MAX];
static int nlocals;
static pthread_mutex_t locals_lock = PTHREAD_MUTEX_INITIALIZER;

void sim_device_local_register(void *(*get)(void), void (*set)(void *))
{
    pthread_mutex_lock(&locals_lock);
    bool seen = false;
    for (int i = 0; i < nlocals; i++) seen |= locals[i].get == get;
    if (!seen) {
        SIM_ASSERT(nlocals < SIM_DEVICE_LOCALS_MAX);
        locals[nlocals].get = get;
        locals[nlocals].set = set;
        __atomic_store_n(&nlocals, nlocals + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&locals_lock);
}

void sim_device_locals_save(void **slots)
{
    int n = __atomic_load_n(&nlocals, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++) slots[i] = locals[i].get();
}

void sim_device_locals_restore(void *const *slots)
{
    int n = __atomic_load_n(&nlocals, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; i++) locals[i].set(slots[i]);
}

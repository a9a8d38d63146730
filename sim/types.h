/* types.h — plain data shared by the sim/ modules: dtypes, mesh axes lists,
 * phases, memory categories, and the monotonic clock. */
#ifndef SIM_TYPES_H
#define SIM_TYPES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { SIM_MAX_AXES = 16, SIM_MAX_DEVICES = 512, SIM_TAG_MAX = 96, SIM_AXIS_NAME_MAX = 32 };

typedef enum { SIM_F32 = 0, SIM_I32, SIM_BF16, SIM_U8, SIM_NDTYPE } sim_dtype;

/* Appends at most `max` bytes of s to dst (whose length is `at`, capacity
 * cap), truncating at cap - 1, and returns the new length: snprintf's "%s"
 * and "%.80s" without the format parsing, for names built on every op of
 * every device (SIZE_MAX: no limit but cap). */
static inline size_t sim_str_put(char *dst, size_t cap, size_t at, const char *s, size_t max)
{
    if (!cap) return 0;
    if (at >= cap) at = cap - 1;
    size_t room = cap - 1 - at; /* strnlen and memcpy: libc's vector loops (a byte loop was 6% of a dry run) */
    size_t n = strnlen(s, max < room ? max : room);
    memcpy(dst + at, s, n);
    dst[at + n] = '\0';
    return at + n;
}

/* Bytes per element of a dtype. */
size_t sim_dtype_size(sim_dtype dt);
const char *sim_dtype_name(sim_dtype dt);

/* An ordered list of mesh axis indices.  For a collective the group is the
 * set of devices that agree on every other axis; a device's rank in the group
 * is the mixed-radix number of its coordinates on these axes, first axis most
 * significant (so ('data','fsdp') and ('fsdp','data') order ranks differently). */
typedef struct {
    int n;                     /* number of axes, 0..SIM_MAX_AXES */
    int8_t axis[SIM_MAX_AXES]; /* mesh axis indices, in significance order */
} sim_axes;

static inline sim_axes sim_axes_none(void)
{
    sim_axes a = {0, {0}};
    return a;
}
static inline sim_axes sim_axes_1(int a0)
{
    sim_axes a = {1, {(int8_t)a0}};
    return a;
}
static inline sim_axes sim_axes_2(int a0, int a1)
{
    sim_axes a = {2, {(int8_t)a0, (int8_t)a1}};
    return a;
}
static inline sim_axes sim_axes_3(int a0, int a1, int a2)
{
    sim_axes a = {3, {(int8_t)a0, (int8_t)a1, (int8_t)a2}};
    return a;
}

/* What part of a training step a collective belongs to (set per device). */
typedef enum { SIM_PHASE_FORWARD = 0, SIM_PHASE_BACKWARD, SIM_PHASE_OPTIMIZER, SIM_PHASE_OTHER, SIM_NPHASE } sim_phase;
const char *sim_phase_name(sim_phase p);

/* Arena memory categories. */
typedef enum {
    SIM_MEM_PARAMS = 0,  /* model parameters */
    SIM_MEM_GRADS,       /* parameter gradients */
    SIM_MEM_OPTIMIZER,   /* optimizer state (Adam moments) */
    SIM_MEM_WCOPY,       /* weight copies: the layer stacks' weights cast to `dtype` once before the
                             layer loops and held through the backward (XLA:TPU's hoisted converts) */
    SIM_MEM_ACTIVATIONS, /* activations saved for backward */
    SIM_MEM_TEMP,        /* temporaries freed within an op */
    SIM_MEM_COMM,        /* communication buffers */
    SIM_NMEM
} sim_mem_cat;
const char *sim_mem_cat_name(sim_mem_cat c);

/* Nanoseconds on the monotonic clock. */
uint64_t sim_now_ns(void);

#endif

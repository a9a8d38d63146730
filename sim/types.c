/* types.c — names and sizes for the plain sim/ types. */
#include "sim/types.h"
#include "sim/status.h"

#include <time.h>

size_t sim_dtype_size(sim_dtype dt)
{
    switch (dt) {
    case SIM_F32: return 4;
    case SIM_I32: return 4;
    case SIM_BF16: return 2;
    case SIM_U8: return 1;
    default: SIM_ASSERT(!"bad dtype");
    }
}

const char *sim_dtype_name(sim_dtype dt)
{
    static const char *names[] = {"float32", "int32", "bfloat16", "uint8"};
    SIM_ASSERT(dt >= 0 && dt < SIM_NDTYPE);
    return names[dt];
}

const char *sim_phase_name(sim_phase p)
{
    static const char *names[] = {"forward", "backward", "optimizer", "other"};
    SIM_ASSERT(p >= 0 && p < SIM_NPHASE);
    return names[p];
}

const char *sim_mem_cat_name(sim_mem_cat c)
{
    static const char *names[] = {"params", "grads", "optimizer", "weight copy", "activations", "temporaries", "comm"};
    SIM_ASSERT(c >= 0 && c < SIM_NMEM);
    return names[c];
}

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

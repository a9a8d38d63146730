/* bench_run.h — benchmark support: train a configuration given as config
 * words for a few steps and keep what the tables print (the highest arena
 * peak with its breakdown, the fastest step after the first, the bytes each
 * device sends in the last step by collective and mesh axes). */
#ifndef BENCH_LIB_BENCH_RUN_H
#define BENCH_LIB_BENCH_RUN_H

#include <stdbool.h>
#include <stddef.h>

#include "sim/collectives.h"
#include "sim/machine.h"

enum { BENCH_MAX_TRAFFIC = 64 };

/* Bytes sent per device (mean over devices) in the last step, one op and axes. */
typedef struct {
    sim_op op;
    char axes[64];
    double bytes;
} bench_traffic;

typedef struct {
    bool refused; /* the configuration was refused: why holds the message */
    char why[1024];
    size_t peak;              /* highest arena peak over devices */
    size_t at_peak[SIM_NMEM]; /* that device's bytes by category at its peak */
    double step_s;            /* fastest step after the first (or the only one) */
    int nrows;
    bench_traffic rows[BENCH_MAX_TRAFFIC];
} bench_result;

/* Trains configs/base.yml with words[0..n) for `steps` steps into *res.  A
 * refusal of the configuration (SIM_ERR_INPUT or SIM_ERR_SHARDING, at any
 * stage) is a result; any other failure exits 1 naming `who`. */
void bench_run(const char *who, const char *const *words, int n, int steps, bench_result *res);

/* The row of `op` over `axes`, or NULL. */
const bench_traffic *bench_find_traffic(const bench_result *r, sim_op op, const char *axes);

#endif

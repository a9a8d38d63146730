/* xla_truth.h — XLA:TPU's own figures for MaxText 0.2.5's train step, as the
 * project stores them (tests/data/xla/, one JSON file a set: each configuration's
 * MaxText keys, the topology it was compiled for ahead of time, the exact command,
 * memory_analysis() and the bytes each device sends per collective kind in
 * the optimised HLO), and a shardsim dry run of the same keys beside them.
 *
 * Targets (what the comparison checks): the peak per device within
 * XT_PEAK_TOL of XLA's arguments + outputs - aliases + temporaries, and every
 * collective kind that carries at least XT_KIND_MIN_SHARE of XLA's bytes (or
 * of shardsim's) within XT_KIND_TOL.  A ragged all-to-all is not compared: XLA's figure is
 * the worst-case output buffer, shardsim's the bytes its router sent. */
#ifndef BENCH_LIB_XLA_TRUTH_H
#define BENCH_LIB_XLA_TRUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "sim/collectives.h"
#include "sim/types.h"

#define XT_PEAK_TOL 0.03
#define XT_KIND_TOL 0.05
#define XT_KIND_MIN_SHARE 0.01

enum { XT_MAX_KEYS = 24, XT_NKINDS = SIM_OP_RAGGED_ALL_TO_ALL + 1 };

typedef struct {
    char name[96];
    char topology[32]; /* compile_topology */
    int num_devices, num_slices;
    int nkeys;
    char *keys[XT_MAX_KEYS]; /* MaxText key=value words */
    bool compiled;           /* false: XLA (or MaxText) refused it; `error` says why */
    char error[256];
    double peak, arguments, temporaries; /* bytes per device */
    double kind_bytes[XT_NKINDS];        /* bytes sent per device, by shardsim's collective kinds */
    char miss[512];                      /* "" when shardsim is expected within the targets; else why it is
                                       not yet (the file's known_miss: a transformation not modelled) */
} xt_config;

typedef struct {
    int n;
    xt_config *c;
    char versions[256]; /* libtpu, jax, maxtext versions of the compiles */
} xt_set;

/* Loads one ground-truth file; on failure returns false with a message in err. */
bool xt_load(const char *path, xt_set *out, char *err, size_t cap);
void xt_free(xt_set *s);

typedef struct {
    bool refused; /* shardsim refused the keys: why */
    char why[1024];
    double peak;                  /* highest peak per device */
    size_t at_peak[SIM_NMEM];     /* its composition */
    double kind_bytes[XT_NKINDS]; /* bytes sent per device (mean over devices) in the step */
    double peak_ratio;            /* shardsim / XLA */
    bool peak_ok;
    bool kind_checked[XT_NKINDS]; /* carries >= XT_KIND_MIN_SHARE of either's bytes (not ragged) */
    double kind_ratio[XT_NKINDS];
    bool kind_ok[XT_NKINDS];
    bool all_ok;
} xt_result;

/* A dry run (one step) of c's keys on its topology, compared with c. */
void xt_compare(const xt_config *c, xt_result *r);
/* XLA's share of kind k in c's bytes. */
double xt_share(const xt_config *c, int k);

#endif

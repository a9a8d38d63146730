/* hostmem.h — will a real run fit in this machine's memory?  Every
 * simulated device's arena is real host memory in a real run, so before one
 * starts, train sizes it with the accounting a dry run does (one dry step:
 * each device's peak) plus the host buffers around the devices, and
 * compares that with the memory the process may still take (MemAvailable,
 * or the cgroup's room when that is smaller).  A run that cannot fit is
 * refused with the figures instead of meeting the kernel's OOM killer. */
#ifndef CLI_HOSTMEM_H
#define CLI_HOSTMEM_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "models/core/train.h"
#include "sim/status.h"

/* What a real run needs, in bytes. */
typedef struct {
    int devices;
    uint64_t device_peaks; /* sum over devices of the dry step's arena peak */
    uint64_t max_peak;     /* the largest of them */
    uint64_t reuse_cache;  /* released large blocks the arenas keep for reuse: up to 1/8 of each peak (1 GiB) */
    uint64_t host_buffers; /* the step's token arrays, checkpoint bounce buffers */
    uint64_t remat_values; /* the forward values remat keeps for its recomputation (remat_recompute,
                              mesh/replay.h): sum over devices of the dry step's host peak */
} cli_host_need;

uint64_t cli_host_need_total(const cli_host_need *n);

/* Memory the process may still take, in bytes, and where the figure came
 * from ("MemAvailable in /proc/meminfo", "the cgroup limit ...").  The
 * environment variable SHARDSIM_HOST_MEMORY_BYTES (a decimal byte count)
 * replaces the measurement (tests; a machine whose /proc is not Linux's).
 * *known = false when nothing could be read: the check is skipped. */
sim_status cli_host_memory_available(uint64_t *bytes, char *source, size_t cap, int *known);

/* SIM_OK when need fits in avail; else an error (exit 2) with the figures
 * and what to change. */
sim_status cli_host_memory_check(const cli_host_need *need, uint64_t avail, const char *source);

/* The whole check before a real run of def: one dry step of the same model,
 * optimizer and data (job's opt and data; the rest of job is not used) on a
 * dry machine of capacity hbm_limit_gb = hbm gives every device's peak; the
 * host buffers are the step's token arrays, a checkpoint bounce buffer per
 * device when ckpt_io (about 4 MiB each), and extra_host bytes the caller
 * keeps (parity's gradient copies); with def->d.remat_replay, the remat
 * values the dry step kept.  Where only those do not fit and
 * remat_recompute=auto, def->d.remat_replay is turned off (the layers are
 * recomputed, the same results) and one line on err says so.  SIM_OK when
 * it fits or when the machine's figure is unknown; the dry step's OOM as the
 * real run's. */
sim_status cli_host_memory_fits(model_def *def, const model_train_job *job, double hbm, bool ckpt_io,
                                uint64_t extra_host, FILE *err);

#endif

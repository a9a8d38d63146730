/* topology.h — the host's cores as hwloc sees them, and best-effort pinning
 * of device threads.  The topology is loaded once per process. */
#ifndef SIM_TOPOLOGY_H
#define SIM_TOPOLOGY_H

#include "sim/status.h"

/* Physical cores (processing units when hwloc reports no cores); >= 1. */
int sim_topology_cores(void);
/* Binds the calling thread to core `index % cores`.  Fails (with a message)
 * where the OS refuses binding; callers treat that as a warning. */
sim_status sim_topology_pin_self(int index);
/* OpenBLAS threads each device should use: max(1, cores / devices). */
int sim_topology_blas_threads(int devices);

#endif

/* topology.c — hwloc discovery and thread binding. */
#include "sim/topology.h"

#include <hwloc.h>
#include <pthread.h>

static hwloc_topology_t g_topo;
static int g_cores = 1;
static int g_loaded;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void topo_load(void)
{
    if (hwloc_topology_init(&g_topo) != 0) return;
    if (hwloc_topology_load(g_topo) != 0) {
        hwloc_topology_destroy(g_topo);
        return;
    }
    g_loaded = 1;
    int n = hwloc_get_nbobjs_by_type(g_topo, HWLOC_OBJ_CORE);
    if (n <= 0) n = hwloc_get_nbobjs_by_type(g_topo, HWLOC_OBJ_PU);
    g_cores = n > 0 ? n : 1;
}

int sim_topology_cores(void)
{
    pthread_once(&g_once, topo_load);
    return g_cores;
}

int sim_topology_blas_threads(int devices)
{
    int c = sim_topology_cores();
    int t = devices > 0 ? c / devices : c;
    return t < 1 ? 1 : t;
}

sim_status sim_topology_pin_self(int index)
{
    pthread_once(&g_once, topo_load);
    if (!g_loaded) return sim_err(SIM_ERR_INTERNAL, "hwloc could not load the host topology");
    hwloc_obj_type_t type = hwloc_get_nbobjs_by_type(g_topo, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    hwloc_obj_t obj = hwloc_get_obj_by_type(g_topo, type, (unsigned)(index % g_cores));
    if (!obj || !obj->cpuset) return sim_err(SIM_ERR_INTERNAL, "hwloc has no core %d", index % g_cores);
    if (hwloc_set_cpubind(g_topo, obj->cpuset, HWLOC_CPUBIND_THREAD) != 0)
        return sim_err(SIM_ERR_INTERNAL, "hwloc could not bind a device thread to core %d", index % g_cores);
    return SIM_OK;
}

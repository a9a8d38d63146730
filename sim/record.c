/* record.c — see record.h. */
#include "sim/record.h"

#include "sim/status.h"

const char *sim_op_name(sim_op op)
{
    static const char *names[] = {"all-gather", "reduce-scatter", "all-reduce",
                                  "all-to-all", "ppermute",       "ragged-all-to-all"};
    SIM_ASSERT(op >= 0 && op < SIM_NOP);
    return names[op];
}

/* trace.h — writes the spans the devices recorded (sim_machine_opts.trace) as
 * Chrome trace-event JSON: one process per device named by its mesh
 * coordinates, a "compute" lane and one lane per group of mesh axes for
 * collectives, and the arena's live bytes as a counter track.  Perfetto and
 * chrome://tracing open the file. */
#ifndef SIM_TRACE_H
#define SIM_TRACE_H

#include <stdio.h>

#include "sim/machine.h"

/* Writes the trace; with max_events > 0 only whole devices, in id order,
 * while their spans fit in max_events (device 0 always), so a large run
 * gives a readable summary of its first devices.  Each collective event
 * carries its record (op, mesh axes, group size, dtype, elements, bytes,
 * phase, step, kind, tag); each step starts with an instant marker. */
sim_status sim_trace_write_chrome(sim_machine *m, FILE *f, size_t max_events);
/* Before a run: the trace will be written with this max_events, so a device that can no
 * longer fit (see sim_trace_write_chrome) keeps no spans, only their count.  0 (the
 * default) keeps every device's spans. */
void sim_trace_set_limit(sim_machine *m, size_t max_events);
/* How many devices (from device 0) the trace holds under max_events (0: all). */
size_t sim_trace_devices_within(sim_machine *m, size_t max_events);
/* Number of spans device `id` recorded. */
size_t sim_trace_span_count(sim_machine *m, int id);
/* Writes s as a JSON string literal (with quotes). */
void sim_json_write_string(FILE *f, const char *s);

#endif

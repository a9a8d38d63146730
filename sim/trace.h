/* trace.h — Chrome trace-event JSON (Perfetto and chrome://tracing open it).
 *
 * One streaming writer (sim_trace_out, over the one JSON writer sim/jsonout.h) writes every
 * trace.json: the spans the
 * devices recorded (sim_machine_opts.trace: one process per device named by
 * its mesh coordinates, a "compute" lane and one lane per group of mesh axes
 * for collectives, the arena's live bytes as a counter track) and the step-time
 * model's modelled timeline.  The caller gives it a FILE*; the output
 * directory's writer (cli_artifact_write) makes the file appear whole or not
 * at all.  A run's trace keeps only the steps asked for (sim_trace_set_steps),
 * so its size does not grow with the number of steps trained, and says in its
 * otherData what it left out. */
#ifndef SIM_TRACE_H
#define SIM_TRACE_H

#include <stdint.h>
#include <stdio.h>

#include "sim/machine.h"

/* ---- the streaming writer ------------------------------------------------- */

typedef struct sim_trace_out sim_trace_out;

/* Starts a trace on f: {"displayTimeUnit":"ms","otherData":{...},"traceEvents":[.
 * The otherData members are written with the sim_trace_out_meta_* calls that
 * follow, before the first event. */
sim_status sim_trace_out_new(FILE *f, sim_trace_out **out);
void sim_trace_out_meta_u64(sim_trace_out *o, const char *key, uint64_t v);
void sim_trace_out_meta_str(sim_trace_out *o, const char *key, const char *v);
/* A member whose value is a list of [first, last] pairs. */
void sim_trace_out_meta_ranges(sim_trace_out *o, const char *key, const int64_t (*r)[2], int n);
/* Metadata events: a process (its name and its place in the list) and a lane's name. */
void sim_trace_out_process(sim_trace_out *o, int64_t pid, const char *name, int64_t sort_index);
void sim_trace_out_thread(sim_trace_out *o, int64_t pid, int64_t tid, const char *name);
/* A complete event ("ph":"X"), times in nanoseconds (written as microseconds with three
 * decimals), cat may be NULL; its args follow with sim_trace_out_arg_* and the event
 * is closed by sim_trace_out_event_end. */
void sim_trace_out_span(sim_trace_out *o, int64_t pid, int64_t tid, uint64_t ts_ns, uint64_t dur_ns, const char *name,
                        const char *cat);
void sim_trace_out_arg_str(sim_trace_out *o, const char *key, const char *v);
void sim_trace_out_arg_i64(sim_trace_out *o, const char *key, int64_t v);
void sim_trace_out_event_end(sim_trace_out *o);
/* An instant event across the process's lanes ("ph":"i","s":"p"). */
void sim_trace_out_instant(sim_trace_out *o, int64_t pid, uint64_t ts_ns, const char *name, const char *cat);
/* A counter sample ("ph":"C") with one series. */
void sim_trace_out_counter(sim_trace_out *o, int64_t pid, uint64_t ts_ns, const char *name, const char *series,
                           uint64_t v);
/* Closes the event list and the document, flushes and frees o: SIM_ERR_IO when a write failed. */
sim_status sim_trace_out_end(sim_trace_out *o);

/* ---- a run's spans ---------------------------------------------------------- */

/* Steps [first, last], inclusive. */
typedef struct sim_trace_range {
    int64_t first, last;
} sim_trace_range;

/* Writes the trace; with max_events > 0 only whole devices, in id order,
 * while their spans fit in max_events (device 0 always), so a large run
 * gives a readable summary of its first devices.  Each collective event
 * carries its record (op, mesh axes, group size, dtype, bytes sent, bytes
 * received where they differ, phase, kind; the tag is the event's name after
 * the op, the step is the marker's before it); each step starts with an
 * instant marker; the live-bytes counter moves in steps of 1% of the device's
 * traced peak.  otherData says which steps the trace holds and how many steps
 * and spans it left out. */
sim_status sim_trace_write_chrome(sim_machine *m, FILE *f, size_t max_events);
/* Before a run: the trace will be written with this max_events, so a device that can no
 * longer fit (see sim_trace_write_chrome) keeps no spans, only their count.  0 (the
 * default) keeps every device's spans. */
void sim_trace_set_limit(sim_machine *m, size_t max_events);
/* Before a run: keep the spans of the steps in r[0..n) only (copied; n = 0: every step);
 * spans recorded before the first step (a device's setup) are kept.  text is how the user
 * named them (trace_steps), written into the trace's otherData. */
sim_status sim_trace_set_steps(sim_machine *m, const sim_trace_range *r, int n, const char *text);
/* After a run: steps device 0 started whose spans the trace left out, and the spans left
 * out that way over every device. */
uint64_t sim_trace_steps_skipped(sim_machine *m);
uint64_t sim_trace_spans_skipped(sim_machine *m);
/* How many devices (from device 0) the trace holds under max_events (0: all). */
size_t sim_trace_devices_within(sim_machine *m, size_t max_events);
/* Number of spans device `id` recorded in the traced steps. */
size_t sim_trace_span_count(sim_machine *m, int id);

#endif

/* trace.c — Chrome trace-event JSON: the streaming writer, and a run's spans
 * written through it. */
#include "sim/trace.h"
#include "sim/machine_priv.h"

#include <stdlib.h>

#include "sim/jsonout.h"

/* ================================================================ the writer */

/* The document {"displayTimeUnit":"ms","otherData":{...},"traceEvents":[ one event a line ]}, in
 * the one JSON writer's compact layout. */
struct sim_trace_out {
    sim_json *j;
    bool meta_open; /* otherData still takes members */
    bool arg_open;  /* the open event has an args object */
};

sim_status sim_trace_out_new(FILE *f, sim_trace_out **out)
{
    sim_trace_out *o = malloc(sizeof *o);
    if (!o) return sim_err(SIM_ERR_OOM, "trace: out of host memory");
    sim_status st = sim_json_new(f, SIM_JSON_COMPACT, false, 17, &o->j);
    if (st != SIM_OK) {
        free(o);
        return st;
    }
    o->meta_open = true;
    o->arg_open = false;
    sim_json_obj(o->j);
    sim_json_key(o->j, "displayTimeUnit");
    sim_json_str(o->j, "ms");
    sim_json_key(o->j, "otherData");
    sim_json_obj(o->j);
    *out = o;
    return SIM_OK;
}

static void meta_key(sim_trace_out *o, const char *key)
{
    SIM_ASSERT(o->meta_open); /* otherData comes before the events */
    sim_json_key(o->j, key);
}

void sim_trace_out_meta_u64(sim_trace_out *o, const char *key, uint64_t v)
{
    meta_key(o, key);
    sim_json_u64(o->j, v);
}

void sim_trace_out_meta_str(sim_trace_out *o, const char *key, const char *v)
{
    meta_key(o, key);
    sim_json_str(o->j, v);
}

void sim_trace_out_meta_ranges(sim_trace_out *o, const char *key, const int64_t (*r)[2], int n)
{
    meta_key(o, key);
    sim_json_arr(o->j);
    for (int i = 0; i < n; i++) {
        sim_json_arr(o->j);
        sim_json_i64(o->j, r[i][0]);
        sim_json_i64(o->j, r[i][1]);
        sim_json_end(o->j);
    }
    sim_json_end(o->j);
}

/* an event's object on a line of its own; the first one closes otherData and opens the list */
static void event_open(sim_trace_out *o)
{
    if (o->meta_open) {
        sim_json_end(o->j);
        sim_json_key(o->j, "traceEvents");
        sim_json_arr_lines(o->j);
        o->meta_open = false;
    }
    sim_json_obj(o->j);
}

static void member_str(sim_trace_out *o, const char *key, const char *v)
{
    sim_json_key(o->j, key);
    sim_json_str(o->j, v);
}

static void member_i64(sim_trace_out *o, const char *key, int64_t v)
{
    sim_json_key(o->j, key);
    sim_json_i64(o->j, v);
}

/* ts and dur are microseconds with three decimals, from a nanosecond count */
static void member_us(sim_trace_out *o, const char *key, uint64_t ns)
{
    sim_json_key(o->j, key);
    sim_json_milli(o->j, ns);
}

/* a metadata event: {"name":name,"ph":"M","pid":pid[,"tid":tid],"args":{arg:...}} */
static void metadata(sim_trace_out *o, const char *name, int64_t pid, const int64_t *tid, const char *arg)
{
    event_open(o);
    member_str(o, "name", name);
    member_str(o, "ph", "M");
    member_i64(o, "pid", pid);
    if (tid) member_i64(o, "tid", *tid);
    sim_json_key(o->j, "args");
    sim_json_obj(o->j);
    sim_json_key(o->j, arg);
}

void sim_trace_out_process(sim_trace_out *o, int64_t pid, const char *name, int64_t sort_index)
{
    metadata(o, "process_name", pid, NULL, "name");
    sim_json_str(o->j, name);
    sim_json_end(o->j);
    sim_json_end(o->j);
    metadata(o, "process_sort_index", pid, NULL, "sort_index");
    sim_json_i64(o->j, sort_index);
    sim_json_end(o->j);
    sim_json_end(o->j);
}

void sim_trace_out_thread(sim_trace_out *o, int64_t pid, int64_t tid, const char *name)
{
    metadata(o, "thread_name", pid, &tid, "name");
    sim_json_str(o->j, name);
    sim_json_end(o->j);
    sim_json_end(o->j);
}

void sim_trace_out_span(sim_trace_out *o, int64_t pid, int64_t tid, uint64_t ts_ns, uint64_t dur_ns, const char *name,
                        const char *cat)
{
    event_open(o);
    member_str(o, "name", name);
    member_str(o, "ph", "X");
    member_i64(o, "pid", pid);
    member_i64(o, "tid", tid);
    member_us(o, "ts", ts_ns);
    member_us(o, "dur", dur_ns);
    if (cat) member_str(o, "cat", cat);
    o->arg_open = false;
}

static void arg_key(sim_trace_out *o, const char *key)
{
    if (!o->arg_open) {
        sim_json_key(o->j, "args");
        sim_json_obj(o->j);
        o->arg_open = true;
    }
    sim_json_key(o->j, key);
}

void sim_trace_out_arg_str(sim_trace_out *o, const char *key, const char *v)
{
    arg_key(o, key);
    sim_json_str(o->j, v);
}

void sim_trace_out_arg_i64(sim_trace_out *o, const char *key, int64_t v)
{
    arg_key(o, key);
    sim_json_i64(o->j, v);
}

void sim_trace_out_event_end(sim_trace_out *o)
{
    if (o->arg_open) sim_json_end(o->j);
    sim_json_end(o->j);
    o->arg_open = false;
}

void sim_trace_out_instant(sim_trace_out *o, int64_t pid, uint64_t ts_ns, const char *name, const char *cat)
{
    event_open(o);
    member_str(o, "name", name);
    member_str(o, "ph", "i");
    member_str(o, "s", "p");
    member_i64(o, "pid", pid);
    member_i64(o, "tid", 0);
    member_us(o, "ts", ts_ns);
    member_str(o, "cat", cat);
    sim_json_end(o->j);
}

void sim_trace_out_counter(sim_trace_out *o, int64_t pid, uint64_t ts_ns, const char *name, const char *series,
                           uint64_t v)
{
    event_open(o);
    member_str(o, "name", name);
    member_str(o, "ph", "C");
    member_i64(o, "pid", pid);
    member_us(o, "ts", ts_ns);
    sim_json_key(o->j, "args");
    sim_json_obj(o->j);
    sim_json_key(o->j, series);
    sim_json_u64(o->j, v);
    sim_json_end(o->j);
    sim_json_end(o->j);
}

sim_status sim_trace_out_end(sim_trace_out *o)
{
    if (o->meta_open) { /* no event: an empty list */
        sim_json_end(o->j);
        sim_json_key(o->j, "traceEvents");
        sim_json_arr_lines(o->j);
    }
    sim_json_end(o->j);
    sim_json_end(o->j);
    sim_status st = sim_json_close(o->j, "\n", "the trace file");
    free(o);
    return st;
}

/* ================================================================ a run's spans */

size_t sim_trace_span_count(sim_machine *m, int id) { return sim_machine_device(m, id)->nspans; }

void sim_trace_set_limit(sim_machine *m, size_t max_events) { m->trace_limit = max_events; }

sim_status sim_trace_set_steps(sim_machine *m, const sim_trace_range *r, int n, const char *text)
{
    free(m->trace_steps);
    m->trace_steps = NULL;
    m->ntrace_steps = 0;
    snprintf(m->trace_steps_text, sizeof m->trace_steps_text, "%s", text ? text : "");
    if (n <= 0) return SIM_OK;
    m->trace_steps = malloc((size_t)n * sizeof *r);
    if (!m->trace_steps) return sim_err(SIM_ERR_OOM, "trace: out of host memory");
    memcpy(m->trace_steps, r, (size_t)n * sizeof *r);
    m->ntrace_steps = n;
    return SIM_OK;
}

bool sim_trace_step_selected(const sim_machine *m, int64_t step)
{
    if (!m->trace_steps) return true;
    for (int i = 0; i < m->ntrace_steps; i++)
        if (step >= m->trace_steps[i].first && step <= m->trace_steps[i].last) return true;
    return false;
}

uint64_t sim_trace_steps_skipped(sim_machine *m) { return m->n ? m->dev[0].steps_skipped : 0; }

uint64_t sim_trace_spans_skipped(sim_machine *m)
{
    uint64_t n = 0;
    for (int i = 0; i < m->n; i++) n += m->dev[i].spans_skipped;
    return n;
}

/* Device d (> 0) is written only while the spans of devices 0..d fit in the limit.  Counts
 * only grow, so once the running counts of devices 0..d (each read atomically: the others
 * are still running) exceed it, d's final prefix exceeds it too: d drops its spans, which
 * then cost neither memory nor formatting.  Checked every 256 spans.  A step the trace
 * leaves out keeps nothing (and counts nothing towards the limit). */
bool sim_trace_keeps(sim_device *d)
{
    if (d->spans_dropped || d->step_untraced) return false;
    const sim_machine *m = d->m;
    if (!m->trace_limit || d->id == 0 || d->nspans % 256) return true;
    size_t total = d->nspans;
    for (int j = 0; j < d->id && total <= m->trace_limit; j++)
        total += __atomic_load_n(&m->dev[j].nspans, __ATOMIC_RELAXED);
    if (total <= m->trace_limit) return true;
    d->spans_dropped = true;
    free(d->spans);
    d->spans = NULL;
    d->capspans = 0;
    return false;
}

static void lane_name(const sim_machine *m, int lane, char *buf, size_t cap)
{
    if (lane == 0) {
        snprintf(buf, cap, "compute");
        return;
    }
    if (lane >= SIM_LANE_MB0) {
        snprintf(buf, cap, "compute mb%d", lane - SIM_LANE_MB0);
        return;
    }
    unsigned mask = (unsigned)(lane - 1);
    size_t n = (size_t)snprintf(buf, cap, "collectives ");
    for (int a = 0, first = 1; a < m->mesh.naxes && n < cap; a++)
        if (mask & (1u << a)) {
            n += (size_t)snprintf(buf + n, cap - n, "%s%s", first ? "" : "+", m->mesh.names[a]);
            first = 0;
        }
}

size_t sim_trace_devices_within(sim_machine *m, size_t max_events)
{
    if (!max_events) return (size_t)m->n;
    size_t total = 0, n = 0;
    for (int i = 0; i < m->n; i++) {
        total += m->dev[i].nspans;
        if (i > 0 && total > max_events) break;
        n++;
    }
    return n;
}

/* otherData: the devices written, the limit, and which steps the trace holds and what it left out */
static void write_meta(sim_trace_out *o, sim_machine *m, size_t ndev, size_t max_events)
{
    sim_trace_out_meta_u64(o, "devices_traced", ndev);
    sim_trace_out_meta_u64(o, "devices", (uint64_t)m->n);
    sim_trace_out_meta_u64(o, "trace_max_events", max_events);
    if (*m->trace_steps_text) sim_trace_out_meta_str(o, "trace_steps", m->trace_steps_text);
    if (m->trace_steps) { /* inclusive ranges */
        int64_t(*r)[2] = malloc((size_t)m->ntrace_steps * sizeof *r);
        SIM_ASSERT(r);
        for (int i = 0; i < m->ntrace_steps; i++) {
            r[i][0] = m->trace_steps[i].first;
            r[i][1] = m->trace_steps[i].last;
        }
        sim_trace_out_meta_ranges(o, "steps_kept", (const int64_t(*)[2])r, m->ntrace_steps);
        free(r);
    }
    const sim_device *d0 = &m->dev[0];
    sim_trace_out_meta_u64(o, "steps_traced", d0->steps_traced);
    sim_trace_out_meta_u64(o, "steps_left_out", d0->steps_skipped);
    sim_trace_out_meta_u64(o, "spans_left_out", sim_trace_spans_skipped(m));
    /* a dry run's repeated microbatches (sim_repeat): simulated once, their copies counted in every
     * figure but not drawn; the trace says how many spans they stand for */
    uint64_t repeated = 0;
    for (size_t i = 0; i < ndev; i++) repeated += m->dev[i].span_extra;
    if (repeated) {
        sim_trace_out_meta_u64(o, "spans_repeated_not_drawn", repeated);
        sim_trace_out_meta_str(o, "spans_repeated_note",
                               "a dry run simulates the first microbatch and one steady-state one; the other "
                               "microbatches repeat the second: counted in every figure, not drawn here");
    }
}

sim_status sim_trace_write_chrome(sim_machine *m, FILE *f, size_t max_events)
{
    size_t ndev = sim_trace_devices_within(m, max_events);
    for (size_t i = 0; i < ndev; i++)
        if (m->dev[i].spans_dropped) /* the limit set for the run is smaller than max_events */
            return sim_err(SIM_ERR_INTERNAL,
                           "trace: device %zu dropped its spans under a limit of %zu events, "
                           "but the trace is written with %zu",
                           i, m->trace_limit, max_events);
    sim_trace_out *o;
    SIM_TRY(sim_trace_out_new(f, &o));
    write_meta(o, m, ndev, max_events);
    for (size_t i = 0; i < ndev; i++) {
        sim_device *d = &m->dev[i];
        sim_trace_out_process(o, (int64_t)i, d->label, (int64_t)i);
        /* name each lane once */
        unsigned char named[(SIM_LANE_MB0 + 16) / 8 + 1] = {0}; /* every lane: compute, collectives, microbatches */
        size_t kept = d->spans ? d->nspans : 0, live = 0, peak = 0;
        bool live_known = false, peak_shown = false;
        for (size_t s = 0; s < kept; s++)
            if (d->spans[s].lane >= 0 && d->spans[s].live_bytes > peak) peak = d->spans[s].live_bytes;
        for (size_t s = 0; s < kept; s++) {
            int lane = d->spans[s].lane;
            if (lane < 0 || (size_t)lane / 8 >= sizeof named || (named[lane / 8] & (1u << (lane % 8)))) continue;
            named[lane / 8] |= (unsigned char)(1u << (lane % 8));
            char ln[160];
            lane_name(m, lane, ln, sizeof ln);
            sim_trace_out_thread(o, (int64_t)i, lane, ln);
        }
        for (size_t s = 0; s < kept; s++) {
            const sim_span *sp = &d->spans[s];
            uint64_t t1 = sp->t1 ? sp->t1 : sp->t0;
            if (sp->lane < 0) { /* a step marker: an instant event across the device's lanes */
                sim_trace_out_instant(o, (int64_t)i, sp->t0 - m->t_origin, sp->name, "step");
                continue;
            }
            bool coll = sp->lane > 0 && sp->lane < SIM_LANE_MB0; /* else compute (the main or a microbatch lane) */
            sim_trace_out_span(o, (int64_t)i, sp->lane, sp->t0 - m->t_origin, t1 - sp->t0, sp->name,
                               coll ? "collective" : "compute");
            if (coll && sp->rec >= 0 && (size_t)sp->rec < d->nrec) {
                /* the record; its tag and step are the event's name (after the op) and the step marker before it */
                const sim_record *r = &d->rec[sp->rec];
                char ax[160];
                sim_axes_label(&m->mesh, r->axes, ax, sizeof ax);
                sim_trace_out_arg_str(o, "op", sim_op_name(r->op));
                sim_trace_out_arg_str(o, "mesh_axes", ax);
                sim_trace_out_arg_i64(o, "group_size", r->group_size);
                sim_trace_out_arg_str(o, "dtype", sim_dtype_name(r->dtype));
                sim_trace_out_arg_i64(o, "bytes_sent", (int64_t)r->bytes_sent);
                if (r->bytes_recv != r->bytes_sent) sim_trace_out_arg_i64(o, "bytes_recv", (int64_t)r->bytes_recv);
                sim_trace_out_arg_str(o, "phase", sim_phase_name(r->phase));
                sim_trace_out_arg_str(o, "kind", r->implicit ? "implicit" : "explicit");
            } else if (coll) {
                sim_trace_out_arg_str(o, "op", sim_op_name(sp->op));
                sim_trace_out_arg_i64(o, "bytes_sent", (int64_t)sp->bytes);
            }
            sim_trace_out_event_end(o);
            /* the live-bytes track at a resolution of 1% of the device's traced peak (a pixel of a
             * chart): a sample where the bytes moved by that much since the last, at the peak and
             * at the device's last span; a third of the events of a trace otherwise */
            size_t v = sp->live_bytes, moved = v > live ? v - live : live - v;
            if (!live_known || moved >= peak / 100 + 1 || (v == peak && !peak_shown) || s + 1 == kept) {
                sim_trace_out_counter(o, (int64_t)i, t1 - m->t_origin, "arena live bytes", "bytes", v);
                live_known = true;
                live = v;
                peak_shown = peak_shown || v == peak;
            }
        }
    }
    return sim_trace_out_end(o);
}

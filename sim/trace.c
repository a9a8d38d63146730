/* trace.c — Chrome trace-event JSON from the devices' spans. */
#include "sim/trace.h"
#include "sim/machine_priv.h"

#include <stdlib.h>

#include "sim/textout.h"

void sim_json_write_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

size_t sim_trace_span_count(sim_machine *m, int id) { return sim_machine_device(m, id)->nspans; }

void sim_trace_set_limit(sim_machine *m, size_t max_events) { m->trace_limit = max_events; }

/* Device d (> 0) is written only while the spans of devices 0..d fit in the limit.  Counts
 * only grow, so once the running counts of devices 0..d (each read atomically: the others
 * are still running) exceed it, d's final prefix exceeds it too: d drops its spans, which
 * then cost neither memory nor formatting.  Checked every 256 spans. */
bool sim_trace_keeps(sim_device *d)
{
    if (d->spans_dropped) return false;
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

/* ts and dur are microseconds printed "%.3f": for a nanosecond count v below 2^49 (6.5 days)
 * the double v / 1e3 is within 3e-5 of a number with three decimals, so printf prints
 * v / 1000 and v % 1000 exactly; beyond that, printf itself. */
static void put_us(sim_textout *o, uint64_t ns, double us)
{
    if (ns < (1ull << 49)) {
        sim_textout_milli(o, ns);
        return;
    }
    char b[64];
    sim_textout_mem(o, b, (size_t)snprintf(b, sizeof b, "%.3f", us));
}

static void put_head(sim_textout *o, const char *name_json_key, size_t pid)
{
    sim_textout_str(o, name_json_key);
    sim_textout_u64(o, pid);
}

sim_status sim_trace_write_chrome(sim_machine *m, FILE *f, size_t max_events)
{
    size_t ndev = sim_trace_devices_within(m, max_events);
    for (size_t i = 0; i < ndev; i++)
        if (m->dev[i].spans_dropped) /* the limit set for the run is smaller than max_events */
            return sim_err(SIM_ERR_INTERNAL, "trace: device %zu dropped its spans under a limit of %zu events, "
                                             "but the trace is written with %zu", i, m->trace_limit, max_events);
    sim_textout *o = malloc(sizeof *o);
    if (!o) return sim_err(SIM_ERR_OOM, "trace: out of host memory");
    sim_textout_init(o, f);
    sim_textout_str(o, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"devices_traced\":");
    sim_textout_u64(o, ndev);
    sim_textout_str(o, ",\"devices\":");
    sim_textout_i64(o, m->n);
    sim_textout_str(o, ",\"trace_max_events\":");
    sim_textout_u64(o, max_events);
    sim_textout_str(o, "},\"traceEvents\":[\n");
    bool first = true;
    for (size_t i = 0; i < ndev; i++) {
        sim_device *d = &m->dev[i];
        put_head(o, first ? "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":"
                          : ",\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", i);
        first = false;
        sim_textout_str(o, ",\"args\":{\"name\":");
        sim_textout_json_string(o, d->label);
        sim_textout_str(o, "}}");
        put_head(o, ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", i);
        put_head(o, ",\"args\":{\"sort_index\":", i);
        sim_textout_str(o, "}}");
        /* name each lane once */
        unsigned char named[(SIM_LANE_MB0 + 16) / 8 + 1] = {0}; /* every lane: compute, collectives, microbatches */
        for (size_t s = 0; s < d->nspans; s++) {
            int lane = d->spans[s].lane;
            if (lane < 0 || (size_t)lane / 8 >= sizeof named || (named[lane / 8] & (1u << (lane % 8)))) continue;
            named[lane / 8] |= (unsigned char)(1u << (lane % 8));
            char ln[160];
            lane_name(m, lane, ln, sizeof ln);
            put_head(o, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", i);
            sim_textout_str(o, ",\"tid\":");
            sim_textout_i64(o, lane);
            sim_textout_str(o, ",\"args\":{\"name\":");
            sim_textout_json_string(o, ln);
            sim_textout_str(o, "}}");
        }
        for (size_t s = 0; s < d->nspans; s++) {
            const sim_span *sp = &d->spans[s];
            uint64_t t1 = sp->t1 ? sp->t1 : sp->t0;
            double ts = (double)(sp->t0 - m->t_origin) / 1e3, dur = (double)(t1 - sp->t0) / 1e3;
            sim_textout_str(o, ",\n{\"name\":");
            sim_textout_json_string(o, sp->name);
            if (sp->lane < 0) { /* a step marker: an instant event across the device's lanes */
                put_head(o, ",\"ph\":\"i\",\"s\":\"p\",\"pid\":", i);
                sim_textout_str(o, ",\"tid\":0,\"ts\":");
                put_us(o, sp->t0 - m->t_origin, ts);
                sim_textout_str(o, ",\"cat\":\"step\"}");
                continue;
            }
            put_head(o, ",\"ph\":\"X\",\"pid\":", i);
            sim_textout_str(o, ",\"tid\":");
            sim_textout_i64(o, sp->lane);
            sim_textout_str(o, ",\"ts\":");
            put_us(o, sp->t0 - m->t_origin, ts);
            sim_textout_str(o, ",\"dur\":");
            put_us(o, t1 - sp->t0, dur);
            bool coll = sp->lane > 0 && sp->lane < SIM_LANE_MB0; /* else compute (the main or a microbatch lane) */
            if (coll && sp->rec >= 0 && (size_t)sp->rec < d->nrec) {
                const sim_record *r = &d->rec[sp->rec];
                char ax[160];
                sim_axes_label(&m->mesh, r->axes, ax, sizeof ax);
                sim_textout_str(o, ",\"cat\":\"collective\",\"args\":{\"op\":\"");
                sim_textout_str(o, sim_op_name(r->op));
                sim_textout_str(o, "\",\"mesh_axes\":");
                sim_textout_json_string(o, ax);
                sim_textout_str(o, ",\"group_size\":");
                sim_textout_i64(o, r->group_size);
                sim_textout_str(o, ",\"dtype\":\"");
                sim_textout_str(o, sim_dtype_name(r->dtype));
                sim_textout_str(o, "\",\"elements\":");
                sim_textout_u64(o, r->elements);
                sim_textout_str(o, ",\"bytes_sent\":");
                sim_textout_u64(o, r->bytes_sent);
                sim_textout_str(o, ",\"bytes_recv\":");
                sim_textout_u64(o, r->bytes_recv);
                sim_textout_str(o, ",\"phase\":\"");
                sim_textout_str(o, sim_phase_name(r->phase));
                sim_textout_str(o, "\",\"step\":");
                sim_textout_i64(o, r->step);
                sim_textout_str(o, r->implicit ? ",\"kind\":\"implicit\",\"tag\":" : ",\"kind\":\"explicit\",\"tag\":");
                sim_textout_json_string(o, r->tag);
                sim_textout_char(o, '}');
            } else if (coll) {
                sim_textout_str(o, ",\"cat\":\"collective\",\"args\":{\"op\":\"");
                sim_textout_str(o, sim_op_name(sp->op));
                sim_textout_str(o, "\",\"bytes_sent\":");
                sim_textout_u64(o, sp->bytes);
                sim_textout_char(o, '}');
            } else {
                sim_textout_str(o, ",\"cat\":\"compute\"");
            }
            sim_textout_char(o, '}');
            put_head(o, ",\n{\"name\":\"arena live bytes\",\"ph\":\"C\",\"pid\":", i);
            sim_textout_str(o, ",\"ts\":");
            /* printf printed ts + dur: the sum of the two doubles, within a few ulps of the end */
            if (sp->t0 - m->t_origin < (1ull << 48) && t1 - sp->t0 < (1ull << 48))
                sim_textout_milli(o, t1 - m->t_origin);
            else
                put_us(o, UINT64_MAX, ts + dur);
            sim_textout_str(o, ",\"args\":{\"bytes\":");
            sim_textout_u64(o, sp->live_bytes);
            sim_textout_str(o, "}}");
        }
    }
    sim_textout_str(o, "\n]}\n");
    sim_textout_flush(o);
    free(o);
    if (ferror(f)) return sim_err(SIM_ERR_IO, "could not write the trace file");
    return SIM_OK;
}

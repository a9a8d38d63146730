/* trace.c — Chrome trace-event JSON from the devices' spans. */
#include "sim/trace.h"
#include "sim/machine_priv.h"

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

sim_status sim_trace_write_chrome(sim_machine *m, FILE *f, size_t max_events)
{
    size_t ndev = sim_trace_devices_within(m, max_events);
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"devices_traced\":%zu,\"devices\":%d,"
               "\"trace_max_events\":%zu},\"traceEvents\":[\n",
            ndev, m->n, max_events);
    bool first = true;
#define SEP() (first ? (first = false, "") : ",\n")
    for (size_t i = 0; i < ndev; i++) {
        sim_device *d = &m->dev[i];
        fprintf(f, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%zu,\"args\":{\"name\":", SEP(), i);
        sim_json_write_string(f, d->label);
        fprintf(f, "}}");
        fprintf(f, ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%zu,\"args\":{\"sort_index\":%zu}}", i, i);
        /* name each lane once */
        unsigned char named[(SIM_LANE_MB0 + 16) / 8 + 1] = {0}; /* every lane: compute, collectives, microbatches */
        for (size_t s = 0; s < d->nspans; s++) {
            int lane = d->spans[s].lane;
            if (lane < 0 || (size_t)lane / 8 >= sizeof named || (named[lane / 8] & (1u << (lane % 8)))) continue;
            named[lane / 8] |= (unsigned char)(1u << (lane % 8));
            char ln[160];
            lane_name(m, lane, ln, sizeof ln);
            fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%zu,\"tid\":%d,\"args\":{\"name\":", i, lane);
            sim_json_write_string(f, ln);
            fprintf(f, "}}");
        }
        for (size_t s = 0; s < d->nspans; s++) {
            const sim_span *sp = &d->spans[s];
            uint64_t t1 = sp->t1 ? sp->t1 : sp->t0;
            double ts = (double)(sp->t0 - m->t_origin) / 1e3, dur = (double)(t1 - sp->t0) / 1e3;
            if (sp->lane < 0) { /* a step marker: an instant event across the device's lanes */
                fprintf(f, ",\n{\"name\":");
                sim_json_write_string(f, sp->name);
                fprintf(f, ",\"ph\":\"i\",\"s\":\"p\",\"pid\":%zu,\"tid\":0,\"ts\":%.3f,\"cat\":\"step\"}", i, ts);
                continue;
            }
            fprintf(f, ",\n{\"name\":");
            sim_json_write_string(f, sp->name);
            fprintf(f, ",\"ph\":\"X\",\"pid\":%zu,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f", i, sp->lane, ts, dur);
            bool coll = sp->lane > 0 && sp->lane < SIM_LANE_MB0; /* else compute (the main or a microbatch lane) */
            if (coll && sp->rec >= 0 && (size_t)sp->rec < d->nrec) {
                const sim_record *r = &d->rec[sp->rec];
                char ax[160];
                sim_axes_label(&m->mesh, r->axes, ax, sizeof ax);
                fprintf(f, ",\"cat\":\"collective\",\"args\":{\"op\":\"%s\",\"mesh_axes\":", sim_op_name(r->op));
                sim_json_write_string(f, ax);
                fprintf(f, ",\"group_size\":%d,\"dtype\":\"%s\",\"elements\":%llu,\"bytes_sent\":%llu,"
                           "\"bytes_recv\":%llu,\"phase\":\"%s\",\"step\":%d,\"kind\":\"%s\",\"tag\":",
                        r->group_size, sim_dtype_name(r->dtype), (unsigned long long)r->elements,
                        (unsigned long long)r->bytes_sent, (unsigned long long)r->bytes_recv, sim_phase_name(r->phase),
                        r->step, r->implicit ? "implicit" : "explicit");
                sim_json_write_string(f, r->tag);
                fprintf(f, "}");
            } else if (coll) {
                fprintf(f, ",\"cat\":\"collective\",\"args\":{\"op\":\"%s\",\"bytes_sent\":%llu}", sim_op_name(sp->op),
                        (unsigned long long)sp->bytes);
            } else {
                fprintf(f, ",\"cat\":\"compute\"");
            }
            fprintf(f, "}");
            fprintf(f, ",\n{\"name\":\"arena live bytes\",\"ph\":\"C\",\"pid\":%zu,\"ts\":%.3f,\"args\":{\"bytes\":%zu}}",
                    i, ts + dur, sp->live_bytes);
        }
    }
#undef SEP
    fprintf(f, "\n]}\n");
    if (ferror(f)) return sim_err(SIM_ERR_IO, "could not write the trace file");
    return SIM_OK;
}

/* report.c — console output of a run: config box, step lines, progress bar,
 * traffic table, memory table, parity table.
 *
 * The traffic pivot is built once from the records of every device (one pass,
 * a short list of cells with per-device counters, the last cell hit cached
 * because a device's consecutive records usually share a cell) and then both
 * printed here and written to traffic.csv by artifacts.c.  Every byte figure
 * is printed in the binary unit that fits it (B, KiB, MiB, GiB, TiB: 48 B,
 * 336.0 KiB, 1.59 MiB), right-aligned, so small and large rows both read
 * at a glance; each table ends with a legend for the columns that need one. */
#include "cli/report.h"
#include "sim/xrank.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ======================================================================== */
/* units                                                                    */
/* ======================================================================== */

const char *cli_bytes_text(double bytes, char *buf, size_t cap)
{
    static const char *names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int i = 0;
    double v = bytes;
    while (i < 6 && fabs(v) >= 1024.0) {
        v /= 1024.0;
        i++;
    }
    if (i == 0) snprintf(buf, cap, "%.0f B", v);
    else snprintf(buf, cap, "%.*f %s", fabs(v) < 10 ? 2 : fabs(v) < 100 ? 1 : 0, v, names[i]);
    return buf;
}

static void put_repeat(FILE *f, char c, int n)
{
    for (int i = 0; i < n; i++) fputc(c, f);
}

/* ======================================================================== */
/* config box                                                               */
/* ======================================================================== */

enum { BOX_VALUE_MAX = 72 };

/* Length of the next wrapped piece of s (at most w bytes, broken after a
 * space or comma when there is one in the second half). */
static int wrap_piece(const char *s, int w)
{
    int len = (int)strlen(s);
    if (len <= w) return len;
    for (int i = w; i > w / 2; i--)
        if (s[i - 1] == ' ' || s[i - 1] == ',') return i;
    return w;
}

void cli_report_config_box(FILE *f, const char *title, const cli_kv *rows, int n)
{
    int kw = 0, vw = 1;
    for (int i = 0; i < n; i++) {
        int k = rows[i].key ? (int)strlen(rows[i].key) : 0;
        int v = rows[i].value ? (int)strlen(rows[i].value) : 0;
        if (k > kw) kw = k;
        if (v > vw) vw = v;
    }
    if (vw > BOX_VALUE_MAX) vw = BOX_VALUE_MAX;
    int inner = kw + vw + 3; /* "key | value" between the outer "| " and " |" */
    int tl = title ? (int)strlen(title) : 0;
    if (tl > inner) {
        vw += tl - inner;
        inner = tl;
    }
    fputc('+', f);
    put_repeat(f, '-', inner + 2);
    fputs("+\n", f);
    if (title) {
        fprintf(f, "| %-*s |\n", inner, title);
        fputc('+', f);
        put_repeat(f, '-', kw + 2);
        fputc('+', f);
        put_repeat(f, '-', vw + 2);
        fputs("+\n", f);
    }
    for (int i = 0; i < n; i++) {
        const char *k = rows[i].key ? rows[i].key : "";
        const char *v = rows[i].value ? rows[i].value : "";
        int first = 1;
        do {
            int p = wrap_piece(v, vw);
            fprintf(f, "| %-*s | %-*.*s |\n", kw, first ? k : "", vw, p, v);
            v += p;
            while (*v == ' ') v++;
            first = 0;
        } while (*v);
    }
    fputc('+', f);
    put_repeat(f, '-', kw + 2);
    fputc('+', f);
    put_repeat(f, '-', vw + 2);
    fputs("+\n", f);
}

const char *cli_mesh_summary(const mesh_shape *m, char *buf, size_t cap)
{
    size_t n = 0;
    if (cap) buf[0] = '\0';
    for (int a = 0; a < m->n_axes; a++) {
        if (m->sizes[a] <= 1 || n >= cap) continue;
        n += (size_t)snprintf(buf + n, cap - n, "%s%s=%d", n ? " " : "", m->names[a], m->sizes[a]);
    }
    if (n < cap)
        snprintf(buf + n, cap - n, "%s%s%d device%s%s", n ? " " : "", n ? "(" : "", m->num_devices,
                 m->num_devices == 1 ? "" : "s", n ? ")" : "");
    return buf;
}

/* ======================================================================== */
/* step lines                                                               */
/* ======================================================================== */

void cli_report_step_header(FILE *f)
{
    /* grad norm: after clipping (the gradients applied; MaxText's learning/grad_norm); raw norm: before
     * (learning/raw_grad_norm) */
    fprintf(f, "%6s %11s %11s %11s %10s %9s %12s %12s\n", "step", "loss", "grad norm", "raw norm", "lr", "time (s)",
            "tokens/s", "peak/device");
}

void cli_report_step_line(FILE *f, const cli_step_metrics *s)
{
    char loss[32], gn[32], raw[32];
    if (s->dry) {
        snprintf(loss, sizeof loss, "-");
        snprintf(gn, sizeof gn, "-");
        snprintf(raw, sizeof raw, "-");
    } else {
        snprintf(loss, sizeof loss, "%.5f", s->loss);
        snprintf(gn, sizeof gn, "%.4e", s->grad_norm);
        snprintf(raw, sizeof raw, "%.4e", s->raw_grad_norm);
    }
    char tps[32], peak[32];
    if (s->dry) snprintf(tps, sizeof tps, "-"); /* a dry run computes nothing: no throughput */
    else snprintf(tps, sizeof tps, "%.0f", s->tokens_per_s);
    fprintf(f, "%6d %11s %11s %11s %10.3e %9.3f %12s %12s\n", s->step, loss, gn, raw, s->lr, s->time_s, tps,
            cli_bytes_text((double)s->peak_bytes, peak, sizeof peak));
}

/* ======================================================================== */
/* progress                                                                 */
/* ======================================================================== */

enum { BAR_WIDTH = 30 };

const char *cli_progress_format(double frac, const char *label, char *buf, size_t cap)
{
    if (!(frac >= 0)) frac = 0; /* NaN too */
    if (frac > 1) frac = 1;
    int fill = (int)(frac * BAR_WIDTH + 1e-9);
    char bar[BAR_WIDTH + 1];
    for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < fill ? '=' : ' ';
    if (fill < BAR_WIDTH) bar[fill] = '>';
    bar[BAR_WIDTH] = '\0';
    snprintf(buf, cap, "[%s] %3d%%%s%s", bar, (int)(frac * 100 + 1e-9), label ? " " : "", label ? label : "");
    return buf;
}

void cli_progress(FILE *f, double frac, const char *label)
{
    if (!f || !isatty(fileno(f))) return;
    char buf[256];
    /* \033[K clears what a longer previous label left on the line. */
    fprintf(f, "\r%s\033[K", cli_progress_format(frac, label, buf, sizeof buf));
    fflush(f);
}

void cli_progress_done(FILE *f)
{
    if (!f || !isatty(fileno(f))) return;
    fputs("\r\033[K", f);
    fflush(f);
}

/* ======================================================================== */
/* records and the traffic pivot                                            */
/* ======================================================================== */

void cli_records_from_machine(sim_machine *m, cli_records *out)
{
    memset(out, 0, sizeof *out);
    out->mesh = *sim_machine_mesh(m);
    out->n_devices = sim_machine_num_devices(m);
    for (int d = 0; d < out->n_devices; d++) {
        const sim_device *dev = sim_machine_device(m, d);
        out->recs[d] = sim_device_records(dev, &out->nstored[d]);
        out->reps[d] = sim_device_repeats(dev, &out->nreps[d]);
        out->n[d] = sim_device_nrecords(dev);
    }
}

void cli_records_walk(const cli_records *r, int d, sim_walk *w)
{
    sim_walk_init(w, r->recs[d], r->nstored[d], NULL, 0, r->reps[d], r->nreps[d]);
}

const char *cli_axes_text(const sim_mesh_desc *mesh, sim_axes axes, char *buf, size_t cap)
{
    size_t n = 0;
    if (cap) buf[0] = '\0';
    if (axes.n == 0) {
        snprintf(buf, cap, "-");
        return buf;
    }
    for (int i = 0; i < axes.n && n < cap; i++) {
        int a = axes.axis[i];
        const char *name = a >= 0 && a < mesh->naxes ? mesh->names[a] : "?";
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i ? "+" : "", name);
    }
    return buf;
}

static int axes_cmp(sim_axes a, sim_axes b)
{
    if (a.n != b.n) return a.n < b.n ? -1 : 1;
    for (int i = 0; i < a.n; i++)
        if (a.axis[i] != b.axis[i]) return a.axis[i] < b.axis[i] ? -1 : 1;
    return 0;
}

static int row_cmp(const void *pa, const void *pb)
{
    const cli_traffic_row *a = pa, *b = pb;
    if (a->bytes != b->bytes) return a->bytes > b->bytes ? -1 : 1;
    if (a->calls != b->calls) return a->calls > b->calls ? -1 : 1;
    if (a->op != b->op) return a->op < b->op ? -1 : 1;
    int c = axes_cmp(a->axes, b->axes);
    if (c) return c;
    if (a->phase != b->phase) return a->phase < b->phase ? -1 : 1;
    return 0;
}

/* Per-device counters of one cell while building. */
typedef struct {
    cli_traffic_row row;
    uint64_t *calls; /* [n_devices] */
    uint64_t *bytes; /* [n_devices] */
} cell;

static void finish_row(cli_traffic_row *r, const uint64_t *calls, const uint64_t *bytes, int nd)
{
    r->calls_max = 0;
    r->bytes_max = 0;
    r->bytes_min = nd ? UINT64_MAX : 0;
    for (int d = 0; d < nd; d++) {
        if (calls[d] > r->calls_max) r->calls_max = calls[d];
        if (bytes[d] > r->bytes_max) r->bytes_max = bytes[d];
        if (bytes[d] < r->bytes_min) r->bytes_min = bytes[d];
    }
    r->bytes_mean = nd ? (double)r->bytes / nd : 0;
}

sim_status cli_traffic_build(const cli_records *recs, cli_step_range steps, cli_traffic *out)
{
    memset(out, 0, sizeof *out);
    out->mesh = recs->mesh;
    out->n_devices = recs->n_devices;
    out->steps = steps;
    int nd = recs->n_devices, ncell = 0, cap = 0, last = -1;
    cell *cells = NULL;
    uint64_t *tot_calls = calloc((size_t)nd + 1, sizeof *tot_calls);
    uint64_t *tot_bytes = calloc((size_t)nd + 1, sizeof *tot_bytes);
    SIM_ASSERT(tot_calls && tot_bytes);
    for (int d = 0; d < nd; d++) {
        /* each stored record once, weighted by the copies its repeated blocks stand for: sums of
         * integers, so the same as over every copy (and the cells come in the same first-seen order) */
        for (size_t i = 0; i < recs->nstored[d]; i++) {
            const sim_record *r = &recs->recs[d][i];
            if (r->step < steps.first || r->step > steps.last) continue;
            uint64_t k = sim_repeat_weight(recs->reps[d], recs->nreps[d], i);
            int c = last;
            if (c < 0 || cells[c].row.op != r->op || cells[c].row.phase != r->phase ||
                axes_cmp(cells[c].row.axes, r->axes)) {
                for (c = 0; c < ncell; c++)
                    if (cells[c].row.op == r->op && cells[c].row.phase == r->phase &&
                        !axes_cmp(cells[c].row.axes, r->axes))
                        break;
                if (c == ncell) {
                    if (ncell == cap) {
                        cap = cap ? 2 * cap : 16;
                        cells = realloc(cells, (size_t)cap * sizeof *cells);
                        SIM_ASSERT(cells);
                    }
                    memset(&cells[c], 0, sizeof cells[c]);
                    cells[c].row.op = r->op;
                    cells[c].row.phase = r->phase;
                    cells[c].row.axes = r->axes;
                    cells[c].calls = calloc((size_t)nd, sizeof(uint64_t));
                    cells[c].bytes = calloc((size_t)nd, sizeof(uint64_t));
                    SIM_ASSERT(cells[c].calls && cells[c].bytes);
                    ncell++;
                }
                last = c;
            }
            cell *ce = &cells[c];
            ce->row.calls += k;
            ce->row.bytes += k * r->bytes_sent;
            ce->row.bytes_dcn += k * r->bytes_sent_dcn;
            ce->row.bytes_recv += k * r->bytes_recv;
            ce->calls[d] += k;
            ce->bytes[d] += k * r->bytes_sent;
            tot_calls[d] += k;
            tot_bytes[d] += k * r->bytes_sent;
        }
    }
    out->n_rows = ncell;
    out->rows = calloc((size_t)ncell + 1, sizeof *out->rows);
    SIM_ASSERT(out->rows);
    cli_traffic_row *t = &out->total;
    for (int c = 0; c < ncell; c++) {
        finish_row(&cells[c].row, cells[c].calls, cells[c].bytes, nd);
        out->rows[c] = cells[c].row;
        t->calls += cells[c].row.calls;
        t->bytes += cells[c].row.bytes;
        t->bytes_dcn += cells[c].row.bytes_dcn;
        t->bytes_recv += cells[c].row.bytes_recv;
        free(cells[c].calls);
        free(cells[c].bytes);
    }
    free(cells);
    finish_row(t, tot_calls, tot_bytes, nd);
    t->share = t->bytes ? 1.0 : 0.0;
    for (int c = 0; c < ncell; c++) out->rows[c].share = t->bytes ? (double)out->rows[c].bytes / (double)t->bytes : 0.0;
    qsort(out->rows, (size_t)ncell, sizeof *out->rows, row_cmp);
    free(tot_calls);
    free(tot_bytes);
    return SIM_OK;
}

void cli_traffic_free(cli_traffic *t)
{
    free(t->rows);
    t->rows = NULL;
    t->n_rows = 0;
}

static const char *steps_text(cli_step_range s, char *buf, size_t cap)
{
    if (s.first == INT_MIN && s.last == INT_MAX) snprintf(buf, cap, "all steps");
    else if (s.first == s.last) snprintf(buf, cap, "step %d", s.first);
    else if (s.first == INT_MIN) snprintf(buf, cap, "steps <= %d", s.last);
    else if (s.last == INT_MAX) snprintf(buf, cap, "steps >= %d", s.first);
    else snprintf(buf, cap, "steps %d-%d", s.first, s.last);
    return buf;
}

/* calls per device: an integer when every device made the same number. */
static const char *per_dev_text(uint64_t total, int nd, char *buf, size_t cap)
{
    if (nd <= 0) snprintf(buf, cap, "0");
    else if (total % (uint64_t)nd == 0) snprintf(buf, cap, "%llu", (unsigned long long)(total / (uint64_t)nd));
    else snprintf(buf, cap, "%.2f", (double)total / nd);
    return buf;
}

static void traffic_line(FILE *f, int aw, const char *op, const char *axes, const char *phase, const cli_traffic_row *r,
                         int nd, bool dcn)
{
    char calls[32], mean[32], max[32], cross[32];
    per_dev_text(r->calls, nd, calls, sizeof calls);
    /* max only where devices differ */
    if (r->bytes_max != r->bytes_min) cli_bytes_text((double)r->bytes_max, max, sizeof max);
    else snprintf(max, sizeof max, "-");
    fprintf(f, "%-17s  %-*s  %-9s %10s %14s %14s", op, aw, axes, phase, calls,
            cli_bytes_text(r->bytes_mean, mean, sizeof mean), max);
    if (dcn) fprintf(f, " %14s", cli_bytes_text(nd ? (double)r->bytes_dcn / nd : 0.0, cross, sizeof cross));
    fprintf(f, " %7.1f%%\n", 100.0 * r->share);
}

/* Whether the mesh spans several slices (some axis has a dcn factor). */
static bool multi_slice(const sim_mesh_desc *m)
{
    for (int a = 0; a < m->naxes; a++)
        if (m->dcn[a] > 1) return true;
    return false;
}

void cli_report_traffic(FILE *f, const cli_traffic *t)
{
    char sbuf[64], ax[256];
    int aw = 4;
    for (int i = 0; i < t->n_rows; i++) {
        int l = (int)strlen(cli_axes_text(&t->mesh, t->rows[i].axes, ax, sizeof ax));
        if (l > aw) aw = l;
    }
    fprintf(f, "collective traffic, %s, %d device%s (bytes sent per device)\n", steps_text(t->steps, sbuf, sizeof sbuf),
            t->n_devices, t->n_devices == 1 ? "" : "s");
    bool dcn = multi_slice(&t->mesh);
    fprintf(f, "%-17s  %-*s  %-9s %10s %14s %14s", "op", aw, "axes", "phase", "calls/dev", "mean/device", "max/device");
    if (dcn) fprintf(f, " %14s", "dcn/device");
    fprintf(f, " %8s\n", "share");
    int width = 17 + 2 + aw + 2 + 9 + 1 + 10 + 1 + 14 + 1 + 14 + 1 + 8 + (dcn ? 15 : 0);
    put_repeat(f, '-', width);
    fputc('\n', f);
    for (int i = 0; i < t->n_rows; i++) {
        const cli_traffic_row *r = &t->rows[i];
        traffic_line(f, aw, sim_op_name(r->op), cli_axes_text(&t->mesh, r->axes, ax, sizeof ax),
                     sim_phase_name(r->phase), r, t->n_devices, dcn);
    }
    put_repeat(f, '-', width);
    fputc('\n', f);
    traffic_line(f, aw, "total", "", "", &t->total, t->n_devices, dcn);
    fprintf(f,
            "axes: the mesh axes the collective's group spans; calls/dev: calls per device; mean/device: bytes\n"
            "sent per device, averaged over devices; max/device: the busiest device, shown only where devices\n"
            "differ; %sshare: of all bytes sent.\n",
            dcn ? "dcn/device: the part of mean/device sent to other slices (the rest stays within a slice, on "
                  "ICI);\n"
                : "");
}

/* ======================================================================== */
/* memory                                                                   */
/* ======================================================================== */

void cli_memory_collect(sim_machine *m, sim_arena_stats *stats)
{
    int nd = sim_machine_num_devices(m);
    for (int d = 0; d < nd; d++) sim_arena_get_stats(sim_device_arena(sim_machine_device(m, d)), &stats[d]);
}

size_t cli_memory_max_peak(sim_machine *m)
{
    size_t mx = 0;
    int nd = sim_machine_num_devices(m);
    for (int d = 0; d < nd; d++) {
        sim_arena_stats st;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(m, d)), &st);
        if (st.peak > mx) mx = st.peak;
    }
    return mx;
}

static int same_memory_row(const sim_arena_stats *a, const sim_arena_stats *b)
{
    if (a->peak != b->peak || a->capacity != b->capacity) return 0;
    for (int c = 0; c < SIM_NMEM; c++)
        if (a->at_peak_by[c] != b->at_peak_by[c]) return 0;
    return 1;
}

/* "0-3,8-11" from sorted ids. */
static void ranges_text(const int *ids, int n, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len < cap;) {
        int j = i;
        while (j + 1 < n && ids[j + 1] == ids[j] + 1) j++;
        if (j == i) len += (size_t)snprintf(buf + len, cap - len, "%s%d", len ? "," : "", ids[i]);
        else len += (size_t)snprintf(buf + len, cap - len, "%s%d-%d", len ? "," : "", ids[i], ids[j]);
        i = j + 1;
    }
}

void cli_report_memory(FILE *f, const sim_arena_stats *stats, int n_devices)
{
    enum { LABEL_CAP = 512 };
    int *group = malloc(((size_t)n_devices + 1) * sizeof *group); /* group of each device */
    int *ids = malloc(((size_t)n_devices + 1) * sizeof *ids);
    char(*labels)[LABEL_CAP] = calloc((size_t)n_devices + 1, sizeof *labels);
    int *lead = malloc(((size_t)n_devices + 1) * sizeof *lead); /* first device of each group */
    SIM_ASSERT(group && ids && labels && lead);
    int ng = 0;
    int any_cap = 0;
    for (int d = 0; d < n_devices; d++) {
        group[d] = -1;
        for (int g = 0; g < ng; g++)
            if (same_memory_row(&stats[lead[g]], &stats[d])) {
                group[d] = g;
                break;
            }
        if (group[d] < 0) {
            lead[ng] = d;
            group[d] = ng++;
        }
        if (stats[d].capacity) any_cap = 1;
    }
    int lw = 7;
    for (int g = 0; g < ng; g++) {
        int n = 0;
        for (int d = 0; d < n_devices; d++)
            if (group[d] == g) ids[n++] = d;
        ranges_text(ids, n, labels[g], LABEL_CAP);
        if ((int)strlen(labels[g]) > lw) lw = (int)strlen(labels[g]);
    }
    fprintf(f, "memory per device at its peak\n");
    fprintf(f, "%-*s", lw, "devices");
    for (int c = 0; c < SIM_NMEM; c++) fprintf(f, " %12s", sim_mem_cat_name((sim_mem_cat)c));
    fprintf(f, " %12s", "peak");
    if (any_cap) fprintf(f, " %12s", "capacity");
    fputc('\n', f);
    int width = lw + 13 * (SIM_NMEM + 1 + any_cap);
    put_repeat(f, '-', width);
    fputc('\n', f);
    for (int g = 0; g < ng; g++) {
        const sim_arena_stats *s = &stats[lead[g]];
        fprintf(f, "%-*s", lw, labels[g]);
        char b[32];
        for (int c = 0; c < SIM_NMEM; c++) fprintf(f, " %12s", cli_bytes_text((double)s->at_peak_by[c], b, sizeof b));
        fprintf(f, " %12s", cli_bytes_text((double)s->peak, b, sizeof b));
        if (any_cap) {
            if (s->capacity) fprintf(f, " %12s", cli_bytes_text((double)s->capacity, b, sizeof b));
            else fprintf(f, " %12s", "-");
        }
        fputc('\n', f);
    }
    fprintf(f,
            "devices: devices with identical figures share a row; each category is what it held when the\n"
            "device's total peaked (weight copy: the layer stacks' weights the compiler casts to dtype once\n"
            "and holds through the layer loops; temporaries: short-lived buffers of an op; comm: collective\n"
            "buffers)%s.\n",
            any_cap ? "; capacity: hbm_limit_gb" : "");
    free(group);
    free(ids);
    free(labels);
    free(lead);
}

/* ======================================================================== */
/* parity                                                                   */
/* ======================================================================== */

double cli_rel_diff(double loss, double ref)
{
    if (loss == ref) return 0.0;
    if (!isfinite(loss) || !isfinite(ref)) return INFINITY;
    if (ref == 0.0) return fabs(loss);
    return fabs(loss - ref) / fabs(ref);
}

double cli_parity_step_diff(const cli_parity *p, int i, int *worst)
{
    double mx = 0.0;
    int w = p->n_configs > 1 ? 1 : 0;
    for (int c = 1; c < p->n_configs; c++) {
        double r = cli_rel_diff(p->configs[c].losses[i], p->configs[0].losses[i]);
        if (r > mx) {
            mx = r;
            w = c;
        }
    }
    if (worst) *worst = w;
    return mx;
}

int cli_parity_first_failure(const cli_parity *p)
{
    for (int i = 0; i < p->n_steps; i++)
        if (cli_parity_step_diff(p, i, NULL) > p->rtol) return i;
    return -1;
}

void cli_report_parity(FILE *f, const cli_parity *p)
{
    int cw = 12;
    for (int c = 0; c < p->n_configs; c++) {
        int l = p->configs[c].label ? (int)strlen(p->configs[c].label) : 0;
        if (l > cw) cw = l;
    }
    /* the configurations were listed as they ran: here only the table */
    fprintf(f, "loss per step; max rel diff: largest |loss - loss of '%s'| / |loss of '%s'| over the configurations\n",
            p->n_configs ? p->configs[0].label : "", p->n_configs ? p->configs[0].label : "");
    fprintf(f, "%6s", "step");
    for (int c = 0; c < p->n_configs; c++) fprintf(f, " %*s", cw, p->configs[c].label ? p->configs[c].label : "");
    fprintf(f, " %13s\n", "max rel diff");
    double mx = 0;
    for (int i = 0; i < p->n_steps; i++) {
        fprintf(f, "%6d", p->first_step + i);
        for (int c = 0; c < p->n_configs; c++) fprintf(f, " %*.7f", cw, p->configs[c].losses[i]);
        double r = cli_parity_step_diff(p, i, NULL);
        if (r > mx) mx = r;
        fprintf(f, " %13.2e%s\n", r, r > p->rtol ? " *" : "");
    }
    int fail = cli_parity_first_failure(p);
    if (fail < 0 && p->diverge_step < 0 && !p->diverge_param) {
        fprintf(f, "PASS: largest relative difference %.2e <= rtol %.1e\n", mx, p->rtol);
        return;
    }
    int worst = 0;
    int step = p->diverge_step >= 0 ? p->diverge_step : p->first_step + (fail >= 0 ? fail : 0);
    double r = fail >= 0 ? cli_parity_step_diff(p, fail, &worst) : 0;
    const char *cfg =
        p->diverge_config ? p->diverge_config : (worst > 0 && worst < p->n_configs ? p->configs[worst].label : NULL);
    fprintf(f, "FAIL: first diverging step %d", step);
    if (cfg) fprintf(f, " (config '%s')", cfg);
    if (fail >= 0) fprintf(f, ", loss differs by %.2e > rtol %.1e", r, p->rtol);
    if (p->diverge_param) fprintf(f, "; first diverging parameter: %s", p->diverge_param);
    fputc('\n', f);
}

/* "0-3", "0,2,4,6", "0-1,4-5": ids in order, runs of consecutive ids as ranges. */
static void ids_text(const int *ids, int n, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && at + 24 < cap; i++) {
        int j = i;
        while (j + 1 < n && ids[j + 1] == ids[j] + 1) j++;
        at += (size_t)snprintf(buf + at, cap - at, j > i ? "%s%d-%d" : "%s%d", i ? "," : "", ids[i], ids[j]);
        i = j;
    }
}

/* A machine run whole under mpirun (a dry run): what each rank would hold, run for real over R ranks
 * (the sum of its devices' arena peaks: a rank's share of the simulated memory, before host overhead). */
static void report_rank_shares(FILE *f, sim_machine *m, int R)
{
    int n = sim_machine_num_devices(m), cnt;
    int *ids = calloc((size_t)n, sizeof *ids);
    SIM_ASSERT(ids);
    fprintf(f, "\nMPI: %d ranks (rank_placement=%s); run for real, each rank would hold its devices' arena peaks:\n", R,
            sim_xrank_placement());
    for (int r = 0; r < R; r++) {
        if (sim_machine_rank_ids(m, R, r, ids, &cnt) != SIM_OK) break; /* the machine checked the placement */
        double sum = 0;
        for (int i = 0; i < cnt; i++) {
            sim_arena_stats as;
            sim_arena_get_stats(sim_device_arena(sim_machine_device(m, ids[i])), &as);
            sum += (double)as.peak;
        }
        char h[32], list[256];
        sim_fmt_bytes(sum, h, sizeof h);
        ids_text(ids, cnt, list, sizeof list);
        fprintf(f, "  rank %d (device%s %s): %s\n", r, cnt == 1 ? "" : "s", list, h);
    }
    free(ids);
}

void cli_report_xrank(FILE *f, sim_machine *m)
{
    int R = sim_machine_ranks(m), nsteps = 0;
    if (R < 2 && sim_xrank_size() > 1 && sim_machine_num_devices(m) >= sim_xrank_size())
        report_rank_shares(f, m, sim_xrank_size());
    if (R < 2) return;
    int n = sim_machine_num_devices(m), cnt;
    int *ids = calloc((size_t)n, sizeof *ids);
    SIM_ASSERT(ids);
    fprintf(f, "\nMPI: %d ranks, devices", R);
    for (int r = 0; r < R; r++) {
        char list[256];
        if (sim_machine_rank_ids(m, R, r, ids, &cnt) != SIM_OK) break;
        ids_text(ids, cnt, list, sizeof list);
        fprintf(f, "%s %s", r ? ";" : "", list);
    }
    free(ids);
    if (strcmp(sim_xrank_placement(), "contiguous")) fprintf(f, " (rank_placement=%s)", sim_xrank_placement());
    fprintf(f, "; bytes the ranks sent each other (the simulator's own messages, not simulated traffic):\n");
    const uint64_t *b = sim_machine_xrank_bytes(m, &nsteps);
    uint64_t total = 0;
    int ran = 0;
    bool same = true;
    for (int s = 0; s < nsteps; s++) {
        if (!b[s]) continue;
        same &= !ran || b[s] == total / (uint64_t)ran;
        total += b[s];
        ran++;
    }
    char h[32];
    if (same && ran > 1) { /* the usual case: every step moves the same */
        fprintf(f, "  %llu bytes (%s) in each of %d steps\n", (unsigned long long)(total / (uint64_t)ran),
                sim_fmt_bytes((double)(total / (uint64_t)ran), h, sizeof h), ran);
        return;
    }
    fprintf(f, "  %6s %16s\n", "step", "bytes");
    for (int s = 0; s < nsteps; s++)
        if (b[s])
            fprintf(f, "  %6d %16llu  %s\n", s, (unsigned long long)b[s], sim_fmt_bytes((double)b[s], h, sizeof h));
}

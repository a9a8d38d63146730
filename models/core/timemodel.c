/* timemodel.c — hardware profiles and the step-time model (see timemodel.h).
 *
 * Replay: one device's kernels and collectives of one step, in the order the
 * device made them, on three lanes: compute, blocking network (activation
 * collectives, and weight collectives unless overlap_weight_collectives: the
 * compute that follows waits for them) and asynchronous network (weight
 * collectives when overlapped).  A weight all-gather may start once the
 * network is free and compute has reached the point where the gather
 * `prefetch` weight collectives earlier was asked for (XLA's latency-hiding
 * scheduler prefetches about one layer of FSDP weights); the next kernel
 * waits for it.  A weight-gradient reduction starts when its gradient exists
 * and nothing waits for it but the end of the step.  The two network lanes do
 * not share bandwidth (a simplification: on hardware they would). */
#include "models/core/timemodel.h"

#include "sim/trace.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ profiles */

sim_status model_hw_wire_dtypes(const cfg_config *cfg, sim_dtype act, sim_dtype weight, sim_dtype *gather,
                                sim_dtype *reduce, char *rule, size_t cap)
{
    cfg_hw hw;
    bool found;
    SIM_TRY(cfg_hw_from_config(cfg, 0, &hw, &found));
    /* a cast moves before a collective only when it narrows: bfloat16 activations of float32 weights */
    bool narrows = sim_dtype_size(act) < sim_dtype_size(weight);
    *gather = found && hw.gather_in_dtype && narrows ? act : weight;
    *reduce = found && hw.reduce_in_dtype && narrows ? act : weight;
    if (!found)
        snprintf(rule, cap, "weight gathers %s, gradient reductions %s (weight_dtype, as XLA:CPU; no hardware profile)",
                 sim_dtype_name(*gather), sim_dtype_name(*reduce));
    else
        snprintf(rule, cap,
                 "weight gathers %s, gradient reductions %s (as XLA:%s compiles for %s: configs/hardware/%s.yml)",
                 sim_dtype_name(*gather), sim_dtype_name(*reduce), hw.gpu ? "GPU" : "TPU", hw.name, hw.name);
    return SIM_OK;
}

sim_status model_hw_xla_rules(const cfg_config *cfg, sim_dtype act, sim_dtype weight, cfg_xla_rules *out)
{
    memset(out, 0, sizeof *out);
    cfg_hw hw;
    bool found;
    SIM_TRY(cfg_hw_from_config(cfg, 0, &hw, &found));
    if (!found) return SIM_OK;
    /* jax.lax.Precision: DEFAULT and BF16 are one bfloat16 pass on TPU; HIGH (3 passes) and HIGHEST/FLOAT32
     * (6) keep the float32 operand, so nothing narrows before the gather */
    static const char *const precisions[] = {"default", "bfloat16", "high", "highest", "float32"};
    int p;
    SIM_TRY(cfg_get_enum(cfg, "matmul_precision", precisions, 5, &p));
    *out = hw.xla;
    out->hoist_casts = hw.xla.hoist_casts && sim_dtype_size(act) < sim_dtype_size(weight);
    out->ns_gather_bf16 = hw.xla.ns_gather_bf16 && p <= 1;
    return SIM_OK;
}

/* Appends ", text" (or text first) to buf of n used bytes; returns the new length. */
static size_t add_rule(char *buf, size_t cap, size_t n, const char *text)
{
    int w = snprintf(buf + (n < cap ? n : cap), n < cap ? cap - n : 0, "%s%s", n ? ", " : "", text);
    return n + (size_t)(w > 0 ? w : 0);
}

const char *model_xla_rules_text(const cfg_xla_rules *r, char *buf, size_t cap)
{
    size_t n = 0;
    char t[96];
    buf[0] = '\0';
    if (r->hoist_casts) n = add_rule(buf, cap, n, "hoisted weight copies");
    if (r->ga_grad_copies) {
        snprintf(t, sizeof t, "%d accumulation gradient sets", r->ga_grad_copies);
        n = add_rule(buf, cap, n, t);
    }
    if (r->saved_grad_copies) {
        snprintf(t, sizeof t, "%d weight_dtype cop%s of saved products' weights", r->saved_grad_copies,
                 r->saved_grad_copies == 1 ? "y" : "ies");
        n = add_rule(buf, cap, n, t);
    }
    if (r->ns_gather_bf16) n = add_rule(buf, cap, n, "bfloat16 Newton-Schulz gathers");
    if (r->ns_gather_once) n = add_rule(buf, cap, n, "one Newton-Schulz gather per operand and step");
    if (r->muon_stacked) n = add_rule(buf, cap, n, "Muon's estimates and Newton-Schulz products held stacked");
    if (r->windowed_min_group) {
        snprintf(t, sizeof t, "windowed einsums over >= %d devices", r->windowed_min_group);
        n = add_rule(buf, cap, n, t);
    }
    if (r->psum_scatter_max_group) {
        snprintf(t, sizeof t, "expert psums reduce-scattered over <= %d devices", r->psum_scatter_max_group);
        n = add_rule(buf, cap, n, t);
    }
    if (r->regather_far) n = add_rule(buf, cap, n, "MoE attention weights re-gathered for input gradients");
    if (r->lane_scatter_ar_max) {
        snprintf(t, sizeof t, "gradients split to <= %d last-dim elements all-reduced", r->lane_scatter_ar_max);
        n = add_rule(buf, cap, n, t);
    }
    if (r->embed_all_to_all) n = add_rule(buf, cap, n, "embedding looked up by all-to-all");
    if (r->norm_splits_product) n = add_rule(buf, cap, n, "MLA's low-rank products split like their norms");
    if (!n) snprintf(buf, cap, "none (no hardware profile, or none applies: XLA:CPU's program)");
    return buf;
}

sim_status model_tm_eff_load(const char *configs_dir, model_tm_eff *out)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/timemodel.yml", configs_dir);
    cfg_config *cfg;
    SIM_TRY(cfg_load_file(path, &cfg));
    static const char *const keys[] = {"mxu_efficiency",
                                       "hbm_efficiency",
                                       "ici_efficiency",
                                       "dcn_efficiency",
                                       "layout_op_efficiency",
                                       "hop_latency_us",
                                       "prefetch_weight_collectives"};
    double v[7];
    sim_status st = SIM_OK;
    for (int i = 0; i < 7 && !st; i++) {
        const cfg_entry *e = cfg_find(cfg, keys[i]);
        if (!e) st = sim_err(SIM_ERR_INPUT, "%s: '%s' is missing", path, keys[i]);
        else st = cfg_hw_figure(&e->value, path, keys[i], &v[i]);
        if (!st && i < 5 && (v[i] <= 0 || v[i] > 1))
            st = sim_err(SIM_ERR_INPUT, "%s: %s = %g: expected a fraction in (0, 1]", path, keys[i], v[i]);
    }
    const cfg_entry *ov = st ? NULL : cfg_find(cfg, "overlap_weight_collectives");
    const char *ovt = ov && ov->value.kind == CFG_SCALAR ? ov->value.text : NULL;
    if (!st && (!ovt || (strcmp(ovt, "true") && strcmp(ovt, "false"))))
        st = sim_err(SIM_ERR_INPUT, "%s: 'overlap_weight_collectives' = %s: expected true or false", path,
                     ovt ? ovt : "(missing)");
    out->overlap_weights = ovt && !strcmp(ovt, "true");
    cfg_free(cfg);
    if (st) return st;
    out->mxu = v[0], out->hbm = v[1], out->ici = v[2], out->dcn = v[3];
    out->layout = v[4];
    out->hop_latency_s = v[5] * 1e-6;
    out->prefetch = (int)v[6];
    return SIM_OK;
}

double model_hw_peak(const cfg_hw *hw, const char *dtype, const char **note)
{
    if (note) *note = NULL;
    if (dtype && !strcmp(dtype, "float32")) {
        if (hw->peak_f32 > 0) return hw->peak_f32;
        if (note) *note = "no float32 peak is published for this accelerator: the bfloat16 peak stands in";
    }
    return hw->peak_bf16;
}

/* ------------------------------------------------------------ collectives */

double model_tm_collective(const cfg_hw *hw, const model_tm_eff *eff, const sim_record *r, int *links, double *bw)
{
    int k = r->group_size;
    *links = 0;
    *bw = 0;
    if (k <= 1 || r->bytes_sent == 0) return 0.0;
    double ici = (double)(r->bytes_sent - r->bytes_sent_dcn), dcn = (double)r->bytes_sent_dcn;
    bool a2a = r->op == SIM_OP_ALL_TO_ALL || r->op == SIM_OP_RAGGED_ALL_TO_ALL;
    if (hw->gpu) {
        *links = 1; /* through the switch: the GPU's whole NVLink injection */
    } else {
        /* a ring over the group: both directions of the ring (two links) from 3 devices on; a pair
         * or a ppermute to one neighbour has one link */
        *links = (k == 2 || r->op == SIM_OP_PPERMUTE) ? 1 : 2;
        if (a2a) { /* on a bidirectional ring a byte to rank +d travels min(d, k-d) links */
            double hops = 0;
            for (int d = 1; d < k; d++) hops += d < k - d ? d : k - d;
            ici *= hops / (double)(k - 1);
        }
    }
    *bw = (double)*links * hw->link_bw * eff->ici;
    double steps = a2a || r->op == SIM_OP_PPERMUTE ? 1.0 : (double)(k - 1);
    if (r->op == SIM_OP_ALL_REDUCE) steps *= 2.0;
    double t = eff->hop_latency_s * steps;
    if (ici > 0) t += *bw > 0 ? ici / *bw : INFINITY;
    if (dcn > 0) t += hw->dcn_bw > 0 ? dcn / (hw->dcn_bw * eff->dcn) : INFINITY;
    return t;
}

/* ------------------------------------------------------------ replay */

static int axes_slot(model_tm_result *out, sim_axes a)
{
    for (int i = 0; i < out->naxes; i++)
        if (out->axes[i].n == a.n && !memcmp(out->axes[i].axis, a.axis, sizeof a.axis[0] * (size_t)a.n)) return i;
    if (out->naxes == MODEL_TM_MAX_AXES) return MODEL_TM_MAX_AXES - 1;
    out->axes[out->naxes] = a;
    return out->naxes++;
}

static void top_add(model_tm_result *out, const model_tm_coll *c)
{
    int n = out->ntop;
    if (n == MODEL_TM_TOP && c->time_s <= out->top[n - 1].time_s) return;
    int i = n < MODEL_TM_TOP ? n++ : n - 1;
    while (i > 0 && out->top[i - 1].time_s < c->time_s) {
        out->top[i] = out->top[i - 1];
        i--;
    }
    out->top[i] = *c;
    out->ntop = n;
}

/* Kernel kinds: the tag with its digit runs as '*' (moe_layers_12 and moe_layers_13 are one kind). */
typedef struct {
    model_tm_kernel *k;
    size_t n, cap;
} kernel_sink;

static void kind_name(const char *tag, char *name, size_t cap)
{
    size_t o = 0;
    for (const char *p = tag; *p && o + 1 < cap; p++) {
        if (*p >= '0' && *p <= '9') {
            if (!o || name[o - 1] != '*') name[o++] = '*';
        } else {
            name[o++] = *p;
        }
    }
    name[o] = '\0';
}

typedef struct {
    model_tm_coll_kind *k;
    size_t n, cap;
} coll_sink;

/* memo: the kind of this stored record once found (-1 before), as a repeated block meets it again */
static void coll_add(coll_sink *s, const model_tm_coll *c, int *memo)
{
    if (*memo >= 0) {
        model_tm_coll_kind *k = &s->k[*memo];
        k->calls++;
        k->bytes += (double)c->rec.bytes_sent;
        k->time_s += c->time_s;
        return;
    }
    char name[SIM_TAG_MAX];
    kind_name(c->rec.tag, name, sizeof name);
    size_t i = 0;
    for (; i < s->n; i++) {
        const sim_record *r = &s->k[i].rec;
        if (r->op == c->rec.op && r->phase == c->rec.phase && r->axes.n == c->rec.axes.n &&
            !memcmp(r->axes.axis, c->rec.axes.axis, sizeof r->axes.axis[0] * (size_t)r->axes.n) &&
            !strcmp(r->tag, name))
            break;
    }
    if (i == s->n) {
        if (s->n == s->cap) {
            s->cap = s->cap ? 2 * s->cap : 64;
            s->k = realloc(s->k, s->cap * sizeof *s->k);
            SIM_ASSERT(s->k);
        }
        memset(&s->k[i], 0, sizeof s->k[0]);
        s->k[i].rec = c->rec;
        snprintf(s->k[i].rec.tag, sizeof s->k[i].rec.tag, "%s", name);
        s->k[i].links = c->links;
        s->k[i].bw = c->bw;
        s->n++;
    }
    *memo = (int)i;
    s->k[i].calls++;
    s->k[i].bytes += (double)c->rec.bytes_sent;
    s->k[i].time_s += c->time_s;
}

static int cmp_coll_time(const void *a, const void *b)
{
    double x = ((const model_tm_coll_kind *)a)->time_s, y = ((const model_tm_coll_kind *)b)->time_s;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* work: the matrix unit's FLOPs the replay timed (c's mxu_flops, or its flops when that is unset) */
static void kernel_add(kernel_sink *s, const sim_cost *c, double work, double bytes, double dur, bool compute_bound,
                       int *memo)
{
    size_t i = *memo >= 0 ? (size_t)*memo : 0;
    char name[SIM_TAG_MAX] = "";
    if (*memo < 0) {
        kind_name(c->tag, name, sizeof name);
        while (i < s->n && strcmp(s->k[i].name, name)) i++;
        *memo = (int)i;
    }
    if (i == s->n) {
        if (s->n == s->cap) {
            s->cap = s->cap ? 2 * s->cap : 64;
            s->k = realloc(s->k, s->cap * sizeof *s->k);
            SIM_ASSERT(s->k);
        }
        memset(&s->k[s->n], 0, sizeof s->k[0]);
        snprintf(s->k[s->n].name, sizeof s->k[0].name, "%s", name);
        s->n++;
    }
    model_tm_kernel *k = &s->k[i];
    k->calls++;
    k->flops += c->flops;
    k->mxu_flops += work;
    k->bytes += bytes;
    k->time_s += dur;
    k->compute_bound += compute_bound;
}

static int cmp_kernel_time(const void *a, const void *b)
{
    double x = ((const model_tm_kernel *)a)->time_s, y = ((const model_tm_kernel *)b)->time_s;
    return x < y ? 1 : x > y ? -1 : 0;
}

typedef struct {
    model_tm_result *out;
    bool want;
    size_t cap;
} span_sink;

static void span_add(span_sink *s, double t0, double t1, int lane, const char *name)
{
    if (!s->want || t1 <= t0) return;
    model_tm_result *o = s->out;
    if (o->nspans == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 1024;
        o->spans = realloc(o->spans, s->cap * sizeof *o->spans);
        SIM_ASSERT(o->spans);
    }
    model_tm_span *sp = &o->spans[o->nspans++];
    sp->t0 = t0, sp->t1 = t1, sp->lane = lane;
    snprintf(sp->name, sizeof sp->name, "%s", name);
}

/* The replay over the records and costs in call order, the repeated blocks expanded (a dry run's
 * steady-state microbatches and layers: every copy is timed in turn, so the clocks and sums take the
 * same steps as over the lists a full dry run keeps). */
static sim_status tm_device(const cfg_hw *hw, const model_tm_eff *eff, double peak, double act_bytes,
                            const sim_repeat *reps, size_t nreps, const sim_record *recs, size_t nrec,
                            const sim_cost *costs, size_t ncost, int step, bool want_spans, model_tm_result *out)
{
    memset(out, 0, sizeof *out);
    out->peak = peak;
    span_sink sink = {out, want_spans, 0};
    kernel_sink kinds = {NULL, 0, 0};
    coll_sink ckinds = {NULL, 0, 0};
    int depth = eff->prefetch > 0 ? eff->prefetch : 1;
    double *issued = calloc((size_t)depth, sizeof *issued); /* compute clock when recent weight gathers were asked */
    if (!issued) return sim_err(SIM_ERR_INTERNAL, "step-time model: out of host memory");
    size_t nweight = 0;
    double t = 0, sync_free = 0, async_free = 0, gather_ready = 0, fwd_flops = 0;
    int gather_slot = -1;
    /* per stored record and cost: its timing and kind once found (a repeated block meets them again) */
    typedef struct {
        double time_s, bw;
        int links, kind;
        bool timed;
    } rec_memo;
    rec_memo *rmemo = malloc((nrec ? nrec : 1) * sizeof *rmemo);
    int *cmemo = malloc((ncost ? ncost : 1) * sizeof *cmemo);
    if (!rmemo || !cmemo) {
        free(rmemo);
        free(cmemo);
        free(issued);
        return sim_err(SIM_ERR_INTERNAL, "step-time model: out of host memory");
    }
    for (size_t i = 0; i < nrec; i++) rmemo[i].timed = false, rmemo[i].kind = -1;
    for (size_t i = 0; i < ncost; i++) cmemo[i] = -1;
    sim_walk w;
    sim_walk_init(&w, recs, nrec, costs, ncost, reps, nreps);
    const sim_record *r;
    sim_cost kc;
    bool drain_known = false; /* the last asynchronous collective's axes, for the drain */
    sim_axes drain_axes = {0, {0}};
    while (sim_walk_next(&w, &r, &kc)) {
        if (r) {
            if (r->step != step) continue;
            if (r->weight && r->phase != SIM_PHASE_OPTIMIZER) drain_known = true, drain_axes = r->axes;
            rec_memo *rm = &rmemo[r - recs];
            if (!rm->timed) rm->time_s = model_tm_collective(hw, eff, r, &rm->links, &rm->bw), rm->timed = true;
            if (rm->time_s == 0) continue;
            model_tm_coll c = {*r, rm->links, rm->bw, rm->time_s, false};
            if (!isfinite(c.time_s)) {
                free(rmemo);
                free(cmemo);
                free(issued);
                free(kinds.k);
                free(ckinds.k);
                return sim_err(SIM_ERR_INPUT,
                               "hardware profile %s publishes no %s bandwidth: the %s of %s cannot be timed; add the "
                               "sourced figure to configs/hardware/%s.yml or choose another hardware_profile",
                               hw->name, r->bytes_sent_dcn ? "DCN" : "ICI", sim_op_name(r->op), r->tag, hw->name);
            }
            int slot = axes_slot(out, r->axes);
            c.async = eff->overlap_weights && r->weight && r->phase != SIM_PHASE_OPTIMIZER;
            double start;
            if (c.async && r->op == SIM_OP_ALL_GATHER) {
                double earliest = nweight >= (size_t)depth ? issued[nweight % (size_t)depth] : 0.0;
                start = async_free > earliest ? async_free : earliest;
                gather_ready = start + c.time_s;
                gather_slot = slot;
            } else if (c.async) {
                start = async_free > t ? async_free : t;
            } else {
                start = sync_free > t ? sync_free : t;
                out->exposed_axes_s[slot] += start + c.time_s - t;
                out->exposed_s += start + c.time_s - t;
                t = start + c.time_s;
                sync_free = t;
            }
            if (c.async) {
                issued[nweight % (size_t)depth] = t;
                nweight++;
                async_free = start + c.time_s;
            }
            span_add(&sink, start, start + c.time_s, c.async ? 2 : 1, r->tag);
            top_add(out, &c);
            coll_add(&ckinds, &c, &rm->kind);
            continue;
        }
        const sim_cost *k = &kc;
        if (k->step != step) continue;
        if (gather_ready > t) { /* the weight this kernel uses is still on its way */
            out->exposed_axes_s[gather_slot] += gather_ready - t;
            out->exposed_s += gather_ready - t;
            t = gather_ready;
        }
        /* the matrix unit's work: a tiled kernel (megablox gmm) computes its padded tiles too */
        double work = k->mxu_flops > k->flops ? k->mxu_flops : k->flops;
        /* a layout op (split, concatenation, head broadcast) streams below the HBM roofline */
        double tc = work / (peak * eff->mxu),
               tm = k->elements * act_bytes / (hw->hbm_bw * (k->layout ? eff->layout : eff->hbm));
        double dur = tc > tm ? tc : tm;
        kernel_add(&kinds, k, work, k->elements * act_bytes, dur, tc >= tm, &cmemo[w.ci - 1]);
        span_add(&sink, t, t + dur, 0, k->tag);
        t += dur;
        out->compute_s += dur;
        if (k->phase == SIM_PHASE_FORWARD) fwd_flops += k->flops;
    }
    if (async_free > t) { /* gradient reductions still running when compute ends */
        out->exposed_s += async_free - t;
        if (out->naxes) {
            /* attribute the drain to the axes of the last asynchronous collective */
            if (drain_known) out->exposed_axes_s[axes_slot(out, drain_axes)] += async_free - t;
        }
        t = async_free;
    }
    out->step_s = t;
    out->model_flops = 3.0 * fwd_flops;
    free(issued);
    free(rmemo);
    free(cmemo);
    if (kinds.n) qsort(kinds.k, kinds.n, sizeof kinds.k[0], cmp_kernel_time);
    for (size_t i = 0; i < kinds.n && i < MODEL_TM_TOP; i++) out->kernels[out->nkernels++] = kinds.k[i];
    free(kinds.k);
    if (ckinds.n) qsort(ckinds.k, ckinds.n, sizeof ckinds.k[0], cmp_coll_time);
    for (size_t i = 0; i < ckinds.n && i < MODEL_TM_TOP; i++) out->colls[out->ncolls++] = ckinds.k[i];
    free(ckinds.k);
    return SIM_OK;
}

sim_status model_tm_device(const cfg_hw *hw, const model_tm_eff *eff, double peak, double act_bytes,
                           const sim_record *recs, size_t nrec, const sim_cost *costs, size_t ncost, int step,
                           bool want_spans, model_tm_result *out)
{
    return tm_device(hw, eff, peak, act_bytes, NULL, 0, recs, nrec, costs, ncost, step, want_spans, out);
}

sim_status model_tm_estimate(const cfg_hw *hw, const model_tm_eff *eff, const char *dtype, sim_machine *m, int step,
                             double bubble_fraction, double optimizer_bytes, bool want_spans, model_tm_result *out)
{
    memset(out, 0, sizeof *out);
    double act_bytes = dtype && !strcmp(dtype, "float32") ? 4.0 : 2.0; /* bfloat16/float16: 2 */
    double peak = model_hw_peak(hw, dtype, NULL);
    int n = sim_machine_num_devices(m);
    double worst = -1;
    for (int id = 0; id < n; id++) {
        sim_device *d = sim_machine_device(m, id);
        size_t nrec, ncost;
        const sim_record *recs = sim_device_records(d, &nrec);
        const sim_cost *costs = sim_device_costs(d, &ncost);
        model_tm_result r;
        size_t nreps;
        const sim_repeat *reps = sim_device_repeats(d, &nreps);
        SIM_TRY(tm_device(hw, eff, peak, act_bytes, reps, nreps, recs, nrec, costs, ncost, step, false, &r));
        if (r.step_s > worst) {
            worst = r.step_s;
            *out = r;
            out->device = id;
        }
    }
    if (want_spans) { /* the slowest device again, with its timeline */
        sim_device *d = sim_machine_device(m, out->device);
        size_t nrec, ncost;
        const sim_record *recs = sim_device_records(d, &nrec);
        const sim_cost *costs = sim_device_costs(d, &ncost);
        int dev = out->device;
        size_t nreps;
        const sim_repeat *reps = sim_device_repeats(d, &nreps);
        SIM_TRY(tm_device(hw, eff, peak, act_bytes, reps, nreps, recs, nrec, costs, ncost, step, true, out));
        out->device = dev;
    }
    /* the optimizer's elementwise passes and the metrics' norms (model_opt_step_bytes): memory-bound,
     * after the gradients are reduced */
    out->optimizer_s = optimizer_bytes / (hw->hbm_bw * eff->hbm);
    out->step_s += out->optimizer_s;
    out->bubble_s = out->compute_s * bubble_fraction;
    out->model_flops *= 1.0 - bubble_fraction;
    out->mfu = out->step_s > 0 ? out->model_flops / (out->step_s * peak) : 0;
    return SIM_OK;
}

/* ------------------------------------------------------------ output */

static const char *hw_shape(const cfg_hw *hw, char *buf, size_t cap)
{
    if (!hw->torus_n) return "";
    size_t u = (size_t)snprintf(buf, cap, ", slice ");
    for (int i = 0; i < hw->torus_n && u < cap; i++)
        u += (size_t)snprintf(buf + u, cap - u, "%s%d", i ? "x" : "", hw->torus[i]);
    return buf;
}

void model_tm_print(FILE *f, const cfg_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r)
{
    char shape[64], ax[128];
    fprintf(
        f,
        "estimated step time on %s%s (configs/timemodel.yml; README \"Hardware profiles and the step-time model\"):\n",
        hw->name, hw_shape(hw, shape, sizeof shape));
    fprintf(f, "  step %10.3f ms   MFU %5.1f%%   (slowest device %d; peak %.0f TFLOP/s per device)\n", r->step_s * 1e3,
            100.0 * r->mfu, r->device, r->peak / 1e12);
    fprintf(f,
            "  compute %7.3f ms (of which pipeline bubbles %.3f ms)   optimizer %.3f ms   exposed "
            "communication %.3f ms\n",
            r->compute_s * 1e3, r->bubble_s * 1e3, r->optimizer_s * 1e3, r->exposed_s * 1e3);
    for (int i = 0; i < r->naxes; i++)
        if (r->exposed_axes_s[i] > 0)
            fprintf(f, "    exposed over %-24s %10.3f ms\n", sim_axes_label(mesh, r->axes[i], ax, sizeof ax),
                    r->exposed_axes_s[i] * 1e3);
    if (r->nkernels) {
        fprintf(f,
                "  slowest kernels (device %d; a kind: the tag without its layer numbers; MXU: the matrix unit's\n"
                "  work with padded tiles; bound: by FLOPs or by HBM bytes):\n",
                r->device);
        fprintf(f, "    %6s %10s %10s %10s %6s %10s  %s\n", "calls", "TFLOP", "MXU TFLOP", "HBM GB", "bound",
                "time (ms)", "kernel");
        for (int i = 0; i < r->nkernels; i++) {
            const model_tm_kernel *k = &r->kernels[i];
            fprintf(f, "    %6d %10.3f %10.3f %10.3f %6s %10.3f  %s\n", k->calls, k->flops / 1e12, k->mxu_flops / 1e12,
                    k->bytes / 1e9, 2 * k->compute_bound >= k->calls ? "FLOPs" : "bytes", k->time_s * 1e3, k->name);
        }
    }
    if (r->ncolls) {
        fprintf(f,
                "  slowest kinds of collective (device %d; all calls of a kind; a kind: op, axes, phase and the tag\n"
                "  without its layer numbers):\n",
                r->device);
        fprintf(f, "    %-17s %-16s %-8s %6s %12s %6s %8s %10s  %s\n", "op", "axes", "phase", "calls", "GB sent",
                "links", "GB/s", "time (ms)", "tag");
        for (int i = 0; i < r->ncolls; i++) {
            const model_tm_coll_kind *c = &r->colls[i];
            fprintf(f, "    %-17s %-16s %-8s %6d %12.3f %6d %8.1f %10.3f  %s\n", sim_op_name(c->rec.op),
                    sim_axes_label(mesh, c->rec.axes, ax, sizeof ax), sim_phase_name(c->rec.phase), c->calls,
                    c->bytes / 1e9, c->links, c->bw / 1e9, c->time_s * 1e3, c->rec.tag);
        }
    }
    if (!r->ntop) return;
    fprintf(f, "  slowest collectives (device %d):\n", r->device);
    fprintf(f, "    %-17s %-16s %-8s %12s %6s %12s %10s  %s\n", "op", "axes", "phase", "bytes sent", "links", "GB/s",
            "time (ms)", "tag");
    for (int i = 0; i < r->ntop; i++) {
        const model_tm_coll *c = &r->top[i];
        fprintf(f, "    %-17s %-16s %-8s %12llu %6d %12.1f %10.3f  %s%s\n", sim_op_name(c->rec.op),
                sim_axes_label(mesh, c->rec.axes, ax, sizeof ax), sim_phase_name(c->rec.phase),
                (unsigned long long)c->rec.bytes_sent, c->links, c->bw / 1e9, c->time_s * 1e3, c->rec.tag,
                c->async ? " (async)" : "");
    }
}

/* One collective of the estimate as a JSON object: a single call (`one`: its exact bytes, whether it
 * overlaps) or a kind of call (`kind`: its phase, how many calls, their bytes). */
static void coll_json(cfg_jw *w, const sim_mesh_desc *mesh, const model_tm_coll *one, const model_tm_coll_kind *kind)
{
    const sim_record *rec = one ? &one->rec : &kind->rec;
    char ax[128];
    cfg_jw_obj(w);
    cfg_jw_key(w, "op");
    cfg_jw_str(w, sim_op_name(rec->op));
    cfg_jw_key(w, "axes");
    cfg_jw_str(w, sim_axes_label(mesh, rec->axes, ax, sizeof ax));
    if (kind) {
        cfg_jw_key(w, "phase");
        cfg_jw_str(w, sim_phase_name(rec->phase));
    }
    cfg_jw_key(w, "tag");
    cfg_jw_str(w, rec->tag);
    if (kind) {
        cfg_jw_key(w, "calls");
        cfg_jw_int(w, kind->calls);
    }
    cfg_jw_key(w, "bytes_sent");
    if (kind) cfg_jw_num(w, kind->bytes, 17);
    else cfg_jw_u64(w, (unsigned long long)rec->bytes_sent);
    cfg_jw_key(w, "links");
    cfg_jw_int(w, one ? one->links : kind->links);
    cfg_jw_key(w, "bandwidth_Bps");
    cfg_jw_num(w, one ? one->bw : kind->bw, 6);
    cfg_jw_key(w, "time_s");
    cfg_jw_num(w, one ? one->time_s : kind->time_s, 6);
    if (one) {
        cfg_jw_key(w, "async");
        cfg_jw_bool(w, one->async);
    }
    cfg_jw_end(w);
}

/* The figures keep the digits the estimate has always been written with (%.17g for the times, %.6g
 * for rates and counts), through the one JSON writer. */
void model_tm_json(cfg_jw *w, const cfg_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r)
{
    char ax[128];
    cfg_jw_obj(w);
    cfg_jw_key(w, "hardware_profile");
    cfg_jw_str(w, hw->name);
    static const char *const keys[] = {"step_s",
                                       "mfu",
                                       "compute_s",
                                       "bubble_s",
                                       "optimizer_s",
                                       "exposed_communication_s",
                                       "peak_flops_per_device",
                                       "model_flops_per_device"};
    const double vals[] = {r->step_s,      r->mfu,       r->compute_s, r->bubble_s,
                           r->optimizer_s, r->exposed_s, r->peak,      r->model_flops};
    static const int digits[] = {17, 6, 17, 17, 17, 17, 6, 6};
    for (int i = 0; i < 8; i++) {
        cfg_jw_key(w, keys[i]);
        cfg_jw_num(w, vals[i], digits[i]);
    }
    cfg_jw_key(w, "slowest_device");
    cfg_jw_int(w, r->device);
    cfg_jw_key(w, "exposed_by_axes");
    cfg_jw_obj(w);
    for (int i = 0; i < r->naxes; i++) {
        cfg_jw_key(w, sim_axes_label(mesh, r->axes[i], ax, sizeof ax));
        cfg_jw_num(w, r->exposed_axes_s[i], 6);
    }
    cfg_jw_end(w);
    cfg_jw_key(w, "slowest_collectives");
    cfg_jw_arr(w);
    for (int i = 0; i < r->ntop; i++) coll_json(w, mesh, &r->top[i], NULL);
    cfg_jw_end(w);
    cfg_jw_key(w, "slowest_collective_kinds");
    cfg_jw_arr(w);
    for (int i = 0; i < r->ncolls; i++) coll_json(w, mesh, NULL, &r->colls[i]);
    cfg_jw_end(w);
    cfg_jw_key(w, "slowest_kernels");
    cfg_jw_arr(w);
    for (int i = 0; i < r->nkernels; i++) {
        const model_tm_kernel *k = &r->kernels[i];
        cfg_jw_obj(w);
        cfg_jw_key(w, "kernel");
        cfg_jw_str(w, k->name);
        cfg_jw_key(w, "calls");
        cfg_jw_int(w, k->calls);
        static const char *const kkeys[] = {"flops", "mxu_flops", "hbm_bytes", "time_s"};
        const double kv[] = {k->flops, k->mxu_flops, k->bytes, k->time_s};
        for (int j = 0; j < 4; j++) {
            cfg_jw_key(w, kkeys[j]);
            cfg_jw_num(w, kv[j], 6);
        }
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    cfg_jw_end(w);
}

sim_status model_tm_write_trace(FILE *f, const cfg_hw *hw, const model_tm_result *r)
{
    static const char *const lanes[] = {"compute", "collectives (blocking)", "collectives (async: weights)"};
    sim_trace_out *o;
    SIM_TRY(sim_trace_out_new(f, &o));
    sim_trace_out_meta_str(o, "timeline", "modelled"); /* one step of the slowest device, in the profile's time */
    sim_trace_out_meta_str(o, "hardware_profile", hw->name);
    sim_trace_out_meta_u64(o, "device", (uint64_t)r->device);
    char name[256];
    snprintf(name, sizeof name, "device %d, modelled on %s", r->device, hw->name);
    sim_trace_out_process(o, 0, name, 0);
    for (int l = 0; l < 3; l++) sim_trace_out_thread(o, 0, l, lanes[l]);
    for (size_t i = 0; i < r->nspans; i++) {
        const model_tm_span *s = &r->spans[i];
        double t0 = s->t0 * 1e9, t1 = s->t1 * 1e9; /* nanoseconds */
        uint64_t a = t0 > 0 ? (uint64_t)llround(t0) : 0, b = t1 > 0 ? (uint64_t)llround(t1) : 0;
        sim_trace_out_span(o, 0, s->lane, a, b > a ? b - a : 0, s->name, NULL);
        sim_trace_out_event_end(o);
    }
    return sim_trace_out_end(o);
}

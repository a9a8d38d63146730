/* explain.c — `shardsim explain`: the collectives that turn one sharding of
 * an array into another, step by step, with a device-grid picture of both
 * shardings.  The plan is then run for real on the simulated mesh (dry when
 * the array is large) to check that values survive and that the counted
 * bytes equal the plan's.  Specs come as PartitionSpec text (from=, to=) or
 * as logical axis names resolved with the config's rules (from_logical=,
 * to_logical=); the mesh comes from mesh=axis=size,... or the config's
 * ici_* and dcn_* flags.  Bytes are counted in the dtype train would count
 * the array in: the config's weight_dtype for a parameter (tensor=weight, or
 * logical names that are all axes of the config's model's parameters) -- its
 * dtype where the hardware profile's compiler casts weights before moving
 * them (model_hw_wire_dtypes) -- its dtype for anything else; dtype= overrides
 * both. */
#include "cli/cli.h"
#include "cli/common.h"

#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "models/core/model.h"
#include "models/core/timemodel.h"
#include "mesh/reshard.h"
#include "mesh/rules.h"
#include "mesh/visual.h"

typedef struct {
    const mesh_shape *m;
    const mesh_plan *plan;
    size_t es;
    unsigned char *global, *out;
    uint64_t sent[SIM_MAX_DEVICES];
} verify_state;

static sim_status verify_device(sim_device *d, void *arg)
{
    verify_state *vs = arg;
    const mesh_plan *p = vs->plan;
    mesh_array a;
    SIM_TRY(mesh_array_new(d, vs->m, "explain", p->rank, p->shape, &p->from, p->dtype, SIM_MEM_ACTIVATIONS, &a));
    if (vs->global) mesh_array_load_global(d, vs->m, &a, vs->global);
    SIM_TRY(mesh_plan_run(d, vs->m, p, &a, sim_meta_tag("explain")));
    size_t nr;
    const sim_record *rec = sim_device_records(d, &nr);
    for (size_t i = 0; i < nr; i++) vs->sent[sim_device_id(d)] += rec[i].bytes_sent;
    if (vs->out && a.spec.partial) {
        mesh_spec full = a.spec;
        full.partial = 0;
        SIM_TRY(mesh_reshard(d, vs->m, &a, &full, sim_meta_tag("explain/check")));
    }
    if (vs->out) SIM_TRY(mesh_array_store_global(d, vs->m, &a, vs->out));
    mesh_array_free(d, &a);
    return SIM_OK;
}

/* Runs the plan on the mesh; *ok and a one-line verdict in msg. */
static sim_status verify(const mesh_shape *m, const mesh_plan *p, char *msg, size_t cap)
{
    sim_mesh_desc md;
    SIM_TRY(mesh_shape_to_sim(m, &md));
    int64_t n = 1;
    for (int i = 0; i < p->rank; i++) n *= p->shape[i];
    bool dry = n > (1 << 24);
    sim_machine_opts o = {0};
    o.dry_run = dry;
    o.quiet = true;
    sim_machine *mach;
    SIM_TRY(sim_machine_new(&md, &o, &mach));
    verify_state *vs = calloc(1, sizeof *vs);
    vs->m = m;
    vs->plan = p;
    vs->es = sim_dtype_size(p->dtype);
    if (!dry) {
        vs->global = malloc((size_t)n * vs->es);
        vs->out = calloc((size_t)n, vs->es);
        for (int64_t i = 0; i < n; i++) {
            if (p->dtype == SIM_F32) ((float *)vs->global)[i] = (float)(i % 65521);
            else if (p->dtype == SIM_I32) ((int32_t *)vs->global)[i] = (int32_t)i;
            else
                for (size_t b = 0; b < vs->es; b++)
                    vs->global[(size_t)i * vs->es + b] = (unsigned char)(i * 7 + (int64_t)b);
        }
    }
    sim_status st = sim_machine_run(mach, verify_device, vs);
    if (st == SIM_OK) {
        bool values = dry || !memcmp(vs->global, vs->out, (size_t)n * vs->es);
        bool bytes = true; /* every device's count equals what the plan says of that device */
        for (int d = 0; d < m->num_devices; d++) bytes = bytes && vs->sent[d] == mesh_plan_device_bytes(p, m, d);
        snprintf(msg, cap, "%s on %d simulated devices: %s, counted bytes %s the plan", dry ? "dry-run" : "run",
                 m->num_devices,
                 dry      ? "no data moved (large array)"
                 : values ? "values preserved"
                          : "VALUES DIFFER",
                 bytes ? "equal" : "DIFFER FROM");
        if (!values || !bytes) st = sim_err(SIM_ERR_CHECK, "%s", msg);
    }
    free(vs->global);
    free(vs->out);
    free(vs);
    sim_machine_free(mach);
    return st;
}

static sim_status logical_spec(const cfg_config *cfg, const mesh_shape *m, const char *text, int rank, const char *what,
                               mesh_spec *out)
{
    mesh_rules rules;
    mesh_rules_init(&rules);
    sim_status st = mesh_rules_from_config(cfg, &rules);
    if (st) return st;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", text);
    const char *names[MESH_SPEC_MAX_RANK];
    int n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        while (*tok == ' ' || *tok == '(' || *tok == '[' || *tok == '\'') tok++;
        char *e = tok + strlen(tok);
        while (e > tok && (e[-1] == ' ' || e[-1] == ')' || e[-1] == ']' || e[-1] == '\'')) *--e = '\0';
        if (n == MESH_SPEC_MAX_RANK) {
            mesh_rules_free(&rules);
            return sim_err(SIM_ERR_INPUT, "%s='%s': more than %d names", what, text, MESH_SPEC_MAX_RANK);
        }
        names[n++] = (!strcmp(tok, "None") || !strcmp(tok, "null") || !*tok) ? NULL : tok;
        /* A name no rule mentions would resolve to None (replicated) without a
         * word; for a question about one array that is a typo, not a choice. */
        if (names[n - 1] && mesh_rules_find(&rules, names[n - 1]) < 0) {
            char known[2048];
            size_t len = 0;
            const char *near = NULL;
            int best = 4; /* suggest only a close name */
            known[0] = '\0';
            for (int i = 0; i < rules.n; i++) {
                if (mesh_rules_find(&rules, rules.rules[i].name) != i) continue;
                int dist = cfg_edit_distance(names[n - 1], rules.rules[i].name);
                if (dist < best) best = dist, near = rules.rules[i].name;
                if (len < sizeof known - 64)
                    len +=
                        (size_t)snprintf(known + len, sizeof known - len, "%s%s", len ? ", " : "", rules.rules[i].name);
            }
            st = sim_err(SIM_ERR_INPUT,
                         "%s: '%s' is not a logical axis name of the rules in effect (logical_axis_rules)%s%s%s; "
                         "write None for a replicated dim, or one of: %s",
                         what, names[n - 1], near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "", known);
            mesh_rules_free(&rules);
            return st;
        }
    }
    if (n != rank) {
        mesh_rules_free(&rules);
        return sim_err(SIM_ERR_INPUT, "%s='%s' names %d dims but shape has %d", what, text, n, rank);
    }
    mesh_resolved r;
    st = mesh_rules_resolve(&rules, m, what, rank, names, &r);
    mesh_rules_free(&rules);
    if (st) return st;
    *out = r.spec;
    return SIM_OK;
}

/* The logical names in `text` (comma separated, brackets and quotes
 * stripped, None dropped) into names[0..*n). */
static void logical_names(const char *text, char (*names)[64], int *n)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", text);
    *n = 0;
    for (char *tok = strtok(buf, ","); tok && *n < MESH_SPEC_MAX_RANK; tok = strtok(NULL, ",")) {
        while (*tok == ' ' || *tok == '(' || *tok == '[' || *tok == '\'') tok++;
        char *e = tok + strlen(tok);
        while (e > tok && (e[-1] == ' ' || e[-1] == ')' || e[-1] == ']' || e[-1] == '\'')) *--e = '\0';
        if (*tok && strcmp(tok, "None") && strcmp(tok, "null")) snprintf(names[(*n)++], 64, "%s", tok);
    }
}

/* Whether some parameter of `def` has a dim with logical name `name`. */
static bool parameter_axis(const model_def *def, const char *name)
{
    for (int i = 0; i < def->nparams; i++)
        for (int d = 0; d < def->defs[i].rank; d++)
            if (def->defs[i].logical[d] && !strcmp(def->defs[i].logical[d], name)) return true;
    return false;
}

/* The dtype bytes are counted in, as train counts them (models/core/model.c's
 * counted dtypes): weight_dtype for a parameter, dtype for an activation,
 * or `override` (dtype=, already checked) when given; `why` says which and
 * why.  A parameter is tensor=weight, or (without tensor=) an array whose
 * logical names, on every side given as logical names, are all logical axes
 * of the config's model's parameters -- the question is then about a weight
 * as the model shards it.  With an override the model only adds a note, so
 * a model that cannot be defined is no error then. */
static sim_status counted_dtype(const cfg_config *cfg, const char *tensor, const char *from_l, const char *to_l,
                                const char *override, sim_dtype *dt, char *why, size_t cap)
{
    static const char *const names[] = {"float32", "bfloat16"};
    static const sim_dtype dts[] = {SIM_F32, SIM_BF16};
    int act, wgt;
    SIM_TRY(cfg_get_enum(cfg, "dtype", names, 2, &act));
    SIM_TRY(cfg_get_enum(cfg, "weight_dtype", names, 2, &wgt));
    bool weight = false;
    /* the longest reason is a 64-character name plus 45 characters of text; 160 keeps the sentence
     * below within the caller's 768 bytes (GCC -O1 checks that bound) */
    char reason[160] = "";
    if (tensor) {
        if (strcmp(tensor, "weight") && strcmp(tensor, "activation"))
            return sim_err(SIM_ERR_INPUT,
                           "tensor='%s': expected weight (counted in weight_dtype) or activation (counted in dtype)",
                           tensor);
        weight = !strcmp(tensor, "weight");
        snprintf(reason, sizeof reason, "tensor=%.16s", tensor);
    } else if (from_l || to_l) {
        char nm[2 * MESH_SPEC_MAX_RANK][64];
        int n = 0, k;
        if (from_l) logical_names(from_l, nm, &n);
        if (to_l) logical_names(to_l, nm + n, &k), n += k;
        model_def *def = calloc(1, sizeof *def);
        if (!def) return sim_err(SIM_ERR_INTERNAL, "explain: out of host memory");
        sim_status st = model_def_from_config(cfg, def);
        const char *other = NULL;
        for (int i = 0; !st && i < n && !other; i++)
            if (!parameter_axis(def, nm[i])) other = nm[i];
        model_def_free(def);
        free(def);
        if (st && override) {
            sim_err_clear();
            snprintf(why, cap, "%.16s (dtype=)", override);
            return SIM_OK;
        }
        if (st) {
            sim_err_append("\n(explain tells a weight from an activation by the logical axes of the config's model's "
                           "parameters, and that model could not be defined; give tensor=weight or "
                           "tensor=activation, or dtype=, to count the array without it)");
            return st;
        }
        weight = n > 0 && !other;
        if (weight) snprintf(reason, sizeof reason, "its logical names are all parameter axes of the config's model");
        else if (other) snprintf(reason, sizeof reason, "'%.64s' is not a parameter axis of the config's model", other);
        else snprintf(reason, sizeof reason, "no logical name given");
    } else {
        snprintf(reason, sizeof reason, "no tensor= or logical names given");
    }
    /* a weight moves in the dtype the hardware profile's compiler gathers it in (weight_dtype with no
     * profile, as XLA:CPU; `dtype` on a TPU or GPU profile, which casts the shard first) */
    sim_dtype gather, reduce;
    char rule[192];
    SIM_TRY(model_hw_wire_dtypes(cfg, dts[act], dts[wgt], &gather, &reduce, rule, sizeof rule));
    bool cast = gather != dts[wgt];
    const char *wkey = cast ? "dtype" : "weight_dtype";
    sim_dtype counted = weight ? gather : dts[act];
    if (override) {
        snprintf(why, cap, "%.16s (dtype=; train counts this %s in the config's %s, %s)", override,
                 weight ? "weight" : "activation", weight ? wkey : "dtype", sim_dtype_name(counted));
        return SIM_OK;
    }
    *dt = counted;
    snprintf(why, cap, "%s, the config's %s (%s: %s; tensor=%s counts it in %s, %s, and dtype= in any)%s%.190s",
             sim_dtype_name(*dt), weight ? wkey : "dtype", weight ? "a weight" : "an activation", reason,
             weight ? "activation" : "weight", weight ? "dtype" : wkey, weight ? names[act] : sim_dtype_name(gather),
             weight ? "; " : "", weight ? rule : "");
    return SIM_OK;
}

int cli_explain(int argc, char **argv, FILE *out, FILE *err)
{
    static const char *const own[] = {"mesh",         "shape",      "dtype",  "from",  "to",
                                      "from_logical", "to_logical", "verify", "tensor"};
    cli_args a;
    sim_status st = cli_split_args(argc, argv, own, 9, &a);
    if (st) return cli_fail(err, st);
    const char *mesh_text = cli_arg(&a, "mesh"), *shape_text = cli_arg(&a, "shape"), *dtype_text = cli_arg(&a, "dtype"),
               *from = cli_arg(&a, "from"), *to = cli_arg(&a, "to"), *from_l = cli_arg(&a, "from_logical"),
               *to_l = cli_arg(&a, "to_logical"), *verify_text = cli_arg(&a, "verify"), *tensor = cli_arg(&a, "tensor");
    if (!shape_text || (!from && !from_l) || (!to && !to_l)) {
        sim_err(SIM_ERR_INPUT,
                "explain needs shape= and a from= (or from_logical=) and a to= (or to_logical=), e.g.\n"
                "  shardsim explain mesh=data=2,fsdp=2,tensor=2 shape=8,16 from=\"P(('data','fsdp'),None)\" "
                "to=\"P(None,'tensor')\"");
        return cli_fail(err, SIM_ERR_INPUT);
    }
    sim_dtype dt = SIM_F32;
    char dt_why[768] = "";
    if (dtype_text) {
        if (!strcmp(dtype_text, "float32")) dt = SIM_F32;
        else if (!strcmp(dtype_text, "bfloat16")) dt = SIM_BF16;
        else if (!strcmp(dtype_text, "int32")) dt = SIM_I32;
        else {
            sim_err(SIM_ERR_INPUT, "dtype='%s': expected float32, bfloat16 or int32", dtype_text);
            return cli_fail(err, SIM_ERR_INPUT);
        }
    }
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    if ((st = cli_parse_shape(shape_text, "shape", &rank, shape))) return cli_fail(err, st);

    cfg_config *cfg = NULL;
    mesh_shape m;
    /* the config always: it gives the dtypes (and the rules and the mesh when asked) */
    SIM_TRY_GOTO(cli_configs_check(), st, fail);
    SIM_TRY_GOTO(cfg_load_argv(cli_base_config(), a.n_cfg, a.cfg, &cfg), st, fail);
    SIM_TRY_GOTO(counted_dtype(cfg, tensor, from_l, to_l, dtype_text, &dt, dt_why, sizeof dt_why), st, fail);
    SIM_TRY_GOTO(mesh_text ? cli_parse_mesh(mesh_text, &m) : mesh_shape_from_config(cfg, &m), st, fail);
    mesh_spec fs, ts;
    SIM_TRY_GOTO(from ? mesh_spec_parse(from, &m, &fs) : logical_spec(cfg, &m, from_l, rank, "from_logical", &fs), st,
                 fail);
    SIM_TRY_GOTO(to ? mesh_spec_parse(to, &m, &ts) : logical_spec(cfg, &m, to_l, rank, "to_logical", &ts), st, fail);
    mesh_plan plan;
    SIM_TRY_GOTO(mesh_plan_make(&m, "the array", rank, shape, dt, &fs, &ts, &plan), st, fail);
    char mbuf[512];
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= shape[i];
    fprintf(out, "mesh: %s (%d devices)%s\narray: %s (", mesh_shape_format(&m, mbuf, sizeof mbuf), m.num_devices,
            mesh_text ? "" : ", from the config's ici_*/dcn_* flags (mesh=axis=size,... chooses another)",
            sim_dtype_name(dt));
    for (int i = 0; i < rank; i++) fprintf(out, "%s%lld", i ? ", " : "", (long long)shape[i]);
    fprintf(out, "), %lld bytes\ndtype: %s\n\nfrom: ", (long long)(n * (int64_t)sim_dtype_size(dt)), dt_why);
    fs = plan.from;
    ts = plan.to;
    mesh_visualize(out, &m, &fs, rank, shape);
    fprintf(out, "\nto:   ");
    mesh_visualize(out, &m, &ts, rank, shape);
    fprintf(out, "\n");
    if (!verify_text || strcmp(verify_text, "false")) {
        char msg[256];
        SIM_TRY_GOTO(verify(&m, &plan, msg, sizeof msg), st, fail);
        fprintf(out, "plan (%s):\n", msg);
    } else {
        fprintf(out, "plan:\n");
    }
    mesh_plan_print(&plan, &m, out);
fail:
    cfg_free(cfg);
    return st ? cli_fail(err, st) : 0;
}

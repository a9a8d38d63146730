/* plan.c — `shardsim plan`: every mesh, rule set, remat policy and accumulation the search space
 * (configs/plan.yml) holds, checked as `train` checks them, pruned by memory, dry-run within a
 * budget and ranked by the hardware profile's modelled step time.
 *
 * Stages, cheapest first:
 *   1. structures: rule set x mesh (ici within a slice, dcn across slices) x shard_mode x
 *      shard_optimizer_over_data, each loaded with the config loader and defined with
 *      model_def_from_config as `train` does: a refusal rejects the structure and every knob
 *      variant of it with train's own message;
 *   2. a lower bound: the parameters, gradients and optimizer state one device holds (their
 *      shards under the candidate's specs) against the device's HBM;
 *   3. equivalent candidates (the same mesh, parameter specs, logical-name resolution and knobs)
 *      are dry-run once;
 *   4. knob variants (remat_policy x gradient_accumulation_steps x pipeline microbatches) of the
 *      structures that pass, each loaded and checked as in 1;
 *   5. dry runs, at most plan_dry_runs of them: first every structure with its default knobs
 *      (lowest lower bound first), then the knob variants of the best structures.  A dry run
 *      simulates one or two layers of each kind (llama's decoder layer; DeepSeek's dense and MoE
 *      layers; a pipeline's stages' worth) and extrapolates every figure (peak bytes by category,
 *      step time and its parts, bytes per mesh axis) to the model's layer count: layers of a
 *      kind are identical, so each figure is affine in their number.  The top plan_verify
 *      candidates are then dry-run in full with the device's HBM, which replaces their figures.
 * Each dry run runs in a child process: a candidate that trips an assertion or hangs costs its
 * own rank, not the search, and every run starts from a clean heap.
 *
 * Ranking: fitting candidates by modelled step time, then peak memory, then enumeration order
 * (deterministic).  Each printed candidate carries the command line that reproduces it with
 * `shardsim train`. */
#include "cli/plan.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/artifacts.h"
#include "cli/cli.h"
#include "cli/common.h"
#include "cli/report.h"
#include "cli/report_html.h"
#include "config/config.h"
#include "config/json.h"
#include "config/release.h"
#include "mesh/mesh_shape.h"
#include "models/core/checks.h"
#include "models/core/data.h"
#include "models/core/model.h"
#include "models/optimizers/optim.h"
#include "models/core/timemodel.h"
#include "models/core/train.h"
#include "sim/machine.h"
#include "sim/topology.h"
#include "sim/xrank.h"

enum {
    PLAN_LIST = 24,          /* items of one search-space list */
    PLAN_NAME = 64,          /* bytes of one list item */
    PLAN_WORD = 112,         /* bytes of one key=value word */
    PLAN_CW = 24,            /* words of one candidate (its varied keys) */
    PLAN_USER = 256,         /* the user's words */
    PLAN_AXES = 8,           /* mesh-axis groups kept per result */
    PLAN_MAX_STRUCT = 20000, /* structures enumerated at most (the search says when it stops early) */
    PLAN_REASONS = 64,       /* distinct rejection reasons kept (the rest pooled) */
    PLAN_CHILD_TIMEOUT_S = 900,
    PLAN_DEFAULT_BUDGET = 48 /* plan_dry_runs=0: 48 - devices / 8, at least 24 */
};

/* ------------------------------------------------------------ the search space */

typedef struct {
    int n;
    char s[PLAN_LIST][PLAN_NAME];
} plan_list;

typedef struct {
    plan_list ici_axes, dcn_axes, moe_only, rule_sets, modes, remat;
    int zero1[2], nzero1;
    int ga[PLAN_LIST], nga;
    int mb[PLAN_LIST], nmb;
    int max_split;
} plan_space;

static bool list_has(const plan_list *l, const char *s)
{
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->s[i], s)) return true;
    return false;
}

static sim_status space_list(const cfg_config *f, const char *path, const char *key, plan_list *out)
{
    const char **items = NULL;
    int n = 0;
    SIM_TRY(cfg_get_str_list(f, key, &items, &n));
    memset(out, 0, sizeof *out);
    sim_status st = SIM_OK;
    for (int i = 0; i < n && !st; i++) {
        const char *v = items[i] ? items[i] : "";
        if (out->n == PLAN_LIST || strlen(v) >= PLAN_NAME)
            st = sim_err(SIM_ERR_INPUT, "%s: %s holds more than %d items or an item longer than %d bytes; shorten it",
                         path, key, PLAN_LIST, PLAN_NAME - 1);
        else snprintf(out->s[out->n++], PLAN_NAME, "%s", v);
    }
    free(items);
    return st;
}

static sim_status space_ints(const cfg_config *f, const char *path, const char *key, int lo, int *out, int *n)
{
    plan_list l;
    SIM_TRY(space_list(f, path, key, &l));
    *n = 0;
    for (int i = 0; i < l.n; i++) {
        char *end;
        long v = strtol(l.s[i], &end, 10);
        if (*end || v < lo || v > 1 << 20)
            return sim_err(SIM_ERR_INPUT, "%s: %s holds '%s'; expected integers from %d to %d", path, key, l.s[i], lo,
                           1 << 20);
        out[(*n)++] = (int)v;
    }
    if (*n == 0) return sim_err(SIM_ERR_INPUT, "%s: %s is empty; give at least one value", path, key);
    return SIM_OK;
}

static sim_status space_load(plan_space *sp)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/plan.yml", cli_configs_dir());
    cfg_config *f = NULL;
    SIM_TRY(cfg_load_file(path, &f));
    memset(sp, 0, sizeof *sp);
    plan_list z;
    long long ms = 0;
    sim_status st;
    SIM_TRY_GOTO(space_list(f, path, "ici_axes", &sp->ici_axes), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "dcn_axes", &sp->dcn_axes), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "moe_only_axes", &sp->moe_only), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "rule_sets", &sp->rule_sets), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "shard_modes", &sp->modes), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "remat_policies", &sp->remat), st, fail);
    SIM_TRY_GOTO(space_list(f, path, "shard_optimizer_over_data", &z), st, fail);
    for (int i = 0; i < z.n && i < 2; i++) sp->zero1[sp->nzero1++] = !strcmp(z.s[i], "true");
    SIM_TRY_GOTO(space_ints(f, path, "gradient_accumulation_steps", 1, sp->ga, &sp->nga), st, fail);
    SIM_TRY_GOTO(space_ints(f, path, "pipeline_microbatches_per_stage", 1, sp->mb, &sp->nmb), st, fail);
    SIM_TRY_GOTO(cfg_get_int(f, "max_sharded_axes", &ms), st, fail);
    if (ms < 1 || ms > MESH_MAX_AXES)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "%s: max_sharded_axes=%lld; expected 1 to %d", path, ms, MESH_MAX_AXES), st,
                     fail);
    sp->max_split = (int)ms;
    if (!sp->rule_sets.n || !sp->modes.n || !sp->remat.n || !sp->nzero1 || !sp->ici_axes.n)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "%s: ici_axes, rule_sets, shard_modes, remat_policies and "
                             "shard_optimizer_over_data each need at least one value",
                             path),
                     st, fail);
fail:
    cfg_free(f);
    return st;
}

/* ------------------------------------------------------------ words */

typedef struct {
    int n;
    char w[PLAN_CW][PLAN_WORD];
} plan_words;

static void words_add(plan_words *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void words_add(plan_words *w, const char *fmt, ...)
{
    SIM_ASSERT(w->n < PLAN_CW);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->w[w->n++], PLAN_WORD, fmt, ap);
    va_end(ap);
}

/* The key of a key=value word ("" for a file); its length in *len. */
static size_t word_key_len(const char *w)
{
    const char *eq = strchr(w, '=');
    return eq ? (size_t)(eq - w) : 0;
}

static bool word_sets(const char *w, const char *key)
{
    size_t k = word_key_len(w);
    return k && k == strlen(key) && !strncmp(w, key, k);
}

/* Keys of plan's own that a printed train command leaves out (output_dir is where plan writes
 * plan.json and report.html: a candidate's train command must not overwrite them). */
static bool plan_own_key(const char *w)
{
    return word_sets(w, "plan_top") || word_sets(w, "plan_dry_runs") || word_sets(w, "plan_verify") ||
           word_sets(w, "plan_global_batch") || word_sets(w, "explain_candidate") || word_sets(w, "output_dir");
}

/* ------------------------------------------------------------ one dry run */

/* What a dry run leaves: the figures plan ranks and prints.  Plain data: it crosses a pipe. */
typedef struct {
    int fail; /* 0 ran; 1 out of memory; 2 refused (train's error); 3 the simulator failed */
    char why[480];
    double peak;          /* bytes, the device with the highest peak */
    double cat[SIM_NMEM]; /* that device's bytes by category at its peak */
    double step_s, compute_s, bubble_s, optimizer_s, exposed_s, model_flops, peak_flops;
    int naxes;
    char axes[PLAN_AXES][40];       /* mesh-axis groups ("fsdp", "data+fsdp") */
    double axis_bytes[PLAN_AXES];   /* bytes each device sends over the group per step (mean) */
    double axis_exposed[PLAN_AXES]; /* communication compute waited for, seconds */
    double wall_s;                  /* host seconds the dry run took */
} plan_result;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int axis_slot(plan_result *r, const char *name)
{
    for (int i = 0; i < r->naxes; i++)
        if (!strcmp(r->axes[i], name)) return i;
    if (r->naxes == PLAN_AXES) return -1;
    snprintf(r->axes[r->naxes], sizeof r->axes[0], "%s", name);
    r->axis_bytes[r->naxes] = r->axis_exposed[r->naxes] = 0;
    return r->naxes++;
}

/* The dry run `train` makes of words (one step), here in this process. */
/* The figures of a dry run that ran on m: peak memory by category, bytes per mesh axis and the
 * modelled step time (res->fail = 3 when the profile cannot time it). */
static void measure(const cfg_config *cfg, const model_def *def, sim_machine *m, const cfg_hw *hw,
                    const model_tm_eff *eff, plan_result *res)
{
    int nd = sim_machine_num_devices(m);
    sim_arena_stats *mem = calloc((size_t)nd, sizeof *mem);
    SIM_ASSERT(mem);
    cli_memory_collect(m, mem);
    int top = 0;
    for (int d = 1; d < nd; d++)
        if (mem[d].peak > mem[top].peak) top = d;
    res->peak = (double)mem[top].peak;
    for (int c = 0; c < SIM_NMEM; c++) res->cat[c] = (double)mem[top].at_peak_by[c];
    free(mem);
    cli_records recs;
    cli_records_from_machine(m, &recs);
    cli_traffic traffic;
    memset(&traffic, 0, sizeof traffic);
    sim_status st = cli_traffic_build(&recs, cli_steps_all(), &traffic);
    for (int i = 0; !st && i < traffic.n_rows; i++) {
        char ax[64];
        cli_axes_text(&traffic.mesh, traffic.rows[i].axes, ax, sizeof ax);
        int k = axis_slot(res, ax);
        if (k >= 0) res->axis_bytes[k] += traffic.rows[i].bytes_mean;
    }
    cli_traffic_free(&traffic);
    model_tm_result tm;
    memset(&tm, 0, sizeof tm);
    const char *dt = NULL;
    if (!st) st = cfg_get_str(cfg, "dtype", &dt);
    double bubble = def->d.pipe.on ? model_pipe_bubble_fraction(&def->d.pipe) : 0.0;
    if (!st) st = model_tm_estimate(hw, eff, dt ? dt : "bfloat16", m, 0, bubble, model_opt_step_bytes(def), false, &tm);
    if (st) {
        res->fail = 3;
        snprintf(res->why, sizeof res->why, "step time not modelled: %s", sim_errmsg());
        sim_err_clear();
    } else {
        res->step_s = tm.step_s;
        res->compute_s = tm.compute_s;
        res->bubble_s = tm.bubble_s;
        res->optimizer_s = tm.optimizer_s;
        res->exposed_s = tm.exposed_s;
        res->model_flops = tm.model_flops;
        res->peak_flops = tm.peak;
        for (int i = 0; i < tm.naxes; i++) {
            char ax[64];
            cli_axes_text(sim_machine_mesh(m), tm.axes[i], ax, sizeof ax);
            int k = axis_slot(res, ax);
            if (k >= 0) res->axis_exposed[k] += tm.exposed_axes_s[i];
        }
    }
    free(tm.spans);
}

static void dry_run_here(const char *const *words, int n, plan_result *res)
{
    memset(res, 0, sizeof *res);
    double t0 = now_s();
    cfg_config *cfg = NULL;
    model_def *def = calloc(1, sizeof *def);
    model_data data;
    memset(&data, 0, sizeof data);
    data.fd = -1;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m = NULL;
    cfg_hw hw;
    model_tm_eff eff;
    bool have_hw = false, def_ok = false;
    double hbm = 0, tol = 0;
    sim_status st;
    if (!def) SIM_TRY_GOTO(sim_err(SIM_ERR_INTERNAL, "out of host memory"), st, fail);
    SIM_TRY_GOTO(cfg_load_argv(cli_base_config(), n, words, &cfg), st, fail);
    SIM_TRY_GOTO(model_def_from_config(cfg, def), st, fail);
    def_ok = true;
    SIM_TRY_GOTO(cfg_get_double(cfg, "hbm_limit_gb", &hbm), st, fail);
    SIM_TRY_GOTO(model_optim_from_config(cfg, &job.opt), st, fail);
    SIM_TRY_GOTO(model_data_from_config(cfg, &data), st, fail);
    SIM_TRY_GOTO(cfg_get_double(cfg, "sharding_tolerance", &tol), st, fail);
    SIM_TRY_GOTO(model_check_sharding_tolerance(def, tol), st, fail);
    int per_slice = def->mesh.num_devices / (def->mesh.num_slices > 0 ? def->mesh.num_slices : 1);
    SIM_TRY_GOTO(cfg_hw_from_config(cfg, per_slice, &hw, &have_hw), st, fail);
    if (!have_hw)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "no hardware profile: the step time cannot be modelled"), st, fail);
    SIM_TRY_GOTO(model_tm_eff_load(cli_configs_dir(), &eff), st, fail);
    const cfg_entry *hbm_e = cfg_find(cfg, "hbm_limit_gb");
    if (hbm == 0 && hbm_e && !hbm_e->from_user) hbm = hw.hbm_bytes / 1e9;
    sim_host_malloc_many_arenas();
    SIM_TRY_GOTO(model_machine_new(def, hbm, false, &m), st, fail);
    sim_machine_set_record_costs(m, true);
    job.def = def;
    job.data = &data;
    job.steps = 1;
    job.stats = calloc(1, sizeof *job.stats);
    if (!job.stats) SIM_TRY_GOTO(sim_err(SIM_ERR_INTERNAL, "out of host memory"), st, fail);
    SIM_TRY_GOTO(model_train(&job, m), st, fail);
    measure(cfg, def, m, &hw, &eff, res);
fail:
    if (st) {
        res->fail = st == SIM_ERR_OOM ? 1 : (st == SIM_ERR_INPUT || st == SIM_ERR_SHARDING) ? 2 : 3;
        snprintf(res->why, sizeof res->why, "%s", sim_errmsg());
        sim_err_clear();
    }
    free(job.stats);
    sim_machine_free(m);
    model_data_close(&data);
    if (def_ok) model_def_free(def);
    free(def);
    cfg_free(cfg);
    res->wall_s = now_s() - t0;
}

static bool write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        c += k;
        n -= (size_t)k;
    }
    return true;
}

static size_t read_all(int fd, void *p, size_t n)
{
    char *c = p;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, c + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    return got;
}

/* The last line a child wrote on its stderr (its assertion, say), into buf. */
static void last_line(FILE *f, char *buf, size_t cap)
{
    buf[0] = '\0';
    rewind(f);
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        size_t k = strlen(line);
        while (k && (line[k - 1] == '\n' || line[k - 1] == '\r')) line[--k] = '\0';
        if (k) snprintf(buf, cap, "%s", line);
    }
}

/* dry_run_here in a child process: its crash or hang becomes this candidate's failure. */
static void dry_run(const char *const *words, int n, plan_result *res)
{
    memset(res, 0, sizeof *res);
    int fd[2];
    FILE *errf = tmpfile();
    if (!errf || pipe(fd) != 0) {
        if (errf) fclose(errf);
        res->fail = 3;
        snprintf(res->why, sizeof res->why, "cannot start a dry run: %s", strerror(errno));
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        if (dup2(fileno(errf), 2) < 0) _exit(3);
        if (!freopen("/dev/null", "w", stdout)) _exit(3);
        alarm(PLAN_CHILD_TIMEOUT_S);
        plan_result r;
        dry_run_here(words, n, &r);
        _exit(write_all(fd[1], &r, sizeof r) ? 0 : 3);
    }
    close(fd[1]);
    if (pid < 0) {
        close(fd[0]);
        fclose(errf);
        res->fail = 3;
        snprintf(res->why, sizeof res->why, "cannot start a dry run: %s", strerror(errno));
        return;
    }
    size_t got = read_all(fd[0], res, sizeof *res);
    close(fd[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (got != sizeof *res || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char line[400];
        last_line(errf, line, sizeof line);
        memset(res, 0, sizeof *res);
        res->fail = 3;
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
            snprintf(res->why, sizeof res->why, "the dry run did not finish within %d s", PLAN_CHILD_TIMEOUT_S);
        else if (WIFSIGNALED(status))
            snprintf(res->why, sizeof res->why, "the simulator stopped (signal %d)%s%s", WTERMSIG(status),
                     line[0] ? ": " : "", line);
        else snprintf(res->why, sizeof res->why, "the simulator failed%s%s", line[0] ? ": " : "", line);
    }
    fclose(errf);
}

/* ------------------------------------------------------------ candidates */

typedef enum {
    PC_REJECTED = 0, /* refused by the config checks (train's message) */
    PC_PRUNED,       /* parameters + gradients + optimizer state exceed the HBM */
    PC_DUPLICATE,    /* equivalent to an earlier candidate */
    PC_UNTRIED,      /* valid, not dry-run (the budget) */
    PC_OOM,          /* dry run: out of memory */
    PC_FAILED,       /* dry run: refused while running (explicit-mode sharding) or the simulator failed */
    PC_RANKED,       /* fits; ranked */
    PC_EQUIVALENT,   /* dry run: the same figures as an earlier structure (its variants are not tried) */
    PC_NSTATES
} plan_state;

typedef struct {
    plan_words w;      /* the keys plan varies, as train takes them */
    int structure;     /* its structure (the candidate with its default knobs) */
    int remat, ga, mb; /* knob values: index into remat_policies, accumulation steps, pipeline microbatches */
    int stages;        /* the stage axis's size */
    bool is_default;   /* the structure itself (default knobs) */
    plan_state state;
    int reason;                          /* rejected or failed: index into the reasons */
    double lb;                           /* bytes per device: parameters + gradients + optimizer state */
    uint64_t sig;                        /* equivalence signature */
    int dup_of;                          /* PC_DUPLICATE: the candidate it equals */
    bool sampled;                        /* r extrapolated from runs of fewer layers */
    bool verified;                       /* r is a full dry run's */
    double sampled_step_s, sampled_peak; /* the extrapolation, kept beside a full run's figures */
    plan_result r;
    int rank;      /* 1-based rank among the fitting, 0 if none */
    bool explored; /* a structure whose knob variants were made (they are candidates of their own) */
    bool pareto;   /* ranked, and on the Pareto front of step time and peak (mark_pareto) */
} plan_cand;

/* A candidate the checks dropped before any dry run (refused, pruned or equivalent to an earlier
 * one): plan.json lists it with what became of it. */
typedef struct {
    char *keys;        /* its words, space-separated */
    plan_state state;  /* PC_REJECTED, PC_PRUNED or PC_DUPLICATE */
    char *why;         /* PC_REJECTED: train's message */
    int same_as;       /* PC_DUPLICATE: the candidate (index into plan_ctx.c) it equals */
    double lb;         /* PC_PRUNED, PC_DUPLICATE: parameters + gradients + optimizer state per device */
    long long count;   /* candidates it stands for: a structure's knob variants share its verdict */
    bool remat_pruned; /* PC_PRUNED: a policy saving more than full where full ran out of memory */
} plan_drop;

typedef struct {
    char key[160];  /* the message with its numbers blanked: the grouping key */
    char text[480]; /* the first message */
    char example[PLAN_WORD * 4];
    long long count;
} plan_reason;

typedef struct {
    /* the problem */
    const char *const *user; /* the user's words minus plan's own and the varied keys */
    int nuser;
    bool fixed_remat, fixed_ga, fixed_mode, fixed_zero1, fixed_rules, fixed_mb, fixed_mesh;
    char fixed_rule_set[PLAN_NAME];
    char model[64], topology[96], profile[32];
    int devices, slices, per_slice;
    long long global; /* rows per step */
    long long seq;
    double hbm; /* bytes per device */
    bool moe;
    const model_family *family; /* the model's family: how to shorten it (model_depth_words) */
    bool two_stacks;            /* the family runs a first stack of other layers (DeepSeek's dense layers:
                                 model_family.layers_before_pipeline) before the scanned stack */
    int64_t layers, dense_layers;
    plan_space sp;
    /* the search */
    plan_cand *c;
    int nc, cap;
    long long considered; /* every (structure, knobs) pair enumerated */
    long long by_state[PC_NSTATES];
    plan_reason reasons[PLAN_REASONS];
    int nreasons;
    long long structures, meshes;
    long long variants_made; /* knob variants generated (of the structures explored) */
    long long pruned_remat;  /* of by_state[PC_PRUNED]: remat policies where full ran out of memory */
    int structures_explored;
    bool truncated;
    int budget, dry_runs, verify;
    double dry_wall_s, wall_s;
    int ndry_sampled_runs, nfull;
    int top, explain;
    int *ranked; /* candidate indices in rank order */
    int nranked;
    plan_drop *drops; /* the candidates dropped by the checks, in enumeration order */
    int ndrops, capdrops;
    char outdir[1024];       /* output_dir: plan.json and report.html ("" none) */
    const char *const *argv; /* the command's words, as given (plan.json) */
    int argc;
} plan_ctx;

/* "... 128 devices ..." -> "... N devices ...": messages grouped without their numbers. */
static void reason_key(const char *msg, char *key, size_t cap)
{
    size_t n = 0;
    for (const char *p = msg; *p && n + 2 < cap; p++) {
        if (isdigit((unsigned char)*p)) {
            if (n == 0 || key[n - 1] != 'N') key[n++] = 'N';
            while (isdigit((unsigned char)p[1]) || (p[1] == '.' && isdigit((unsigned char)p[2]))) p++;
        } else {
            key[n++] = *p;
        }
    }
    key[n] = '\0';
}

static void cand_command(const plan_ctx *P, const plan_cand *c, char *buf, size_t cap);

static int add_reason(plan_ctx *P, const char *msg, const plan_cand *c, long long count)
{
    char key[160];
    reason_key(msg, key, sizeof key);
    int i;
    for (i = 0; i < P->nreasons; i++)
        if (!strcmp(P->reasons[i].key, key)) break;
    if (i == P->nreasons) {
        if (P->nreasons == PLAN_REASONS) i = PLAN_REASONS - 1; /* pooled into the last */
        else {
            plan_reason *r = &P->reasons[P->nreasons++];
            memset(r, 0, sizeof *r);
            snprintf(r->key, sizeof r->key, "%s", key);
            snprintf(r->text, sizeof r->text, "%.*s", (int)strcspn(msg, "\n"), msg); /* its first line */
            for (int k = 0; k < c->w.n; k++) {
                size_t l = strlen(r->example);
                snprintf(r->example + l, sizeof r->example - l, "%s%s", k ? " " : "", c->w.w[k]);
            }
        }
    }
    P->reasons[i].count += count;
    return i;
}

/* Array a of n elements and room for *cap, with room for one more (doubling, from 256). */
static void *grow(void *a, int *cap, int n, size_t elem)
{
    if (n < *cap) return a;
    int c = *cap ? *cap * 2 : 256;
    void *p = realloc(a, (size_t)c * elem);
    SIM_ASSERT(p);
    *cap = c;
    return p;
}

static plan_cand *cand_new(plan_ctx *P)
{
    P->c = grow(P->c, &P->cap, P->nc, sizeof *P->c);
    plan_cand *c = &P->c[P->nc++];
    memset(c, 0, sizeof *c);
    c->dup_of = -1;
    return c;
}

/* Records a candidate the checks dropped (see plan_drop). */
static void add_drop(plan_ctx *P, const plan_words *w, plan_state state, const char *why, int same_as, double lb,
                     long long count)
{
    P->drops = grow(P->drops, &P->capdrops, P->ndrops, sizeof *P->drops);
    plan_drop *d = &P->drops[P->ndrops++];
    memset(d, 0, sizeof *d);
    char keys[PLAN_CW * PLAN_WORD];
    size_t n = 0;
    keys[0] = '\0';
    for (int i = 0; i < w->n && n < sizeof keys; i++)
        n += (size_t)snprintf(keys + n, sizeof keys - n, "%s%s", i ? " " : "", w->w[i]);
    d->keys = strdup(keys);
    d->why = why ? strdup(why) : NULL;
    SIM_ASSERT(d->keys && (!why || d->why));
    d->state = state;
    d->same_as = same_as;
    d->lb = lb;
    d->count = count;
}

/* The words of a candidate's config: the user's, then its own. */
static int cand_argv(const plan_ctx *P, const plan_cand *c, const char **w, int cap)
{
    int n = 0;
    for (int i = 0; i < P->nuser && n < cap; i++) w[n++] = P->user[i];
    for (int i = 0; i < c->w.n && n < cap; i++) w[n++] = c->w.w[i];
    return n;
}

static void cand_command(const plan_ctx *P, const plan_cand *c, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "shardsim train");
    for (int i = 0; i < P->nuser && n < cap; i++) n += (size_t)snprintf(buf + n, cap - n, " %s", P->user[i]);
    for (int i = 0; i < c->w.n && n < cap; i++) n += (size_t)snprintf(buf + n, cap - n, " %s", c->w.w[i]);
}

/* ------------------------------------------------------------ lower bound and signature */

static double shard_elems(const model_def *def, int i, const mesh_spec *spec)
{
    double e = 1;
    for (int d = 0; d < def->defs[i].rank; d++) e *= (double)def->defs[i].shape[d];
    uint32_t axes = mesh_spec_dim_axes(spec);
    for (int a = 0; a < def->mesh.n_axes; a++)
        if (axes & (1u << a)) e /= def->mesh.sizes[a];
    return e;
}

/* Bytes one device holds of parameters, gradients and Adam moments (each in weight_dtype, as
 * the arenas count them): a lower bound on its peak, which holds them all. */
static double state_bytes(const model_def *def, const model_optim_cfg *opt)
{
    double wb = (double)sim_dtype_size(def->d.weight_dtype), total = 0;
    for (int i = 0; i < def->nparams; i++) {
        double e = shard_elems(def, i, &def->spec[i]);
        total += e * wb;
        if (def->defs[i].state_var) continue;
        total += e * wb;
        if (opt->type == MODEL_OPT_ADAMW) total += 2.0 * shard_elems(def, i, &def->opt_spec[i]) * wb;
    }
    return total;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

static uint64_t fnv_str(uint64_t h, const char *s) { return fnv(h, s, strlen(s) + 1); }

static uint64_t spec_sig(uint64_t h, const mesh_shape *m, const mesh_spec *s)
{
    char buf[256];
    mesh_spec_format(s, m, buf, (int)sizeof buf);
    return fnv_str(h, buf);
}

/* Equal for configurations that run the same program: the mesh (axes of size > 1 in order, with
 * their slice factors), every parameter's spec, every logical name's resolution and the knobs. */
static uint64_t signature(const model_def *def, const plan_cand *c)
{
    uint64_t h = 1469598103934665603ull;
    const mesh_shape *m = &def->mesh;
    for (int a = 0; a < m->n_axes; a++)
        if (m->sizes[a] > 1) {
            h = fnv_str(h, m->names[a]);
            h = fnv(h, &m->ici[a], sizeof m->ici[a]);
            h = fnv(h, &m->dcn[a], sizeof m->dcn[a]);
        }
    for (int i = 0; i < def->nparams; i++) {
        h = fnv_str(h, def->defs[i].path);
        h = spec_sig(h, m, &def->spec[i]);
        h = spec_sig(h, m, &def->opt_spec[i]);
    }
    for (int r = 0; r < def->rules.n; r++) {
        const char *name = def->rules.rules[r].name;
        if (mesh_rules_find(&def->rules, name) != r) continue; /* first rule of the name: resolve once */
        mesh_resolved res;
        if (mesh_rules_resolve(&def->rules, m, name, 1, &name, &res) != SIM_OK) {
            sim_err_clear();
            continue;
        }
        h = fnv_str(h, name);
        h = spec_sig(h, m, &res.spec);
    }
    h = fnv_str(h, def->d.remat_policy);
    int64_t knobs[5] = {def->d.ga, def->d.zero1, def->d.mode, def->d.pipe.on ? def->d.pipe.microbatches : 0,
                        def->d.batch};
    return fnv(h, knobs, sizeof knobs);
}

/* ------------------------------------------------------------ checking a candidate */

/* Loads and defines the candidate as `train` does before it runs; *lb its state bytes, *sig its
 * signature, *stages its stage axis. */
static sim_status check_cand(const plan_ctx *P, plan_cand *c)
{
    const char *w[PLAN_USER + PLAN_CW];
    int n = cand_argv(P, c, w, PLAN_USER + PLAN_CW);
    cfg_config *cfg = NULL;
    model_def *def = calloc(1, sizeof *def);
    SIM_ASSERT(def);
    model_optim_cfg opt;
    double tol = 0;
    sim_status st = cfg_load_argv(cli_base_config(), n, w, &cfg);
    bool def_ok = false;
    if (!st) def_ok = !(st = model_def_from_config(cfg, def));
    if (!st) st = model_optim_from_config(cfg, &opt);
    if (!st) st = cfg_get_double(cfg, "sharding_tolerance", &tol);
    if (!st) st = model_check_sharding_tolerance(def, tol);
    if (!st) {
        c->lb = state_bytes(def, &opt);
        c->sig = signature(def, c);
        c->stages = def->d.pipe.on ? (int)def->d.pipe.stages : 1;
    }
    if (def_ok) model_def_free(def);
    free(def);
    cfg_free(cfg);
    return st;
}

static int find_sig(const plan_ctx *P, uint64_t sig, int upto)
{
    for (int i = 0; i < upto; i++)
        if (P->c[i].state != PC_REJECTED && P->c[i].state != PC_DUPLICATE && P->c[i].sig == sig) return i;
    return -1;
}

static void progress(const plan_ctx *P, FILE *err, double frac, const char *what)
{
    char label[160];
    snprintf(label, sizeof label, "plan: %s (%d kept, %d dry runs)", what, P->nc, P->dry_runs);
    cli_progress(err, frac, label);
}

/* ------------------------------------------------------------ enumeration */

/* per_device_batch_size for ga microbatches, or false when the rows do not split into whole rows
 * per device and step as MaxText computes them (int(num_devices x per_device_batch_size)). */
static bool pdbs_text(const plan_ctx *P, int ga, char *buf, size_t cap)
{
    if (P->global % ga) return false;
    long long micro = P->global / ga;
    double p = (double)micro / (double)P->devices;
    snprintf(buf, cap, "%.12g", p);
    double back = strtod(buf, NULL);
    return (long long)((double)P->devices * back) == micro;
}

/* The knobs of a candidate: remat_policy, accumulation, pipeline microbatches. */
static void knob_words(const plan_ctx *P, plan_cand *c, int stages)
{
    char pd[64];
    if (!P->fixed_remat) words_add(&c->w, "remat_policy=%s", P->sp.remat.s[c->remat]);
    if (!P->fixed_ga && c->ga > 1) words_add(&c->w, "gradient_accumulation_steps=%d", c->ga);
    if (pdbs_text(P, c->ga, pd, sizeof pd)) words_add(&c->w, "per_device_batch_size=%s", pd);
    if (!P->fixed_mb && stages > 1) words_add(&c->w, "num_pipeline_microbatches=%d", c->mb * stages);
}

typedef struct {
    int n; /* enumerable axes */
    char names[MESH_MAX_AXES][MESH_AXIS_NAME_MAX];
    int ici[MESH_MAX_AXES], dcn[MESH_MAX_AXES];
    bool dcn_ok[MESH_MAX_AXES]; /* may span slices */
} plan_mesh;

typedef struct {
    plan_ctx *P;
    FILE *err;
    const char *rule_set;
    plan_mesh mesh;
    int nvariants_max;
} enum_state;

static int axis_size(const plan_mesh *m, const char *name)
{
    for (int a = 0; a < m->n; a++)
        if (!strcmp(m->names[a], name)) return m->ici[a] * m->dcn[a];
    return 1;
}

static int count_variants(const plan_ctx *P, int stages)
{
    int nr = P->fixed_remat ? 1 : P->sp.remat.n, ng = P->fixed_ga ? 1 : P->sp.nga;
    int nm = (stages > 1 && !P->fixed_mb) ? P->sp.nmb : 1;
    return nr * ng * nm;
}

/* One structure: its default candidate checked, pruned or kept. */
/* Returns what became of it: 0 kept, 1 rejected (*reason set), 2 pruned, 3 equivalent.  With
 * inherit > 0 the verdict of the same structure in another shard_mode is taken without loading it:
 * the config checks read shard_mode only in check_vma's combination, which plan does not vary, and
 * the state a device holds does not depend on it. */
static int add_structure(enum_state *E, const char *mode, bool zero1, int inherit, int *reason)
{
    plan_ctx *P = E->P;
    if (P->structures >= PLAN_MAX_STRUCT) {
        P->truncated = true;
        return 1;
    }
    P->structures++;
    plan_cand *c = cand_new(P);
    if (E->rule_set[0] && !P->fixed_rules) words_add(&c->w, "custom_mesh_and_rule=%s", E->rule_set);
    int stages = 1;
    for (int a = 0; a < E->mesh.n; a++) {
        const char *stem = mesh_shape_flag_stem(E->mesh.names[a]);
        if (!strcmp(E->mesh.names[a], "stage")) stages = E->mesh.ici[a] * E->mesh.dcn[a];
        if (E->mesh.ici[a] > 1 && strcmp(E->mesh.names[a], "fsdp")) /* fsdp's -1 fills the rest of the slice */
            words_add(&c->w, "ici_%s_parallelism=%d", stem, E->mesh.ici[a]);
        if (E->mesh.dcn[a] > 1 && strcmp(E->mesh.names[a], "data")) /* data's -1 fills the rest of the slices */
            words_add(&c->w, "dcn_%s_parallelism=%d", stem, E->mesh.dcn[a]);
    }
    if (!P->fixed_mode && strcmp(mode, "auto")) words_add(&c->w, "shard_mode=%s", mode);
    if (!P->fixed_zero1 && zero1) words_add(&c->w, "shard_optimizer_over_data=true");
    c->structure = P->nc - 1;
    c->is_default = true;
    c->remat = 0;
    c->ga = P->fixed_ga ? 1 : P->sp.ga[0];
    c->mb = P->sp.mb[0];
    c->stages = stages;
    knob_words(P, c, stages);
    int nv = count_variants(P, stages);
    P->considered += nv;
    if (inherit == 1 || inherit == 2) {
        if (inherit == 1) P->reasons[*reason].count += nv;
        P->by_state[inherit == 1 ? PC_REJECTED : PC_PRUNED] += nv;
        /* the twin's verdict: the drop just recorded is the twin's (the call before this one) */
        SIM_ASSERT(P->ndrops > 0);
        const plan_drop *twin = &P->drops[P->ndrops - 1];
        char *why = twin->why ? strdup(twin->why) : NULL; /* add_drop may move the drops */
        double lb = twin->lb;
        add_drop(P, &c->w, inherit == 1 ? PC_REJECTED : PC_PRUNED, why, -1, lb, nv);
        free(why);
        P->nc--;
        return inherit;
    }
    char pd[64];
    sim_status st = pdbs_text(P, c->ga, pd, sizeof pd)
                        ? check_cand(P, c)
                        : sim_err(SIM_ERR_INPUT,
                                  "the global batch of %lld rows does not split into %d microbatch%s "
                                  "of whole rows over %d devices",
                                  P->global, c->ga, c->ga > 1 ? "es" : "", P->devices);
    if (st) {
        *reason = c->reason = add_reason(P, sim_errmsg(), c, nv);
        add_drop(P, &c->w, PC_REJECTED, sim_errmsg(), -1, 0, nv);
        sim_err_clear();
        P->by_state[PC_REJECTED] += nv;
        P->nc--; /* a rejected structure keeps only its count */
        return 1;
    }
    if (c->lb > P->hbm) {
        P->by_state[PC_PRUNED] += nv;
        add_drop(P, &c->w, PC_PRUNED, NULL, -1, c->lb, nv);
        P->nc--;
        return 2;
    }
    int d = find_sig(P, c->sig, P->nc - 1);
    if (d >= 0) {
        P->by_state[PC_DUPLICATE] += nv;
        add_drop(P, &c->w, PC_DUPLICATE, NULL, d, c->lb, nv);
        P->nc--;
        return 3;
    }
    c->state = PC_UNTRIED;
    if ((P->structures & 15) == 0) progress(P, E->err, 0.0, "checking meshes");
    return 0;
}

static void enum_modes(enum_state *E)
{
    plan_ctx *P = E->P;
    bool data = axis_size(&E->mesh, "data") > 1;
    for (int z = 0; z < (P->fixed_zero1 ? 1 : P->sp.nzero1); z++) {
        bool zero1 = !P->fixed_zero1 && P->sp.zero1[z];
        if (zero1 && !data) continue; /* ZeRO-1 over a data axis of 1 is the same program */
        int first = -1, reason = -1;
        for (int m = 0; m < (P->fixed_mode ? 1 : P->sp.modes.n); m++) {
            int v = add_structure(E, P->fixed_mode ? "auto" : P->sp.modes.s[m], zero1, first, &reason);
            if (m == 0) first = v;
        }
    }
}

/* Slice factors: the dcn axes' sizes multiply to the slices. */
static void enum_dcn(enum_state *E, int a, int left)
{
    if (a == E->mesh.n) {
        if (left == 1) enum_modes(E);
        return;
    }
    for (int k = 1; k <= left; k++) {
        if (left % k || (k > 1 && !E->mesh.dcn_ok[a])) continue;
        E->mesh.dcn[a] = k;
        enum_dcn(E, a + 1, left / k);
    }
    E->mesh.dcn[a] = 1;
}

/* In-slice factors: at most max_split axes of size > 1, multiplying to the slice. */
static void enum_ici(enum_state *E, int a, int left, int split)
{
    plan_ctx *P = E->P;
    if (a == E->mesh.n) {
        if (left == 1) {
            P->meshes++;
            enum_dcn(E, 0, P->slices);
        }
        return;
    }
    for (int k = 1; k <= left; k++) {
        if (left % k || (k > 1 && split == P->sp.max_split)) continue;
        E->mesh.ici[a] = k;
        enum_ici(E, a + 1, left / k, split + (k > 1));
    }
    E->mesh.ici[a] = 1;
}

int64_t cli_plan_count_meshes(int n, int parts, int max_split)
{
    if (parts == 0) return n == 1;
    int64_t total = 0;
    for (int k = 1; k <= n; k++) {
        if (n % k) continue;
        if (k > 1 && max_split == 0) continue;
        total += cli_plan_count_meshes(n / k, parts - 1, max_split - (k > 1));
    }
    return total;
}

/* The rule set's mesh axes that plan varies. */
static sim_status rule_set_axes(plan_ctx *P, const char *rule_set, plan_mesh *m)
{
    memset(m, 0, sizeof *m);
    const char *w[PLAN_USER + 2];
    int n = 0;
    for (int i = 0; i < P->nuser; i++) w[n++] = P->user[i];
    char cw[PLAN_WORD];
    if (rule_set[0] && !P->fixed_rules) {
        snprintf(cw, sizeof cw, "custom_mesh_and_rule=%s", rule_set);
        w[n++] = cw;
    }
    cfg_config *cfg = NULL;
    SIM_TRY(cfg_load_argv(cli_base_config(), n, w, &cfg));
    const char **axes = NULL;
    int na = 0;
    sim_status st = cfg_get_str_list(cfg, "mesh_axes", &axes, &na);
    for (int i = 0; !st && i < na; i++) {
        const char *a = axes[i];
        if (P->fixed_mesh || !list_has(&P->sp.ici_axes, a) || (!P->moe && list_has(&P->sp.moe_only, a))) continue;
        if (m->n == MESH_MAX_AXES) break;
        snprintf(m->names[m->n], MESH_AXIS_NAME_MAX, "%s", a);
        m->ici[m->n] = m->dcn[m->n] = 1;
        m->dcn_ok[m->n] = list_has(&P->sp.dcn_axes, a);
        m->n++;
    }
    free(axes);
    cfg_free(cfg);
    return st;
}

static void enumerate(plan_ctx *P, FILE *err)
{
    enum_state E;
    memset(&E, 0, sizeof E);
    E.P = P;
    E.err = err;
    int nsets = P->fixed_rules ? 1 : P->sp.rule_sets.n;
    for (int r = 0; r < nsets; r++) {
        E.rule_set = P->fixed_rules ? P->fixed_rule_set : P->sp.rule_sets.s[r];
        if (rule_set_axes(P, E.rule_set, &E.mesh)) {
            plan_cand tmp;
            memset(&tmp, 0, sizeof tmp);
            words_add(&tmp.w, "custom_mesh_and_rule=%s", E.rule_set);
            add_reason(P, sim_errmsg(), &tmp, 1);
            add_drop(P, &tmp.w, PC_REJECTED, sim_errmsg(), -1, 0, 1);
            sim_err_clear();
            P->considered++;
            P->by_state[PC_REJECTED]++;
            continue;
        }
        if (E.mesh.n == 0) { /* the user's mesh: one structure per mode and ZeRO-1 */
            P->meshes++;
            enum_modes(&E);
        } else {
            enum_ici(&E, 0, P->per_slice, 0);
        }
    }
}

/* The knob variants of structure s (its default candidate is s itself), checked as train checks
 * them, in the order they are worth a dry run: more accumulation first where the structure ran out
 * of memory, last where it fits; the remat policies in configs/plan.yml's order.  Returns the
 * index of the first one added (they follow it). */
static int add_variants(plan_ctx *P, int s)
{
    int first = P->nc;
    const plan_cand base = P->c[s];
    int nr = P->fixed_remat ? 1 : P->sp.remat.n, ng = P->fixed_ga ? 1 : P->sp.nga;
    int nm = (base.stages > 1 && !P->fixed_mb) ? P->sp.nmb : 1;
    bool oom = base.state == PC_OOM;
    bool full_oom = oom && !P->fixed_remat && !strcmp(P->sp.remat.s[base.remat], "full");
    /* the structure's own words: everything before its knob words */
    plan_words sw = base.w;
    while (sw.n &&
           (word_sets(sw.w[sw.n - 1], "remat_policy") || word_sets(sw.w[sw.n - 1], "gradient_accumulation_steps") ||
            word_sets(sw.w[sw.n - 1], "per_device_batch_size") ||
            word_sets(sw.w[sw.n - 1], "num_pipeline_microbatches")))
        sw.n--;
    for (int gi = 0; gi < ng; gi++) {
        int g = oom ? ng - 1 - gi : gi;
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < nm; m++) {
                if (g == 0 && r == 0 && m == 0) continue; /* the structure itself */
                P->variants_made++;
                int ga = P->fixed_ga ? 1 : P->sp.ga[g];
                if (full_oom && ga <= base.ga && r != base.remat) {
                    /* every other policy saves more than full: it cannot fit where full did not */
                    P->by_state[PC_PRUNED]++;
                    P->pruned_remat++;
                    plan_cand *t = calloc(1, sizeof *t);
                    SIM_ASSERT(t);
                    t->w = sw;
                    t->remat = r;
                    t->ga = ga;
                    t->mb = P->sp.mb[m];
                    knob_words(P, t, base.stages);
                    add_drop(P, &t->w, PC_PRUNED, NULL, -1, base.lb, 1);
                    P->drops[P->ndrops - 1].remat_pruned = true;
                    free(t);
                    continue;
                }
                plan_cand *c = cand_new(P);
                c->w = sw;
                c->structure = s;
                c->remat = r;
                c->ga = ga;
                c->mb = P->sp.mb[m];
                c->stages = base.stages;
                knob_words(P, c, base.stages);
                char pd[64];
                sim_status st = pdbs_text(P, c->ga, pd, sizeof pd)
                                    ? check_cand(P, c)
                                    : sim_err(SIM_ERR_INPUT,
                                              "the global batch of %lld rows does not split into %d "
                                              "microbatches of whole rows over %d devices",
                                              P->global, c->ga, P->devices);
                if (st) {
                    add_reason(P, sim_errmsg(), c, 1);
                    add_drop(P, &c->w, PC_REJECTED, sim_errmsg(), -1, 0, 1);
                    sim_err_clear();
                    P->by_state[PC_REJECTED]++;
                    P->nc--;
                    continue;
                }
                if (c->lb > P->hbm) {
                    P->by_state[PC_PRUNED]++;
                    add_drop(P, &c->w, PC_PRUNED, NULL, -1, c->lb, 1);
                    P->nc--;
                    continue;
                }
                int d = find_sig(P, c->sig, P->nc - 1);
                if (d >= 0) {
                    P->by_state[PC_DUPLICATE]++;
                    add_drop(P, &c->w, PC_DUPLICATE, NULL, d, c->lb, 1);
                    P->nc--;
                    continue;
                }
                c->state = PC_UNTRIED;
            }
    }
    return first;
}

/* ------------------------------------------------------------ dry runs */

static void result_axpy(plan_result *y, double a, const plan_result *x, const plan_result *base)
{
    /* y += a (x - base), field by field */
    y->peak += a * (x->peak - base->peak);
    for (int c = 0; c < SIM_NMEM; c++) y->cat[c] += a * (x->cat[c] - base->cat[c]);
    y->step_s += a * (x->step_s - base->step_s);
    y->compute_s += a * (x->compute_s - base->compute_s);
    y->bubble_s += a * (x->bubble_s - base->bubble_s);
    y->optimizer_s += a * (x->optimizer_s - base->optimizer_s);
    y->exposed_s += a * (x->exposed_s - base->exposed_s);
    y->model_flops += a * (x->model_flops - base->model_flops);
    for (int i = 0; i < x->naxes; i++) {
        int k = axis_slot(y, x->axes[i]);
        if (k < 0) continue;
        double b_bytes = 0, b_exp = 0;
        for (int j = 0; j < base->naxes; j++)
            if (!strcmp(base->axes[j], x->axes[i])) {
                b_bytes = base->axis_bytes[j];
                b_exp = base->axis_exposed[j];
            }
        y->axis_bytes[k] += a * (x->axis_bytes[i] - b_bytes);
        y->axis_exposed[k] += a * (x->axis_exposed[i] - b_exp);
    }
}

static void run_words(plan_ctx *P, const plan_cand *c, const char *extra[], int nextra, plan_result *r)
{
    const char *w[PLAN_USER + PLAN_CW + 8];
    int n = cand_argv(P, c, w, PLAN_USER + PLAN_CW);
    for (int i = 0; i < nextra; i++) w[n++] = extra[i];
    dry_run(w, n, r);
    P->dry_wall_s += r->wall_s;
}

/* Layers of each kind simulated, then every figure extrapolated to the model's layer count. */
static void sampled_run(plan_ctx *P, plan_cand *c)
{
    typedef struct {
        int dense, moe;
    } shape;
    shape runs[3];
    double coef[3] = {1, 0, 0};
    int nruns = 0;
    int64_t L = P->layers, D = P->two_stacks ? P->dense_layers : 0, M = L - D;
    int u = c->stages;
    /* a pipeline runs in full: its layers per stage and circular repeats change the schedule (the
     * iterations, the bubble), so its figures are not affine in the layer count */
    if (u > 1) {
    } else if (!P->two_stacks) {
        /* one stack: a dry run simulates three of its layers and accounts the rest whatever their
         * number (model_layers_bounded), so one full run costs what the two sampled ones would and
         * gives the exact figures */
    } else if (!P->two_stacks) {
        if (L > 2 * u && L % u == 0) {
            runs[0] = (shape){0, u};
            runs[1] = (shape){0, 2 * u};
            coef[1] = (double)(L - u) / u;
            nruns = 2;
        }
    } else if (L > 2) {
        int d0 = D > 0 ? 1 : 0;
        runs[nruns++] = (shape){d0, 1};
        if (D > 1) {
            runs[nruns] = (shape){d0 + 1, 1};
            coef[nruns++] = (double)(D - d0);
        }
        if (M > 1) {
            runs[nruns] = (shape){d0, 2};
            coef[nruns++] = (double)(M - 1);
        }
    }
    plan_result res[3];
    bool ok = nruns > 0;
    for (int i = 0; ok && i < nruns; i++) {
        /* the family says which keys make the shortened model (DeepSeek: base_num_decoder_layers and
         * first_num_dense_layers) */
        enum { MAX_DEPTH_WORDS = 4 };
        char dw[MAX_DEPTH_WORDS][MODEL_WORD_MAX];
        int ndw = model_depth_words(P->family, runs[i].dense, runs[i].moe, dw, MAX_DEPTH_WORDS);
        SIM_ASSERT(ndw >= 1);
        /* the full model passed sharding_tolerance (check_cand); with fewer layers the unsharded share
         * (embedding, norms) grows, so the shortened model is not checked again */
        const char *extra[4 + MAX_DEPTH_WORDS] = {"override_model_config=true", dw[0], "hbm_limit_gb=1000000",
                                                  "sharding_tolerance=1"};
        for (int w = 1; w < ndw; w++) extra[3 + w] = dw[w];
        run_words(P, c, extra, 3 + ndw, &res[i]);
        P->ndry_sampled_runs++;
        if (res[i].fail) {
            /* a refusal of the shortened model itself (its layers, say): the full dry run decides */
            if (res[i].fail == 2 && i == 0 && strstr(res[i].why, "layers")) ok = false;
            else {
                c->r = res[i];
                c->state = PC_FAILED;
                return;
            }
        }
    }
    if (ok) {
        c->r = res[0];
        for (int i = 1; i < nruns; i++) result_axpy(&c->r, coef[i], &res[i], &res[0]);
        c->sampled = true;
    } else {
        const char *extra[] = {"hbm_limit_gb=1000000"};
        run_words(P, c, extra, 1, &c->r);
        P->nfull++;
        if (c->r.fail) {
            c->state = PC_FAILED;
            return;
        }
    }
    c->state = c->r.peak > P->hbm ? PC_OOM : PC_RANKED;
}

static double score(const plan_cand *c) { return c->r.step_s; }

static int cmp_ctx_idx(const plan_ctx *P, int a, int b)
{
    const plan_cand *x = &P->c[a], *y = &P->c[b];
    if (score(x) != score(y)) return score(x) < score(y) ? -1 : 1;
    if (x->r.peak != y->r.peak) return x->r.peak < y->r.peak ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* insertion sort on indices (the lists are short enough; qsort has no context argument in C11) */
static void sort_idx(const plan_ctx *P, int *idx, int n, int (*cmp)(const plan_ctx *, int, int))
{
    for (int i = 1; i < n; i++) {
        int v = idx[i], j = i;
        while (j > 0 && cmp(P, idx[j - 1], v) > 0) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = v;
    }
}

static __attribute__((unused)) int cmp_lb(const plan_ctx *P, int a, int b)
{
    if (P->c[a].lb != P->c[b].lb) return P->c[a].lb < P->c[b].lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* Structures ranked by their default candidate's run: fitting by step time, then the ones out of
 * memory by their peak (accumulation may bring them in). */
static int cmp_struct(const plan_ctx *P, int a, int b)
{
    const plan_cand *x = &P->c[a], *y = &P->c[b];
    int cx = x->state == PC_RANKED ? 0
             : x->state == PC_OOM  ? 1
                                   : 2,
        cy = y->state == PC_RANKED ? 0
             : y->state == PC_OOM  ? 1
                                   : 2;
    if (cx != cy) return cx - cy;
    if (cx == 0) return cmp_ctx_idx(P, a, b);
    if (x->r.peak != y->r.peak) return x->r.peak < y->r.peak ? -1 : 1;
    return a < b ? -1 : a > b;
}

static void run_one(plan_ctx *P, FILE *err, int i, const char *phase)
{
    char what[96];
    snprintf(what, sizeof what, "%s, dry run %d of at most %d", phase, P->dry_runs + 1, P->budget);
    progress(P, err, (double)P->dry_runs / P->budget, what);
    sampled_run(P, &P->c[i]);
    if (P->c[i].state == PC_FAILED) {
        P->c[i].reason = add_reason(P, P->c[i].r.why, &P->c[i], 1);
    }
    P->dry_runs++;
}

/* Two results with the same figures: configurations that differ only in names the model never uses
 * (a rule for MoE weights on a dense model, say). */
static bool same_figures(const plan_result *a, const plan_result *b)
{
    if (a->fail || b->fail || a->peak != b->peak || a->step_s != b->step_s || a->naxes != b->naxes) return false;
    for (int i = 0; i < a->naxes; i++)
        if (strcmp(a->axes[i], b->axes[i]) || a->axis_bytes[i] != b->axis_bytes[i]) return false;
    return true;
}

static int cmp_struct_order(const plan_ctx *P, int a, int b)
{
    /* the most sharded state first (the one most likely to fit), simpler meshes first among equals */
    if (P->c[a].lb != P->c[b].lb) return P->c[a].lb < P->c[b].lb ? -1 : 1;
    if (P->c[a].w.n != P->c[b].w.n) return P->c[a].w.n - P->c[b].w.n;
    return a < b ? -1 : a > b;
}

static void dry_runs(plan_ctx *P, FILE *err)
{
    int nstruct = 0;
    int *idx = malloc((size_t)(P->nc + 1) * sizeof *idx);
    SIM_ASSERT(idx);
    for (int i = 0; i < P->nc; i++)
        if (P->c[i].is_default && P->c[i].state == PC_UNTRIED) idx[nstruct++] = i;
    sort_idx(P, idx, nstruct, cmp_struct_order);
    /* phase 1: structures with their default knobs, two thirds of the budget at most */
    int phase1 = P->budget - P->budget / 3;
    int ran = 0;
    for (int k = 0; k < nstruct && P->dry_runs < phase1; k++) {
        int i = idx[k];
        run_one(P, err, i, "meshes");
        for (int j = 0; j < k; j++)
            if (same_figures(&P->c[idx[j]].r, &P->c[i].r) && P->c[idx[j]].state != PC_EQUIVALENT) {
                P->c[i].state = PC_EQUIVALENT; /* its knob variants would repeat the earlier one's */
                P->c[i].dup_of = idx[j];
                break;
            }
        ran = k + 1;
    }
    /* phase 2: the knob variants of the best structures, best first */
    sort_idx(P, idx, ran, cmp_struct);
    for (int k = 0; k < ran && P->dry_runs < P->budget; k++) {
        int s = idx[k];
        if (P->c[s].state != PC_RANKED && P->c[s].state != PC_OOM) continue;
        int first = add_variants(P, s);
        P->c[s].explored = true;
        P->structures_explored++;
        for (int i = first; i < P->nc && P->dry_runs < P->budget; i++)
            if (P->c[i].state == PC_UNTRIED) run_one(P, err, i, "remat and accumulation");
    }
    free(idx);
}

static void rank_all(plan_ctx *P)
{
    free(P->ranked);
    P->ranked = malloc((size_t)(P->nc + 1) * sizeof *P->ranked);
    SIM_ASSERT(P->ranked);
    P->nranked = 0;
    for (int i = 0; i < P->nc; i++) {
        P->c[i].rank = 0;
        if (P->c[i].state == PC_RANKED) P->ranked[P->nranked++] = i;
    }
    sort_idx(P, P->ranked, P->nranked, cmp_ctx_idx);
    for (int k = 0; k < P->nranked; k++) P->c[P->ranked[k]].rank = k + 1;
}

/* The top candidates dry-run in full, every layer, with the device's HBM. */
static void verify(plan_ctx *P, FILE *err)
{
    int done = 0, tries = 0;
    rank_all(P);
    while (done < P->verify && tries < 2 * P->verify + 2) {
        int pick = -1;
        for (int k = 0; k < P->nranked; k++)
            if (!P->c[P->ranked[k]].verified) {
                pick = P->ranked[k];
                break;
            }
        if (pick < 0) break;
        tries++;
        plan_cand *c = &P->c[pick];
        char what[96];
        snprintf(what, sizeof what, "full dry run of #%d", c->rank);
        progress(P, err, 1.0, what);
        c->sampled_step_s = c->r.step_s;
        c->sampled_peak = c->r.peak;
        plan_result full;
        run_words(P, c, NULL, 0, &full);
        P->nfull++;
        c->verified = true;
        if (full.fail == 1) {
            c->state = PC_OOM;
            snprintf(c->r.why, sizeof c->r.why, "%s", full.why);
        } else if (full.fail) {
            c->state = PC_FAILED;
            c->r = full;
            c->reason = add_reason(P, full.why, c, 1);
        } else {
            c->r = full;
            done++;
        }
        rank_all(P);
    }
}

/* ------------------------------------------------------------ output */

static const char *gib(double b, char *buf, size_t cap) { return cli_bytes_text(b, buf, cap); }

static double mfu(const plan_result *r)
{
    return r->step_s > 0 && r->peak_flops > 0 ? r->model_flops / (r->step_s * r->peak_flops) : 0;
}

/* The mesh-axis group whose exposed communication is largest, or -1. */
static int worst_axis(const plan_result *r)
{
    int k = -1;
    for (int i = 0; i < r->naxes; i++)
        if (r->axis_exposed[i] > 0 && (k < 0 || r->axis_exposed[i] > r->axis_exposed[k])) k = i;
    return k;
}

/* What bounds the candidate, one line. */
static void bound_text(const plan_ctx *P, const plan_cand *c, char *buf, size_t cap)
{
    const plan_result *r = &c->r;
    double step = r->step_s > 0 ? r->step_s : 1, work = r->compute_s - r->bubble_s;
    int w = worst_axis(r);
    size_t n;
    if (r->bubble_s > 0.2 * step)
        n = (size_t)snprintf(buf, cap, "pipeline bubble (%.0f%% of the step)", 100 * r->bubble_s / step);
    else if (r->exposed_s > work && w >= 0)
        n = (size_t)snprintf(buf, cap, "bandwidth over %s (%.3g ms exposed of %.3g)", r->axes[w],
                             1e3 * r->axis_exposed[w], 1e3 * step);
    else if (r->optimizer_s > 0.3 * step)
        n = (size_t)snprintf(buf, cap, "optimizer update (memory-bound, %.0f ms)", 1e3 * r->optimizer_s);
    else
        n = (size_t)snprintf(buf, cap, "compute (%.0f%% of the step; MFU %.1f%%)", 100 * r->compute_s / step,
                             100 * mfu(r));
    double free_b = P->hbm - r->peak;
    char fb[32];
    if (n < cap && free_b < 0.1 * P->hbm)
        snprintf(buf + n, cap - n, "; memory headroom %s", gib(free_b, fb, sizeof fb));
}

/* "fsdp=4 tensor=2", "+ legacy, explicit, ZeRO-1, remat minimal, GA 2" from the words */
static void short_text(const plan_cand *c, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = '\0';
    for (int i = 0; i < c->w.n && n < cap; i++) {
        const char *w = c->w.w[i];
        if (word_sets(w, "per_device_batch_size")) continue;
        char t[PLAN_WORD];
        snprintf(t, sizeof t, "%s", w);
        /* ici_tensor_parallelism=2 -> tensor=2 ; dcn_fsdp_parallelism=2 -> dcn fsdp=2 */
        char *p;
        if (!strncmp(t, "ici_", 4) && (p = strstr(t, "_parallelism="))) {
            *p = '\0';
            n += (size_t)snprintf(buf + n, cap - n, "%s%s=%s", n ? " " : "", t + 4, p + 13);
        } else if (!strncmp(t, "dcn_", 4) && (p = strstr(t, "_parallelism="))) {
            *p = '\0';
            n += (size_t)snprintf(buf + n, cap - n, "%sdcn_%s=%s", n ? " " : "", t + 4, p + 13);
        } else {
            const char *eq = strchr(w, '=');
            const char *k = word_sets(w, "custom_mesh_and_rule")          ? "rules"
                            : word_sets(w, "gradient_accumulation_steps") ? "GA"
                            : word_sets(w, "num_pipeline_microbatches")   ? "microbatches"
                            : word_sets(w, "shard_optimizer_over_data")   ? "ZeRO-1"
                            : word_sets(w, "remat_policy")                ? "remat"
                                                                          : NULL;
            if (word_sets(w, "shard_optimizer_over_data"))
                n += (size_t)snprintf(buf + n, cap - n, "%sZeRO-1", n ? " " : "");
            else if (word_sets(w, "shard_mode")) n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " " : "", eq + 1);
            else if (k) n += (size_t)snprintf(buf + n, cap - n, "%s%s=%s", n ? " " : "", k, eq + 1);
            else n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " " : "", w);
        }
    }
}

static void print_memory(FILE *out, const plan_result *r)
{
    static const char *names[SIM_NMEM] = {"params",      "grads",       "optimizer", "weight copy",
                                          "activations", "temporaries", "comm"};
    fprintf(out, "      memory:");
    bool first = true;
    for (int c = 0; c < SIM_NMEM; c++) {
        if (r->cat[c] < 0.5) continue;
        char b[32];
        fprintf(out, "%s %s %s", first ? "" : ",", names[c], gib(r->cat[c], b, sizeof b));
        first = false;
    }
    fprintf(out, "\n");
}

static void print_axes(FILE *out, const plan_result *r)
{
    fprintf(out, "      bytes per device and step:");
    if (r->naxes == 0) fprintf(out, " none (no collectives)");
    /* largest first */
    int idx[PLAN_AXES];
    for (int i = 0; i < r->naxes; i++) idx[i] = i;
    for (int i = 1; i < r->naxes; i++)
        for (int j = i; j > 0 && r->axis_bytes[idx[j]] > r->axis_bytes[idx[j - 1]]; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    for (int k = 0; k < r->naxes; k++) {
        int i = idx[k];
        char b[32];
        fprintf(out, "%s %s %s", k ? "," : "", r->axes[i], gib(r->axis_bytes[i], b, sizeof b));
        if (r->axis_exposed[i] > 0) fprintf(out, " (%.1f ms exposed)", 1e3 * r->axis_exposed[i]);
    }
    fprintf(out, "\n");
}

static void print_candidate(FILE *out, const plan_ctx *P, const plan_cand *c)
{
    char peak[32], bound[256], cmd[PLAN_WORD * (PLAN_USER + PLAN_CW) / 4];
    bound_text(P, c, bound, sizeof bound);
    fprintf(out, "  #%-3d %.3f ms  MFU %5.1f%%  peak %s per device  [%s]\n", c->rank, 1e3 * c->r.step_s,
            100 * mfu(&c->r), gib(c->r.peak, peak, sizeof peak),
            c->verified  ? "full dry run"
            : c->sampled ? "sampled layers, extrapolated"
                         : "dry run");
    fprintf(out, "      bound: %s\n", bound);
    print_memory(out, &c->r);
    print_axes(out, &c->r);
    cand_command(P, c, cmd, sizeof cmd);
    fprintf(out, "      $ %s\n", cmd);
}

static void print_table(FILE *out, const plan_ctx *P, int n)
{
    fprintf(out, "  rank   step (ms)     MFU   peak/device  candidate\n");
    for (int k = 0; k < n; k++) {
        const plan_cand *c = &P->c[P->ranked[k]];
        char peak[32], s[512];
        short_text(c, s, sizeof s);
        fprintf(out, "  %4d %11.1f  %5.1f%%  %12s  %s\n", c->rank, 1e3 * c->r.step_s, 100 * mfu(&c->r),
                gib(c->r.peak, peak, sizeof peak), s[0] ? s : "(the defaults)");
    }
}

static void print_counts(FILE *out, const plan_ctx *P)
{
    long long st[PC_NSTATES] = {0};
    for (int i = 0; i < P->nc; i++) st[P->c[i].state]++;
    long long ran = st[PC_OOM] + st[PC_FAILED] + st[PC_RANKED] + st[PC_EQUIVALENT];
    long long untried =
        P->considered - P->by_state[PC_REJECTED] - P->by_state[PC_PRUNED] - P->by_state[PC_DUPLICATE] - ran;
    fprintf(out,
            "\n%lld candidates considered: %lld structures (%lld meshes x rule sets x shard_mode x "
            "shard_optimizer_over_data) x their remat_policy, gradient_accumulation_steps and pipeline "
            "microbatch variants (configs/plan.yml)%s\n",
            P->considered, P->structures, P->meshes,
            P->truncated ? "; the enumeration stopped at its limit of structures" : "");
    fprintf(out, "  %8lld rejected by the checks train applies (reasons below)\n", P->by_state[PC_REJECTED]);
    fprintf(out, "  %8lld pruned: parameters + gradients + optimizer state alone exceed the HBM",
            P->by_state[PC_PRUNED] - P->pruned_remat);
    if (P->pruned_remat)
        fprintf(out, "; %lld more: a remat policy that saves more than full where full ran out", P->pruned_remat);
    fprintf(out, "\n  %8lld equivalent to an earlier candidate (same mesh, parameter shardings, rules and knobs)\n",
            P->by_state[PC_DUPLICATE]);
    fprintf(out,
            "  %8lld dry-run: %lld fit and are ranked, %lld out of memory, %lld refused or failed while running, "
            "%lld with the same figures as an earlier mesh (not explored further)\n",
            ran, st[PC_RANKED], st[PC_OOM], st[PC_FAILED], st[PC_EQUIVALENT]);
    fprintf(out,
            "  %8lld not dry-run: beyond the budget plan_dry_runs=%d (the knob variants of %d structures were "
            "explored)\n",
            untried, P->budget, P->structures_explored);
    fprintf(out,
            "dry runs: %d runs of a few layers per kind, extrapolated to the model's %lld layers, and %d in full; "
            "%.1f s of the plan's %.1f s\n",
            P->ndry_sampled_runs, (long long)P->layers, P->nfull, P->dry_wall_s, P->wall_s);
}

/* The reasons' indices, most frequent first (stable). */
static void reasons_by_count(const plan_ctx *P, int *idx)
{
    for (int i = 0; i < P->nreasons; i++) idx[i] = i;
    for (int i = 1; i < P->nreasons; i++)
        for (int j = i; j > 0 && P->reasons[idx[j]].count > P->reasons[idx[j - 1]].count; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
}

static void print_reasons(FILE *out, const plan_ctx *P)
{
    if (!P->nreasons) return;
    int idx[PLAN_REASONS];
    reasons_by_count(P, idx);
    fprintf(out, "\nrejected or failed, by reason (count, first message, its candidate's keys):\n");
    for (int k = 0; k < P->nreasons; k++) {
        const plan_reason *r = &P->reasons[idx[k]];
        fprintf(out, "  %8lld  %s\n            (%s)\n", r->count, r->text, r->example[0] ? r->example : "the defaults");
    }
}

/* Why candidate K ranks where it does: its step time's parts against the best and its neighbours. */
static void explain(FILE *out, const plan_ctx *P, int K)
{
    const plan_cand *c = &P->c[P->ranked[K - 1]];
    const plan_result *r = &c->r;
    char b1[32], b2[32];
    fprintf(out, "\nwhy #%d ranks #%d of %d:\n", K, K, P->nranked);
    fprintf(out,
            "  step %.1f ms = compute %.1f ms (of which pipeline bubbles %.1f) + optimizer %.1f + exposed "
            "communication %.1f\n",
            1e3 * r->step_s, 1e3 * r->compute_s, 1e3 * r->bubble_s, 1e3 * r->optimizer_s, 1e3 * r->exposed_s);
    for (int i = 0; i < r->naxes; i++)
        if (r->axis_exposed[i] > 0)
            fprintf(out, "    exposed over %-20s %9.1f ms (%s sent per device)\n", r->axes[i], 1e3 * r->axis_exposed[i],
                    gib(r->axis_bytes[i], b1, sizeof b1));
    fprintf(out, "  memory: peak %s of %s per device (headroom %s)\n", gib(r->peak, b1, sizeof b1),
            gib(P->hbm, b2, sizeof b2), gib(P->hbm - r->peak, b1, sizeof b1));
    if (c->verified && c->sampled_step_s > 0)
        fprintf(out, "  the sampled layers had predicted %.1f ms and %s; the full dry run gives the figures above\n",
                1e3 * c->sampled_step_s, gib(c->sampled_peak, b1, sizeof b1));
    int others[3] = {1, K - 1, K + 1};
    const char *label[3] = {"the best", "the one above", "the one below"};
    for (int o = 0; o < 3; o++) {
        int k = others[o];
        if (k < 1 || k > P->nranked || k == K || (o > 0 && k == 1)) continue;
        const plan_result *q = &P->c[P->ranked[k - 1]].r;
        double parts[4] = {r->compute_s - r->bubble_s - (q->compute_s - q->bubble_s), r->bubble_s - q->bubble_s,
                           r->optimizer_s - q->optimizer_s, r->exposed_s - q->exposed_s};
        const char *pn[4] = {"compute", "pipeline bubbles", "optimizer", "exposed communication"};
        int big = 0;
        for (int i = 1; i < 4; i++)
            if (fabs(parts[i]) > fabs(parts[big])) big = i;
        char s[512];
        short_text(&P->c[P->ranked[k - 1]], s, sizeof s);
        fprintf(out,
                "  against #%d (%s: %s): %+.1f ms; compute %+.1f, bubbles %+.1f, optimizer %+.1f, exposed "
                "communication %+.1f; most of it: %s",
                k, label[o], s[0] ? s : "the defaults", 1e3 * (r->step_s - q->step_s), 1e3 * parts[0], 1e3 * parts[1],
                1e3 * parts[2], 1e3 * parts[3], pn[big]);
        if (big == 3) { /* the axis whose exposure moved most */
            double best = 0;
            const char *ax = NULL;
            for (int i = 0; i < r->naxes; i++) {
                double qe = 0;
                for (int j = 0; j < q->naxes; j++)
                    if (!strcmp(q->axes[j], r->axes[i])) qe = q->axis_exposed[j];
                if (fabs(r->axis_exposed[i] - qe) > fabs(best)) {
                    best = r->axis_exposed[i] - qe;
                    ax = r->axes[i];
                }
            }
            for (int j = 0; j < q->naxes; j++) {
                bool seen = false;
                for (int i = 0; i < r->naxes; i++) seen |= !strcmp(q->axes[j], r->axes[i]);
                if (!seen && fabs(q->axis_exposed[j]) > fabs(best)) {
                    best = -q->axis_exposed[j];
                    ax = q->axes[j];
                }
            }
            if (ax) fprintf(out, " (over %s: %+.1f ms)", ax, 1e3 * best);
        }
        fprintf(out, "; peak %+.2f GiB\n", (r->peak - q->peak) / 1073741824.0);
    }
}

/* ------------------------------------------------------------ plan.json and report.html */

/* Marks the Pareto front of the ranked candidates: those that no other ranked candidate dominates,
 * i.e. none is as fast or faster and as small or smaller, and strictly better in one of the two
 * (candidates with the same figures are all on it).  P->ranked is in step-time order, then peak
 * order, so one sweep decides: a candidate is dominated iff a strictly faster one has a peak no
 * larger, or one with its step time has a strictly smaller peak. */
static void mark_pareto(plan_ctx *P)
{
    double min_faster = INFINITY; /* the smallest peak of the candidates faster than the current step time */
    for (int k = 0; k < P->nranked;) {
        double step = P->c[P->ranked[k]].r.step_s, group_min = INFINITY;
        int e = k;
        for (; e < P->nranked && P->c[P->ranked[e]].r.step_s == step; e++)
            if (P->c[P->ranked[e]].r.peak < group_min) group_min = P->c[P->ranked[e]].r.peak;
        for (int j = k; j < e; j++) {
            plan_cand *c = &P->c[P->ranked[j]];
            c->pareto = !(min_faster <= c->r.peak) && !(group_min < c->r.peak);
        }
        if (group_min < min_faster) min_faster = group_min;
        k = e;
    }
}

/* The candidate out of memory with the smallest peak (the closest to fitting), or -1. */
static int closest_oom(const plan_ctx *P)
{
    int best = -1;
    for (int i = 0; i < P->nc; i++)
        if (P->c[i].state == PC_OOM && (best < 0 || P->c[i].r.peak < P->c[best].r.peak)) best = i;
    return best;
}

static const char *state_name(plan_state s)
{
    switch (s) {
    case PC_RANKED: return "ranked";
    case PC_OOM: return "out_of_memory";
    case PC_FAILED: return "failed";
    case PC_EQUIVALENT: return "same_figures";
    case PC_UNTRIED: return "not_dry_run";
    case PC_DUPLICATE: return "equivalent";
    case PC_PRUNED: return "pruned";
    case PC_REJECTED: return "rejected";
    default: return "unknown";
    }
}

/* A member of the open object: a number (null where it is not finite: JSON has no NaN), an
 * integer, a string, a boolean, or null. */
static void jnum(cfg_jw *w, const char *key, double v)
{
    cfg_jw_key(w, key);
    cfg_jw_double(w, v);
}

static void jint(cfg_jw *w, const char *key, long long v)
{
    cfg_jw_key(w, key);
    cfg_jw_int(w, v);
}

static void jstr(cfg_jw *w, const char *key, const char *v)
{
    cfg_jw_key(w, key);
    cfg_jw_str(w, v);
}

static void jbool(cfg_jw *w, const char *key, bool v)
{
    cfg_jw_key(w, key);
    cfg_jw_bool(w, v);
}

/* an integer, or null when absent (v < 0) */
static void jint_or_null(cfg_jw *w, const char *key, long long v)
{
    cfg_jw_key(w, key);
    if (v >= 0) cfg_jw_int(w, v);
    else cfg_jw_null(w);
}

/* The figures of a dry run: step time and its parts, MFU, the peak and its composition, the bytes
 * per mesh-axis group. */
static void result_json(cfg_jw *w, const plan_result *r)
{
    cfg_jw_key(w, "step_time");
    cfg_jw_obj(w);
    jnum(w, "step_s", r->step_s);
    jnum(w, "compute_s", r->compute_s);
    jnum(w, "bubble_s", r->bubble_s);
    jnum(w, "optimizer_s", r->optimizer_s);
    jnum(w, "exposed_communication_s", r->exposed_s);
    jnum(w, "model_flops", r->model_flops);
    jnum(w, "peak_flops", r->peak_flops);
    cfg_jw_end(w);
    jnum(w, "step_s", r->step_s);
    jnum(w, "mfu", mfu(r));
    jnum(w, "peak_bytes", r->peak);
    cfg_jw_key(w, "memory");
    cfg_jw_obj(w);
    for (int c = 0; c < SIM_NMEM; c++) jnum(w, sim_mem_cat_name((sim_mem_cat)c), r->cat[c]);
    cfg_jw_end(w);
    cfg_jw_key(w, "axes");
    cfg_jw_arr(w);
    for (int i = 0; i < r->naxes; i++) {
        cfg_jw_obj(w);
        jstr(w, "axes", r->axes[i]);
        jnum(w, "bytes_per_device", r->axis_bytes[i]);
        jnum(w, "exposed_s", r->axis_exposed[i]);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
}

/* The words of a space-separated list (a dropped candidate's keys). */
static void split_words(const char *keys, plan_words *w)
{
    memset(w, 0, sizeof *w);
    for (const char *p = keys; *p && w->n < PLAN_CW;) {
        size_t k = strcspn(p, " ");
        if (k) snprintf(w->w[w->n++], PLAN_WORD, "%.*s", (int)k, p);
        p += k;
        while (*p == ' ') p++;
    }
}

/* Opens a candidate's object with the fields every candidate has: its outcome, keys, summary and
 * command line. */
static void cand_head(cfg_jw *w, const plan_ctx *P, int id, plan_state state, const plan_cand *c, long long count)
{
    char s[512], cmd[PLAN_WORD * (PLAN_USER + PLAN_CW) / 4];
    cfg_jw_obj(w);
    jint(w, "id", id);
    jstr(w, "state", state_name(state));
    jint_or_null(w, "rank", c->rank > 0 ? c->rank : -1);
    jbool(w, "pareto", c->pareto);
    jint(w, "candidates", count);
    short_text(c, s, sizeof s);
    jstr(w, "summary", s[0] ? s : "(the defaults)");
    cfg_jw_key(w, "keys");
    cfg_jw_arr(w);
    for (int i = 0; i < c->w.n; i++) cfg_jw_str(w, c->w.w[i]);
    cfg_jw_end(w);
    cand_command(P, c, cmd, sizeof cmd);
    jstr(w, "command", cmd);
}

static void plan_json(cfg_jw *w, const plan_ctx *P)
{
    char b1[32], b2[32], msg[700];
    cfg_jw_obj(w);
    jint(w, "format", 1);
    jstr(w, "command", "plan");
    cfg_jw_key(w, "argv");
    cfg_jw_arr(w);
    for (int i = 0; i < P->argc; i++) cfg_jw_str(w, P->argv[i]);
    cfg_jw_end(w);
    jstr(w, "model", P->model);
    jstr(w, "topology", P->topology);
    jstr(w, "hardware_profile", P->profile);
    jint(w, "devices", P->devices);
    jint(w, "slices", P->slices);
    jnum(w, "hbm_bytes", P->hbm);
    jint(w, "global_batch_rows", P->global);
    jint(w, "max_target_length", P->seq);
    jint(w, "layers", P->layers);
    jint(w, "top", P->top);

    long long st[PC_NSTATES] = {0};
    for (int i = 0; i < P->nc; i++) st[P->c[i].state]++;
    long long ran = st[PC_OOM] + st[PC_FAILED] + st[PC_RANKED] + st[PC_EQUIVALENT];
    cfg_jw_key(w, "counts");
    cfg_jw_obj(w);
    jint(w, "considered", P->considered);
    jint(w, "structures", P->structures);
    jint(w, "meshes", P->meshes);
    jbool(w, "truncated", P->truncated);
    jint(w, "rejected", P->by_state[PC_REJECTED]);
    jint(w, "pruned", P->by_state[PC_PRUNED] - P->pruned_remat);
    jint(w, "pruned_remat", P->pruned_remat);
    jint(w, "equivalent", P->by_state[PC_DUPLICATE]);
    jint(w, "dry_run", ran);
    jint(w, "ranked", st[PC_RANKED]);
    jint(w, "out_of_memory", st[PC_OOM]);
    jint(w, "failed", st[PC_FAILED]);
    jint(w, "same_figures", st[PC_EQUIVALENT]);
    jint(w, "not_dry_run",
         P->considered - P->by_state[PC_REJECTED] - P->by_state[PC_PRUNED] - P->by_state[PC_DUPLICATE] - ran);
    jint(w, "dry_run_budget", P->budget);
    jint(w, "structures_explored", P->structures_explored);
    jint(w, "sampled_runs", P->ndry_sampled_runs);
    jint(w, "full_runs", P->nfull);
    cfg_jw_end(w);

    int idx[PLAN_REASONS];
    reasons_by_count(P, idx);
    cfg_jw_key(w, "reasons");
    cfg_jw_arr(w);
    for (int k = 0; k < P->nreasons; k++) {
        const plan_reason *r = &P->reasons[idx[k]];
        cfg_jw_obj(w);
        jint(w, "count", r->count);
        jstr(w, "message", r->text);
        jstr(w, "example", r->example);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);

    /* ids: the ranked in rank order, the other kept candidates in enumeration order, then the
     * dropped ones */
    int *id_of = malloc((size_t)(P->nc + 1) * sizeof *id_of);
    SIM_ASSERT(id_of);
    int next = 0;
    for (int k = 0; k < P->nranked; k++) id_of[P->ranked[k]] = next++;
    for (int i = 0; i < P->nc; i++)
        if (P->c[i].state != PC_RANKED) id_of[i] = next++;
    int *order = malloc((size_t)(P->nc + 1) * sizeof *order);
    SIM_ASSERT(order);
    for (int i = 0; i < P->nc; i++) order[id_of[i]] = i;

    jint_or_null(w, "winner", P->nranked ? 0 : -1);
    int best = closest_oom(P);
    jint_or_null(w, "closest", !P->nranked && best >= 0 ? id_of[best] : -1);
    /* the front's ids in rank order (the ranked come first: rank k + 1 is id k) */
    cfg_jw_key(w, "pareto");
    cfg_jw_arr(w);
    for (int k = 0; k < P->nranked; k++)
        if (P->c[P->ranked[k]].pareto) cfg_jw_int(w, k);
    cfg_jw_end(w);

    cfg_jw_key(w, "candidates");
    cfg_jw_arr(w);
    for (int k = 0; k < P->nc; k++) {
        const plan_cand *c = &P->c[order[k]];
        /* a structure whose knob variants were never made: not dry-run, they are counted with it
         * (beyond the budget); dry-run, they are counted beside it */
        long long unmade = c->is_default && !c->explored ? count_variants(P, c->stages) - 1 : 0;
        cand_head(w, P, k, c->state, c, c->state == PC_UNTRIED ? 1 + unmade : 1);
        if (c->state != PC_UNTRIED) jint(w, "variants_not_dry_run", unmade);
        jnum(w, "lower_bound_bytes", c->lb);
        bool figures = c->state == PC_RANKED || c->state == PC_OOM || c->state == PC_EQUIVALENT;
        if (figures) {
            jstr(w, "figures",
                 c->verified && c->state == PC_RANKED ? "full dry run"
                 : c->sampled                         ? "sampled layers, extrapolated"
                                                      : "dry run");
            result_json(w, &c->r);
        }
        if (c->verified && c->sampled_step_s > 0) {
            jnum(w, "sampled_step_s", c->sampled_step_s);
            jnum(w, "sampled_peak_bytes", c->sampled_peak);
        }
        msg[0] = '\0';
        switch (c->state) {
        case PC_RANKED:
            bound_text(P, c, msg, sizeof msg);
            jstr(w, "bound", msg);
            msg[0] = '\0';
            break;
        case PC_OOM:
            if (c->r.why[0]) snprintf(msg, sizeof msg, "out of memory in the full dry run: %s", c->r.why);
            else
                snprintf(msg, sizeof msg, "out of memory: a peak of %s per device exceeds the HBM (%s)",
                         gib(c->r.peak, b1, sizeof b1), gib(P->hbm, b2, sizeof b2));
            break;
        case PC_FAILED: snprintf(msg, sizeof msg, "%s", c->r.why); break;
        case PC_EQUIVALENT:
            snprintf(msg, sizeof msg, "the same figures as candidate %d: its knob variants are not explored",
                     c->dup_of >= 0 ? id_of[c->dup_of] : -1);
            jint_or_null(w, "same_as", c->dup_of >= 0 ? id_of[c->dup_of] : -1);
            break;
        case PC_UNTRIED: snprintf(msg, sizeof msg, "not dry-run: beyond the budget plan_dry_runs=%d", P->budget); break;
        default: break;
        }
        if (msg[0]) jstr(w, "reason", msg);
        cfg_jw_end(w);
    }
    plan_cand *tmp = calloc(1, sizeof *tmp);
    SIM_ASSERT(tmp);
    for (int i = 0; i < P->ndrops; i++) {
        const plan_drop *d = &P->drops[i];
        split_words(d->keys, &tmp->w);
        cand_head(w, P, P->nc + i, d->state, tmp, d->count);
        if (d->state == PC_REJECTED) {
            cfg_jw_key(w, "lower_bound_bytes");
            cfg_jw_null(w);
        } else {
            jnum(w, "lower_bound_bytes", d->lb);
        }
        if (d->state == PC_REJECTED) snprintf(msg, sizeof msg, "%s", d->why ? d->why : "refused");
        else if (d->state == PC_PRUNED && d->remat_pruned)
            snprintf(msg, sizeof msg, "pruned: a remat policy that saves more than full, where full ran out of memory");
        else if (d->state == PC_PRUNED)
            snprintf(msg, sizeof msg,
                     "pruned: parameters + gradients + optimizer state alone (%s per device) exceed "
                     "the HBM (%s)",
                     gib(d->lb, b1, sizeof b1), gib(P->hbm, b2, sizeof b2));
        else
            snprintf(msg, sizeof msg,
                     "equivalent to candidate %d (the same mesh, parameter shardings, rules and knobs)",
                     d->same_as >= 0 ? id_of[d->same_as] : -1);
        if (d->state == PC_DUPLICATE) jint_or_null(w, "same_as", d->same_as >= 0 ? id_of[d->same_as] : -1);
        jstr(w, "reason", msg);
        cfg_jw_end(w);
    }
    free(tmp);
    cfg_jw_end(w);
    cfg_jw_end(w);
    free(id_of);
    free(order);
}

static sim_status write_plan_json(FILE *f, void *arg)
{
    cfg_jw w;
    cfg_jw_init(&w);
    plan_json(&w, arg);
    cfg_jw_write(&w, f, CFG_JW_INDENT1, 17);
    fputc('\n', f); /* a write error shows in ferror(f), which cli_artifact_write checks */
    return SIM_OK;
}

/* ------------------------------------------------------------ the command */

/* Keys plan varies: a user who sets one fixes it. */
static bool is_mesh_flag(const char *key)
{
    return (!strncmp(key, "ici_", 4) || !strncmp(key, "dcn_", 4)) && strstr(key, "_parallelism");
}

static bool user_set(const cfg_config *cfg, const char *key)
{
    const cfg_entry *e = cfg_find(cfg, key);
    return e && e->from_user;
}

static sim_status setup(plan_ctx *P, int argc, char **argv, const char **user, char (*extra)[PLAN_WORD])
{
    /* --explain K becomes explain_candidate=K */
    const char *words[PLAN_USER];
    int n = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--explain")) {
            if (i + 1 >= argc)
                return sim_err(SIM_ERR_INPUT, "--explain needs the rank of a candidate: --explain K (K >= 1)");
            snprintf(extra[0], PLAN_WORD, "explain_candidate=%s", argv[++i]);
            if (n == PLAN_USER) return sim_err(SIM_ERR_INPUT, "too many arguments (at most %d)", PLAN_USER);
            words[n++] = extra[0];
            continue;
        }
        if (n == PLAN_USER) return sim_err(SIM_ERR_INPUT, "too many arguments (at most %d)", PLAN_USER);
        words[n++] = argv[i];
    }
    SIM_TRY(cli_configs_check());
    SIM_TRY(space_load(&P->sp));
    cfg_config *cfg = NULL;
    SIM_TRY(cfg_load_argv(cli_base_config(), n, words, &cfg));
    long long nd = 0, ns = 0, top = 0, budget = 0, verify = 0, gb = 0, ex = 0, ga = 1, seq = 0, experts = 0;
    double pdbs = 0, hbm = 0;
    const char *topo = NULL, *model = NULL, *rules = NULL, *outdir = NULL;
    cfg_hw hw;
    bool have_hw = false;
    sim_status st = cfg_get_int(cfg, "num_devices", &nd);
    if (!st) st = cfg_get_int(cfg, "num_slices", &ns);
    if (!st) st = cfg_get_int(cfg, "plan_top", &top);
    if (!st) st = cfg_get_int(cfg, "plan_dry_runs", &budget);
    if (!st) st = cfg_get_int(cfg, "plan_verify", &verify);
    if (!st) st = cfg_get_int(cfg, "plan_global_batch", &gb);
    if (!st) st = cfg_get_int(cfg, "explain_candidate", &ex);
    if (!st) st = cfg_get_int(cfg, "gradient_accumulation_steps", &ga);
    if (!st) st = cfg_get_int(cfg, "max_target_length", &seq);
    if (!st) st = cfg_get_int(cfg, "num_experts", &experts);
    if (!st) st = cfg_get_double(cfg, "per_device_batch_size", &pdbs);
    if (!st) st = cfg_get_double(cfg, "hbm_limit_gb", &hbm);
    if (!st) st = cfg_get_str(cfg, "compile_topology", &topo);
    if (!st) st = cfg_get_str(cfg, "model_name", &model);
    if (!st) st = cfg_get_str(cfg, "custom_mesh_and_rule", &rules);
    if (!st) st = cfg_get_str(cfg, "output_dir", &outdir);
    if (!st && outdir && strlen(outdir) >= sizeof P->outdir)
        st = sim_err(SIM_ERR_INPUT, "output_dir is %zu bytes long; give a path shorter than %zu bytes", strlen(outdir),
                     sizeof P->outdir);
    /* the directory first: a search of a minute is not run for files that cannot be written */
    if (!st && outdir && *outdir) {
        snprintf(P->outdir, sizeof P->outdir, "%s", outdir);
        if (cli_artifacts_mkdir(P->outdir)) {
            char why[600];
            snprintf(why, sizeof why, "%s", sim_errmsg());
            sim_err_clear();
            st = sim_err(SIM_ERR_IO, "output_dir=%s: plan writes plan.json and report.html there, but %s", outdir, why);
        }
    }
    if (!st && nd <= 0)
        st = sim_err(SIM_ERR_INPUT, "plan needs the devices to plan for: compile_topology=NAME "
                                    "compile_topology_num_slices=S (configs/topologies.yml), or num_devices=N (and "
                                    "num_slices=S) with hardware_profile=NAME");
    if (!st) {
        P->devices = (int)nd;
        P->slices = ns > 0 ? (int)ns : 1;
        P->per_slice = P->devices / P->slices;
        st = cfg_hw_from_config(cfg, P->per_slice, &hw, &have_hw);
    }
    if (!st && !have_hw) {
        char names[512];
        st = sim_err(SIM_ERR_INPUT,
                     "plan ranks by the modelled step time, which needs a hardware profile: give "
                     "compile_topology=NAME (its family's profile) or hardware_profile=NAME (one of %s)",
                     cfg_hw_names(cli_configs_dir(), names, sizeof names));
    }
    if (!st) {
        P->hbm = hbm > 0 ? hbm * 1e9 : hw.hbm_bytes;
        snprintf(P->profile, sizeof P->profile, "%s", hw.name);
        snprintf(P->topology, sizeof P->topology, "%s", topo && *topo ? topo : "");
        snprintf(P->model, sizeof P->model, "%s", model ? model : "default");
        P->global = gb > 0 ? gb : (long long)((double)P->devices * pdbs) * ga;
        P->seq = seq;
        P->moe = experts > 1;
        P->top = (int)top;
        P->verify = (int)verify;
        P->explain = (int)ex;
        /* a dry run's cost grows with the devices: fewer of them on large meshes */
        P->budget = budget > 0                                  ? (int)budget
                    : PLAN_DEFAULT_BUDGET - P->devices / 8 > 24 ? PLAN_DEFAULT_BUDGET - P->devices / 8
                                                                : 24;
        if (P->global < 1)
            st = sim_err(SIM_ERR_INPUT,
                         "the global batch is %lld rows (per_device_batch_size=%g x %d devices x "
                         "gradient_accumulation_steps=%lld): give per_device_batch_size or "
                         "plan_global_batch so that a step holds at least one row",
                         P->global, pdbs, P->devices, ga);
    }
    /* what the user fixed */
    if (!st) {
        P->fixed_remat = user_set(cfg, "remat_policy");
        P->fixed_ga = user_set(cfg, "gradient_accumulation_steps");
        P->fixed_mode = user_set(cfg, "shard_mode");
        P->fixed_zero1 = user_set(cfg, "shard_optimizer_over_data");
        P->fixed_rules = user_set(cfg, "custom_mesh_and_rule");
        P->fixed_mb = user_set(cfg, "num_pipeline_microbatches");
        snprintf(P->fixed_rule_set, sizeof P->fixed_rule_set, "%s", rules ? rules : "");
        for (int i = 0; i < cfg->n; i++)
            if (cfg->entries[i].from_user && is_mesh_flag(cfg->entries[i].key)) P->fixed_mesh = true;
        /* configs/plan.yml leaves remat_policy=none out because a scanned stack recomputes under it as
         * under full; where the release keeps every activation instead (unscanned layers in 0.2.5:
         * cfg_release_remat_none_keeps), none is a candidate of its own */
        bool none_keeps = false;
        if (!st) st = cfg_release_remat_none_keeps(cfg, &none_keeps);
        if (!st && !P->fixed_remat && none_keeps && P->sp.remat.n < PLAN_LIST) {
            bool have = false;
            for (int i = 0; i < P->sp.remat.n; i++) have |= !strcmp(P->sp.remat.s[i], "none");
            if (!have) snprintf(P->sp.remat.s[P->sp.remat.n++], PLAN_NAME, "none");
        }
    }
    /* the model itself, as the user's keys define it (its kind and layers; a refusal here is the user's) */
    if (!st) {
        model_def *def = calloc(1, sizeof *def);
        SIM_ASSERT(def);
        st = model_def_from_config(cfg, def);
        if (!st) {
            P->family = def->d.family;
            P->two_stacks = def->d.family->layers_before_pipeline != NULL;
            P->layers = def->d.layers;
            P->dense_layers = P->two_stacks ? def->d.family->layers_before_pipeline(def) : 0;
            model_def_free(def);
        }
        free(def);
    }
    /* the user's words for every candidate: without plan's own keys and the keys plan sets */
    if (!st) {
        int nu = 0;
        bool dry = false;
        for (int i = 0; i < n; i++) {
            const char *w = words[i];
            if (plan_own_key(w) || word_sets(w, "per_device_batch_size")) continue;
            if (word_sets(w, "dry_run") || word_sets(w, "compile_topology")) dry = true;
            user[nu++] = w;
        }
        if (!dry) user[nu++] = "dry_run=true";
        P->user = user;
        P->nuser = nu;
    }
    cfg_free(cfg);
    return st;
}

int cli_plan(int argc, char **argv, FILE *out, FILE *err)
{
    plan_ctx *P = calloc(1, sizeof *P);
    const char **user = calloc(PLAN_USER + 1, sizeof *user);
    char(*extra)[PLAN_WORD] = calloc(2, sizeof *extra);
    SIM_ASSERT(P && user && extra);
    double t0 = now_s();
    P->argc = argc;
    P->argv = (const char *const *)argv;
    sim_status st = setup(P, argc, argv, user, extra);
    if (st) {
        int rc = cli_fail(err, st);
        free(P);
        free(user);
        free(extra);
        return rc;
    }
    sim_topology_cores(); /* hwloc's topology, loaded once here: every dry run's child inherits it */
    enumerate(P, err);
    dry_runs(P, err);
    verify(P, err);
    mark_pareto(P);
    cli_progress_done(err);
    P->wall_s = now_s() - t0;
    char hb[32];
    fprintf(out,
            "shardsim plan: %s on %s%s%d device%s in %d slice%s (profile %s, %s HBM per device), %lld rows x "
            "%lld tokens per step\n",
            P->model, P->topology[0] ? P->topology : "", P->topology[0] ? ", " : "", P->devices,
            P->devices > 1 ? "s" : "", P->slices, P->slices > 1 ? "s" : "", P->profile, gib(P->hbm, hb, sizeof hb),
            P->global, P->seq);
    int rc = 0;
    int show = P->nranked < P->top ? P->nranked : P->top;
    if (P->nranked == 0) {
        fprintf(out, "\nno candidate fits.\n");
        /* the closest: the dry-run candidates out of memory with the smallest peak */
        int best = closest_oom(P);
        if (best >= 0) {
            char s[512], pk[32], cmd[PLAN_WORD * (PLAN_USER + PLAN_CW) / 4];
            short_text(&P->c[best], s, sizeof s);
            cand_command(P, &P->c[best], cmd, sizeof cmd);
            fprintf(out, "the closest: %s needs %s per device (%s HBM)%s\n      $ %s\n", s[0] ? s : "the defaults",
                    gib(P->c[best].r.peak, pk, sizeof pk), hb,
                    P->c[best].sampled && !P->c[best].verified ? " (sampled layers, extrapolated)" : "", cmd);
        }
        rc = 1;
    } else {
        fprintf(out, "\nthe %d fastest of %d that fit, by modelled step time on %s:\n", show, P->nranked, P->profile);
        print_table(out, P, show);
        fprintf(out, "\n");
        for (int k = 0; k < show; k++) print_candidate(out, P, &P->c[P->ranked[k]]);
    }
    print_counts(out, P);
    print_reasons(out, P);
    if (P->outdir[0]) {
        st = cli_artifact_write(P->outdir, "plan.json", write_plan_json, P);
        if (!st) st = cli_write_plan_report_html(P->outdir);
        if (st) rc = cli_fail(err, st);
        else fprintf(out, "\nplan.json and report.html written to %s (open report.html in a browser)\n", P->outdir);
    }
    if (P->explain > 0) {
        if (P->explain > P->nranked) {
            st = sim_err(SIM_ERR_INPUT, "explain_candidate=%d: only %d candidate%s ranked; give 1 to %d", P->explain,
                         P->nranked, P->nranked == 1 ? " is" : "s are", P->nranked);
            rc = cli_fail(err, st);
        } else {
            explain(out, P, P->explain);
        }
    }
    for (int i = 0; i < P->ndrops; i++) {
        free(P->drops[i].keys);
        free(P->drops[i].why);
    }
    free(P->drops);
    free(P->ranked);
    free(P->c);
    free(P);
    free(user);
    free(extra);
    return rc;
}

/* validate.c — the checks after merging: value ranges (<configs>/ranges.yml), MaxText's
 * combination checks that need more than key comparisons (configs/types.py), and the
 * combinations MaxText rejects as data (<configs>/combinations.yml). */
#include "config/internal.h"
#include "config/release.h"

#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* MaxText's combination checks (configs/types.py, 0.2.5) that concern what is
 * simulated, with MaxText's conditions; run after merging, when the config has
 * the full key set (keys.yml).  Each message names the keys and the fix. */
sim_status cfg_maxtext_rules(const cfg_config *cfg)
{
    long long experts, dense, interleave = 1, inhomog = 1;
    double mlp, moe_mlp, update_rate;
    int routed_bias;
    const char *decoder, *cs, *lp, *lfs;
    SIM_TRY(cfg_get_int(cfg, "num_experts", &experts));
    SIM_TRY(cfg_get_int(cfg, "first_num_dense_layers", &dense));
    SIM_TRY(cfg_get_double(cfg, "base_mlp_dim", &mlp));
    SIM_TRY(cfg_get_double(cfg, "base_moe_mlp_dim", &moe_mlp));
    SIM_TRY(cfg_get_str(cfg, "decoder_block", &decoder));
    if (cfg_find(cfg, "interleave_moe_layer_step")) SIM_TRY(cfg_get_int(cfg, "interleave_moe_layer_step", &interleave));
    if (cfg_find(cfg, "inhomogeneous_layer_cycle_interval"))
        SIM_TRY(cfg_get_int(cfg, "inhomogeneous_layer_cycle_interval", &inhomog));
    if (experts > 1) {
        if (moe_mlp <= 0)
            return sim_err(SIM_ERR_INPUT,
                           "num_experts=%lld needs base_moe_mlp_dim > 0 (it is %g): MaxText requires a "
                           "positive expert width for MoE models; set base_moe_mlp_dim",
                           experts, moe_mlp);
        /* a model whose every layer is MoE has one MLP width; for qwen3_moe MaxText sets
         * base_mlp_dim to base_moe_mlp_dim instead (the qwen3_moe family does the same) */
        if (interleave == 1 && dense == 0 && inhomog == 1 && mlp != moe_mlp &&
            !(decoder && !strcmp(decoder, "qwen3_moe")))
            return sim_err(SIM_ERR_INPUT,
                           "num_experts=%lld with first_num_dense_layers=0 is a fully MoE model: MaxText requires "
                           "base_mlp_dim (%g) to equal base_moe_mlp_dim (%g); make them equal or keep dense layers",
                           experts, mlp, moe_mlp);
        SIM_TRY(cfg_get_bool(cfg, "routed_bias", &routed_bias));
        SIM_TRY(cfg_get_double(cfg, "routed_bias_update_rate", &update_rate));
        /* types.py: loss-free load balancing for the blocks decoder_blocks.yml marks loss_free_balancing */
        if (routed_bias && update_rate > 0 && decoder && !cfg_block_flag(cfg, decoder, "loss_free_balancing"))
            return sim_err(SIM_ERR_INPUT,
                           "routed_bias_update_rate=%g with decoder_block=%s: MaxText supports loss-free "
                           "load balancing only for the DeepSeek decoder",
                           update_rate, decoder);
    }
    SIM_TRY(cfg_get_str(cfg, "context_sharding", &cs));
    if (!cs || (strcmp(cs, "context") && strcmp(cs, "expert")))
        return sim_err(SIM_ERR_INPUT, "context_sharding=%s: MaxText supports only 'context' or 'expert'",
                       cs ? cs : "None");
    SIM_TRY(cfg_get_str(cfg, "load_parameters_path", &lp));
    SIM_TRY(cfg_get_str(cfg, "load_full_state_path", &lfs));
    if (lp && *lp && lfs && *lfs)
        return sim_err(SIM_ERR_INPUT,
                       "load_parameters_path and load_full_state_path are both set: MaxText allows at most "
                       "one; keep one of them");
    int ckpt_on = 1;
    if (lfs && *lfs) SIM_TRY(cfg_get_bool(cfg, "enable_checkpointing", &ckpt_on));
    if (!ckpt_on) /* types.py: a full-state resume goes through the checkpoint manager */
        return sim_err(SIM_ERR_INPUT,
                       "load_full_state_path=%s with enable_checkpointing=false: MaxText resumes the full "
                       "state only with checkpointing on; set enable_checkpointing=true, or use "
                       "load_parameters_path to start from the parameters alone",
                       lfs);
    return SIM_OK;
}

/* A scalar's number, when it is one. */
static int scalar_number(const cfg_value *v, double *out)
{
    if (v->kind != CFG_SCALAR) return 0;
    cfg_type t = cfg_scalar_type(v);
    if (t != CFG_INT && t != CFG_FLOAT) return 0;
    if (cfg_value_double(v, "", out) != SIM_OK) {
        sim_err_clear();
        return 0;
    }
    return 1;
}

/* Whether config value v equals rule value r: numbers and booleans by value, null with null,
 * text without case. */
static int combo_equal(const cfg_value *v, const cfg_value *r)
{
    if (v->kind != CFG_SCALAR || r->kind != CFG_SCALAR) return 0;
    if (cfg_is_null(v) || cfg_is_null(r)) return cfg_is_null(v) && cfg_is_null(r);
    double a, b;
    if (scalar_number(v, &a) && scalar_number(r, &b)) return a == b;
    int x, y;
    if (cfg_scalar_type(v) == CFG_BOOL && cfg_scalar_type(r) == CFG_BOOL)
        return cfg_bool_word(v->text, &x) && cfg_bool_word(r->text, &y) && x == y;
    return v->text && r->text && !strcasecmp(v->text, r->text);
}

static int combo_in(const cfg_value *v, const cfg_value *list)
{
    for (int i = 0; list->kind == CFG_LIST && i < list->n; i++)
        if (combo_equal(v, &list->items[i])) return 1;
    return 0;
}

/* Whether condition c (a scalar, or a one-entry map {op: value}) holds for value v. */
static sim_status combo_holds(const cfg_value *v, const cfg_value *c, const char *file, int *holds)
{
    *holds = 0;
    if (c->kind != CFG_MAP) {
        *holds = combo_equal(v, c);
        return SIM_OK;
    }
    if (c->n != 1)
        return sim_err(SIM_ERR_INPUT, "%s:%d: a condition is one {op: value} (ne, gt, ge, lt, le, in, not_in, empty)",
                       file, c->line);
    const char *op = c->keys[0];
    const cfg_value *r = &c->items[0];
    if (!strcmp(op, "empty")) {
        int want;
        SIM_TRY(cfg_value_bool(r, "empty", &want));
        int empty = v->kind == CFG_LIST  ? v->n == 0
                    : v->kind == CFG_MAP ? v->n == 0
                                         : cfg_is_null(v) || !v->text || !*v->text;
        *holds = empty == want;
        return SIM_OK;
    }
    if (v->kind == CFG_SCALAR && cfg_is_null(v)) return SIM_OK; /* None compares with nothing */
    if (!strcmp(op, "ne")) *holds = !combo_equal(v, r);
    else if (!strcmp(op, "in")) *holds = combo_in(v, r);
    else if (!strcmp(op, "not_in")) *holds = !combo_in(v, r);
    else if (!strcmp(op, "gt") || !strcmp(op, "ge") || !strcmp(op, "lt") || !strcmp(op, "le")) {
        double a, b;
        if (!scalar_number(v, &a) || !scalar_number(r, &b)) return SIM_OK;
        *holds = op[0] == 'g' ? (op[1] == 't' ? a > b : a >= b) : (op[1] == 't' ? a < b : a <= b);
    } else
        return sim_err(SIM_ERR_INPUT, "%s:%d: unknown condition '%s' (ne, gt, ge, lt, le, in, not_in, empty)", file,
                       c->line, op);
    return SIM_OK;
}

/* The first of dirs that holds `name`, as a malloc'd path, or NULL. */
static char *find_beside(char *const *dirs, int n_dirs, const char *name)
{
    for (int i = 0; i < n_dirs; i++) {
        char *p = cfg_join_path(dirs[i], name);
        if (cfg_file_exists(p)) return p;
        free(p);
    }
    return NULL;
}

/* One rule of combinations.yml: an error when every condition of its `when` holds. */
static sim_status combination_rule(const cfg_config *cfg, const cfg_release *rel, const cfg_value *r, const char *path)
{
    const cfg_value *when = cfg_map_get(r, "when"), *says = cfg_map_get(r, "says"), *fix = cfg_map_get(r, "fix"),
                    *where = cfg_map_get(r, "where");
    if (!when || when->kind != CFG_MAP || !says || !fix || !where)
        return sim_err(SIM_ERR_INPUT, "%s:%d: a rule needs where, when (a map of key conditions), says and fix", path,
                       r->line);
    int all = 1;
    for (int c = 0; all && c < when->n; c++) {
        const cfg_entry *e = cfg_find(cfg, when->keys[c]);
        /* a key this config, or the release it follows, does not have: the rule does not apply */
        if (!e || cfg_release_lacks_key(rel, when->keys[c])) return SIM_OK;
        SIM_TRY(combo_holds(&e->value, &when->items[c], path, &all));
    }
    if (!all) return SIM_OK;
    cfg_sbuf b = {0};
    for (int c = 0; c < when->n; c++) {
        const cfg_entry *e = cfg_find(cfg, when->keys[c]);
        char *t = cfg_value_to_text(&e->value, 0);
        cfg_sb_putf(&b, "%s%s=%s", c ? ", " : "", e->key, t);
        free(t);
    }
    sim_status st = sim_err(SIM_ERR_INPUT, "%s: MaxText %s rejects this combination (%s): %s; %s", b.s ? b.s : "",
                            cfg_release_maxtext(rel), where->text ? where->text : "?", says->text ? says->text : "?",
                            fix->text ? fix->text : "?");
    free(b.s);
    return st;
}

/* Applies every rule of combinations.yml (found beside ranges.yml; none, no checks). */
sim_status cfg_combinations_check(cfg_config *cfg, char *const *dirs, int n_dirs)
{
    char *path = find_beside(dirs, n_dirs, "combinations.yml");
    if (!path) return SIM_OK;
    cfg_value doc = {0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &doc), st, fail);
    const cfg_value *rules = cfg_map_get(&doc, "rules");
    if (!rules || rules->kind != CFG_LIST)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "%s: expected a list under 'rules'", path), st, fail);
    const cfg_release *rel = NULL;
    if (cfg_find(cfg, "maxtext_release")) SIM_TRY_GOTO(cfg_release_of(cfg, &rel), st, fail);
    for (int k = 0; k < rules->n; k++) SIM_TRY_GOTO(combination_rule(cfg, rel, &rules->items[k], path), st, fail);
fail:
    cfg_value_free(&doc);
    free(path);
    return st;
}

/* One bound of a range entry: *has = 0 when the entry does not set it. */
static sim_status range_bound(const cfg_value *r, const char *name, const char *key, int *has, double *out)
{
    int i = cfg_map_index(r, name);
    *has = i >= 0;
    if (i < 0) return SIM_OK;
    SIM_TRY(cfg_value_double(&r->items[i], name, out));
    return SIM_OK;
}

static void put_num(cfg_sbuf *b, double d)
{
    if (d == floor(d) && fabs(d) < 1e15) cfg_sb_putf(b, "%.0f", d);
    else cfg_sb_putf(b, "%g", d);
}

/* Checks key=v against range entry r ({gt|ge, lt|le, or: [...]}). */
static sim_status range_check(const cfg_entry *e, const cfg_value *r, const char *rfile)
{
    if (r->kind != CFG_MAP)
        return sim_err(SIM_ERR_INPUT, "%s: the range of '%s' is not a map like {ge: 0, le: 1}", rfile, e->key);
    const cfg_value *v = &e->value;
    if (v->kind != CFG_SCALAR || cfg_scalar_type(v) == CFG_NULL) return SIM_OK; /* typed elsewhere */
    cfg_type t = cfg_scalar_type(v);
    if (t != CFG_INT && t != CFG_FLOAT) return SIM_OK; /* cfg_keys_check_type refuses non-numbers */
    double x;
    SIM_TRY(cfg_value_double(v, e->key, &x));
    int has_gt, has_ge, has_lt, has_le;
    double gt, ge, lt, le;
    SIM_TRY(range_bound(r, "gt", e->key, &has_gt, &gt));
    SIM_TRY(range_bound(r, "ge", e->key, &has_ge, &ge));
    SIM_TRY(range_bound(r, "lt", e->key, &has_lt, &lt));
    SIM_TRY(range_bound(r, "le", e->key, &has_le, &le));
    int ok = isfinite(x);
    if (has_gt) ok = ok && x > gt;
    if (has_ge) ok = ok && x >= ge;
    if (has_lt) ok = ok && x < lt;
    if (has_le) ok = ok && x <= le;
    int oi = cfg_map_index(r, "or");
    for (int k = 0; !ok && oi >= 0 && k < r->items[oi].n; k++) {
        double y;
        SIM_TRY(cfg_value_double(&r->items[oi].items[k], "or", &y));
        ok = x == y;
    }
    if (ok) return SIM_OK;
    cfg_sbuf b = {0};
    if (has_gt || has_ge) {
        put_num(&b, has_gt ? gt : ge);
        cfg_sb_putf(&b, " %s ", has_gt ? "<" : "<=");
    }
    cfg_sb_putf(&b, "%s", e->key);
    if (has_lt || has_le) {
        cfg_sb_putf(&b, " %s ", has_lt ? "<" : "<=");
        put_num(&b, has_lt ? lt : le);
    }
    for (int k = 0; oi >= 0 && k < r->items[oi].n; k++)
        cfg_sb_putf(&b, ", or %s", r->items[oi].items[k].text ? r->items[oi].items[k].text : "?");
    sim_status st =
        sim_err(SIM_ERR_INPUT, "%s=%s (%s): out of range%s; the valid range is %s (%s); set a value in that range",
                e->key, v->text, e->where, isfinite(x) ? "" : " (not a finite number)", b.s ? b.s : "?", rfile);
    free(b.s);
    return st;
}

/* Checks every numeric key that has an entry in ranges.yml (found beside
 * the base config or its chain's last file; no file, no checks — a test's
 * own base config has none). */
sim_status cfg_ranges_check(cfg_config *cfg, char *const *dirs, int n_dirs)
{
    char *path = find_beside(dirs, n_dirs, "ranges.yml");
    if (!path) return SIM_OK;
    cfg_value map = {0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &map), st, fail);
    for (int i = 0; i < map.n; i++) {
        const char *pat = map.keys[i];
        if (strchr(pat, '*')) {
            for (int k = 0; k < cfg->n; k++)
                if (fnmatch(pat, cfg->entries[k].key, 0) == 0)
                    SIM_TRY_GOTO(range_check(&cfg->entries[k], &map.items[i], path), st, fail);
        } else {
            const cfg_entry *e = cfg_find(cfg, pat);
            if (e) SIM_TRY_GOTO(range_check(e, &map.items[i], path), st, fail);
        }
    }
fail:
    cfg_value_free(&map);
    free(path);
    return st;
}

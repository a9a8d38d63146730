/* release.h — the MaxText release (and the JAX release it runs on) whose semantics a run follows.
 *
 * The key maxtext_release (shardsim's own; default CFG_RELEASE_DEFAULT) names a file
 * <configs>/releases/<version>.yml that holds everything that differs between the releases shardsim
 * follows, as data:
 *   maxtext, jax        the versions (PyPI), printed in messages ("MaxText 0.2.0 fails here too");
 *   base_rules          a file (relative to <configs>) whose mesh_axes, data_sharding and
 *                       logical_axis_rules replace configs/base.yml's, or "" for base.yml's own;
 *   logical_names       map: a logical name shardsim's models use (0.2.5's) -> the name this release
 *                       gives the same dim; the rules of the release's name apply to it;
 *   unknown_keys        keys shardsim knows that this release does not: setting one is refused,
 *                       naming the release (a combinations.yml rule on such a key does not apply);
 *   explicit_errors     map: id of an explicit-mode error shardsim reproduces -> the MaxText op
 *                       ("file:function") that raises it in this release, or a map {where: op,
 *                       <text>: ...} when a part of the message differs too; an id absent here is
 *                       an error this release does not raise (the op traces);
 *   absent_axes         map: a mesh axis shardsim has a flag for that this release does not have ->
 *                       how to get it (a flag of it set to other than 1 is refused, naming the
 *                       release, unless the config's mesh_axes has the axis);
 *   jax_rules           map: a sharding rule of JAX that changed between the JAX releases -> how
 *                       this release's JAX applies it (dot_general: same | consistent);
 *   grad_logical_names  map: a parameter path suffix -> the logical names its gradient carries
 *                       (0.2.0's sparse MoE: the shard_map in_specs of the expert kernels);
 *   variables           map: a model variable whose storage differs -> how this release keeps it
 *                       (gate_bias: moe_bias_var in 0.2.5, [layers, experts], no optimizer state;
 *                       param in 0.2.0, an nnx.Param [experts, layers] with optimizer state);
 *   formulas            map: a computation whose formula differs -> this release's variant
 *                       (load_balance_density: per_choice in 0.2.5, divided by num_experts_per_tok;
 *                       choices_sum in 0.2.0; load_balance_probs: pre_bias in 0.2.5, the sparse
 *                       path's softmax of the DeepSeek-V3 scores before the bias; gate_logits in
 *                       0.2.0, of the biased gate logits on both paths);
 *   refusals            map: id of a config-time refusal coded in C -> MaxText's validator in this
 *                       release; an id absent here is a combination this release accepts.
 * A release file is read once per process (and per configs directory) and never freed. */
#ifndef CONFIG_RELEASE_H
#define CONFIG_RELEASE_H

#include <stdbool.h>

#include "config/config.h"
#include "sim/status.h"

/* keys.yml's default of maxtext_release: used where no config names a release (unit tests that
 * build a context by hand); test_release checks the two agree */
#define CFG_RELEASE_DEFAULT "0.2.5"

typedef struct cfg_release cfg_release;

/* The release a loaded config follows (its maxtext_release, or the default when the config has
 * no such key); SIM_ERR_INPUT naming the value and the releases available when there is no file. */
sim_status cfg_release_of(const cfg_config *cfg, const cfg_release **out);
/* The release file <configs_dir>/releases/<version>.yml. */
sim_status cfg_release_get(const char *configs_dir, const char *version, const cfg_release **out);

/* "0.2.5"; CFG_RELEASE_DEFAULT for NULL. */
const char *cfg_release_maxtext(const cfg_release *r);
/* "0.12.0.1"; "" for NULL. */
const char *cfg_release_jax(const cfg_release *r);
/* The MaxText op raising explicit-mode error `id` in this release, or NULL when the release does
 * not raise it.  NULL release: `fallback` (the caller's 0.2.5 op), so contexts built without a
 * config keep the default release's errors. */
const char *cfg_release_error(const cfg_release *r, const char *id, const char *fallback);
/* A text of error `id` that differs between releases (its entry written as a map: {where: op,
 * FIELD: text}), or `fallback` (0.2.5's) when the entry has no such field. */
const char *cfg_release_error_text(const cfg_release *r, const char *id, const char *field, const char *fallback);
/* MaxText's validator refusing combination `id` in this release, or NULL when it accepts it. */
const char *cfg_release_refusal(const cfg_release *r, const char *id);
/* 1 when the release does not know key `key` (its unknown_keys). */
bool cfg_release_lacks_key(const cfg_release *r, const char *key);
/* The release's name for a logical axis name, or `name` itself. */
const char *cfg_release_logical_name(const cfg_release *r, const char *name);
/* How to get mesh axis `axis` when this release does not have it (absent_axes), or NULL. */
const char *cfg_release_absent_axis(const cfg_release *r, const char *axis);
/* How this release's JAX decides sharding rule `rule` (jax_rules: "dot_general" -> "same" in JAX
 * 0.12, "consistent" in JAX 0.8.1), or `fallback` (JAX 0.12's) when the file does not say. */
const char *cfg_release_jax_rule(const cfg_release *r, const char *rule, const char *fallback);
/* How this release stores model variable `var` (variables: "gate_bias" -> "moe_bias_var" | "param"),
 * or `fallback` (0.2.5's) when the file does not say. */
const char *cfg_release_variable(const cfg_release *r, const char *var, const char *fallback);
/* This release's variant of computation `id` (formulas), or `fallback` (0.2.5's) when the file does
 * not say. */
const char *cfg_release_formula(const cfg_release *r, const char *id, const char *fallback);
/* Whether remat_policy=none keeps every decoder layer's activations for this config, or
 * rematerialises the layers as full does.  MaxText wraps a scanned layer in jax.checkpoint with
 * policy=None for "none" as for "full" (0.2.5's layers/nnx_decoders.py get_remat_policy and the scan's
 * layer_fn_wrapped; 0.2.0's layers/decoders.py set_remat_policy), which saves nothing; unscanned
 * layers (scan_layers=false) follow the release's formula remat_none_unscanned ("kept" in 0.2.5,
 * "rematerialised" in 0.2.0).  The model definition and plan's candidates both ask this. */
sim_status cfg_release_remat_none_keeps(const cfg_config *cfg, bool *keeps);
/* The logical names a parameter's gradient carries in this release when they are not the
 * parameter's own (grad_logical_names: a path suffix -> names, null = None), into names[0..cap);
 * returns how many (0: the parameter's own). */
int cfg_release_grad_names(const cfg_release *r, const char *path, const char **names, int cap);
/* The shardsim names (logical_names' keys) this release writes as `name`, into out[0..cap);
 * returns how many. */
int cfg_release_aliases(const cfg_release *r, const char *name, const char **out, int cap);
/* The base rule file (absolute or relative to the cwd), or NULL for configs/base.yml's rules. */
const char *cfg_release_base_rules(const cfg_release *r);
/* The release file itself. */
const char *cfg_release_file(const cfg_release *r);

#endif

/* rules.h — logical axis rules: logical dim names -> PartitionSpec.
 *
 * A rule table is the ordered logical_axis_rules list of a config: (logical
 * name, ordered mesh axes; no axes = claim the dim replicated).  Resolution is
 * flax's _logical_to_mesh_axes followed by MaxText's remove_size_one_mesh_axis
 * (reference/maxtext-facts.md §2.3):
 *   1. a logical name may name at most one dim (else an error); NULL = None;
 *   2. the RULES are scanned in table order (not the dims): a rule applies to
 *      the dim carrying its logical name when that dim is still unassigned and
 *      none of the rule's mesh axes is already used by any dim of the tensor
 *      (a check on names: it ignores sizes and whether the axis is in the
 *      mesh); it assigns all of its axes at once, or an empty list (the dim is
 *      claimed replicated and later rules for the name are ignored); a skipped
 *      rule leaves the dim for a later rule of the same name;
 *   3. dims no rule assigned are None;
 *   4. axes absent from the mesh are dropped (`unpruned`, the form MaxText's
 *      named_shardings.json shows, keeps size-1 axes), then size-1 axes are
 *      dropped too (`spec`, the sharding arrays actually get). */
#ifndef MESH_RULES_H
#define MESH_RULES_H

#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "mesh/spec.h"
#include "sim/status.h"

typedef struct {
    char *name;  /* logical axis name */
    int n_axes;  /* number of mesh axes; 0 = claims the dim replicated */
    char **axes; /* mesh axis names, most significant first */
    char *where; /* "file:line" of the rule, or "" */
} mesh_rule;

typedef struct {
    int n;            /* number of rules */
    int cap;          /* allocated slots of rules[] */
    mesh_rule *rules; /* in priority (table) order */
} mesh_rules;

typedef struct {
    mesh_spec spec;               /* final: absent and size-1 axes dropped */
    mesh_spec unpruned;           /* absent axes dropped, size-1 axes kept */
    int rule[MESH_SPEC_MAX_RANK]; /* index of the rule that assigned dim d, -1 if none */
} mesh_resolved;

void mesh_rules_init(mesh_rules *r);
void mesh_rules_free(mesh_rules *r);
/* Appends a rule (n = 0: claims replicated). */
void mesh_rules_add(mesh_rules *r, const char *name, int n, const char *const *axes);
/* From a logical_axis_rules value: a list of [name, axes] with axes a name, a
 * list of names, [] or null (null claims replicated, like []). */
sim_status mesh_rules_from_value(const cfg_value *list, mesh_rules *out);
/* From a loaded config's logical_axis_rules. */
sim_status mesh_rules_from_config(const cfg_config *cfg, mesh_rules *out);
/* Index of the first rule for `name`, or -1. */
int mesh_rules_find(const mesh_rules *r, const char *name);

/* Resolves the logical names of a tensor's dims (names[d] NULL = None) on a
 * mesh.  `tensor` names it in error messages. */
sim_status mesh_rules_resolve(const mesh_rules *r, const mesh_shape *m, const char *tensor, int rank,
                              const char *const *names, mesh_resolved *out);

#endif

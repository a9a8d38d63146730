/* test_mesh_rules.c — logical axis rule resolution on small hand-made tables
 * (expected results worked out by hand from the algorithm in mesh/rules.h), the
 * worked examples of maxtext-facts.md §2.3 on the project's base rules, and
 * rule-table loading errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config/config.h"
#include "mesh/rules.h"
#include "tests/helpers.h"

#define MAXN 8

/* Builds a table from "name:ax1,ax2;name2:;..." ("name:" = claims replicated). */
static void table(mesh_rules *r, const char *text)
{
    mesh_rules_init(r);
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", text);
    for (char *save = NULL, *item = strtok_r(buf, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        char *colon = strchr(item, ':');
        assert_non_null(colon);
        *colon = '\0';
        const char *axes[16];
        int n = 0;
        for (char *s2 = NULL, *a = strtok_r(colon + 1, ",", &s2); a; a = strtok_r(NULL, ",", &s2)) axes[n++] = a;
        mesh_rules_add(r, item, n, axes);
    }
}

static mesh_shape mesh_of(const char *text)
{
    /* "x=2 y=1 ..." */
    const char *names[16];
    char store[16][48];
    int sizes[16], n = 0;
    const char *p = text;
    while (*p) {
        int len = 0, size = 0;
        if (sscanf(p, "%47[^=]=%d%n", store[n], &size, &len) != 2) break;
        names[n] = store[n];
        sizes[n++] = size;
        p += len;
        while (*p == ' ') p++;
    }
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, n, names, sizes), SIM_OK);
    return m;
}

/* Resolves comma-separated names ("-" = None); returns the final spec text,
 * and the unpruned text through *unpruned when given. */
static const char *resolve(const mesh_rules *r, const mesh_shape *m, const char *names_text, char *unpruned)
{
    static char out[256];
    char buf[512];
    snprintf(buf, sizeof buf, "%s", names_text);
    const char *names[MAXN];
    int rank = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
        names[rank++] = strcmp(t, "-") == 0 ? NULL : t;
    mesh_resolved res;
    if (mesh_rules_resolve(r, m, "t", rank, names, &res) != SIM_OK)
        fail_msg("resolve %s: %s", names_text, sim_errmsg());
    mesh_spec_format(&res.spec, m, out, sizeof out);
    if (unpruned) mesh_spec_format(&res.unpruned, m, unpruned, 256);
    return out;
}

static void expect(const mesh_rules *r, const mesh_shape *m, const char *names, const char *spec)
{
    const char *got = resolve(r, m, names, NULL);
    if (strcmp(got, spec) != 0) fail_msg("(%s) -> %s, expected %s", names, got, spec);
}

/* ------------------------------------------------------------------------ */

static void test_skip_rule_whose_axis_is_used(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("x=2 y=2 z=2");
    mesh_rules r;
    /* a takes x; b's first rule wants x (used) -> skipped; b's fallback takes y */
    table(&r, "a:x;b:x,y;b:y");
    expect(&r, &m, "a,b", "P('x', 'y')");
    /* dims in the other order: same result (rules decide, not dims) */
    expect(&r, &m, "b,a", "P('y', 'x')");
    /* without a, b's first rule applies */
    expect(&r, &m, "b,-", "P(('x', 'y'), None)");
    mesh_rules_free(&r);
    /* rules are scanned in table order: b's rule comes first and takes x, so a
     * (whose only rule wants x) stays None even though a is dim 0 */
    table(&r, "b:x;a:x");
    expect(&r, &m, "a,b", "P(None, 'x')");
    mesh_rules_free(&r);
    /* all-or-nothing: a rule with one used axis is skipped whole */
    table(&r, "a:y;b:x,y,z;b:z");
    expect(&r, &m, "a,b", "P('y', 'z')");
    mesh_rules_free(&r);
}

/* Resolutions are memoised per thread: a repeat gives the same answer, and
 * a changed table (same address), an added rule or another mesh is seen. */
static void test_memo_sees_changes(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("x=2 y=2");
    mesh_rules r;
    table(&r, "a:x;b:y");
    expect(&r, &m, "a,b", "P('x', 'y')");
    expect(&r, &m, "a,b", "P('x', 'y')");
    const char *y[] = {"y"};
    mesh_rules_free(&r);
    table(&r, "b:x");
    expect(&r, &m, "a,b", "P(None, 'x')"); /* same address, new table */
    mesh_rules_add(&r, "a", 1, y);
    expect(&r, &m, "a,b", "P('y', 'x')"); /* a rule added after a resolution */
    mesh_shape m2 = mesh_of("x=1 y=2");
    expect(&r, &m2, "a,b", "P('y', None)"); /* another mesh: x has size 1 */
    expect(&r, &m, "a,b", "P('y', 'x')");
    mesh_rules_free(&r);
}

static void test_empty_rule_claims_dim(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("x=2 y=2");
    mesh_rules r;
    table(&r, "a:;a:x;b:x");
    char unpruned[256];
    const char *spec = resolve(&r, &m, "a,b", unpruned);
    assert_string_equal(spec, "P(None, 'x')"); /* a pinned replicated; b still gets x */
    const char *names[] = {"a", "b"};
    mesh_resolved res;
    assert_int_equal(mesh_rules_resolve(&r, &m, "t", 2, names, &res), SIM_OK);
    assert_int_equal(res.rule[0], 0);
    assert_int_equal(res.rule[1], 2);
    mesh_rules_free(&r);
    /* unknown names and None dims resolve to None; rank 0 works */
    table(&r, "a:x");
    expect(&r, &m, "-,nobody,a", "P(None, None, 'x')");
    mesh_resolved r0;
    assert_int_equal(mesh_rules_resolve(&r, &m, "scalar", 0, NULL, &r0), SIM_OK);
    assert_int_equal(r0.spec.rank, 0);
    mesh_rules_free(&r);
}

static void test_size_one_and_absent_axes(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("x=1 y=4 w=1");
    mesh_rules r;
    char unpruned[256];
    /* size-1 x dropped from the final spec but kept in the unpruned form */
    table(&r, "a:x,y;b:w");
    assert_string_equal(resolve(&r, &m, "a,b", unpruned), "P('y', None)");
    assert_string_equal(unpruned, "P(('x', 'y'), 'w')");
    mesh_rules_free(&r);
    /* z is not in the mesh: it still blocks by name, then disappears.
     * a takes [z] (-> None); b's first rule contains z -> skipped; b's second
     * rule takes y; c's rule wants y (used) -> None. */
    table(&r, "a:z;b:z,y;b:y;c:y");
    assert_string_equal(resolve(&r, &m, "a,b,c", unpruned), "P(None, 'y', None)");
    assert_string_equal(unpruned, "P(None, 'y', None)");
    mesh_rules_free(&r);
    /* a size-1 axis also blocks by name: fsdp_transpose (size 1) taken by
     * 'mlp' skips the first 'embed' rule (MaxText's ('embed','mlp') case) */
    m = mesh_of("fsdp=4 fsdp_transpose=1 tensor=2");
    table(&r, "mlp:fsdp_transpose,tensor;embed:fsdp,fsdp_transpose;embed:fsdp");
    assert_string_equal(resolve(&r, &m, "embed,mlp", unpruned), "P('fsdp', 'tensor')");
    assert_string_equal(unpruned, "P('fsdp', ('fsdp_transpose', 'tensor'))");
    expect(&r, &m, "embed,-", "P('fsdp', None)"); /* alone, the first rule applies */
    char u2[256];
    resolve(&r, &m, "embed,-", u2);
    assert_string_equal(u2, "P(('fsdp', 'fsdp_transpose'), None)");
    mesh_rules_free(&r);
}

static void test_multi_axis_order(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("data=2 fsdp=2 expert=2");
    mesh_rules r;
    /* the rule's order, not the mesh's, orders a dim's axes */
    table(&r, "batch:expert,data;embed:fsdp");
    expect(&r, &m, "batch,embed", "P(('expert', 'data'), 'fsdp')");
    mesh_rules_free(&r);
}

static void test_resolve_errors(void **state)
{
    (void)state;
    mesh_shape m = mesh_of("x=2");
    mesh_rules r;
    table(&r, "a:x");
    const char *names[] = {"a", "b", "a"};
    mesh_resolved res;
    assert_int_equal(mesh_rules_resolve(&r, &m, "layer/w", 3, names, &res), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "'layer/w'");
    assert_contains(sim_errmsg(), "'a'");
    assert_contains(sim_errmsg(), "dims 0 and 2");
    const char *nine[9] = {0};
    assert_int_equal(mesh_rules_resolve(&r, &m, "big", 9, nine, &res), SIM_ERR_INPUT);
    mesh_rules_free(&r);

    /* malformed tables from YAML */
    const char *bad[] = {"logical_axis_rules=[[a, [x, [y]]]]", "logical_axis_rules=[[a, x, y]]",
                         "logical_axis_rules=[a]"};
    for (int i = 0; i < 3; i++) {
        const char *o[] = {bad[i], "override_logical_axis_rules=true"};
        cfg_args args = {NULL, NULL, NULL, 0, o, 2};
        cfg_config *cfg = NULL;
        assert_int_equal(cfg_load(&args, &cfg), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), "command line");
    }
}

/* maxtext-facts.md §2.3 "Derived examples" on the project's base rules. */
static void test_facts_examples(void **state)
{
    (void)state;
    cfg_args args = {NULL, NULL, NULL, 0, NULL, 0};
    cfg_config *cfg = NULL;
    assert_int_equal(cfg_load(&args, &cfg), SIM_OK);
    mesh_rules r;
    assert_int_equal(mesh_rules_from_config(cfg, &r), SIM_OK);
    assert_int_equal(r.n, 80);
    assert_int_equal(mesh_rules_find(&r, "embed"), 53);
    assert_int_equal(r.rules[38].n_axes, 1); /* ['exp', 'expert'] */
    assert_string_equal(r.rules[38].axes[0], "expert");
    assert_int_equal(r.rules[0].n_axes, 0); /* circular_repeats -> [] */
    assert_contains(r.rules[0].where, "configs/base.yml:");
    cfg_free(cfg);

    const char *all12 = "diloco=1 data=1 stage=1 fsdp=16 fsdp_transpose=1 context=1 context_usp_ulysses=1 "
                        "context_autoregressive=1 tensor=1 tensor_sequence=1 expert=1 autoregressive=1";
    mesh_shape m = mesh_of(all12);
    char unpruned[256];
    assert_string_equal(resolve(&r, &m, "embed,layers,mlp", unpruned), "P('fsdp', None, None)");
    assert_string_equal(unpruned, "P(('fsdp', 'context', 'context_usp_ulysses', 'expert'), 'stage', "
                                  "('fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive'))");
    assert_string_equal(resolve(&r, &m, "activation_batch,activation_norm_length,activation_embed", unpruned),
                        "P('fsdp', None, None)");
    assert_string_equal(unpruned, "P(('data', 'fsdp', 'fsdp_transpose', 'expert'), "
                                  "('tensor_sequence', 'context', 'context_usp_ulysses'), 'tensor')");

    m = mesh_of("diloco=1 data=2 stage=1 fsdp=2 fsdp_transpose=1 context=1 context_usp_ulysses=1 "
                "context_autoregressive=1 tensor=2 tensor_sequence=1 expert=1 autoregressive=1");
    expect(&r, &m, "embed,layers,mlp", "P('fsdp', None, 'tensor')");
    expect(&r, &m, "mlp,layers,embed", "P('tensor', None, 'fsdp')");
    expect(&r, &m, "embed,layers,q_heads,kv", "P('fsdp', None, 'tensor', None)");
    expect(&r, &m, "heads,layers,kv,embed", "P('tensor', None, None, 'fsdp')");
    expect(&r, &m, "vocab,embed_vocab", "P('tensor', 'fsdp')");
    expect(&r, &m, "embed_vocab,vocab", "P('fsdp', 'tensor')");
    expect(&r, &m, "norm,layers", "P('tensor', None)");
    expect(&r, &m, "activation_batch,activation_norm_length,activation_embed", "P(('data', 'fsdp'), None, 'tensor')");
    expect(&r, &m, "activation_batch,activation_length,activation_mlp", "P(('data', 'fsdp'), None, 'tensor')");
    expect(&r, &m, "activation_embed_and_logits_batch,activation_length,activation_vocab",
           "P(('data', 'fsdp'), None, 'tensor')");

    m = mesh_of("diloco=1 data=1 stage=1 fsdp=2 fsdp_transpose=1 context=2 context_usp_ulysses=1 "
                "context_autoregressive=1 tensor=1 tensor_sequence=1 expert=2 autoregressive=1");
    expect(&r, &m, "exp,moe_layers,embed_moe,mlp_moe", "P('expert', None, ('fsdp', 'context'), None)");
    expect(&r, &m, "embed_moe,moe_layers,-", "P(('fsdp', 'context'), None, None)");
    expect(&r, &m, "activation_batch,activation_norm_length,activation_embed",
           "P(('fsdp', 'expert'), 'context', None)");
    expect(&r, &m, "activation_kv_batch,activation_length,activation_kv_heads,activation_kv_head_dim",
           "P(('fsdp', 'expert'), 'context', None, None)");
    /* dense MoE dispatch: activation_batch_moe (earlier) takes expert first */
    expect(&r, &m, "activation_exp,activation_batch_moe,-,activation_embed_moe",
           "P(None, ('fsdp', 'expert'), None, None)");
    /* attention: kv_head_dim loses to kv_heads (same axes, later rule) */
    m = mesh_of("diloco=1 data=1 stage=1 fsdp=2 fsdp_transpose=1 context=1 context_usp_ulysses=1 "
                "context_autoregressive=1 tensor=2 tensor_sequence=1 expert=1 autoregressive=1");
    expect(&r, &m, "activation_kv_batch,activation_length_attn,activation_kv_heads,activation_kv_head_dim",
           "P('fsdp', None, 'tensor', None)");
    mesh_rules_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_skip_rule_whose_axis_is_used),
        cmocka_unit_test(test_empty_rule_claims_dim),
        cmocka_unit_test(test_memo_sees_changes),
        cmocka_unit_test(test_size_one_and_absent_axes),
        cmocka_unit_test(test_multi_axis_order),
        cmocka_unit_test(test_resolve_errors),
        cmocka_unit_test(test_facts_examples),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

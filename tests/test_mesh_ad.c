/* test_mesh_ad.c — mesh/ad.h: the generic sharded ops on the autodiff tape, each VJP against
 * central finite differences of its own forward (tests/vjp_check.h) on a 2 x 2 mesh of 'data' and
 * 'tensor':
 *   - einsum: a batch-sharded activation times a weight split on its output dim, a contraction
 *     over a sharded dim (the product partial over 'tensor', summed by the VJP's reshards), and
 *     an explicit out_sharding;
 *   - add of two differently sharded operands (the cotangent resharded back to each);
 *   - shard_as and constraint: identity on the global tensor, the cotangent brought back to the
 *     input's sharding;
 *   - the fused einsum-into path: its count grows when a cotangent sum is reused, and switching it
 *     off leaves the gradients the finite differences' (test_mesh_accum compares bytes and
 *     memory). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>

#include "mesh/ad.h"
#include "tests/helpers.h"
#include "tests/vjp_check.h"

static const double TOL = 2e-2;

static double check(const vjp_case *c)
{
    static const char *const names[] = {"data", "tensor"};
    static const int sizes[] = {2, 2};
    mesh_shape m = helper_mesh(2, names, sizes);
    double worst = vjp_check(c, &m, TOL);
    printf("  %-34s worst gradient difference %.2e of the largest finite difference\n", c->what, worst);
    return worst;
}

typedef struct {
    const char *sub;
    const char *out_sharding; /* NULL: none */
} einsum_arg;

static sim_status op_einsum(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const einsum_arg *e = arg;
    mesh_spec os;
    if (e->out_sharding) SIM_TRY(mesh_spec_parse(e->out_sharding, mesh_tape_ctx(t)->mesh, &os));
    return mesh_ad_einsum(t, e->sub, in[0], in[1], e->out_sharding ? &os : NULL, "einsum", out);
}

static void test_einsum(void **state)
{
    (void)state;
    einsum_arg batch = {"bte,ef->btf", NULL};
    vjp_case c1 = {.what = "einsum, weight split on its output",
                   .nin = 2,
                   .rank = {3, 2},
                   .shape = {{2, 3, 4}, {4, 6}},
                   .spec = {"P('data', None, None)", "P(None, 'tensor')"},
                   .out_rank = 3,
                   .out_shape = {2, 3, 6},
                   .op = op_einsum,
                   .arg = &batch};
    check(&c1);
    einsum_arg contract = {"bte,ef->btf", NULL};
    vjp_case c2 = {.what = "einsum, contraction dim sharded",
                   .nin = 2,
                   .rank = {3, 2},
                   .shape = {{2, 3, 4}, {4, 6}},
                   .spec = {"P('data', None, 'tensor')", "P('tensor', None)"},
                   .out_rank = 3,
                   .out_shape = {2, 3, 6},
                   .op = op_einsum,
                   .arg = &contract};
    check(&c2);
    einsum_arg outs = {"bte,ef->btf", "P(None, None, 'tensor')"};
    vjp_case c3 = {.what = "einsum, out_sharding",
                   .nin = 2,
                   .rank = {3, 2},
                   .shape = {{2, 3, 4}, {4, 6}},
                   .spec = {"P('data', None, None)", "P(None, None)"},
                   .out_rank = 3,
                   .out_shape = {2, 3, 6},
                   .op = op_einsum,
                   .arg = &outs};
    check(&c3);
}

static sim_status op_add(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    /* a * b elementwise is not an ad op: the sum, then an einsum against a fixed third operand,
     * makes the cotangent of each addend depend on the data */
    mesh_var *s;
    SIM_TRY(mesh_ad_add(t, in[0], in[1], "add", &s));
    return mesh_ad_einsum(t, "ij,jk->ik", s, in[2], NULL, "mix", out);
}

static void test_add(void **state)
{
    (void)state;
    vjp_case c = {.what = "add, two shardings",
                  .nin = 3,
                  .rank = {2, 2, 2},
                  .shape = {{4, 6}, {4, 6}, {6, 2}},
                  .spec = {"P('data', None)", "P(None, 'tensor')", "P(None, None)"},
                  .out_rank = 2,
                  .out_shape = {4, 2},
                  .op = op_add};
    check(&c);
}

typedef struct {
    bool constraint;
    const char *spec;
} shard_arg;

static sim_status op_shard(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const shard_arg *a = arg;
    mesh_spec s;
    SIM_TRY(mesh_spec_parse(a->spec, mesh_tape_ctx(t)->mesh, &s));
    mesh_var *y;
    if (a->constraint) SIM_TRY(mesh_ad_constraint(t, in[0], &s, "constraint", &y));
    else SIM_TRY(mesh_ad_shard_as(t, in[0], &s, "shard_as", &y));
    return mesh_ad_einsum(t, "ij,jk->ik", y, in[1], NULL, "after", out);
}

static void test_shard_as_and_constraint(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++) {
        shard_arg a = {k == 1, "P('tensor', 'data')"};
        vjp_case c = {.what = k ? "constraint to another sharding" : "shard_as to another sharding",
                      .nin = 2,
                      .rank = {2, 2},
                      .shape = {{4, 6}, {6, 2}},
                      .spec = {"P('data', None)", "P(None, None)"},
                      .out_rank = 2,
                      .out_shape = {4, 2},
                      .op = op_shard,
                      .arg = &a};
        check(&c);
    }
}

/* h = x w1 used by two products: its cotangent is the sum of both contributions, the second added
 * into the first's sum by the fused path when it is on (h is no parameter: those are reduced one
 * contribution at a time). */
static sim_status op_two_uses(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    mesh_var *h, *p, *q;
    SIM_TRY(mesh_ad_einsum(t, "bte,ef->btf", in[0], in[1], NULL, "h", &h));
    SIM_TRY(mesh_ad_einsum(t, "btf,fg->btg", h, in[2], NULL, "p", &p));
    SIM_TRY(mesh_ad_einsum(t, "btf,fg->btg", h, in[3], NULL, "q", &q));
    return mesh_ad_add(t, p, q, "sum", out);
}

static void test_fused_accumulation(void **state)
{
    (void)state;
    vjp_case c = {.what = "one value, two products",
                  .nin = 4,
                  .rank = {3, 2, 2, 2},
                  .shape = {{2, 3, 4}, {4, 6}, {6, 5}, {6, 5}},
                  .spec = {"P('data', None, None)", "P(None, None)", "P(None, None)", "P(None, None)"},
                  .out_rank = 3,
                  .out_shape = {2, 3, 5},
                  .op = op_two_uses};
    long long before = mesh_ad_fused_count();
    check(&c);
    long long fused = mesh_ad_fused_count() - before;
    assert_true(fused >= 4); /* h's second contribution on each of the 4 devices */
    mesh_ad_set_fuse(false);
    before = mesh_ad_fused_count();
    check(&c);
    assert_int_equal(mesh_ad_fused_count(), before);
    mesh_ad_set_fuse(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_einsum),
        cmocka_unit_test(test_add),
        cmocka_unit_test(test_shard_as_and_constraint),
        cmocka_unit_test(test_fused_accumulation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

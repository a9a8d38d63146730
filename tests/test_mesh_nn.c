/* test_mesh_nn.c — mesh/nn.h: the fused neural-network ops, each op's VJP against central finite
 * differences of its own forward (tests/vjp_check.h: the scalar sum(c * op(x)) for a fixed
 * pseudo-random cotangent c, differences in double on one device, gradients on a 2 x 2 mesh of
 * 'data' and 'tensor' with the inputs sharded as the models shard them, so the VJPs' partial
 * sums and reshards are exercised): RMSNorm with the normalised dim sharded (its sum of squares
 * all-reduced), SwiGLU, the soft cap, cross-entropy with the z-loss over a vocabulary split on
 * 'tensor', the token mean, RoPE, causal attention (flash and dot-product kernels) with the heads
 * split (with the sliding window and the sinks on a split sequence too), a projection's bias, the
 * embedding lookup with the table split on 'tensor', dropout with a fixed key, and
 * the two halves of unstack2.  The memory-op cost records are test_mesh_costs's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>

#include "mesh/nn.h"
#include "tests/helpers.h"
#include "tests/vjp_check.h"

enum { B = 2, T = 4, H = 2, D = 8 };
static const double TOL = 2e-2;

static mesh_shape mesh22(void)
{
    static const char *const names[] = {"data", "tensor"};
    static const int sizes[] = {2, 2};
    return helper_mesh(2, names, sizes);
}

static void check(const vjp_case *c)
{
    mesh_shape m = mesh22();
    double worst = vjp_check(c, &m, TOL);
    printf("  %-22s worst gradient difference %.2e of the largest finite difference\n", c->what, worst);
}

/* ---- the ops as vjp_op */

static sim_status op_rmsnorm(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_rmsnorm(t, in[0], in[1], 1e-6, "norm", out);
}

static sim_status op_swiglu(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_swiglu(t, in[0], in[1], "mlp", out);
}

static sim_status op_geglu(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_geglu(t, in[0], in[1], "mlp", out);
}

static sim_status op_softcap(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_softcap(t, in[0], 0.8, 1.5, "cap", out);
}

static sim_status op_xent(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_xent(t, in[0], &in[1]->val, 1e-3, "xent", out);
}

static sim_status op_mean(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_mean(t, in[0], "mean", out);
}

static sim_status op_rope(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    bk_rope_params p = bk_rope_params_default(D);
    return mesh_nn_rope(t, in[0], &in[1]->val, &p, "rope", out);
}

static sim_status op_attention(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const bool *dot = arg;
    return mesh_nn_attention_kernel(t, in[0], in[1], in[2], &in[3]->val, 1.0 / sqrt((double)D), 0, 0, *dot, NULL,
                                    "attention", out);
}

/* local_sliding with a window of 2 positions (each query sees itself and the key before it) */
static sim_status op_attention_window(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const bool *dot = arg;
    return mesh_nn_attention_kernel(t, in[0], in[1], in[2], &in[3]->val, 1.0 / sqrt((double)D), 0, 2, *dot, NULL,
                                    "attention", out);
}

/* attention sinks (one logit per query head) with the window of 2: in[3] the sinks, in[4] the positions */
static sim_status op_attention_sinks(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const bool *dot = arg;
    return mesh_nn_attention_sinks(t, in[0], in[1], in[2], in[3], &in[4]->val, 1.0 / sqrt((double)D), 0, 2, *dot, NULL,
                                   "attention", out);
}

static sim_status op_bias(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_bias_add(t, in[0], in[1], "bias", out);
}

static sim_status op_embed(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_embed(t, in[0], &in[1]->val, "embed", out);
}

static sim_status op_dropout(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    (void)arg;
    return mesh_nn_dropout(t, in[0], 0.25, 42, 1, "dropout", out);
}

static sim_status op_unstack2(mesh_tape *t, mesh_var *const *in, const void *arg, mesh_var **out)
{
    const int *half = arg;
    mesh_var *y[2];
    SIM_TRY(mesh_nn_unstack2(t, in[0], 1, "unstack", &y[0], &y[1]));
    *out = y[*half];
    return SIM_OK;
}

/* ---- the cases */

static void test_rmsnorm(void **state)
{
    (void)state;
    vjp_case c = {.what = "rmsnorm",
                  .nin = 2,
                  .rank = {3, 1},
                  .shape = {{B, 3, D}, {D}},
                  .spec = {"P('data', None, 'tensor')", "P('tensor')"},
                  .out_rank = 3,
                  .out_shape = {B, 3, D},
                  .op = op_rmsnorm};
    check(&c);
}

static void test_swiglu(void **state)
{
    (void)state;
    vjp_case c = {.what = "swiglu",
                  .nin = 2,
                  .rank = {2, 2},
                  .shape = {{4, 6}, {4, 6}},
                  .spec = {"P('data', 'tensor')", "P('data', 'tensor')"},
                  .out_rank = 2,
                  .out_shape = {4, 6},
                  .scale = 2.0f,
                  .op = op_swiglu};
    check(&c);
}

static void test_geglu(void **state)
{
    (void)state;
    vjp_case c = {.what = "geglu",
                  .nin = 2,
                  .rank = {2, 2},
                  .shape = {{4, 6}, {4, 6}},
                  .spec = {"P('data', 'tensor')", "P('data', 'tensor')"},
                  .out_rank = 2,
                  .out_shape = {4, 6},
                  .scale = 2.0f,
                  .op = op_geglu};
    check(&c);
}

static void test_softcap(void **state)
{
    (void)state;
    vjp_case c = {.what = "softcap",
                  .nin = 1,
                  .rank = {2},
                  .shape = {{4, 6}},
                  .spec = {"P('data', None)"},
                  .out_rank = 2,
                  .out_shape = {4, 6},
                  .scale = 3.0f,
                  .op = op_softcap};
    check(&c);
}

static void test_xent(void **state)
{
    (void)state;
    vjp_case c = {.what = "cross-entropy, z-loss",
                  .nin = 2,
                  .rank = {3, 2},
                  .shape = {{B, T, D}, {B, T}},
                  .spec = {"P('data', None, 'tensor')", "P('data', None)"},
                  .integer = {false, true},
                  .int_bound = {0, D},
                  .out_rank = 2,
                  .out_shape = {B, T},
                  .scale = 2.0f,
                  .op = op_xent};
    check(&c);
}

static void test_mean(void **state)
{
    (void)state;
    vjp_case c = {.what = "mean",
                  .nin = 1,
                  .rank = {2},
                  .shape = {{4, 6}},
                  .spec = {"P('data', 'tensor')"},
                  .out_rank = 0,
                  .op = op_mean};
    check(&c);
}

static void test_rope(void **state)
{
    (void)state;
    vjp_case c = {.what = "rope",
                  .nin = 2,
                  .rank = {4, 2},
                  .shape = {{B, T, H, D}, {B, T}},
                  .spec = {"P('data', None, 'tensor', None)", "P('data', None)"},
                  .integer = {false, true},
                  .int_bound = {0, 64},
                  .out_rank = 4,
                  .out_shape = {B, T, H, D},
                  .op = op_rope};
    check(&c);
}

static void attention_case(bool dot)
{
    vjp_case c = {.what = dot ? "attention (dot)" : "attention (flash)",
                  .nin = 4,
                  .rank = {4, 4, 4, 2},
                  .shape = {{B, T, H, D}, {B, T, H, D}, {B, T, H, D}, {B, T}},
                  .spec = {"P('data', None, 'tensor', None)", "P('data', None, 'tensor', None)",
                           "P('data', None, 'tensor', None)", "P('data', None)"},
                  .integer = {false, false, false, true},
                  .int_bound = {0, 0, 0, T},
                  .out_rank = 4,
                  .out_shape = {B, T, H, D},
                  .op = op_attention,
                  .arg = &dot};
    check(&c);
}

/* The sliding window with the sequence split over 'data' as context parallelism splits it: the
 * keys and values are gathered with their positions, so the window is the same across shards. */
static void attention_window_case(bool dot)
{
    vjp_case c = {.what = dot ? "window, T split (dot)" : "window, T split (flash)",
                  .nin = 4,
                  .rank = {4, 4, 4, 2},
                  .shape = {{B, T, H, D}, {B, T, H, D}, {B, T, H, D}, {B, T}},
                  .spec = {"P(None, 'data', 'tensor', None)", "P(None, 'data', 'tensor', None)",
                           "P(None, 'data', 'tensor', None)", "P(None, 'data')"},
                  .integer = {false, false, false, true},
                  .int_bound = {0, 0, 0, T},
                  .out_rank = 4,
                  .out_shape = {B, T, H, D},
                  .op = op_attention_window,
                  .arg = &dot};
    check(&c);
}

/* Sinks (gpt_oss's attention_sink) with the window, the sequence split over 'data' (context
 * parallelism) and the heads over 'tensor': the sinks enter replicated and come back reduced over the
 * batch and sequence axes. */
static void attention_sinks_case(bool dot, const char *sinks_spec)
{
    vjp_case c = {.what = dot ? "sinks, T split (dot)" : "sinks, T split (flash)",
                  .nin = 5,
                  .rank = {4, 4, 4, 1, 2},
                  .shape = {{B, T, H, D}, {B, T, H, D}, {B, T, H, D}, {H}, {B, T}},
                  .spec = {"P(None, 'data', 'tensor', None)", "P(None, 'data', 'tensor', None)",
                           "P(None, 'data', 'tensor', None)", sinks_spec, "P(None, 'data')"},
                  .integer = {false, false, false, false, true},
                  .int_bound = {0, 0, 0, 0, T},
                  .out_rank = 4,
                  .out_shape = {B, T, H, D},
                  .op = op_attention_sinks,
                  .arg = &dot};
    check(&c);
}

static void test_attention(void **state)
{
    (void)state;
    attention_case(false);
    attention_case(true);
    attention_window_case(false);
    attention_window_case(true);
    attention_sinks_case(false, NULL);
    attention_sinks_case(true, NULL);
    attention_sinks_case(false, "P('tensor')");
}

/* A projection's bias (DenseGeneral use_bias) over the trailing (heads, head_dim) dims of a
 * (B, T, H, D) activation: the bias's gradient sums the batch and sequence dims (partial over 'data'),
 * whether it enters replicated or on the heads' axis. */
static void test_bias(void **state)
{
    (void)state;
    const char *specs[2] = {NULL, "P('tensor', None)"};
    for (int i = 0; i < 2; i++) {
        vjp_case c = {.what = i ? "bias (H on tensor)" : "bias (replicated)",
                      .nin = 2,
                      .rank = {4, 2},
                      .shape = {{B, T, H, D}, {H, D}},
                      .spec = {"P('data', None, 'tensor', None)", specs[i]},
                      .out_rank = 4,
                      .out_shape = {B, T, H, D},
                      .op = op_bias};
        check(&c);
    }
}

static void test_embed(void **state)
{
    (void)state;
    vjp_case c = {.what = "embed",
                  .nin = 2,
                  .rank = {2, 2},
                  .shape = {{16, D}, {B, T}},
                  .spec = {"P(None, 'tensor')", "P('data', None)"},
                  .integer = {false, true},
                  .int_bound = {0, 16},
                  .out_rank = 3,
                  .out_shape = {B, T, D},
                  .op = op_embed};
    check(&c);
}

static void test_dropout(void **state)
{
    (void)state;
    vjp_case c = {.what = "dropout",
                  .nin = 1,
                  .rank = {3},
                  .shape = {{B, T, D}},
                  .spec = {"P('data', None, 'tensor')"},
                  .out_rank = 3,
                  .out_shape = {B, T, D},
                  .op = op_dropout};
    check(&c);
}

static void test_unstack2(void **state)
{
    (void)state;
    for (int half = 0; half < 2; half++) {
        vjp_case c = {.what = half ? "unstack2, second" : "unstack2, first",
                      .nin = 1,
                      .rank = {3},
                      .shape = {{4, 2, 6}},
                      .spec = {"P('data', None, 'tensor')"},
                      .out_rank = 2,
                      .out_shape = {4, 6},
                      .op = op_unstack2,
                      .arg = &half};
        check(&c);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bias),    cmocka_unit_test(test_rmsnorm),   cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_geglu),
        cmocka_unit_test(test_softcap), cmocka_unit_test(test_xent),      cmocka_unit_test(test_mean),
        cmocka_unit_test(test_rope),    cmocka_unit_test(test_attention), cmocka_unit_test(test_embed),
        cmocka_unit_test(test_dropout), cmocka_unit_test(test_unstack2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

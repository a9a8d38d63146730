/* bk_optim.h — the optimizer's elementwise kernels: one fused pass of AdamW over a
 * parameter shard (moments and parameter updated in place), plain SGD, and the sum of
 * squares behind the global gradient norm.  Chunks of a fixed size run on the kernel
 * pool (bk_parallel), so results do not depend on the thread count. */
#ifndef BK_OPTIM_H
#define BK_OPTIM_H

#include <stdbool.h>
#include <stddef.h>

/* One AdamW update's scalars, in float32 as optax computes them. */
typedef struct {
    bool clip;        /* scale the gradient by thr / gnorm first (clip_by_global_norm) */
    float gnorm, thr; /* global gradient norm, clipping threshold */
    float neg_lr;     /* -learning rate of this step */
    float b1, b2;     /* moment decay rates */
    float omb1, omb2; /* 1 - b1, 1 - b2 (rounded from double, as optax's constants) */
    float bc1, bc2;   /* bias corrections 1 - b1^t, 1 - b2^t */
    float eps, eps_root, wd;
} bk_adamw_hp;

/* For i < n, in optax's order of operations (scale_by_adam, add_decayed_weights, scale):
 *   g' = clip ? (g / gnorm) * thr : g
 *   mu = (1 - b1) g' + b1 mu,  nu = (1 - b2) g'^2 + b2 nu
 *   u = (mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps) + wd x,  x = x + (-lr) u
 * x, mu, nu: (n) updated in place; g: (n). */
void bk_adamw_update(float *x, float *mu, float *nu, const float *g, size_t n, const bk_adamw_hp *hp);
void bk_adamw_update_ref(float *x, float *mu, float *nu, const float *g, size_t n, const bk_adamw_hp *hp);

/* x = x + neg_lr * g' (g' as above; hp's other fields are not used). */
void bk_sgd_update(float *x, const float *g, size_t n, const bk_adamw_hp *hp);

/* sum of x[i]^2 in double: per chunk of BK_SUMSQ_GRAIN elements 8 interleaved lanes
 * (lane k adds elements k, k + 8, ...), the lanes added in order, then the chunk's last
 * n % 8 in order; the chunks in order, the shorter tail chunk last.  A fixed order, so the
 * same bits on any thread count. */
enum { BK_SUMSQ_GRAIN = 1 << 16 };
double bk_sumsq(const float *x, size_t n);
double bk_sumsq_ref(const float *x, size_t n); /* one plain double sum */

#endif

/* bk_xent.h — softmax cross-entropy with z-loss over logits (N, V) and int32 targets, as MaxText's
 * cross_entropy_with_logits: loss_n = lse_n - x[n, t_n] + z * lse_n^2, lse = logsumexp(x_n).
 * (The z-loss term alone is z * lse^2, from the saved lse.) Backward:
 * dx[n, j] += dloss_n * (softmax_j * (1 + 2 z lse_n) - [j == t_n]).
 *
 * Vocab-sharded composition (each device holds the columns [v_lo, v_lo + V_local)):
 *   m   = max over devices of bk_xent_row_max(local)            (all-reduce max)
 *   s   = sum over devices of bk_xent_row_sumexp(local, m)      (all-reduce sum)
 *   t   = sum over devices of bk_xent_pick_target(local, v_lo)  (all-reduce sum; 0 off-shard)
 *   bk_xent_combine(loss, lse, m, s, t)                         (lse = m + log s)
 *   backward: bk_xent_bwd_local(local dlogits, ..., lse, v_lo)  (no communication)
 * With one device (v_lo = 0, V_local = V) this is exactly bk_xent_fwd / bk_xent_bwd.
 */
#ifndef BK_XENT_H
#define BK_XENT_H

#include <stdint.h>

void bk_xent_fwd(float *loss,            // (N) per-row loss, z-loss included
                 float *lse,             // (N) saved: logsumexp of the row
                 const float *logits,    // (N, V)
                 const int32_t *targets, // (N) each in [0, V)
                 int N, int V, float z_loss);
void bk_xent_bwd(float *dlogits,         // (N, V) accumulated
                 const float *dloss,     // (N)
                 const float *logits,    // (N, V)
                 const float *lse,       // (N) saved
                 const int32_t *targets, // (N)
                 int N, int V, float z_loss);

/* ---- composable pieces for a vocab-sharded row (see the note above) ---- */
void bk_xent_row_max(float *m,            // (N)
                     const float *logits, // (N, V_local)
                     int N, int V_local);
void bk_xent_row_sumexp(float *s,            // (N) sum_j exp(x_j - m), summed in double
                        const float *logits, // (N, V_local)
                        const float *m,      // (N) the GLOBAL row max (any finite shift works)
                        int N, int V_local);
void bk_xent_pick_target(float *t,               // (N) x[n, t_n - v_lo] if on this shard, else 0
                         const float *logits,    // (N, V_local)
                         const int32_t *targets, // (N) global ids
                         int N, int V_local, int v_lo);
void bk_xent_combine(float *loss,    // (N)
                     float *lse,     // (N) = m + log s
                     const float *m, // (N) global max
                     const float *s, // (N) global sum of exp(x - m)
                     const float *t, // (N) global target logit
                     int N, float z_loss);
void bk_xent_bwd_local(float *dlogits,         // (N, V_local) accumulated
                       const float *dloss,     // (N)
                       const float *logits,    // (N, V_local)
                       const float *lse,       // (N) GLOBAL lse
                       const int32_t *targets, // (N) global ids
                       int N, int V_local, int v_lo, float z_loss);
/* The same, writing dlogits instead of adding to it (no need to zero it first; every element
 * equals what bk_xent_bwd_local adds to a zeroed buffer). */
void bk_xent_bwd_local_into(float *dlogits, const float *dloss, const float *logits, const float *lse,
                            const int32_t *targets, int N, int V_local, int v_lo, float z_loss);

void bk_xent_fwd_ref(float *loss, float *lse, const float *logits, const int32_t *targets, int N, int V, float z_loss);
void bk_xent_bwd_ref(float *dlogits, const float *dloss, const float *logits, const float *lse, const int32_t *targets,
                     int N, int V, float z_loss);

#endif /* BK_XENT_H */

/* bk_topk.h — top-k over the last dim: values descending with int32 indices. Ties are broken by
 * the LOWEST index, always (as jax.lax.top_k); NaN ranks above +inf (a total order, so the
 * result is deterministic whatever the data). Backward scatters dvals back to the chosen slots.
 */
#ifndef BK_TOPK_H
#define BK_TOPK_H

#include <stdint.h>

void bk_topk_fwd(float *vals,    // (N, k)
                 int32_t *idx,   // (N, k)
                 const float *x, // (N, E)
                 int N, int E, int k);
/* dx[n, idx[n, s]] += dvals[n, s] */
void bk_topk_bwd(float *dx,          // (N, E) accumulated
                 const float *dvals, // (N, k)
                 const int32_t *idx, // (N, k)
                 int N, int E, int k);
void bk_topk_fwd_ref(float *vals, int32_t *idx, const float *x, int N, int E, int k);

#endif /* BK_TOPK_H */

/* bk_embedding.h — token embedding lookup over a (possibly vocab-sharded) table.
 * The local table holds rows [v_lo, v_lo + V_local) of the global (V, C) table; an id outside that
 * range gives a zero row, so summing the outputs of all shards (all-reduce) gives the full lookup.
 * Backward scatter-adds dout rows into dtable in token order (deterministic).  Both run on the kernel
 * pool (bk_parallel); the results do not depend on the thread count.
 */
#ifndef BK_EMBEDDING_H
#define BK_EMBEDDING_H

#include <stdint.h>

void bk_embedding_fwd(float *out,         // (N, C)
                      const int32_t *ids, // (N) global ids
                      const float *table, // (V_local, C)
                      int N, int C, int v_lo, int V_local);
void bk_embedding_bwd(float *dtable,      // (V_local, C) accumulated
                      const float *dout,  // (N, C)
                      const int32_t *ids, // (N)
                      int N, int C, int v_lo, int V_local);
/* The same into a table it first zero-fills (each pool chunk its own rows): for a fresh cotangent. */
void bk_embedding_bwd_zero(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local);
void bk_embedding_fwd_ref(float *out, const int32_t *ids, const float *table, int N, int C, int v_lo, int V_local);
void bk_embedding_bwd_ref(float *dtable, const float *dout, const int32_t *ids, int N, int C, int v_lo, int V_local);

#endif /* BK_EMBEDDING_H */

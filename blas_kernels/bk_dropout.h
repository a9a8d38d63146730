/* bk_dropout.h — dropout with a counter-based mask (flax/MaxText Dropout semantics:
 * keep = 1 - rate, y = x / keep where the mask keeps, 0 elsewhere; rate >= 1 gives zeros).
 *
 * The mask is a pure function of (key, global mask index): element j of the mask is kept iff
 * u_j < keep, u_j = top 24 bits of splitmix64(key + (j + 1) * golden) / 2^24.  The mask has the
 * tensor's global shape with dim `bcast` removed (MaxText's broadcast_dims=(-2,): one draw per
 * (batch, feature), shared along the sequence), so a shard computes its part from its global
 * offsets and every mesh drops the same elements.
 */
#ifndef BK_DROPOUT_H
#define BK_DROPOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Is mask element j kept? */
bool bk_dropout_keep(uint64_t key, uint64_t j, double rate);

/* A local block of a rank-`rank` tensor: local[d] elements starting at global offset off[d] of
 * global[d], row-major.  out = mask * in / keep (out may equal in). */
void bk_dropout_fwd(float *out, const float *in, int rank, const int64_t *local, const int64_t *off,
                    const int64_t *global, int bcast, uint64_t key, double rate);
/* din += mask * dout / keep */
void bk_dropout_bwd(float *din, const float *dout, int rank, const int64_t *local, const int64_t *off,
                    const int64_t *global, int bcast, uint64_t key, double rate);

#endif /* BK_DROPOUT_H */

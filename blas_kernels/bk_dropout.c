/* bk_dropout.c — counter-based dropout (see the header). */
#include "blas_kernels/bk_dropout.h"

#include "blas_kernels/bk.h"

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

bool bk_dropout_keep(uint64_t key, uint64_t j, double rate)
{
    if (rate <= 0.0) return true;
    if (rate >= 1.0) return false;
    double u = (double)(mix64(key + (j + 1) * 0x9E3779B97F4A7C15ull) >> 40) * (1.0 / 16777216.0);
    return u < 1.0 - rate;
}

/* Walks the local block in row-major order; acc: out += (or =) scale * in on kept elements. */
static void apply(float *out, const float *in, int rank, const int64_t *local, const int64_t *off,
                  const int64_t *global, int bcast, uint64_t key, double rate, int acc)
{
    BK_ASSERT(rank >= 1 && rank <= 8 && bcast >= 0 && bcast < rank);
    const float keep = (float)(1.0 - rate); /* flax divides by keep_prob */
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= local[d];
    int64_t idx[8] = {0};
    for (int64_t i = 0; i < n; i++) {
        uint64_t j = 0; /* mask index: global coordinates without the broadcast dim, row-major */
        for (int d = 0; d < rank; d++)
            if (d != bcast) j = j * (uint64_t)global[d] + (uint64_t)(off[d] + idx[d]);
        float v = rate < 1.0 && bk_dropout_keep(key, j, rate) ? in[i] / keep : 0.0f;
        if (acc) out[i] += v;
        else out[i] = v;
        for (int d = rank - 1; d >= 0; d--) {
            if (++idx[d] < local[d]) break;
            idx[d] = 0;
        }
    }
}

void bk_dropout_fwd(float *out, const float *in, int rank, const int64_t *local, const int64_t *off,
                    const int64_t *global, int bcast, uint64_t key, double rate)
{
    apply(out, in, rank, local, off, global, bcast, key, rate, 0);
}

void bk_dropout_bwd(float *din, const float *dout, int rank, const int64_t *local, const int64_t *off,
                    const int64_t *global, int bcast, uint64_t key, double rate)
{
    apply(din, dout, rank, local, off, global, bcast, key, rate, 1);
}

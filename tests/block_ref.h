/* block_ref.h — test support: float64 references of the dense decoder's blocks written from
 * MaxText's definitions (layers/attentions.py Attention, layers/linears.py MlpBlock,
 * layers/normalizations.py RMSNorm), independent of the program's kernels, for the block tests.
 * Activations are (N, E) row-major with N = B * T tokens, token n at position n % T; weights are
 * one layer's, global, row-major in MaxText's layout. */
#ifndef TESTS_BLOCK_REF_H
#define TESTS_BLOCK_REF_H

#include <stdbool.h>
#include <stdint.h>

/* RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * g (g NULL: no scale). */
void ref_rmsnorm(int64_t N, int64_t E, const double *x, const float *g, double eps, double *y);

/* Token x (E) through kernel w (E, nh, D), heads [h0, h0 + n) -> p (n, D). */
void ref_project(int64_t E, const double *x, const float *w, int64_t nh, int64_t h0, int64_t n, int64_t D, double *p);
/* y (N, E) = o (N, HD) . wo (HD, E). */
void ref_out_proj(int64_t N, int64_t HD, int64_t E, const double *o, const float *wo, double *y);
/* The default RoPE (embeddings.RotaryEmbedding) in place on n heads of D at position pos:
 * timescale_i = min_ts (max_ts / min_ts)^(2i/D), the pair (x[i], x[i + D/2]) rotated by pos / timescale_i. */
void ref_rope(double *v, int64_t n, int64_t D, int64_t pos, double min_ts, double max_ts);
/* Causal softmax attention of q (B, T, H, Dqk) over k (B, T, K, Dqk), v (B, T, K, Dv) -> o (B, T, H, Dv):
 * scores scale q . k over key positions up to the query's, query head h reading kv head h / (H / K). */
void ref_causal_attention(int64_t B, int64_t T, int64_t H, int64_t K, int64_t Dqk, int64_t Dv, const double *q,
                          const double *k, const double *v, double scale, double *o);

/* Global causal attention: q, k, v = x . wq, wk, wv (or one fused (E, H + 2K, D) wqkv: query,
 * key, value heads in that order); q, k RMSNormed over D by qn, kn when given; the default RoPE
 * (timescale_i = min_ts (max_ts / min_ts)^(2i/D), halves rotated); scores scale q . k over
 * positions up to the query's, query head h reading kv head h / (H / K); softmax; (p . v) . wo. */
typedef struct {
    int64_t E, H, K, D;
    const float *wq, *wk, *wv; /* (E, H | K, D), or NULL with wqkv */
    const float *wqkv;
    const float *wo;      /* (H, D, E) */
    const float *qn, *kn; /* (D), or NULL */
    double eps, scale, min_ts, max_ts;
} ref_attention;
void ref_attention_fwd(const ref_attention *a, int64_t B, int64_t T, const double *x, double *y);

/* SwiGLU: y = (silu(x . wi0) * (x . wi1)) . wo, or with one fused (E, 2, F) wi (gate at [e, 0, f]);
 * with gelu, GeGLU: gelu(g) = g * 0.5 * (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (jax.nn.gelu's default). */
typedef struct {
    int64_t E, F;
    bool gelu;
    const float *wi0, *wi1; /* (E, F), or NULL with wi */
    const float *wi;
    const float *wo; /* (F, E) */
} ref_mlp;
void ref_mlp_fwd(const ref_mlp *m, int64_t N, const double *x, double *y);

/* The pre-norm dense decoder layer (LlamaDecoderLayer, Qwen3DecoderLayer):
 * h = x + attention(rmsnorm(x, ln1)), y = h + mlp(rmsnorm(h, ln2)). */
typedef struct {
    ref_attention a;
    ref_mlp m;
    const float *ln1, *ln2; /* (E) */
    double eps;
} ref_dense_layer;
void ref_dense_layer_fwd(const ref_dense_layer *L, int64_t B, int64_t T, const double *x, double *y);

#endif

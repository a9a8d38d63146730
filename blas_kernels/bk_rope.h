/* bk_rope.h — rotary position embedding, MaxText numerics (reference/maxtext-facts.md §4.7).
 * DEFAULT (llama2, embeddings.RotaryEmbedding): timescale_i = min*(max/min)^(2i/d) [* linear
 *   scaling factor], angle = pos / timescale_i, pairs (x[i], x[i+d/2]) (concatenated halves).
 * YARN (DeepSeek, embeddings.YarnRotaryEmbedding): freq_i = theta^(-2i/d) blended with
 *   freq_i/factor by the beta_fast/beta_slow ramp; input pairs (x[2i], x[2i+1]) if interleave,
 *   else concatenated halves; output ALWAYS concatenated [real..., imag...]; optional
 *   attention_scaling multiplies the output by 0.1 ln(factor) + 1. mscale is not a RoPE input in
 *   MaxText: it enters the MLA softmax scale (bk_mla_softmax_scale).
 * LLAMA31 (every model_name llama3.1*, or rope_type=llama3.1: attentions.py init_rotary_embedding,
 *   embeddings.LLaMARotaryEmbedding): the DEFAULT timescales (no linear scaling factor, which
 *   LLaMARotaryEmbedding does not read) with Llama 3.1's frequency scaling when use_scale
 *   (rope_use_scale): wavelength 2 pi / freq below 8192/4 keeps freq, above 8192 gives freq/8,
 *   between blends the two by s = (8192/wavelength - 1)/3; pairs (x[2i], x[2i+1]) in input AND
 *   output (the layout stays interleaved).
 * Every token carries its own int32 position, so context-parallel chunks rotate correctly.
 */
#ifndef BK_ROPE_H
#define BK_ROPE_H

#include <stdint.h>

typedef enum { BK_ROPE_DEFAULT = 0, BK_ROPE_YARN = 1, BK_ROPE_LLAMA31 = 2 } bk_rope_kind;

typedef struct {
    bk_rope_kind kind;
    int dim;                              // rotary dim d (even): head_dim, or qk_rope_head_dim for MLA
    double min_timescale;                 // DEFAULT, LLAMA31: rope_min_timescale (1)
    double max_timescale;                 // rope_max_timescale = theta (10000), both kinds
    double linear_scaling_factor;         // DEFAULT: rope_linear_scaling_factor (1 = off), scales timescales
    double factor;                        // YARN: rope_factor (40)
    int original_max_position_embeddings; // YARN: (4096)
    double beta_fast;                     // YARN: (32), the high-frequency end of the ramp
    double beta_slow;                     // YARN: (1)
    int interleave;                       // YARN: rope_interleave (1): input pairs are (x[2i], x[2i+1])
    int truncate;                         // YARN: rope_truncate (1): floor/ceil the correction range
    int attention_scaling;                // YARN: rope_attention_scaling (0)
    int use_scale;                        // LLAMA31: rope_use_scale (1): Llama 3.1's frequency scaling
} bk_rope_params;

/* MaxText base.yml defaults for each kind, with rotary dim `dim`. */
bk_rope_params bk_rope_params_default(int dim);
bk_rope_params bk_rope_params_yarn(int dim);
bk_rope_params bk_rope_params_llama31(int dim);

/* Angular frequency (radians per position) of each of the d/2 pairs. */
void bk_rope_freqs(double *freq, // (dim/2)
                   const bk_rope_params *p);

/* 0.1 * mscale * ln(factor) + 1 when factor > 1, else 1 (DeepSeek yarn_get_mscale). */
double bk_yarn_mscale(double factor, double mscale);
/* MLA softmax scale (attention_mla.MLA): qk_head_dim^-0.5, times (0.1*mscale*ln(rope_factor)+1)^2
 * when max_position_embeddings > original_max_position_embeddings. */
double bk_mla_softmax_scale(int qk_head_dim, long max_position_embeddings, long original_max_position_embeddings,
                            double rope_factor, double mscale);

/* Rotate N tokens x H heads. Row (n, h) of the input starts at in + (n*H + h) * in_stride and
 * holds dim contiguous values (in_stride >= dim lets a caller rotate the rope slice of a wider row,
 * e.g. MLA's q_pe inside (B, T, H, 192)); same for out. out == in (same stride) is allowed. */
void bk_rope_fwd(float *out,               // (N, H, out_stride)
                 const float *in,          // (N, H, in_stride)
                 const int32_t *positions, // (N)
                 int N, int H, int in_stride, int out_stride, const bk_rope_params *p);
/* din += R^T dout: the inverse rotation (times the attention scaling, if on), un-interleaved. */
void bk_rope_bwd(float *din,               // (N, H, in_stride)
                 const float *dout,        // (N, H, out_stride)
                 const int32_t *positions, // (N)
                 int N, int H, int in_stride, int out_stride, const bk_rope_params *p);
/* The fwd/bwd kernels keep each distinct cos/sin table (params, position range) once per process,
 * shared read-only by every device (thread or fiber); the bits are those of a fresh table.
 * bk_rope_cache_clear frees them (call it while no RoPE kernel runs; it also runs at exit);
 * bk_rope_cache_tables counts them (tests). */
void bk_rope_cache_clear(void);
int bk_rope_cache_tables(void);

void bk_rope_fwd_ref(float *out, const float *in, const int32_t *positions, int N, int H, int in_stride, int out_stride,
                     const bk_rope_params *p);
void bk_rope_bwd_ref(float *din, const float *dout, const int32_t *positions, int N, int H, int in_stride,
                     int out_stride, const bk_rope_params *p);

#endif /* BK_ROPE_H */

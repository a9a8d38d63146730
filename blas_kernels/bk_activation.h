/* bk_activation.h — elementwise activations on contiguous buffers: SiLU and SwiGLU
 * (out = silu(gate) * up, MaxText mlp_activations ["silu", "linear"]), GeGLU (out = gelu(gate) * up,
 * ["gelu", "linear"], with jax.nn.gelu's default tanh approximation), and the float32 -> bfloat16 ->
 * float32 round trip of a jnp.asarray(x, jnp.bfloat16) read back in float32.
 * silu(x) = x * sigmoid(x), sigmoid evaluated without overflow for any sign of x;
 * gelu(x) = x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (jax/_src/nn/functions.py gelu).
 */
#ifndef BK_ACTIVATION_H
#define BK_ACTIVATION_H

#include <stddef.h>

void bk_silu_fwd(float *out,      // (n)
                 const float *in, // (n)
                 size_t n);
/* din += dout * silu'(in) */
void bk_silu_bwd(float *din, const float *dout, const float *in, size_t n); // all (n)

void bk_swiglu_fwd(float *out,        // (n)
                   const float *gate, // (n)
                   const float *up,   // (n)
                   size_t n);
/* dgate += dout * up * silu'(gate); dup += dout * silu(gate) */
void bk_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                   size_t n); // all (n)
/* The same, writing dgate and dup instead of adding to them (no need to zero them first). */
void bk_swiglu_bwd_into(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);

/* gpt-oss's clamped GLU (MaxText moe.py apply_ffn_activation for decoder_block gpt_oss):
 *   g = min(gate, limit), u = clip(up, -limit, limit), out = g sigmoid(alpha g) (u + 1)
 * with alpha = 1.702 in MaxText and limit = mlp_activations_limit.  The backward adds to dgate and
 * dup; a clipped input (gate > limit, |up| > limit) gets no gradient. */
void bk_clamped_glu_fwd(float *out, const float *gate, const float *up, size_t n, float alpha, float limit);
void bk_clamped_glu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n,
                        float alpha, float limit);
void bk_geglu_fwd(float *out,        // (n)
                  const float *gate, // (n)
                  const float *up,   // (n)
                  size_t n);
/* dgate = dout * up * gelu'(gate); dup = dout * gelu(gate) (written, not added) */
void bk_geglu_bwd_into(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);

/* out = x rounded to the nearest bfloat16 (ties to even), as float32; out may be x. */
void bk_round_bf16(float *out, const float *x, size_t n); // (n)

void bk_silu_fwd_ref(float *out, const float *in, size_t n);
void bk_silu_bwd_ref(float *din, const float *dout, const float *in, size_t n);
void bk_swiglu_fwd_ref(float *out, const float *gate, const float *up, size_t n);
void bk_swiglu_bwd_ref(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);

void bk_geglu_fwd_ref(float *out, const float *gate, const float *up, size_t n);
void bk_geglu_bwd_ref(float *dgate, float *dup, const float *dout, const float *gate, const float *up, size_t n);

#endif /* BK_ACTIVATION_H */

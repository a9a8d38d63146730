/* bk_softcap.h — the scaled tanh soft cap MaxText puts on logits:
 * y = cap * tanh(a * x / cap) when cap > 0, else y = a * x.
 * (final_logits_soft_cap with normalize_embedding_logits: a = 1/sqrt(emb);
 * attn_logits_soft_cap lives inside bk_attention.)  The backward reads the
 * saved output: dy/dx = a * (1 - (y / cap)^2), so the input need not be kept.
 */
#ifndef BK_SOFTCAP_H
#define BK_SOFTCAP_H

#include <stddef.h>

void bk_softcap_fwd(float *out,      // (n)
                    const float *in, // (n)
                    size_t n, float a, float cap);
/* din += dout * a * (1 - (out / cap)^2)  (cap = 0: din += a * dout) */
void bk_softcap_bwd(float *din,        // (n)
                    const float *dout, // (n)
                    const float *out,  // (n) saved output of the forward
                    size_t n, float a, float cap);

/* Twins in double (tanh from libm, derivative from the input, not the output). */
void bk_softcap_fwd_ref(float *out, const float *in, size_t n, float a, float cap);
void bk_softcap_bwd_ref(float *din, const float *dout, const float *in, size_t n, float a, float cap);

#endif /* BK_SOFTCAP_H */

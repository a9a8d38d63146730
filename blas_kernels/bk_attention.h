/* bk_attention.h — causal attention with explicit positions, blocked with an online softmax
 * (flash-attention style): memory O(block_q * block_k), block products via sgemm.
 * Key j is visible to query i iff k_pos[j] <= q_pos[i], and, with a sliding window W > 0, also
 * k_pos[j] > q_pos[i] - W (MaxText's local_sliding mask, attention_op.py generate_attention_mask:
 * col > row - W and col <= row, so a query sees itself and the W - 1 keys before it), so permuted
 * (load-balanced context parallel) or chunked sequences mask correctly and Tq != Tk is fine. GQA: query head h reads kv
 * head h / (Hq / Hkv). Dv may differ from Dqk (MLA: 192 vs 128). A query with no visible key gets
 * out = 0, lse = -INFINITY and zero gradients (with sinks: out = 0, lse = sink).
 */
#ifndef BK_ATTENTION_H
#define BK_ATTENTION_H

#include <stdint.h>

typedef struct {
    int B;          // batch
    int Tq, Tk;     // query and key lengths (independent)
    int Hq, Hkv;    // query heads, kv heads; Hq % Hkv == 0
    int Dqk, Dv;    // q/k head dim, v head dim
    float scale;    // softmax scale multiplying q.k (MaxText MHA: 1, MLA: bk_mla_softmax_scale)
    int block_q;    // query tile rows, 0 = default (128)
    int block_k;    // key tile rows, 0 = default (128)
    float soft_cap; // attn_logits_soft_cap: scores s -> cap * tanh(s / cap) after the scale; 0 = off
    int window;     // sliding window (MaxText local_sliding): key j also needs k_pos[j] > q_pos[i] - window; 0 = off
    /* Attention sinks (MaxText attention_sink, attention_op.py compute_local_attention): one learned
     * logit per query head joins every row's softmax as an extra column whose value is dropped, so
     * p_j = e^(s_j) / (e^(sink_h) + sum_k e^(s_k)) and out = sum_j p_j v_j; lse includes the sink.
     * sinks (Hq) or NULL = none.  dsinks (Hq), backward only: receives += d loss / d sink_h =
     * -sum over (batch, query) of p_sink (sum(dO O) - dlse), reduced over batch rows in order. */
    const float *sinks;
    float *dsinks;
} bk_attn_dims;

void bk_attention_fwd(float *out,           // (B, Tq, Hq, Dv)
                      float *lse,           // (B, Hq, Tq) saved: logsumexp of scaled scores
                      const float *q,       // (B, Tq, Hq, Dqk)
                      const float *k,       // (B, Tk, Hkv, Dqk)
                      const float *v,       // (B, Tk, Hkv, Dv)
                      const int32_t *q_pos, // (B, Tq)
                      const int32_t *k_pos, // (B, Tk)
                      const bk_attn_dims *d);
/* Flash-attention backward: recomputes score tiles from q, k and lse; accumulates dq, dk, dv.
 * dlse is an optional upstream gradient of lse (NULL = none), for callers that merge partial
 * attentions by their logsumexp. */
void bk_attention_bwd(float *dq,         // (B, Tq, Hq, Dqk)
                      float *dk,         // (B, Tk, Hkv, Dqk)
                      float *dv,         // (B, Tk, Hkv, Dv)
                      const float *dout, // (B, Tq, Hq, Dv)
                      const float *dlse, // (B, Hq, Tq) or NULL
                      const float *out,  // (B, Tq, Hq, Dv) saved
                      const float *lse,  // (B, Hq, Tq) saved
                      const float *q, const float *k, const float *v, const int32_t *q_pos, const int32_t *k_pos,
                      const bk_attn_dims *d);

/* Dot-product attention (MaxText's attention=dot_product): the same math with the whole score
 * matrix materialised.  probs (B, Hq, Tq, Tk) receives the softmax probabilities (masked keys 0; a
 * query with no visible key: a zero row and out = 0); the backward reads them instead of
 * recomputing.  Block sizes are ignored.  dq, dk, dv are overwritten. */
void bk_attention_dot_fwd(float *out,   // (B, Tq, Hq, Dv)
                          float *probs, // (B, Hq, Tq, Tk) saved
                          const float *q, const float *k, const float *v, const int32_t *q_pos, const int32_t *k_pos,
                          const bk_attn_dims *d);
void bk_attention_dot_bwd(float *dq, float *dk, float *dv, const float *dout, const float *probs, const float *q,
                          const float *k, const float *v, const bk_attn_dims *d);

/* Naive twins: full score rows in double, no blocking (block sizes ignored). */
void bk_attention_fwd_ref(float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                          const int32_t *k_pos, const bk_attn_dims *d);
void bk_attention_bwd_ref(float *dq, float *dk, float *dv, const float *dout, const float *dlse, const float *out,
                          const float *lse, const float *q, const float *k, const float *v, const int32_t *q_pos,
                          const int32_t *k_pos, const bk_attn_dims *d);

#endif /* BK_ATTENTION_H */

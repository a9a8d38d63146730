/* bk_activation.c — SiLU / SwiGLU.
 * silu'(x) = s + x s (1 - s) with s = sigmoid(x). */
#include "blas_kernels/bk_activation.h"

#include <math.h>

#include "blas_kernels/bk.h"

/* 1/(1+e^-x) written so that expf never overflows: for x<0 use e^x/(1+e^x). */
static inline float sigmoidf_stable(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  float e = expf(x);
  return e / (1.0f + e);
}

static inline double sigmoid_d(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
  double e = exp(x);
  return e / (1.0 + e);
}

void bk_silu_fwd(float *out, const float *in, size_t n) {
  BK_ASSERT(n == 0 || (out && in));
  for (size_t i = 0; i < n; i++) out[i] = in[i] * sigmoidf_stable(in[i]);
}

void bk_silu_bwd(float *din, const float *dout, const float *in, size_t n) {
  BK_ASSERT(n == 0 || (din && dout && in));
  for (size_t i = 0; i < n; i++) {
    float x = in[i], s = sigmoidf_stable(x);
    din[i] += dout[i] * (s + x * s * (1.0f - s));
  }
}

void bk_swiglu_fwd(float *out, const float *gate, const float *up, size_t n) {
  BK_ASSERT(n == 0 || (out && gate && up));
  for (size_t i = 0; i < n; i++) out[i] = gate[i] * sigmoidf_stable(gate[i]) * up[i];
}

void bk_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate,
                   const float *up, size_t n) {
  BK_ASSERT(n == 0 || (dgate && dup && dout && gate && up));
  for (size_t i = 0; i < n; i++) {
    float g = gate[i], s = sigmoidf_stable(g), d = dout[i];
    dgate[i] += d * up[i] * (s + g * s * (1.0f - s));
    dup[i] += d * g * s;
  }
}

void bk_silu_fwd_ref(float *out, const float *in, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = (float)(in[i] * sigmoid_d(in[i]));
}

void bk_silu_bwd_ref(float *din, const float *dout, const float *in, size_t n) {
  for (size_t i = 0; i < n; i++) {
    double x = in[i], s = sigmoid_d(x);
    din[i] += (float)(dout[i] * (s + x * s * (1.0 - s)));
  }
}

void bk_swiglu_fwd_ref(float *out, const float *gate, const float *up, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = (float)(gate[i] * sigmoid_d(gate[i]) * up[i]);
}

void bk_swiglu_bwd_ref(float *dgate, float *dup, const float *dout, const float *gate,
                       const float *up, size_t n) {
  for (size_t i = 0; i < n; i++) {
    double g = gate[i], s = sigmoid_d(g);
    dgate[i] += (float)(dout[i] * up[i] * (s + g * s * (1.0 - s)));
    dup[i] += (float)(dout[i] * g * s);
  }
}

/* bk_softmax.h — softmax over the last dim of (N, V), max-subtracted, row sum in double.
 * Backward: din += y * (dout - sum(dout * y)) with y the saved forward output.
 */
#ifndef BK_SOFTMAX_H
#define BK_SOFTMAX_H

void bk_softmax_fwd(float *out,      // (N, V)
                    const float *in, // (N, V)
                    int N, int V);
void bk_softmax_bwd(float *din,        // (N, V)
                    const float *dout, // (N, V)
                    const float *out,  // (N, V) saved forward output
                    int N, int V);
void bk_softmax_fwd_ref(float *out, const float *in, int N, int V);
void bk_softmax_bwd_ref(float *din, const float *dout, const float *out, int N, int V);

#endif /* BK_SOFTMAX_H */

/* bk_einsum.h — two-operand einsum on row-major float32 buffers, through OpenBLAS sgemm.
 *
 * Subscripts are explicit ("btd,dh->bth"): letters a-z, one per dim, no repeats within one operand
 * or the output, every output letter in some input.  A letter in both inputs and the output is a
 * batch index, in one input and the output a free index, in both inputs but not the output a
 * contraction index, in one input only a summed index (summed before the product).
 * The product runs as per-batch sgemm on (M, K) x (K, N) views of the operands; an operand or the
 * output is copied into that layout only when its memory cannot be viewed so (a merged group of
 * letters must be contiguous and in order, one of the two groups must have stride 1), so
 * "btd,dh->bth", "bsnh,btnh->bnst" or "bth,hd->btd" run without any copy.
 * bk_einsum asserts on bad subscripts: callers facing user input validate with bk_einsum_parse,
 * which returns an error message instead.
 */
#ifndef BK_EINSUM_H
#define BK_EINSUM_H

#include <stddef.h>
#include <stdint.h>

enum { BK_EINSUM_MAX_RANK = 8 };

/* Role of an index letter. */
typedef enum {
    BK_EIN_UNUSED = 0,
    BK_EIN_BATCH,    /* in a, b and the output */
    BK_EIN_LHS_FREE, /* in a and the output */
    BK_EIN_RHS_FREE, /* in b and the output */
    BK_EIN_CONTRACT, /* in a and b, not the output */
    BK_EIN_LHS_SUM,  /* in a only: summed over */
    BK_EIN_RHS_SUM   /* in b only: summed over */
} bk_ein_role;

/* A parsed, validated einsum against concrete shapes. */
typedef struct {
    int ra, rb, ro;              /* ranks of a, b and the output */
    char la[BK_EINSUM_MAX_RANK]; /* letter of each dim of a */
    char lb[BK_EINSUM_MAX_RANK]; /* letter of each dim of b */
    char lo[BK_EINSUM_MAX_RANK]; /* letter of each dim of the output */
    int64_t size[26];            /* size of each letter ('a' + i), -1 when unused */
    bk_ein_role role[26];        /* role of each letter */
    int64_t out_shape[BK_EINSUM_MAX_RANK];
} bk_einsum_dims;

/* Parses `subscripts` against the shapes of a (ra dims sa) and b (rb dims sb).  Returns 0 and fills
 * *out, or -1 with a message in err (naming the subscripts, the operand, the letter and the sizes)
 * when the subscripts are malformed or disagree with the shapes.  out may be NULL. */
int bk_einsum_parse(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb, bk_einsum_dims *out,
                    char *err, size_t errcap);

/* out = einsum(a, b) + beta * out (beta == 0 ignores out's contents; beta == 1 accumulates). */
void bk_einsum(const char *subscripts,
               float *out,                                // (out_shape)
               const float *a, int ra, const int64_t *sa, // (sa)
               const float *b, int rb, const int64_t *sb, // (sb)
               float beta);
/* Naive loops over every index, double accumulation. */
void bk_einsum_ref(const char *subscripts, float *out, const float *a, int ra, const int64_t *sa, const float *b,
                   int rb, const int64_t *sb, float beta);

/* Elements bk_einsum would copy to lay the operands and the output out for sgemm (the output
 * counts twice); 0 when every buffer can be used as it is. */
int64_t bk_einsum_copied(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb);

/* Whether bk_einsum writes the output in place: every sgemm's C is a view of `out` (no scratch
 * result scattered afterwards), so beta = 1 accumulates into out inside sgemm itself, each output
 * element one dot product added to its old value in sgemm's order. */
int bk_einsum_out_direct(const char *subscripts, int ra, const int64_t *sa, int rb, const int64_t *sb);

/* out = in with its dims permuted: out dim i is in dim perm[i] (elements of `es` bytes). */
void bk_permute(void *out, const void *in, size_t es, int rank, const int64_t *shape, const int *perm);

#endif /* BK_EINSUM_H */

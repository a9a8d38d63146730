/* bk_coretype.h — which OpenBLAS kernels run: the best core that is correct on this CPU.
 *
 * Debian's OpenBLAS is a DYNAMIC_ARCH build: its load-time constructor picks a kernel set ("core")
 * from CPUID, and only OPENBLAS_CORETYPE in the environment at load time can change it. On CPUs it
 * does not recognise (virtual Xeons with AVX-512) it falls back to generic Prescott kernels, 3-5x
 * slower. At start-up (a constructor of this module, before main, linked into every binary through
 * `-u bk_coretype_current` in the Makefile) shardsim compares the ISA level of the core OpenBLAS chose
 * with the best level the CPU's features allow; when OpenBLAS chose lower, it sets OPENBLAS_CORETYPE
 * and re-executes itself (/proc/self/exe, same argv). Whatever core runs is then checked against a
 * naive sgemm (exact on integer-valued data, under a SIGILL/SIGSEGV guard); a failing core is never
 * used: the next lower one is tried (again by re-executing), down to OpenBLAS's own choice and below.
 * A user-set OPENBLAS_CORETYPE is respected (and refused with exit 2 if it fails the check).
 *
 * Environment (state passed across the re-execution, and test hooks):
 *   SHARDSIM_BLAS_SELECTION        set by the selector: "detected=X;asked=Y;failed=A,B"
 *   SHARDSIM_BLAS_PRETEND_DETECTED=1  treat OPENBLAS_CORETYPE as OpenBLAS's own detection, not as a
 *                                  user choice (to start from a misdetected core on a machine that
 *                                  OpenBLAS recognises; tests and demonstrations)
 *   SHARDSIM_BLAS_FAIL_CHECK=CORE  the start-up check fails when CORE runs (tests of the fallback)
 */
#ifndef BK_CORETYPE_H
#define BK_CORETYPE_H

#include <stdbool.h>
#include <stddef.h>

/* The CPU's vector features (CPUID, with the OS's support for the register state). */
typedef struct {
    bool sse3, sse42, avx, avx2, fma;
    bool avx512f, avx512bw, avx512vl, avx512dq, avx512bf16;
    bool amd; /* AuthenticAMD: AVX2 level maps to OpenBLAS's Zen kernels instead of Haswell */
} bk_cpu_features;

void bk_cpu_features_detect(bk_cpu_features *f);

/* The CPU as benchmark headers name it, so that figures from different machine kinds are never
 * compared by mistake: the model name and the vector features that set kernel speed, from
 * /proc/cpuinfo ("model name", "flags"), e.g. "Intel(R) Xeon(R) Processor; fma avx2 avx512f
 * avx512_bf16 amx_tile amx_bf16 amx_int8". Without a readable /proc/cpuinfo, the CPUID features of
 * bk_cpu_features_detect. Returns buf. */
const char *bk_cpu_describe(char *buf, size_t cap);
/* The same from the text of a /proc/cpuinfo (pure: tests give it a fixed text). */
const char *bk_cpu_describe_cpuinfo(const char *cpuinfo, char *buf, size_t cap);

/* ISA level of an OpenBLAS core name (case-insensitive): 0 pre-SSE3, 1 SSE3 (Prescott, Core2, ...),
 * 2 SSE4.2 (Nehalem), 3 AVX (Sandybridge, Bulldozer), 4 AVX2+FMA (Haswell, Zen), 5 AVX-512
 * (SkylakeX), 6 AVX-512 with BF16 (Cooperlake), 7 SapphireRapids; -1 for a name it does not know. */
int bk_coretype_level(const char *core);

/* The core to run, given the CPU's features, the core OpenBLAS detected and the cores that already
 * failed the start-up check (comma-separated list or NULL): the best core the features allow when
 * that is above `detected`, else `detected`, else (if it failed too) the best lower one; skipping
 * failed cores. NULL when nothing is left. A detected name this module does not know is kept (a
 * newer OpenBLAS knows the CPU better than this table). Pure: returns a static string or `detected`. */
const char *bk_coretype_choose(const bk_cpu_features *f, const char *detected, const char *failed);

/* How the running core came to be. */
typedef enum {
    BK_CORE_OPENBLAS, /* OpenBLAS's own choice, kept */
    BK_CORE_UPGRADED, /* chosen from CPU features over OpenBLAS's lower choice */
    BK_CORE_FALLBACK, /* a higher core failed the check; this is the next one that passed */
    BK_CORE_USER,     /* OPENBLAS_CORETYPE set by the user */
    BK_CORE_IGNORED,  /* OpenBLAS did not honour the OPENBLAS_CORETYPE we set (not DYNAMIC_ARCH) */
} bk_core_how;

typedef struct {
    char core[32];     /* openblas_get_corename() of the running kernels */
    char detected[32]; /* what OpenBLAS chose by itself ("" when the user forced a core) */
    char failed[128];  /* cores that failed the start-up check, comma-separated */
    bk_core_how how;
    bool checked;      /* the start-up sgemm check passed on `core` */
    char summary[512]; /* "SkylakeX (OpenBLAS detected Prescott; chosen from CPU features; checked)" */
} bk_coretype_info;

/* The selection made at start-up (runs it now if the constructor did not, e.g. in a shared
 * library; never re-executes then). */
const bk_coretype_info *bk_coretype_current(void);

/* The start-up check on the running kernels: small single-threaded sgemms (all transposes, edge
 * tiles, alpha/beta) on integer-valued data, compared exactly with bk_gemm_ref; a SIGILL, SIGSEGV,
 * SIGBUS or SIGFPE inside counts as a failure. Returns true when it passes. */
bool bk_coretype_check(void);

#endif /* BK_CORETYPE_H */

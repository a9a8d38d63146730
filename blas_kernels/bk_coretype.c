/* bk_coretype.c — choosing, checking and (by re-executing) switching OpenBLAS's kernel set.
 *
 * The selection runs once per process, in a constructor: shared libraries' constructors run
 * before the executable's, so OpenBLAS has already chosen its core when this runs, and nothing of
 * shardsim has started yet (no threads, no files), so re-executing the same program with another
 * OPENBLAS_CORETYPE is invisible to the user except for a few milliseconds. The state of the
 * selection travels in SHARDSIM_BLAS_SELECTION across re-executions; every re-execution either
 * switches to the chosen core once or adds a core to the failed list, so it terminates.
 * Child processes inherit both variables and reach the same decision without re-executing. */
#include "blas_kernels/bk_coretype.h"

#include <cblas.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_gemm.h"

char *openblas_get_corename(void);

/* ---- cores and levels ---------------------------------------------------------------------- */

/* OpenBLAS x86-64 core names (openblas_get_corename / OPENBLAS_CORETYPE) and their ISA level. */
static const struct {
    const char *name;
    int level;
} CORES[] = {
    {"Unknown", 0},     {"Katmai", 0},         {"Coppermine", 0},   {"Northwood", 0}, {"Banias", 0},
    {"Athlon", 0},      {"Opteron", 0},        {"Prescott", 1},     {"Atom", 1},      {"Core2", 1},
    {"Penryn", 1},      {"Dunnington", 1},     {"Opteron_SSE3", 1}, {"Barcelona", 1}, {"Nano", 1},
    {"Bobcat", 1},      {"Nehalem", 2},        {"Sandybridge", 3},  {"Bulldozer", 3}, {"Piledriver", 3},
    {"Steamroller", 3}, {"Haswell", 4},        {"Excavator", 4},    {"Zen", 4},       {"SkylakeX", 5},
    {"Cooperlake", 6},  {"SapphireRapids", 7},
};

int bk_coretype_level(const char *core)
{
    if (!core) return -1;
    for (size_t i = 0; i < sizeof CORES / sizeof CORES[0]; i++)
        if (!strcasecmp(core, CORES[i].name)) return CORES[i].level;
    return -1;
}

void bk_cpu_features_detect(bk_cpu_features *f)
{
    memset(f, 0, sizeof *f);
    __builtin_cpu_init();
    /* libgcc's checks include the OS's support (XCR0) for the AVX and AVX-512 register state */
    f->sse3 = __builtin_cpu_supports("sse3");
    f->sse42 = __builtin_cpu_supports("sse4.2");
    f->avx = __builtin_cpu_supports("avx");
    f->avx2 = __builtin_cpu_supports("avx2");
    f->fma = __builtin_cpu_supports("fma");
    f->avx512f = __builtin_cpu_supports("avx512f");
    f->avx512bw = __builtin_cpu_supports("avx512bw");
    f->avx512vl = __builtin_cpu_supports("avx512vl");
    f->avx512dq = __builtin_cpu_supports("avx512dq");
    f->avx512bf16 = __builtin_cpu_supports("avx512bf16");
    f->amd = __builtin_cpu_is("amd");
}

/* ---- the CPU, described ---------------------------------------------------------------------- */

/* The /proc/cpuinfo flags that set a kernel's speed, in the order they are printed. */
static const char *const SPEED_FLAGS[] = {
    "sse4_2",   "avx",         "fma",         "avx2",        "avx_vnni", "avx512f",  "avx512dq", "avx512bw",
    "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16"};

/* The value of the first line "key<spaces>: value" of a cpuinfo text, into out ("" if none). */
static void cpuinfo_field(const char *text, const char *key, char *out, size_t cap)
{
    out[0] = '\0';
    size_t klen = strlen(key);
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len > klen && !strncmp(line, key, klen) && (line[klen] == ' ' || line[klen] == '\t' || line[klen] == ':')) {
            const char *colon = memchr(line, ':', len);
            if (colon) {
                const char *v = colon + 1;
                while (v < line + len && (*v == ' ' || *v == '\t')) v++;
                size_t n = (size_t)(line + len - v);
                if (n >= cap) n = cap - 1;
                memcpy(out, v, n);
                out[n] = '\0';
                return;
            }
        }
        line = end ? end + 1 : NULL;
    }
}

/* Whether the space-separated list holds the word. */
static bool has_word(const char *list, const char *word)
{
    size_t n = strlen(word);
    for (const char *p = list; (p = strstr(p, word)) != NULL; p += n)
        if ((p == list || p[-1] == ' ') && (p[n] == ' ' || p[n] == '\0')) return true;
    return false;
}

const char *bk_cpu_describe_cpuinfo(const char *cpuinfo, char *buf, size_t cap)
{
    char model[256], flags[4096];
    cpuinfo_field(cpuinfo, "model name", model, sizeof model);
    cpuinfo_field(cpuinfo, "flags", flags, sizeof flags);
    size_t k = (size_t)snprintf(buf, cap, "%s;", *model ? model : "unknown model");
    int any = 0;
    for (size_t i = 0; i < sizeof SPEED_FLAGS / sizeof SPEED_FLAGS[0] && k < cap; i++)
        if (has_word(flags, SPEED_FLAGS[i])) {
            k += (size_t)snprintf(buf + k, cap - k, " %s", SPEED_FLAGS[i]);
            any = 1;
        }
    if (!any && k < cap) snprintf(buf + k, cap - k, " %s", *flags ? "no AVX" : "no flags line");
    return buf;
}

const char *bk_cpu_describe(char *buf, size_t cap)
{
    enum { CPUINFO_READ = 1 << 16 }; /* the first CPU's block (a few KiB) is all that is needed */
    char *text = malloc(CPUINFO_READ);
    FILE *f = text ? fopen("/proc/cpuinfo", "r") : NULL;
    size_t n = f ? fread(text, 1, CPUINFO_READ - 1, f) : 0;
    if (f) fclose(f);
    if (n) {
        text[n] = '\0';
        bk_cpu_describe_cpuinfo(text, buf, cap);
        free(text);
        return buf;
    }
    free(text);
    bk_cpu_features f2;
    bk_cpu_features_detect(&f2);
    snprintf(buf, cap, "unknown model (no /proc/cpuinfo); CPUID:%s%s%s%s%s", f2.avx ? " avx" : "", f2.fma ? " fma" : "",
             f2.avx2 ? " avx2" : "", f2.avx512f ? " avx512f" : "", f2.avx512bf16 ? " avx512_bf16" : "");
    return buf;
}

/* Cores the features allow, best first (at most one per level). */
static int candidates(const bk_cpu_features *f, const char *out[6])
{
    int n = 0;
    bool avx512 = f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq;
    if (avx512 && f->avx512bf16) out[n++] = "Cooperlake";
    if (avx512) out[n++] = "SkylakeX";
    if (f->avx2 && f->fma) out[n++] = f->amd ? "Zen" : "Haswell";
    if (f->avx) out[n++] = "Sandybridge";
    if (f->sse42) out[n++] = "Nehalem";
    if (f->sse3) out[n++] = "Prescott";
    return n;
}

static bool in_list(const char *list, const char *name)
{
    if (!list || !name) return false;
    size_t len = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && !strncasecmp(p, name, n)) return true;
        if (!end) break;
        p = end + 1;
    }
    return false;
}

const char *bk_coretype_choose(const bk_cpu_features *f, const char *detected, const char *failed)
{
    const char *c[6];
    int n = candidates(f, c);
    int dl = bk_coretype_level(detected);
    if (detected && dl < 0 && !in_list(failed, detected)) return detected; // a core newer than this table
    for (int i = 0; i < n; i++)                                            // an upgrade
        if (bk_coretype_level(c[i]) > dl && !in_list(failed, c[i])) return c[i];
    if (detected && !in_list(failed, detected)) return detected;
    for (int i = 0; i < n; i++) // below a failed detection
        if (bk_coretype_level(c[i]) < dl && !in_list(failed, c[i])) return c[i];
    return NULL;
}

/* ---- the start-up check -------------------------------------------------------------------- */

static sigjmp_buf check_jmp;

static void check_signal(int sig) { siglongjmp(check_jmp, sig); }

/* op(A) (M, K) times op(B) (K, N) on integers in [-4, 4], alpha and beta powers of two: every
 * partial sum is an exactly representable float, so any correct kernel gives the exact result. */
static bool check_one(int ta, int tb, int M, int N, int K, float alpha, float beta, uint32_t seed)
{
    size_t na = (size_t)M * K, nb = (size_t)K * N, nc = (size_t)M * N;
    float *A = bk_xmalloc(na * sizeof *A), *B = bk_xmalloc(nb * sizeof *B);
    float *C = bk_xmalloc(nc * sizeof *C), *R = bk_xmalloc(nc * sizeof *R);
    uint32_t s = seed;
    for (size_t i = 0; i < na; i++) A[i] = (float)((int)((s = s * 1664525u + 1013904223u) >> 28) % 9 - 4);
    for (size_t i = 0; i < nb; i++) B[i] = (float)((int)((s = s * 1664525u + 1013904223u) >> 28) % 9 - 4);
    for (size_t i = 0; i < nc; i++) C[i] = R[i] = (float)((int)((s = s * 1664525u + 1013904223u) >> 28) % 9 - 4);
    int lda = ta ? M : K, ldb = tb ? K : N;
    bk_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, N);
    bk_gemm_ref(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, R, N);
    bool ok = memcmp(C, R, nc * sizeof *C) == 0;
    free(A), free(B), free(C), free(R);
    return ok;
}

bool bk_coretype_check(void)
{
    const char *inject = getenv("SHARDSIM_BLAS_FAIL_CHECK");
    if (inject && *inject && !strcasecmp(inject, openblas_get_corename())) return false;
    static const int sizes[][5] = {
        /* ta tb   M   N    K: edge tiles in every dimension, K past one cache block */
        {0, 0, 67, 45, 83}, {1, 0, 33, 70, 29}, {0, 1, 40, 36, 520}, {1, 1, 5, 3, 1}, {0, 0, 1, 17, 9},
    };
    int sigs[] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE};
    struct sigaction guard, old[4];
    memset(&guard, 0, sizeof guard);
    guard.sa_handler = check_signal;
    sigemptyset(&guard.sa_mask);
    for (int i = 0; i < 4; i++) sigaction(sigs[i], &guard, &old[i]);
    int threads = openblas_get_num_threads();
    openblas_set_num_threads(1); // the kernels run on this thread, where the guard catches a fault
    volatile bool ok = true;
    if (sigsetjmp(check_jmp, 1) == 0) {
        for (size_t i = 0; ok && i < sizeof sizes / sizeof sizes[0]; i++) {
            const int *z = sizes[i];
            ok = check_one(z[0], z[1], z[2], z[3], z[4], i % 2 ? 0.5f : 1.0f, i == 2 ? 2.0f : 0.0f, 7u + (uint32_t)i);
        }
    } else {
        ok = false; // the kernel faulted: this process will re-execute or exit, never use it
    }
    for (int i = 0; i < 4; i++) sigaction(sigs[i], &old[i], NULL);
    openblas_set_num_threads(threads);
    return ok;
}

/* ---- the selection ------------------------------------------------------------------------- */

static bk_coretype_info INFO;
static bool INFO_DONE;

/* Value of `key=` in a "k=v;k=v" string, into out (empty when absent). */
static void sel_get(const char *sel, const char *key, char *out, size_t cap)
{
    out[0] = '\0';
    size_t len = strlen(key);
    for (const char *p = sel; p && *p;) {
        const char *end = strchr(p, ';');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > len && !strncmp(p, key, len) && p[len] == '=') {
            snprintf(out, cap, "%.*s", (int)(n - len - 1), p + len + 1);
            return;
        }
        if (!end) break;
        p = end + 1;
    }
}

/* Sets OPENBLAS_CORETYPE and the selection state, then replaces this process with a fresh copy
 * of itself; returns only if that is impossible. */
static void reexec(char **argv, const char *core, const char *detected, const char *failed)
{
    if (!argv) return;
    char sel[256];
    snprintf(sel, sizeof sel, "detected=%s;asked=%s;failed=%s", detected, core, failed);
    setenv("OPENBLAS_CORETYPE", core, 1);
    setenv("SHARDSIM_BLAS_SELECTION", sel, 1);
    fflush(NULL);
    execv("/proc/self/exe", argv);
    fprintf(stderr,
            "shardsim: cannot re-execute /proc/self/exe to switch OpenBLAS to %s kernels; continuing "
            "with %s\n",
            core, openblas_get_corename());
}

static void finish(bk_core_how how, const char *detected, const char *failed)
{
    bk_coretype_info *in = &INFO;
    snprintf(in->core, sizeof in->core, "%s", openblas_get_corename());
    snprintf(in->detected, sizeof in->detected, "%s", detected);
    snprintf(in->failed, sizeof in->failed, "%s", failed);
    in->how = how;
    in->checked = true;
    const char *c = in->core, *d = in->detected, *x = in->failed; /* NUL-terminated by snprintf above */
    switch (how) {
    case BK_CORE_OPENBLAS: snprintf(in->summary, sizeof in->summary, "%.31s (OpenBLAS's choice; checked)", c); break;
    case BK_CORE_UPGRADED:
        snprintf(in->summary, sizeof in->summary, "%.31s (OpenBLAS detected %.31s; chosen from CPU features; checked)",
                 c, d);
        break;
    case BK_CORE_FALLBACK:
        snprintf(in->summary, sizeof in->summary,
                 "%.31s (OpenBLAS detected %.31s; %.127s failed the start-up check; checked)", c, d, x);
        break;
    case BK_CORE_USER:
        snprintf(in->summary, sizeof in->summary, "%.31s (OPENBLAS_CORETYPE set by the user; checked)", c);
        break;
    case BK_CORE_IGNORED:
        snprintf(in->summary, sizeof in->summary,
                 "%.31s (OpenBLAS detected %.31s and ignored OPENBLAS_CORETYPE; checked)", c, d);
        break;
    }
    INFO_DONE = true;
}

static void select_core(char **argv)
{
    bk_cpu_features f;
    bk_cpu_features_detect(&f);
    const char *running = openblas_get_corename();
    const char *env = getenv("OPENBLAS_CORETYPE");
    const char *sel = getenv("SHARDSIM_BLAS_SELECTION");
    const char *pretend = getenv("SHARDSIM_BLAS_PRETEND_DETECTED");
    char detected[32], asked[32], failed[128];
    sel_get(sel, "detected", detected, sizeof detected);
    sel_get(sel, "asked", asked, sizeof asked);
    sel_get(sel, "failed", failed, sizeof failed);
    bool ours = env && *asked && !strcasecmp(env, asked) && *detected;
    bool user = !ours && env && *env && !(pretend && *pretend && strcmp(pretend, "0"));
    if (!ours) { // a fresh start: what runs is OpenBLAS's detection (or the user's choice)
        snprintf(detected, sizeof detected, "%s", user ? "" : running);
        asked[0] = failed[0] = '\0';
    }
    bool ignored = false;
    if (!user) {
        const char *want = bk_coretype_choose(&f, detected, failed);
        if (want && strcasecmp(want, running)) {
            if (ours && !strcasecmp(want, asked))
                ignored = true; // we asked for it and OpenBLAS still runs another core
            else reexec(argv, want, detected, failed);
        }
    }
    if (bk_coretype_check()) {
        bk_core_how how = user                            ? BK_CORE_USER
                          : ignored                       ? BK_CORE_IGNORED
                          : *failed                       ? BK_CORE_FALLBACK
                          : strcasecmp(running, detected) ? BK_CORE_UPGRADED
                                                          : BK_CORE_OPENBLAS;
        finish(how, detected, failed);
        return;
    }
    if (user) {
        fprintf(stderr,
                "shardsim: OPENBLAS_CORETYPE=%s: OpenBLAS's %s kernels fail the start-up sgemm check on this "
                "CPU (wrong results or a fault); unset OPENBLAS_CORETYPE to let shardsim choose a core that "
                "passes\n",
                env, running);
        exit(2);
    }
    char more[sizeof failed + 64]; /* the failed list and the running core's name (OpenBLAS names are short) */
    snprintf(more, sizeof more, "%s%s%s", failed, *failed ? "," : "", running);
    const char *next = bk_coretype_choose(&f, detected, more);
    if (!next) {
        fprintf(stderr,
                "shardsim: no OpenBLAS kernel set passes the start-up sgemm check on this CPU (tried %s); "
                "the OpenBLAS installation is broken: reinstall libopenblas0\n",
                more);
        exit(2);
    }
    fprintf(stderr, "shardsim: OpenBLAS's %s kernels fail the start-up sgemm check on this CPU; falling back to %s\n",
            running, next);
    reexec(argv, next, detected, more);
    fprintf(stderr, "shardsim: refusing to run with OpenBLAS kernels that compute wrong results\n");
    exit(2);
}

/* glibc passes (argc, argv, envp) to the executable's constructors. */
__attribute__((constructor)) static void bk_coretype_startup(int argc, char **argv, char **envp)
{
    (void)envp;
    select_core(argc > 0 ? argv : NULL);
}

const bk_coretype_info *bk_coretype_current(void)
{
    if (!INFO_DONE) select_core(NULL);
    return &INFO;
}

/* test_cli_badinput.c — a fixed, seeded corpus of malformed invocations.
 *
 * Each case is one `shardsim` command line (config keys and values, meshes,
 * specs and shapes, YAML files, checkpoint files, output paths), run as a
 * child process with a time limit.  Every case must exit 0, 1 or 2 — never a
 * signal, never the time limit — and a case that fails (exit 1 or 2) must
 * name its input on stderr (the key, the value, the file or the path it
 * broke).  The corpus comes from a seeded generator, so it is the same on
 * every run; SHARDSIM_CORPUS_SHARE=k runs every k-th case (the sanitizer
 * builds run a share).  Children run SHARDSIM_CORPUS_JOBS (default 6) at a
 * time: most cases end in their argument checks, so the run is bounded by
 * process start-up. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/helpers.h"

enum { MAX_ARGS = 24, TIME_LIMIT_S = 60 };

typedef struct {
    const char *cls; /* class name, for the counts */
    int argc;
    char *argv[MAX_ARGS];
    char *needle; /* stderr must contain one of these ('|'-separated) when the exit code is not 0 */
} bad_case;

typedef struct {
    bad_case *c;
    int n, cap;
} corpus;

static char g_dir[64];
static char g_bin[PATH_MAX];
static uint64_t g_rng = 0x5eed2026;

static uint64_t rnd(void)
{
    g_rng = g_rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return g_rng >> 33;
}

static const char *pick(const char *const *a, int n) { return a[rnd() % (uint64_t)n]; }

static char *xstrdup(const char *s)
{
    char *d = strdup(s);
    assert_non_null(d);
    return d;
}

static char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static char *fmt(const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    char *s = NULL;
    assert_true(vasprintf(&s, f, ap) >= 0);
    va_end(ap);
    return s;
}

/* Adds a case: words separated by newlines (a word may hold spaces). */
static void add(corpus *c, const char *cls, const char *needle, const char *words)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 256;
        c->c = realloc(c->c, (size_t)c->cap * sizeof *c->c);
        assert_non_null(c->c);
    }
    bad_case *k = &c->c[c->n++];
    memset(k, 0, sizeof *k);
    k->cls = cls;
    k->needle = xstrdup(needle);
    k->argv[k->argc++] = xstrdup(g_bin);
    char *w = xstrdup(words), *save = NULL;
    for (char *t = strtok_r(w, "\n", &save); t && k->argc < MAX_ARGS - 1; t = strtok_r(NULL, "\n", &save))
        k->argv[k->argc++] = xstrdup(t);
    free(w);
}

/* A tiny Llama: every case that gets past its bad input runs this small. */
#define TINY_MODEL                                                                                                     \
    "model_name=llama2-7b\noverride_model_config=true\nbase_num_decoder_layers=1\nbase_emb_dim=32"                     \
    "\nbase_num_query_heads=2\nbase_num_kv_heads=2\nhead_dim=16\nbase_mlp_dim=64\nvocab_size=64"                       \
    "\nmax_target_length=16\nper_device_batch_size=1"
#define TINY TINY_MODEL "\nsteps=1"

/* ---- the generator ----------------------------------------------------------- */

static const char *const numeric_keys[] = {"vocab_size",
                                           "base_emb_dim",
                                           "base_mlp_dim",
                                           "base_moe_mlp_dim",
                                           "base_num_decoder_layers",
                                           "base_num_query_heads",
                                           "base_num_kv_heads",
                                           "head_dim",
                                           "max_target_length",
                                           "per_device_batch_size",
                                           "first_num_dense_layers",
                                           "num_experts",
                                           "num_experts_per_tok",
                                           "shared_experts",
                                           "q_lora_rank",
                                           "kv_lora_rank",
                                           "qk_nope_head_dim",
                                           "qk_rope_head_dim",
                                           "v_head_dim",
                                           "n_routing_groups",
                                           "topk_routing_group",
                                           "normalization_layer_epsilon",
                                           "rope_max_timescale",
                                           "rope_min_timescale",
                                           "rope_factor",
                                           "beta_fast",
                                           "beta_slow",
                                           "mscale",
                                           "max_position_embeddings",
                                           "original_max_position_embeddings",
                                           "routed_scaling_factor",
                                           "routed_bias_update_rate",
                                           "capacity_factor",
                                           "ragged_buffer_factor",
                                           "load_balance_loss_weight",
                                           "z_loss_multiplier",
                                           "learning_rate",
                                           "learning_rate_final_fraction",
                                           "learning_rate_schedule_steps",
                                           "warmup_steps_fraction",
                                           "adam_b1",
                                           "adam_b2",
                                           "adam_eps",
                                           "adam_eps_root",
                                           "adam_weight_decay",
                                           "gradient_clipping_threshold",
                                           "steps",
                                           "checkpoint_period",
                                           "init_weights_seed",
                                           "data_shuffle_seed",
                                           "num_devices",
                                           "num_slices",
                                           "hbm_limit_gb",
                                           "gradient_accumulation_steps",
                                           "parity_rtol"};
#define N_NUMERIC ((int)(sizeof numeric_keys / sizeof numeric_keys[0]))

static const char *const bad_numbers[] = {"-1",     "0",      "1e30",       "-1e30",
                                          ".nan",   ".inf",   "4294967298", "9223372036854775808",
                                          "abc",    "",       "1.5",        "-9223372036854775809",
                                          "[1, 2]", "{a: 1}", "1e-400",     "0x7fffffff",
                                          "'7'",    "1e309",  "null"};
#define N_BADNUM ((int)(sizeof bad_numbers / sizeof bad_numbers[0]))

static const char *const axes[] = {"diloco",
                                   "data",
                                   "pipeline",
                                   "fsdp",
                                   "fsdp_transpose",
                                   "sequence",
                                   "context",
                                   "context_usp_ulysses",
                                   "context_autoregressive",
                                   "tensor",
                                   "tensor_transpose",
                                   "tensor_sequence",
                                   "expert",
                                   "autoregressive"};

static void gen_keys(corpus *c)
{
    /* every numeric key with every bad value; dry runs of the tiny model when a value passes */
    for (int k = 0; k < N_NUMERIC; k++)
        for (int v = 0; v < N_BADNUM; v++) {
            char *w = fmt("train\n" TINY "\ndry_run=true\n%s=%s", numeric_keys[k], bad_numbers[v]);
            add(c, "config values", numeric_keys[k], w);
            free(w);
        }
    /* unknown, misspelt and malformed keys */
    static const char *const junk[] = {"learning_rat",
                                       "LEARNING_RATE",
                                       "ici_fsdp_paralellism",
                                       "=3",
                                       "a==b",
                                       "=",
                                       "steps==3",
                                       "x.y=1",
                                       "model_name=",
                                       "dtype=float128",
                                       "shard_mode=magic",
                                       "remat_policy=sometimes",
                                       "opt_type=sgd9",
                                       "decoder_block=gpt9",
                                       "attention=flash9",
                                       "logical_axis_rules=[[",
                                       "mesh_axes=[]",
                                       "mesh_axes=[data, data]",
                                       "data_sharding=[[nope]]",
                                       "logical_axis_rules=[['batch', 'nope']]",
                                       "custom_mesh_and_rule=nope",
                                       "model_name=nope",
                                       "model_name=../base",
                                       "model_name=/etc/passwd"};
    for (int i = 0; i < (int)(sizeof junk / sizeof junk[0]); i++)
        for (int cmd = 0; cmd < 3; cmd++) {
            /* each command with the arguments it needs, so that the bad key is what fails */
            char *w = cmd == 0   ? fmt("train\n" TINY "\ndry_run=true\n%s", junk[i])
                      : cmd == 1 ? fmt("dump\n" TINY "\noutput_dir=%s/dumpk\n%s", g_dir, junk[i])
                                 : fmt("parity\n" TINY "\nconfigs=ici_fsdp_parallelism=1\n%s", junk[i]);
            char key[64];
            snprintf(key, sizeof key, "%s", junk[i]);
            char *eq = strchr(key + 1, '=');
            if (eq && key[0] != '=') *eq = 0;
            add(c, "config keys", key[0] == '=' ? "=" : key, w);
            free(w);
        }
    /* random key names */
    for (int i = 0; i < 150; i++) {
        char key[24];
        int len = 1 + (int)(rnd() % 20);
        for (int j = 0; j < len; j++) key[j] = "abcdefghijklmnopqrstuvwxyz_0123456789"[rnd() % 37];
        key[len] = 0;
        char *w = fmt("train\n%s=%d", key, (int)(rnd() % 100));
        add(c, "config keys", key, w);
        free(w);
    }
}

static void gen_meshes(corpus *c)
{
    static const char *const sizes[] = {
        "0", "-2", "3", "7", "4294967298", "513", "1e3", "x", "", "-1", "65536", "2.5", "9999999999999999999999"};
    for (int a = 0; a < 14; a++)
        for (int s = 0; s < 13; s++)
            for (int lvl = 0; lvl < 2; lvl++) {
                char *key = fmt("%s_%s_parallelism", lvl ? "dcn" : "ici", axes[a]);
                char *w = fmt("train\n" TINY "\ndry_run=true\n%s=%s", key, sizes[s]);
                /* the flag, or the mesh axis it sizes ("fsdp=3") */
                /* (MaxText names the pipeline axis 'stage'; context parallelism's sequence
                 * check names the context-parallel size) */
                char *needle = fmt("%s|%s=|stage=|context-parallel size", key, axes[a]);
                add(c, "meshes", needle, w);
                free(needle);
                free(w);
                free(key);
            }
    /* two -1 flags, products over the device limit, slices that do not divide */
    for (int i = 0; i < 60; i++) {
        const char *a = axes[rnd() % 14], *b = axes[rnd() % 14];
        char *w = fmt("train\n" TINY "\ndry_run=true\nici_%s_parallelism=%s\nici_%s_parallelism=%s\nnum_slices=%d", a,
                      pick((const char *const[]){"-1", "2", "64", "512"}, 4), b,
                      pick((const char *const[]){"-1", "3", "16", "1024"}, 4), (int)(rnd() % 5));
        char *needle =
            fmt("ici_%s_parallelism|ici_%s_parallelism|%s=|%s=|num_slices|stage=|context-parallel size", a, b, a, b);
        add(c, "meshes", needle, w);
        free(needle);
        free(w);
    }
    /* explain mesh= strings */
    static const char *const meshes[] = {"data=4294967298",
                                         "data=0",
                                         "data=-1",
                                         "=2",
                                         "data",
                                         "data=2,,fsdp=2",
                                         "data=2,data=2",
                                         "a_very_long_axis_name_that_goes_on_and_on_and_on=2",
                                         "data=2,fsdp=2,tensor=2,expert=2,stage=2,context=2,a=2,b=2,c=2,d=2,e=2,f=2,"
                                         "g=2,h=2,i=2,j=2,k=2",
                                         "data=512,fsdp=2",
                                         "data=2x",
                                         ",",
                                         "data=2,",
                                         "da ta=2",
                                         "data=99999999999"};
    for (int i = 0; i < (int)(sizeof meshes / sizeof meshes[0]); i++) {
        char *w = fmt("explain\nmesh=%s\nshape=8,16\nfrom=P(None,None)\nto=P(None,None)", meshes[i]);
        add(c, "meshes", "mesh", w);
        free(w);
    }
}

static const char *fmt_needle(const char *shape) { return !strcmp(shape, "8,") ? "dims" : shape; }

static void gen_specs(corpus *c)
{
    static const char *const base[] = {"P(('data','fsdp'),None)", "P(None,'tensor')", "P('data',None)", "P(None,None)",
                                       "P(('data','fsdp','tensor'),None)"};
    static const char *const noise[] = {"(",
                                        ")",
                                        "'",
                                        ",",
                                        "P",
                                        "None",
                                        "data",
                                        "'zzz'",
                                        "((",
                                        "))",
                                        " ",
                                        "\"",
                                        "unreduced={'data'}",
                                        "reduced={}",
                                        "\\",
                                        "P(P(",
                                        "'data'",
                                        "'fsdp'"};
    for (int i = 0; i < 300; i++) {
        char spec[160];
        snprintf(spec, sizeof spec, "%s", base[rnd() % 5]);
        int edits = 1 + (int)(rnd() % 3);
        for (int e = 0; e < edits; e++) {
            size_t len = strlen(spec), at = rnd() % (len + 1);
            const char *ins = noise[rnd() % (sizeof noise / sizeof noise[0])];
            if (rnd() % 2 && len > 1) { /* delete a character */
                memmove(spec + at % len, spec + at % len + 1, len - at % len);
            } else if (len + strlen(ins) + 1 < sizeof spec) {
                memmove(spec + at + strlen(ins), spec + at, len - at + 1);
                memcpy(spec + at, ins, strlen(ins));
            }
        }
        int to = (int)(rnd() % 2);
        char *w = fmt("explain\nmesh=data=2,fsdp=2,tensor=2\nshape=8,16\nfrom=%s\nto=%s", to ? "P(None,None)" : spec,
                      to ? spec : "P(None,None)");
        add(c, "specs", spec, w);
        free(w);
    }
    static const char *const shapes[] = {"4611686018427387904,4",
                                         "0,4",
                                         "-8,16",
                                         "8,",
                                         ",",
                                         "",
                                         "8;16",
                                         "8 16",
                                         "1,2,3,4,5,6,7,8,9",
                                         "99999999999999999999",
                                         "8.5,16",
                                         "0x10,16",
                                         "(8,16",
                                         "[8,16]]",
                                         "281474976710657",
                                         "65536,65536,65536,65536"};
    for (int i = 0; i < (int)(sizeof shapes / sizeof shapes[0]); i++)
        for (int j = 0; j < 3; j++) {
            char *w = fmt("explain\nmesh=data=2,fsdp=2\nshape=%s\nfrom=%s\nto=P(None,None)", shapes[i],
                          pick((const char *const[]){"P(None,None)", "P('data',None)", "P(None,'fsdp')"}, 3));
            add(c, "specs", shapes[i][0] ? fmt_needle(shapes[i]) : "shape", w);
            /* ("8," is the shape [8]: then the 2-entry spec is what fails, naming the dims) */
            free(w);
        }
    static const char *const logical[] = {
        "activation_batch,nope", "", ",", "embed", "embed,mlp,heads,kv", "activation_batch,activation_batch"};
    for (int i = 0; i < 6; i++) {
        char *w = fmt("explain\nshape=8,16\nfrom_logical=%s\nto_logical=embed,mlp\nici_fsdp_parallelism=2", logical[i]);
        add(c, "specs", "from_logical", w);
        free(w);
    }
}

static void gen_yaml(corpus *c)
{
    static const char *const bodies[] = {
        "steps: 3\n---\nsteps: 5\n",
        "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\n",
        "steps: [1, 2\n",
        "\tsteps: 3\n",
        "steps: 3\nsteps: 4\n",
        "- a\n- b\n",
        "just a string\n",
        "steps: *nope\n",
        "? [a, b]\n: 3\n",
        "steps: !!binary aGVsbG8=\n",
        "learning_rate: 1e30\n",
        "base_config: /etc/passwd\n",
        "logical_axis_rules: [[1, 2, 3]]\n",
        "mesh_axes: {a: 1}\n",
        "%YAML 9.9\n---\nsteps: 1\n",
        "steps: \"\\xff\"\n",
        "\xff\xfe\x00s\x00t\x00e\x00p\x00s\x00",
        "steps: 3\n...\nsteps: 4\n",
        "{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{",
        "steps: &x 3\nlearning_rate: *x\n",
        "",
        "# only a comment\n",
        "model_name: ../base\n",
        "custom_mesh_and_rule: /proc/nonexistent.yml\n",
    };
    int nb = (int)(sizeof bodies / sizeof bodies[0]);
    for (int i = 0; i < nb; i++)
        for (int how = 0; how < 3; how++) {
            char *path = fmt("%s/y%d.yml", g_dir, i);
            helper_write_file(path, bodies[i], strlen(bodies[i]));
            char *w = how == 0   ? fmt("train\n" TINY "\ndry_run=true\n%s", path)
                      : how == 1 ? fmt("dump\n%s\noutput_dir=%s/dump%d", path, g_dir, i)
                                 : fmt("train\n" TINY "\ndry_run=true\ncustom_mesh_and_rule=%s", path);
            add(c, "yaml files", path, w);
            free(w);
            free(path);
        }
    /* random mutations of a real config */
    const char *good = "steps: 2\nlearning_rate: 1.0e-3\nlogical_axis_rules: [['embed', 'fsdp']]\n"
                       "base_emb_dim: 32\nper_device_batch_size: 1\n";
    for (int i = 0; i < 120; i++) {
        char b[256];
        size_t n = strlen(good);
        memcpy(b, good, n);
        for (int e = 0; e < 1 + (int)(rnd() % 4); e++) b[rnd() % n] = (char)(rnd() % 256);
        char *path = fmt("%s/m%d.yml", g_dir, i);
        helper_write_file(path, b, n);
        char *w = fmt("train\n" TINY "\noverride_model_config=true\ndry_run=true\n%s", path);
        add(c, "yaml files", path, w);
        free(w);
        free(path);
    }
    /* paths that are not files */
    static const char *const notfiles[] = {"/", "/dev/null", "/proc/nonexistent/x.yml", "/proc/self/mem", "/dev/zero"};
    for (int i = 0; i < 5; i++) {
        char *w = fmt("train\n%s", notfiles[i]);
        add(c, "yaml files", notfiles[i], w);
        free(w);
    }
}

static void gen_checkpoints(corpus *c)
{
    /* a real checkpoint of the tiny model, then broken copies of it */
    char *ck = fmt("%s/ck", g_dir);
    char *cmd = fmt("%s train %s checkpoint_dir=%s checkpoint_period=1 >/dev/null 2>&1", g_bin,
                    "model_name=llama2-7b override_model_config=true base_num_decoder_layers=1 base_emb_dim=32 "
                    "base_num_query_heads=2 base_num_kv_heads=2 head_dim=16 base_mlp_dim=64 vocab_size=64 "
                    "max_target_length=16 per_device_batch_size=1 steps=1",
                    ck);
    assert_int_equal(system(cmd), 0);
    free(cmd);
    char *src = fmt("%s/step_0.safetensors", ck); /* after the one step (MaxText numbers it 0) */
    FILE *f = fopen(src, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n), *m = malloc((size_t)n + 64);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | b[i];
    for (int i = 0; i < 110; i++) {
        memcpy(m, b, (size_t)n);
        long len = n;
        switch (i % 6) {
        case 0: /* bytes of the header */
            for (int e = 0; e < 1 + (int)(rnd() % 3); e++) m[8 + rnd() % hl] = (unsigned char)rnd();
            break;
        case 1: /* bytes of the data */
            m[8 + hl + rnd() % ((uint64_t)n - 8 - hl)] ^= (unsigned char)(1u << (rnd() % 8));
            break;
        case 2: /* truncated */ len = (long)(rnd() % (uint64_t)n); break;
        case 3: /* the length field */ m[rnd() % 8] = (unsigned char)rnd(); break;
        case 4: /* trailing bytes */
            memset(m + n, 0, 64);
            len = n + 1 + (long)(rnd() % 63);
            break;
        case 5: /* a digit of an offset changed */
        {
            char *p = strstr((char *)m + 8, "data_offsets\":[");
            for (int skip = (int)(rnd() % 20); p && skip > 0; skip--) {
                char *q = strstr(p + 1, "data_offsets\":[");
                if (q && q < (char *)m + 8 + hl) p = q;
            }
            if (p) {
                p += strlen("data_offsets\":[");
                if (*p >= '0' && *p <= '9') *p = (char)('0' + (*p - '0' + 1 + rnd() % 9) % 10);
            }
            break;
        }
        }
        char *path = fmt("%s/c%d.safetensors", g_dir, i);
        helper_write_file(path, m, (size_t)len);
        char *w = fmt("train\n" TINY "\nload_parameters_path=%s", path);
        add(c, "checkpoint files", path, w);
        free(w);
        /* the same file resumed from: as load_full_state_path, and as the latest step of a
         * checkpoint_dir (steps=3: a file that passes its checks trains steps 1 and 2) */
        if (i % 2 == 0) {
            w = fmt("train\n" TINY_MODEL "\nsteps=3\nload_full_state_path=%s", path);
            add(c, "resume", path, w);
            free(w);
        }
        if (i % 3 == 0) {
            char *dir = fmt("%s/r%d", g_dir, i), *latest = fmt("%s/r%d/step_0.safetensors", g_dir, i);
            assert_int_equal(mkdir(dir, 0755), 0);
            helper_write_file(latest, m, (size_t)len);
            w = fmt("train\n" TINY_MODEL "\nsteps=3\ncheckpoint_dir=%s", dir);
            add(c, "resume", latest, w);
            free(w);
            free(dir);
            free(latest);
        }
        free(path);
    }
    /* a whole checkpoint, resumed by a run that has nothing left to train or that sets a
     * contradiction */
    static const char *const resume_words[] = {"steps=1", "steps=3\nenable_checkpointing=false",
                                               "steps=3\nload_parameters_path=/nonexistent"};
    for (int i = 0; i < 3; i++) {
        char *w = fmt("train\n" TINY_MODEL "\n%s\nload_full_state_path=%s", resume_words[i], src);
        add(c, "resume", i == 0 ? src : i == 1 ? "enable_checkpointing" : "load_parameters_path", w);
        free(w);
    }
    /* things that are not checkpoints */
    static const char *const notck[] = {"/dev/null", "/", "/proc/nonexistent.safetensors", "/etc/hostname"};
    for (int i = 0; i < 4; i++) {
        char *w = fmt("train\n" TINY "\nload_parameters_path=%s", notck[i]);
        add(c, "checkpoint files", notck[i], w);
        free(w);
        w = fmt("train\n" TINY_MODEL "\nsteps=3\nload_full_state_path=%s", notck[i]);
        add(c, "resume", notck[i], w);
        free(w);
    }
    char *tmp = fmt("%s.tmp", src);
    helper_write_file(tmp, b, (size_t)n);
    char *w = fmt("train\n" TINY "\nload_parameters_path=%s", tmp);
    add(c, "checkpoint files", tmp, w);
    free(w);
    free(tmp);
    free(src);
    free(ck);
    free(b);
    free(m);
}

static void gen_outputs(corpus *c)
{
    char *file = fmt("%s/plainfile", g_dir);
    helper_write_file(file, "x", 1);
    char longp[600];
    memset(longp, 'a', sizeof longp - 1);
    longp[sizeof longp - 1] = 0;
    longp[0] = '/';
    /* none of these can be created, even by root: the corpus never writes outside its directory */
    const char *outs[] = {"/dev/null", "/dev/null/x",   "/proc/x", file, "/proc/nonexistent/deep/dir", longp,
                          "",          "/sys/kernel/x", "/proc"};
    char *under = fmt("%s/x", file);
    outs[2] = under;
    for (int i = 0; i < (int)(sizeof outs / sizeof outs[0]); i++) {
        static const char *const cmds[] = {"train\n" TINY, "dump\n" TINY, "train\n" TINY "\ndry_run=true"};
        for (int k = 0; k < 3; k++) {
            char *w = fmt("%s\noutput_dir=%s", cmds[k], outs[i]);
            char needle[40];
            snprintf(needle, sizeof needle, "%s", *outs[i] ? outs[i] : "output_dir");
            add(c, "output paths", needle, w);
            free(w);
            w = fmt("%s\ncheckpoint_dir=%s\ncheckpoint_period=1\noutput_dir=%s/out%d", cmds[k], outs[i], g_dir, k);
            add(c, "output paths", needle, w);
            free(w);
        }
    }
    free(under);
    free(file);
}

/* ---- the runner --------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int idx;
    time_t start;
    char err_path[96];
} slot;

static void start(const bad_case *k, int idx, slot *s)
{
    snprintf(s->err_path, sizeof s->err_path, "%s/err.%d", g_dir, idx);
    s->idx = idx;
    s->start = time(NULL);
    s->pid = fork();
    assert_true(s->pid >= 0);
    if (s->pid == 0) {
        int fd = open(s->err_path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
        int nul = open("/dev/null", O_WRONLY);
        if (fd < 0 || nul < 0) _exit(120);
        dup2(nul, 1);
        dup2(fd, 2);
        /* under the sanitizer builds a finding must not pass for an exit 1 */
        setenv("ASAN_OPTIONS", "exitcode=99:detect_leaks=0", 1);
        setenv("UBSAN_OPTIONS", "exitcode=99:halt_on_error=1", 1);
        execv(k->argv[0], k->argv);
        _exit(121);
    }
}

/* Does err contain one of the '|'-separated needles? */
static int names_input(const char *err, const char *needles)
{
    char *w = xstrdup(needles), *save = NULL;
    int found = 0;
    for (char *t = strtok_r(w, "|", &save); t && !found; t = strtok_r(NULL, "|", &save)) found = strstr(err, t) != NULL;
    free(w);
    return found;
}

static void test_corpus(void **state)
{
    (void)state;
    corpus c = {0};
    gen_keys(&c);
    gen_meshes(&c);
    gen_specs(&c);
    gen_yaml(&c);
    gen_checkpoints(&c);
    gen_outputs(&c);
    int share = getenv("SHARDSIM_CORPUS_SHARE") ? atoi(getenv("SHARDSIM_CORPUS_SHARE")) : 1;
    int jobs = getenv("SHARDSIM_CORPUS_JOBS") ? atoi(getenv("SHARDSIM_CORPUS_JOBS")) : 6;
    if (share < 1) share = 1;
    if (jobs < 1 || jobs > 64) jobs = 6;
    print_message("  corpus: %d cases (running every %d-th, %d at a time)\n", c.n, share, jobs);
    assert_true(c.n >= 2000);

    const char *classes[12] = {0};
    int ncls = 0, counts[12][4] = {{0}}; /* exit 0, 1, 2, other */
    int failures = 0;
    slot run[64];
    int active = 0, next = 0;
    while (next < c.n || active) {
        while (active < jobs && next < c.n) {
            if (next % share == 0) start(&c.c[next], next, &run[active++]);
            next++;
        }
        if (!active) continue;
        int ws;
        pid_t pid = waitpid(-1, &ws, WNOHANG);
        if (pid == 0) {
            /* nobody finished: enforce the time limit, then sleep a little */
            for (int i = 0; i < active; i++)
                if (time(NULL) - run[i].start > TIME_LIMIT_S) kill(run[i].pid, SIGKILL);
            usleep(2000);
            continue;
        }
        assert_true(pid > 0);
        int i = 0;
        while (i < active && run[i].pid != pid) i++;
        assert_true(i < active);
        slot s = run[i];
        run[i] = run[--active];
        const bad_case *k = &c.c[s.idx];
        int ci = 0;
        while (ci < ncls && strcmp(classes[ci], k->cls)) ci++;
        if (ci == ncls) classes[ncls++] = k->cls;
        char *err = helper_read_file_opt(s.err_path, NULL); /* NULL: the child wrote nothing */
        if (!err) err = xstrdup("");
        unlink(s.err_path);
        int rc = WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
        counts[ci][rc >= 0 && rc <= 2 ? rc : 3]++;
        const char *why = NULL;
        if (WIFSIGNALED(ws)) why = time(NULL) - s.start > TIME_LIMIT_S ? "timed out" : "killed by a signal";
        else if (rc > 2) why = "bad exit code";
        else if (rc != 0 && !names_input(err, k->needle)) why = "message does not name the input";
        if (why) {
            failures++;
            if (failures <= 1000) {
                fprintf(stderr, "CASE %d (%s): %s (exit %d, signal %d); needle '%s'; argv:", s.idx, k->cls, why, rc,
                        WIFSIGNALED(ws) ? WTERMSIG(ws) : 0, k->needle);
                for (int a = 1; a < k->argc; a++) fprintf(stderr, " '%s'", k->argv[a]);
                fprintf(stderr, "\n  stderr: %.300s\n", err);
            }
        }
        free(err);
    }
    int tot[4] = {0};
    for (int i = 0; i < ncls; i++) {
        print_message("  %-18s exit0 %4d  exit1 %4d  exit2 %4d  other %d\n", classes[i], counts[i][0], counts[i][1],
                      counts[i][2], counts[i][3]);
        for (int j = 0; j < 4; j++) tot[j] += counts[i][j];
    }
    print_message("  %-18s exit0 %4d  exit1 %4d  exit2 %4d  other %d\n", "total", tot[0], tot[1], tot[2], tot[3]);
    for (int i = 0; i < c.n; i++) {
        for (int a = 0; a < c.c[i].argc; a++) free(c.c[i].argv[a]);
        free(c.c[i].needle);
    }
    free(c.c);
    if (failures) fail_msg("%d of the corpus's cases crashed, hung, or did not name their input", failures);
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/shardsim_corpus_XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    /* the shardsim binary of this build: <BUILD>/tests/<me> -> <BUILD>/shardsim */
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = 0;
    char *d = dirname(dirname(self));
    snprintf(g_bin, sizeof g_bin, "%s/shardsim", d);
    return access(g_bin, X_OK);
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

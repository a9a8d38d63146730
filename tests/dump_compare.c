/* dump_compare.c — test support: shardsim's dump against a MaxText release's (see dump_compare.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "config/json.h"
#include "tests/dump_compare.h"
#include "tests/helpers.h"

/* 0.2.5 dumps an NNX train state: ['model']/..., ['optimizer']/['opt_state']/[0]/['mu']/..., each
 * leaf ending in /.value; ours (and e591f30c's) name the Linen state: .params/['params']/...,
 * .opt_state/[0]/.mu/['params']/..., .step.  Both are brought to params/..., mu/..., nu/...,
 * count, step with the brackets removed. */
static void norm_key(const char *k, char *out, size_t cap)
{
    static const char *const pre[][2] = {
        {"['model']/", "params/"},
        {".params/['params']/", "params/"},
        {".opt_state/[0]/.mu/['params']/", "mu/"},
        {".opt_state/[0]/.nu/['params']/", "nu/"},
        {"['optimizer']/['opt_state']/[0]/['mu']/", "mu/"},
        {"['optimizer']/['opt_state']/[0]/['nu']/", "nu/"},
    };
    char buf[512];
    snprintf(buf, sizeof buf, "%s", k);
    size_t n = strlen(buf);
    if (n > 7 && !strcmp(buf + n - 7, "/.value")) buf[n - 7] = '\0';
    const char *rest = buf, *head = "";
    for (size_t i = 0; i < sizeof pre / sizeof pre[0]; i++)
        if (!strncmp(buf, pre[i][0], strlen(pre[i][0]))) {
            rest = buf + strlen(pre[i][0]);
            head = pre[i][1];
            break;
        }
    if (!strcmp(buf, ".step") || !strcmp(buf, "['optimizer']/['step']")) rest = "step", head = "";
    if (strstr(buf, "opt_state") && strstr(buf, "count")) rest = "count", head = "";
    size_t o = (size_t)snprintf(out, cap, "%s", head);
    for (const char *c = rest; *c && o + 1 < cap; c++) {
        if ((c[0] == '[' && c[1] == '\'') || (c[0] == '\'' && c[1] == ']')) {
            c++;
            continue;
        }
        out[o++] = *c;
    }
    out[o] = '\0';
}

/* A spec entry without the mesh axes of size 1 (they shard nothing); trailing Nones dropped. */
static void spec_text(const cfg_json *spec, const cfg_json *mesh_sizes, char *out, size_t cap)
{
    char ent[16][128];
    int n = 0;
    for (int i = 0; spec && i < spec->n && n < 16; i++) {
        const cfg_json *e = &spec->items[i];
        ent[n][0] = '\0';
        size_t o = 0;
        int cnt = 0;
        for (int j = 0; j < (e->kind == CFG_JSON_ARRAY ? e->n : e->kind == CFG_JSON_STRING ? 1 : 0); j++) {
            const char *ax = e->kind == CFG_JSON_ARRAY ? e->items[j].str : e->str;
            const cfg_json *sz = cfg_json_get(mesh_sizes, ax);
            if (sz && sz->number == 1) continue;
            o += (size_t)snprintf(ent[n] + o, sizeof ent[n] - o, "%s%s", cnt++ ? "," : "", ax);
        }
        n++;
    }
    while (n && !ent[n - 1][0]) n--;
    size_t o = 0;
    out[0] = '\0';
    for (int i = 0; i < n; i++) o += (size_t)snprintf(out + o, cap - o, "%s(%s)", i ? " " : "", ent[i]);
}

int dump_compare_025(const char *what, const char *gdir, int nargs, const char *const *args)
{
    return dump_compare_release("0.2.5", what, gdir, nargs, args);
}

int dump_compare_release(const char *rel, const char *what, const char *gdir, int nargs, const char *const *args)
{
    char tmpl[] = "/tmp/shardsim_dump_XXXXXX";
    char *tmp = mkdtemp(tmpl);
    assert_non_null(tmp);
    char outdir[256];
    snprintf(outdir, sizeof outdir, "output_dir=%s", tmp);
    char *argv[24];
    int argc = 0;
    if (nargs > 22) fail_msg("%s: %d dump arguments, at most 22", what, nargs);
    for (int i = 0; i < nargs; i++) argv[argc++] = (char *)args[i];
    argv[argc++] = outdir;
    FILE *devnull = fopen("/dev/null", "w");
    int rc = cli_dump(argc, argv, devnull, stderr);
    fclose(devnull);
    if (rc) fail_msg("%s: shardsim dump failed (exit %d)", what, rc);
    char p[1600];
    cfg_json *ours[2], *gold[2];
    static const char *const of[2] = {"named_shardings.json", "logical_shardings.json"};
    static const char *const gf[2] = {"named_shardings.json", "logical_names.json"};
    for (int f = 0; f < 2; f++) {
        snprintf(p, sizeof p, "%s/%s", tmp, of[f]);
        ours[f] = helper_read_json(NULL, p);
        snprintf(p, sizeof p, "%s/%s", gdir, gf[f]);
        gold[f] = helper_read_json(NULL, p);
    }
    static const char *const rm[3] = {"named_shardings.json", "logical_shardings.json", "input_shardings.json"};
    for (int f = 0; f < 3; f++) {
        snprintf(p, sizeof p, "%s/%s", tmp, rm[f]);
        unlink(p);
    }
    rmdir(tmp);
    int compared = 0, nnx_only = 0;
    for (int i = 0; i < gold[0]->n; i++) {
        char gk[512];
        norm_key(gold[0]->keys[i], gk, sizeof gk);
        if (strstr(gk, "rngs/") || !strcmp(gk, "count")) { /* NNX rng streams, optax counts */
            nnx_only++;
            continue;
        }
        const cfg_json *o = NULL, *ol = NULL;
        for (int j = 0; j < ours[0]->n && !o; j++) {
            char ok[512];
            norm_key(ours[0]->keys[j], ok, sizeof ok);
            if (!strcmp(ok, gk)) o = &ours[0]->items[j], ol = cfg_json_get(ours[1], ours[0]->keys[j]);
        }
        if (!o) fail_msg("%s: MaxText %s has %s, we do not write it", what, rel, gk);
        const cfg_json *g = &gold[0]->items[i];
        char a[512], b[512];
        spec_text(cfg_json_get(o, "partition_spec"), cfg_json_get(cfg_json_get(o, "mesh"), "shape"), a, sizeof a);
        spec_text(cfg_json_get(g, "partition_spec"), cfg_json_get(cfg_json_get(g, "mesh"), "shape"), b, sizeof b);
        if (strcmp(a, b) || !cfg_json_equal(cfg_json_get(o, "shape"), cfg_json_get(g, "shape")))
            fail_msg("%s: %s: ours %s, MaxText %s %s", what, gk, a, rel, b);
        /* logical names: 0.2.5's (embed_attn, embed_router ...), no mapping */
        const cfg_json *gl = cfg_json_get(gold[1], gold[0]->keys[i]);
        const cfg_json *gs = gl ? cfg_json_get(gl, "partition_spec") : NULL,
                       *os = ol ? cfg_json_get(ol, "partition_spec") : NULL;
        bool g_none = !gs || gs->kind == CFG_JSON_NULL || (gs->kind == CFG_JSON_ARRAY && gs->n == 0);
        bool o_none = !os || os->kind == CFG_JSON_NULL || (os->kind == CFG_JSON_ARRAY && os->n == 0);
        if (gl && ol && !(g_none && o_none) && !(gs && os && cfg_json_equal(gs, os))) /* None = P() */
            fail_msg("%s: %s: logical names differ from MaxText %s's", what, gk, rel);
        compared++;
    }
    for (int j = 0; j < ours[0]->n; j++) { /* and nothing of ours is missing there */
        char ok[512];
        norm_key(ours[0]->keys[j], ok, sizeof ok);
        bool found = !strcmp(ok, "count");
        for (int i = 0; i < gold[0]->n && !found; i++) {
            char gk[512];
            norm_key(gold[0]->keys[i], gk, sizeof gk);
            found = !strcmp(ok, gk);
        }
        if (!found) fail_msg("%s: we write %s, MaxText %s has no such leaf", what, ok, rel);
    }
    printf("  %s %-76s named %d identical (+%d NNX-only leaves)\n", rel, what, compared, nnx_only);
    for (int f = 0; f < 2; f++) {
        cfg_json_free(ours[f]);
        cfg_json_free(gold[f]);
    }
    return compared;
}

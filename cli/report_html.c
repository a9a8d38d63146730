/* report_html.c — report.html: one self-contained page that draws a run.
 *
 * The page is a template compiled into the program (report_template.html,
 * pulled in with the assembler's .incbin, so a copied binary still writes
 * it) with one JSON block put in its place holder.  That block is assembled
 * from the artifacts already written to the output directory, so train and
 * parity share one path and the page shows exactly what the files hold:
 *
 *   {"run": <run.json>, "metrics": <metrics.json>, "parity": <parity.json>,
 *    "traffic": [{"op", "axes", "phase", "bytes"}...]      from traffic.csv,
 *    "layers":  [{"layer", "bytes"}...]                     from collectives.csv,
 *    "sharding": {"mesh", "params": [{"name", "shape", "spec", "logical"}...],
 *                 "activations": [{"name", "logical", "spec"}...]}
 *                         from named_, logical_ and input_shardings.json}
 *
 * plan's page holds {"plan": <plan.json>} alone (cli_write_plan_report_html).
 *
 * Missing files leave their member out (parity writes no metrics).  Bytes are
 * per device: traffic.csv's mean column, and the collectives' bytes sent
 * summed per layer over all devices and divided by the device count.  The
 * block is built and dumped by the one JSON writer (config/json.h); every '<'
 * of its text (only ever inside a string) is then written as \u003c, the same
 * JSON string, so no text can close the script element early. */
#include "cli/report_html.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/artifacts.h"
#include "config/json.h"

#include <jansson.h>

/* The template, NUL-terminated (see the top of this file). */
extern const char cli_report_template[];
__asm__(".section .rodata\n"
        ".global cli_report_template\n"
        ".type cli_report_template, @object\n"
        "cli_report_template:\n"
        ".incbin \"cli/report_template.html\"\n"
        ".byte 0\n"
        ".previous\n");

/* dir/name read whole into a NUL-terminated buffer; NULL if it does not exist. */
static char *read_whole(const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
        n += got;
        if (n + 1 == cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
            } else buf = nb;
        }
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    return buf;
}

/* Splits a CSV line in place on commas (fields here never hold commas or
 * quotes: ops, axis names joined by '+', phases, numbers, tags). */
static int split_csv(char *line, char **field, int cap)
{
    int n = 0;
    for (char *p = line; n < cap;) {
        field[n++] = p;
        char *c = strchr(p, ',');
        if (!c) break;
        *c = '\0';
        p = c + 1;
    }
    return n;
}

static int column(char **head, int n, const char *a, const char *b)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(head[i], a) || (b && !strcmp(head[i], b))) return i;
    return -1;
}

/* JSON text into the HTML: '<' (inside strings only) as \u003c. */
static void put_html_safe(FILE *f, const char *text)
{
    for (const char *p = text; *p; p++) {
        if (*p == '<') fputs("\\u003c", f);
        else fputc(*p, f);
    }
}

static sim_status put_traffic(cfg_jw *w, char *csv)
{
    char *save = NULL, *line = strtok_r(csv, "\n", &save);
    if (!line) return SIM_OK;
    char *head[32];
    int nh = split_csv(line, head, 32);
    int c_op = column(head, nh, "op", NULL), c_axes = column(head, nh, "axes", "mesh_axes");
    int c_phase = column(head, nh, "phase", NULL), c_bytes = column(head, nh, "bytes_per_device_mean", NULL);
    if (c_op < 0 || c_axes < 0 || c_phase < 0 || c_bytes < 0)
        return sim_err(SIM_ERR_INTERNAL,
                       "report.html: traffic.csv lacks the op/axes/phase/bytes_per_device_mean columns");
    cfg_jw_key(w, "traffic");
    cfg_jw_arr(w);
    while ((line = strtok_r(NULL, "\n", &save))) {
        char *fl[32];
        int n = split_csv(line, fl, 32);
        if (n < nh || !strcmp(fl[c_op], "total")) continue;
        cfg_jw_obj(w);
        cfg_jw_key(w, "op");
        cfg_jw_str(w, fl[c_op]);
        cfg_jw_key(w, "axes");
        cfg_jw_str(w, fl[c_axes]);
        cfg_jw_key(w, "phase");
        cfg_jw_str(w, fl[c_phase]);
        cfg_jw_key(w, "bytes");
        cfg_jw_num(w, strtod(fl[c_bytes], NULL), 17);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    return SIM_OK;
}

/* The layer a collective's tag belongs to: the tag up to its "layers_N"
 * component ("decoder/layers_3/mlp/wi" -> "decoder/layers_3"; also
 * dense_layers_N, moe_layers_N), else its first two components; the
 * weight-gradient reductions ("grad/<parameter>") are one row, since a
 * stacked parameter's gradient is reduced once for all its layers. */
static void layer_of(const char *tag, char *out, size_t cap)
{
    if (!strncmp(tag, "grad/", 5)) { /* one per (stacked) parameter, not per layer */
        snprintf(out, cap, "weight-gradient reductions");
        return;
    }
    const char *p = tag, *end = NULL;
    for (int comp = 0; !end; comp++) {
        const char *slash = strchr(p, '/');
        const char *stop = slash ? slash : p + strlen(p);
        const char *hit = strstr(p, "layers_");
        if ((hit && hit < stop && hit[7] >= '0' && hit[7] <= '9') || comp == 1 || !slash) end = stop;
        else p = slash + 1;
    }
    size_t n = (size_t)(end - tag);
    if (n >= cap) n = cap - 1;
    memcpy(out, tag, n);
    out[n] = '\0';
}

typedef struct {
    char name[160];
    double bytes;
} layer_sum;

static sim_status put_layers(cfg_jw *w, char *csv)
{
    char *save = NULL, *line = strtok_r(csv, "\n", &save);
    if (!line) return SIM_OK;
    char *head[32];
    int nh = split_csv(line, head, 32);
    int c_dev = column(head, nh, "device", NULL), c_tag = column(head, nh, "tag", NULL);
    int c_sent = column(head, nh, "bytes_sent", NULL);
    if (c_dev < 0 || c_tag < 0 || c_sent < 0)
        return sim_err(SIM_ERR_INTERNAL, "report.html: collectives.csv lacks the device/tag/bytes_sent columns");
    int cap = 64, n = 0;
    long max_dev = -1;
    layer_sum *ls = malloc((size_t)cap * sizeof *ls);
    if (!ls) return sim_err(SIM_ERR_OOM, "report.html: out of host memory");
    while ((line = strtok_r(NULL, "\n", &save))) {
        char *fl[32];
        if (split_csv(line, fl, 32) < nh) continue;
        long dev = strtol(fl[c_dev], NULL, 10);
        if (dev > max_dev) max_dev = dev;
        char name[160];
        layer_of(fl[c_tag], name, sizeof name);
        int k = n - 1; /* records of one layer come together: look at the last first */
        if (k < 0 || strcmp(ls[k].name, name))
            for (k = 0; k < n && strcmp(ls[k].name, name); k++) {}
        if (k == n) {
            if (n == cap) {
                layer_sum *nl = realloc(ls, (size_t)(cap *= 2) * sizeof *ls);
                if (!nl) {
                    free(ls);
                    return sim_err(SIM_ERR_OOM, "report.html: out of host memory");
                }
                ls = nl;
            }
            snprintf(ls[n].name, sizeof ls[n].name, "%s", name);
            ls[n++].bytes = 0;
        }
        ls[k].bytes += strtod(fl[c_sent], NULL);
    }
    cfg_jw_key(w, "layers");
    cfg_jw_arr(w);
    for (int i = 0; i < n; i++) {
        cfg_jw_obj(w);
        cfg_jw_key(w, "layer");
        cfg_jw_str(w, ls[i].name);
        cfg_jw_key(w, "bytes");
        cfg_jw_num(w, ls[i].bytes / (double)(max_dev + 1), 17);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    cfg_jw_key(w, "layers_devices");
    cfg_jw_int(w, max_dev + 1);
    free(ls);
    return SIM_OK;
}

/* ".params/['params']/['decoder']/['layers']/['mlp']/['wi_0']/['kernel']" -> "decoder/layers/mlp/wi_0/kernel" */
static void param_name(const char *key, char *out, size_t cap)
{
    const char *p = key;
    if (!strncmp(p, ".params/['params']/", 19)) p += 19;
    size_t n = 0;
    for (; *p && n + 1 < cap; p++)
        if (*p != '[' && *p != ']' && *p != '\'') out[n++] = *p;
    out[n] = '\0';
}

/* The "sharding" member: the mesh, every parameter (named_shardings.json's physical spec,
 * logical_shardings.json's logical names, the global shape) and the activations as MaxText's
 * debug_sharding logs them (input_shardings.json: "name: dtype[shape]", the logical names and
 * the PartitionSpec as Python prints them; the page parses those two).  Parameters only: the
 * optimizer state repeats their specs. */
static sim_status put_sharding(cfg_jw *w, const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/named_shardings.json", dir);
    json_t *named = json_load_file(path, 0, NULL);
    if (!named) return SIM_OK; /* no dump in this directory (parity) */
    snprintf(path, sizeof path, "%s/logical_shardings.json", dir);
    json_t *logical = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/input_shardings.json", dir);
    json_t *inputs = json_load_file(path, 0, NULL);
    const char *key;
    json_t *v;
    cfg_jw_key(w, "sharding");
    cfg_jw_obj(w);
    json_object_foreach(named, key, v) if (json_object_get(v, "mesh"))
    { /* the first entry's mesh that names one */
        cfg_jw_key(w, "mesh");
        cfg_jw_tree(w, json_incref(json_object_get(v, "mesh")));
        break;
    }
    /* a member read from a dump, as it is (left out when absent) */
#define PUT_READ(k, x)                                                                                                 \
    do {                                                                                                               \
        json_t *x_ = (x);                                                                                              \
        if (!x_) break;                                                                                                \
        cfg_jw_key(w, k);                                                                                              \
        cfg_jw_tree(w, json_incref(x_));                                                                               \
    } while (0)
    cfg_jw_key(w, "params");
    cfg_jw_arr(w);
    json_object_foreach(named, key, v)
    {
        if (strncmp(key, ".params/", 8)) continue;
        char name[1024];
        param_name(key, name, sizeof name);
        cfg_jw_obj(w);
        cfg_jw_key(w, "name");
        cfg_jw_str(w, name);
        PUT_READ("shape", json_object_get(v, "shape"));
        PUT_READ("spec", json_object_get(v, "partition_spec"));
        json_t *l = logical ? json_object_get(json_object_get(logical, key), "partition_spec") : NULL;
        cfg_jw_key(w, "logical");
        if (l) cfg_jw_tree(w, json_incref(l));
        else cfg_jw_null(w);
        cfg_jw_end(w);
    }
    cfg_jw_end(w);
    cfg_jw_key(w, "activations");
    cfg_jw_arr(w);
    json_t *list = inputs ? json_object_get(inputs, "Activation Sharding Dump") : NULL;
    size_t i;
    json_t *item;
    json_array_foreach(list, i, item)
    {
        json_object_foreach(item, key, v)
        {
            cfg_jw_obj(w);
            cfg_jw_key(w, "name");
            cfg_jw_str(w, key);
            PUT_READ("logical", json_object_get(v, "logic_axes"));
            PUT_READ("spec", json_object_get(v, "PartitionSpec"));
            cfg_jw_end(w);
        }
    }
    cfg_jw_end(w);
#undef PUT_READ
    cfg_jw_end(w);
    json_decref(named);
    json_decref(logical);
    json_decref(inputs);
    return SIM_OK;
}

typedef struct {
    const char *dir;
    bool plan; /* plan's page: plan.json alone */
} report_arg;

/* An artifact of the directory (written by this program) as a JSON value, or NULL when absent. */
static sim_status read_artifact(const char *dir, const char *name, json_t **out)
{
    *out = NULL;
    char *text = read_whole(dir, name);
    if (!text) return SIM_OK;
    json_error_t jerr;
    *out = json_loads(text, 0, &jerr);
    free(text);
    if (!*out)
        return sim_err(SIM_ERR_INTERNAL, "report.html: %s/%s is not the JSON this program wrote (line %d: %s)", dir,
                       name, jerr.line, jerr.text);
    return SIM_OK;
}

static sim_status write_report(FILE *f, void *argp)
{
    const report_arg *a = argp;
    const char *tpl = cli_report_template, *mark = strstr(tpl, "@DATA@");
    SIM_ASSERT(mark);
    static const char *const json_files[][2] = {
        {"run", "run.json"}, {"metrics", "metrics.json"}, {"parity", "parity.json"}};
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "format");
    cfg_jw_int(&w, 1);
    char *traffic = NULL, *coll = NULL, *text = NULL;
    sim_status st;
    if (a->plan) { /* plan's page: plan.json alone */
        json_t *v;
        SIM_TRY_GOTO(read_artifact(a->dir, "plan.json", &v), st, fail);
        if (!v) SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "report.html: %s/plan.json cannot be read", a->dir), st, fail);
        cfg_jw_key(&w, "plan");
        cfg_jw_tree(&w, v);
    }
    for (size_t i = 0; !a->plan && i < sizeof json_files / sizeof json_files[0]; i++) {
        json_t *v;
        SIM_TRY_GOTO(read_artifact(a->dir, json_files[i][1], &v), st, fail);
        if (!v) continue;
        cfg_jw_key(&w, json_files[i][0]);
        cfg_jw_tree(&w, v);
    }
    traffic = a->plan ? NULL : read_whole(a->dir, "traffic.csv");
    if (traffic) SIM_TRY_GOTO(put_traffic(&w, traffic), st, fail);
    coll = a->plan ? NULL : read_whole(a->dir, "collectives.csv");
    if (coll) SIM_TRY_GOTO(put_layers(&w, coll), st, fail);
    if (!a->plan) SIM_TRY_GOTO(put_sharding(&w, a->dir), st, fail);
    cfg_jw_end(&w);
    text = cfg_jw_dumps(&w, CFG_JW_LINE, 17);
    fwrite(tpl, 1, (size_t)(mark - tpl), f);
    put_html_safe(f, text);
    fputs(mark + strlen("@DATA@"), f);
fail:
    if (st != SIM_OK) cfg_jw_discard(&w);
    free(text);
    free(traffic);
    free(coll);
    return st;
}

sim_status cli_write_report_html(const char *dir)
{
    report_arg a = {dir, false};
    return cli_artifact_write(dir, "report.html", write_report, &a);
}

sim_status cli_write_plan_report_html(const char *dir)
{
    report_arg a = {dir, true};
    return cli_artifact_write(dir, "report.html", write_report, &a);
}

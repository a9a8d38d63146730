/* yaml.c — YAML files and command-line overrides read into value trees (internal.h).
 *
 * Files are read with libyaml's document API (every node keeps file:line), bounded in size, depth
 * and alias expansion; a second document in a file is refused.  An override key=value is a YAML
 * flow list or map when it starts with [ or {, a string when quoted, else its text verbatim. */
#include "config/internal.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <yaml.h>

const char cfg_cli_source[] = "command line";

enum { YAML_MAX_DEPTH = 64 };

/* Bounds of one YAML input.  Aliases make a document a graph: `*a` refers
 * to the node `&a` names, and copying it into values expands every reference,
 * so a few lines of nested aliases ("billion laughs") would expand to 10^9
 * values.  The copy counts the values it makes and stops at YAML_MAX_VALUES;
 * files above YAML_MAX_BYTES are refused before they are parsed. */
enum { YAML_MAX_VALUES = 1 << 20, YAML_MAX_BYTES = 16 << 20 };

typedef struct {
    cfg_config *cfg;
    yaml_document_t *doc;
    const char *file;
    long values; /* values made so far */
} yaml_ctx;

static sim_status node_to_value(yaml_ctx *c, yaml_node_t *node, int depth, cfg_value *out)
{
    const char *file = c->file;
    memset(out, 0, sizeof *out);
    out->file = file;
    out->line = file == cfg_cli_source ? 0 : (int)node->start_mark.line + 1;
    if (depth > YAML_MAX_DEPTH)
        return sim_err(SIM_ERR_INPUT, "%s:%d: YAML nested deeper than %d levels", file, out->line, YAML_MAX_DEPTH);
    if (++c->values > YAML_MAX_VALUES)
        return sim_err(SIM_ERR_INPUT,
                       "%s:%d: the YAML expands to more than %d values (aliases referring to aliases?); "
                       "a config needs far fewer: remove the repeated aliases",
                       file, out->line, YAML_MAX_VALUES);
    switch (node->type) {
    case YAML_SCALAR_NODE:
        out->kind = CFG_SCALAR;
        out->text = strndup((const char *)node->data.scalar.value, node->data.scalar.length);
        SIM_ASSERT(out->text);
        out->quoted =
            node->data.scalar.style != YAML_PLAIN_SCALAR_STYLE && node->data.scalar.style != YAML_ANY_SCALAR_STYLE;
        return SIM_OK;
    case YAML_SEQUENCE_NODE: {
        out->kind = CFG_LIST;
        /* sized up front: appending one by one would copy the list each time */
        size_t n = (size_t)(node->data.sequence.items.top - node->data.sequence.items.start);
        if (n) {
            out->items = calloc(n, sizeof *out->items);
            SIM_ASSERT(out->items);
        }
        for (size_t i = 0; i < n; i++) {
            out->n = (int)i + 1;
            sim_status st = node_to_value(c, yaml_document_get_node(c->doc, node->data.sequence.items.start[i]),
                                          depth + 1, &out->items[i]);
            if (st != SIM_OK) {
                cfg_value_free(out);
                return st;
            }
        }
        return SIM_OK;
    }
    case YAML_MAPPING_NODE: {
        out->kind = CFG_MAP;
        size_t n = (size_t)(node->data.mapping.pairs.top - node->data.mapping.pairs.start);
        /* duplicate keys are found through a hash table of the indices seen,
         * so a map of 40k keys loads in linear time */
        size_t hcap = 16;
        while (hcap < 2 * n) hcap *= 2;
        int *slots = NULL;
        if (n) {
            out->items = calloc(n, sizeof *out->items);
            out->keys = calloc(n, sizeof *out->keys);
            slots = malloc(hcap * sizeof *slots);
            SIM_ASSERT(out->items && out->keys && slots);
            memset(slots, 0xff, hcap * sizeof *slots);
        }
        sim_status st = SIM_OK;
        for (size_t i = 0; i < n && st == SIM_OK; i++) {
            yaml_node_pair_t *pr = &node->data.mapping.pairs.start[i];
            yaml_node_t *k = yaml_document_get_node(c->doc, pr->key);
            int kline = (int)k->start_mark.line + 1;
            if (k->type != YAML_SCALAR_NODE) {
                st = sim_err(SIM_ERR_INPUT, "%s:%d: a map key must be a plain name", file, kline);
                break;
            }
            char *key = strndup((const char *)k->data.scalar.value, k->data.scalar.length);
            SIM_ASSERT(key);
            size_t h = (size_t)cfg_hash(key) & (hcap - 1);
            while (slots[h] >= 0 && strcmp(out->keys[slots[h]], key) != 0) h = (h + 1) & (hcap - 1);
            if (slots[h] >= 0) {
                st = sim_err(SIM_ERR_INPUT, "%s:%d: key '%s' appears twice (first at line %d); remove one of them",
                             file, kline, key, out->items[slots[h]].line);
                free(key);
                break;
            }
            slots[h] = (int)i;
            out->keys[i] = key;
            out->n = (int)i + 1;
            st = node_to_value(c, yaml_document_get_node(c->doc, pr->value), depth + 1, &out->items[i]);
            if (st == SIM_OK && file != cfg_cli_source) out->items[i].line = kline; /* key's line reads best */
        }
        free(slots);
        if (st != SIM_OK) cfg_value_free(out);
        return st;
    }
    default: return sim_err(SIM_ERR_INPUT, "%s:%d: empty YAML node", file, out->line);
    }
}

/* Opens a config file for reading: a regular file of at most YAML_MAX_BYTES. */
static sim_status open_config_file(const char *path, FILE **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return sim_err(SIM_ERR_IO, "cannot open config file %s: %s", path, strerror(errno));
    struct stat sb;
    sim_status st = SIM_OK;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode))
        st = sim_err(SIM_ERR_INPUT, "config file %s is not a regular file; give a YAML file", path);
    else if (sb.st_size > YAML_MAX_BYTES)
        st = sim_err(SIM_ERR_INPUT, "config file %s has %lld bytes; a config file has at most %d MiB", path,
                     (long long)sb.st_size, YAML_MAX_BYTES >> 20);
    if (st != SIM_OK) fclose(f);
    else *out = f;
    return st;
}

/* libyaml's parse error, said for a file (path) or a command-line value (text). */
static sim_status parse_error(const yaml_parser_t *parser, const char *path, const char *text)
{
    if (text)
        return sim_err(SIM_ERR_INPUT, "command-line value \"%s\": invalid YAML at column %zu: %s%s%s", text,
                       parser->problem_mark.column + 1, parser->problem ? parser->problem : "syntax error",
                       parser->context ? " " : "", parser->context ? parser->context : "");
    return sim_err(SIM_ERR_INPUT, "%s:%zu:%zu: invalid YAML: %s%s%s", path, parser->problem_mark.line + 1,
                   parser->problem_mark.column + 1, parser->problem ? parser->problem : "syntax error",
                   parser->context ? " " : "", parser->context ? parser->context : "");
}

/* A second document ("---" then more) would be silently dropped: refuse it. */
static sim_status one_document(yaml_parser_t *parser, const char *path, const char *text)
{
    yaml_document_t doc2;
    int more;
    if (!yaml_parser_load(parser, &doc2)) {
        more = -1;
    } else {
        more = yaml_document_get_root_node(&doc2) != NULL;
        yaml_document_delete(&doc2);
    }
    if (!more) return SIM_OK;
    if (text)
        return sim_err(SIM_ERR_INPUT, "command-line value \"%s\": %s after the first YAML document; give one value",
                       text, more < 0 ? "invalid YAML" : "a second document");
    return sim_err(SIM_ERR_INPUT,
                   "%s:%zu: %s after the first YAML document; shardsim reads one document per "
                   "file: merge the documents or split them into separate files",
                   path, parser->mark.line + 1, more < 0 ? "invalid YAML" : "a second document");
}

/* Parses YAML from a file (path) or a string (text).  Files must hold a map
 * (an empty file is an empty map). */
/* Files parsed before, by path and content: a process that loads many configs (plan loads one per
 * candidate structure) reads base.yml, keys.yml and the model's file each time, and the same bytes
 * parse to the same values.  A file whose bytes changed is parsed again. */
enum { YAML_CACHE_MAX = 64 };
typedef struct {
    char *path, *bytes;
    size_t len;
    cfg_value v;
} yaml_cached;
static yaml_cached ycache[YAML_CACHE_MAX];
static int ny;
static pthread_mutex_t ylock = PTHREAD_MUTEX_INITIALIZER;

static void set_file(cfg_value *v, const char *file)
{
    v->file = file;
    for (int i = 0; i < v->n; i++) set_file(&v->items[i], file);
}

/* The cached parse of path's bytes into out (its values written in `file`), or false. */
static bool cache_get(const char *path, const char *bytes, size_t len, const char *file, cfg_value *out)
{
    bool hit = false;
    pthread_mutex_lock(&ylock);
    for (int i = 0; i < ny && !hit; i++) {
        const yaml_cached *c = &ycache[i];
        if (c->len != len || strcmp(c->path, path) || memcmp(c->bytes, bytes, len)) continue;
        cfg_value_copy(out, &c->v);
        set_file(out, file);
        hit = true;
    }
    pthread_mutex_unlock(&ylock);
    return hit;
}

static void cache_put(const char *path, const char *bytes, size_t len, const cfg_value *v)
{
    pthread_mutex_lock(&ylock);
    int slot = -1;
    for (int i = 0; i < ny && slot < 0; i++)
        if (!strcmp(ycache[i].path, path)) slot = i;
    if (slot < 0 && ny < YAML_CACHE_MAX) slot = ny++;
    if (slot >= 0) {
        yaml_cached *c = &ycache[slot];
        free(c->path);
        free(c->bytes);
        if (c->path) cfg_value_free(&c->v);
        c->path = cfg_strdup(path);
        c->bytes = malloc(len ? len : 1);
        SIM_ASSERT(c->bytes);
        memcpy(c->bytes, bytes, len);
        c->len = len;
        cfg_value_copy(&c->v, v);
    }
    pthread_mutex_unlock(&ylock);
}

/* A config file's bytes (*len of them, NUL-terminated, malloc'd). */
static sim_status read_config_file(const char *path, char **out, size_t *len)
{
    FILE *f = NULL;
    SIM_TRY(open_config_file(path, &f));
    size_t cap = 1 << 16, n = 0, k;
    char *buf = malloc(cap + 1);
    SIM_ASSERT(buf);
    while ((k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
            SIM_ASSERT(buf);
        }
    }
    int err = ferror(f);
    fclose(f);
    if (err || n > YAML_MAX_BYTES) {
        free(buf);
        return err ? sim_err(SIM_ERR_IO, "cannot read config file %s", path)
                   : sim_err(SIM_ERR_INPUT, "config file %s has more than %d MiB", path, YAML_MAX_BYTES >> 20);
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return SIM_OK;
}

sim_status cfg_yaml_read(cfg_config *cfg, const char *path, const char *text, cfg_value *out)
{
    yaml_parser_t parser;
    yaml_document_t doc;
    int parser_on = 0, doc_on = 0, have_value = 0;
    char *bytes = NULL;
    size_t nbytes = 0;
    const char *file = text ? cfg_cli_source : cfg_intern(cfg, path);
    sim_status st;
    if (!text) {
        SIM_TRY_GOTO(read_config_file(path, &bytes, &nbytes), st, fail);
        if (cache_get(path, bytes, nbytes, file, out)) {
            free(bytes);
            return SIM_OK;
        }
    } else if (strlen(text) > YAML_MAX_BYTES)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "a command-line value of %zu bytes is too long (at most %d MiB)",
                             strlen(text), YAML_MAX_BYTES >> 20),
                     st, fail);
    SIM_ASSERT(yaml_parser_initialize(&parser));
    parser_on = 1;
    if (bytes) yaml_parser_set_input_string(&parser, (const unsigned char *)bytes, nbytes);
    else yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    if (!yaml_parser_load(&parser, &doc)) SIM_TRY_GOTO(parse_error(&parser, path, text), st, fail);
    doc_on = 1;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) {
        memset(out, 0, sizeof *out);
        out->kind = text ? CFG_SCALAR : CFG_MAP;
        if (text) out->text = cfg_strdup("");
        out->file = file;
        st = SIM_OK;
        goto fail; /* nothing follows an empty document */
    }
    yaml_ctx c = {cfg, &doc, file, 0};
    SIM_TRY_GOTO(node_to_value(&c, root, 0, out), st, fail);
    have_value = 1;
    if (!text && out->kind != CFG_MAP)
        SIM_TRY_GOTO(
            sim_err(SIM_ERR_INPUT, "%s:1: a config file must be a map of `key: value` lines at the top level", path),
            st, fail);
    yaml_document_delete(&doc);
    doc_on = 0;
    SIM_TRY_GOTO(one_document(&parser, path, text), st, fail);
fail:
    if (st != SIM_OK && have_value) cfg_value_free(out);
    if (doc_on) yaml_document_delete(&doc);
    if (parser_on) yaml_parser_delete(&parser);
    if (st == SIM_OK && bytes) cache_put(path, bytes, nbytes, out);
    free(bytes);
    return st;
}

sim_status cfg_yaml_override(cfg_config *cfg, const char *arg, cfg_value *map)
{
    const char *eq = strchr(arg, '=');
    if (!eq || eq == arg)
        return sim_err(SIM_ERR_INPUT,
                       "command-line argument '%s' is not key=value (and not a .yml file); "
                       "write it as key=value, e.g. ici_fsdp_parallelism=4",
                       arg);
    for (const char *p = arg; p < eq; p++)
        if (!isalnum((unsigned char)*p) && *p != '_' && *p != '-' && *p != '.')
            return sim_err(SIM_ERR_INPUT,
                           "command-line argument '%s': '%.*s' is not a config key name "
                           "(letters, digits and '_' only)",
                           arg, (int)(eq - arg), arg);
    char *key = strndup(arg, (size_t)(eq - arg));
    SIM_ASSERT(key);
    const char *val = eq + 1;
    cfg_value v = {0};
    size_t len = strlen(val);
    if (val[0] == '[' || val[0] == '{') {
        sim_status st = cfg_yaml_read(cfg, NULL, val, &v);
        if (st != SIM_OK) {
            sim_err_append(" (in %s; lists are YAML flow lists such as [['norm', 'fsdp']])", arg);
            free(key);
            return st;
        }
    } else if (len >= 2 && (val[0] == '\'' || val[0] == '"') && val[len - 1] == val[0]) {
        v.kind = CFG_SCALAR;
        v.text = strndup(val + 1, len - 2);
        SIM_ASSERT(v.text);
        v.quoted = 1;
    } else {
        v.kind = CFG_SCALAR;
        v.text = cfg_strdup(val);
        /* `key=` is an empty string, as OmegaConf reads it, not null. */
        v.quoted = len == 0;
    }
    v.file = cfg_cli_source;
    v.line = 0;
    cfg_value *slot = cfg_value_push(map, key);
    free(key);
    *slot = v;
    return SIM_OK;
}

int cfg_file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

char *cfg_dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash) return cfg_strdup(".");
    if (slash == path) return cfg_strdup("/");
    return strndup(path, (size_t)(slash - path));
}

char *cfg_join_path(const char *dir, const char *name)
{
    if (name[0] == '/' || !dir || !*dir) return cfg_strdup(name);
    return cfg_asprintf("%s/%s", dir, name);
}

/* Names of the *.yml files in dir, for "available: ..." lists. */
char *cfg_list_yml(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return cfg_asprintf("(cannot list %s)", dir);
    char *names[256];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 256) {
        size_t len = strlen(de->d_name);
        if (len > 4 && strcmp(de->d_name + len - 4, ".yml") == 0) names[n++] = strndup(de->d_name, len - 4);
    }
    closedir(d);
    /* Insertion sort keeps the message stable. */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "%s", "");
    for (int i = 0; i < n; i++) {
        cfg_sb_putf(&b, "%s%s", i ? ", " : "", names[i]);
        free(names[i]);
    }
    if (!n) cfg_sb_putf(&b, "(none in %s)", dir);
    return b.s;
}

int cfg_ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Finds <dir>/<sub>/<name>.yml among the config dirs. */
char *cfg_find_named_file(char *const *dirs, int n_dirs, const char *sub, const char *name)
{
    for (int i = 0; i < n_dirs; i++) {
        char *p = cfg_asprintf("%s/%s/%s.yml", dirs[i], sub, name);
        if (cfg_file_exists(p)) return p;
        free(p);
    }
    return NULL;
}

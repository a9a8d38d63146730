/* config.c — YAML config loading and MaxText merge semantics (see config.h).
 *
 * Files are read with libyaml's document API into mesh_cfg_value trees (every
 * node keeps file:line).  Loading builds the merged base as a MAP value, turns
 * it into entries (the known keys), then applies the model file, the user
 * layers (extra files, command line) and the custom mesh-and-rule file.  The
 * rule list is merged on the side, as pyconfig.py does, and written back. */
#include "config/config.h"
#include "config/release.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <pthread.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <yaml.h>

enum { YAML_MAX_DEPTH = 64, CHAIN_MAX = 16 };

static const char *const CLI_SOURCE = "command line";
static const char *const RULES_KEY = "logical_axis_rules";

/* ======================================================================== */
/* small helpers                                                             */
/* ======================================================================== */

typedef struct {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_putf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_putf(sbuf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->n;
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? room : 0, fmt, ap);
        va_end(ap);
        SIM_ASSERT(k >= 0);
        if (b->s && (size_t)k < room) {
            b->n += (size_t)k;
            return;
        }
        b->cap = (b->cap + (size_t)k + 1) * 2;
        b->s = realloc(b->s, b->cap);
        SIM_ASSERT(b->s);
        if (b->n == 0) b->s[0] = '\0';
    }
}

static char *xstrdup(const char *s)
{
    char *d = strdup(s ? s : "");
    SIM_ASSERT(d);
    return d;
}

static char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xasprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int k = vasprintf(&s, fmt, ap);
    va_end(ap);
    SIM_ASSERT(k >= 0 && s);
    return s;
}

/* Interns a string in the config (values keep `file` pointers into it). */
static const char *cfg_intern(mesh_cfg *cfg, const char *s)
{
    for (int i = 0; i < cfg->n_strings; i++)
        if (strcmp(cfg->strings[i], s) == 0) return cfg->strings[i];
    if (cfg->n_strings == cfg->cap_strings) {
        cfg->cap_strings = cfg->cap_strings ? 2 * cfg->cap_strings : 16;
        cfg->strings = realloc(cfg->strings, (size_t)cfg->cap_strings * sizeof *cfg->strings);
        SIM_ASSERT(cfg->strings);
    }
    cfg->strings[cfg->n_strings] = xstrdup(s);
    return cfg->strings[cfg->n_strings++];
}

int mesh_edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    int *row = malloc((lb + 1) * sizeof *row);
    SIM_ASSERT(row);
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    int d = row[lb];
    free(row);
    return d;
}

/* ======================================================================== */
/* values                                                                    */
/* ======================================================================== */

static void value_free(mesh_cfg_value *v)
{
    free(v->text);
    for (int i = 0; i < v->n; i++) {
        value_free(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

static void value_copy(mesh_cfg_value *dst, const mesh_cfg_value *src)
{
    *dst = *src;
    dst->text = src->text ? xstrdup(src->text) : NULL;
    dst->items = NULL;
    dst->keys = NULL;
    if (src->n) {
        dst->items = calloc((size_t)src->n, sizeof *dst->items);
        SIM_ASSERT(dst->items);
        if (src->keys) {
            dst->keys = calloc((size_t)src->n, sizeof *dst->keys);
            SIM_ASSERT(dst->keys);
        }
        for (int i = 0; i < src->n; i++) {
            value_copy(&dst->items[i], &src->items[i]);
            if (src->keys) dst->keys[i] = xstrdup(src->keys[i]);
        }
    }
}

/* Appends an item (and key for maps); returns the new slot. */
static mesh_cfg_value *value_push(mesh_cfg_value *v, const char *key)
{
    v->items = realloc(v->items, (size_t)(v->n + 1) * sizeof *v->items);
    SIM_ASSERT(v->items);
    if (v->kind == MESH_CFG_MAP) {
        v->keys = realloc(v->keys, (size_t)(v->n + 1) * sizeof *v->keys);
        SIM_ASSERT(v->keys);
        v->keys[v->n] = xstrdup(key);
    }
    mesh_cfg_value *slot = &v->items[v->n++];
    memset(slot, 0, sizeof *slot);
    return slot;
}

static int map_index(const mesh_cfg_value *map, const char *key)
{
    for (int i = map->n - 1; i >= 0; i--)
        if (strcmp(map->keys[i], key) == 0) return i;
    return -1;
}

const char *mesh_cfg_value_where(const mesh_cfg_value *v, char *buf, int cap)
{
    if (!v->file) snprintf(buf, (size_t)cap, "<unknown>");
    else if (v->line > 0) snprintf(buf, (size_t)cap, "%s:%d", v->file, v->line);
    else snprintf(buf, (size_t)cap, "%s", v->file);
    return buf;
}

/* Copies text without '_' separators into buf; 0 when too long. */
static int strip_underscores(const char *t, char *buf, size_t cap)
{
    size_t n = 0;
    for (; *t; t++) {
        if (*t == '_') continue;
        if (n + 1 >= cap) return 0;
        buf[n++] = *t;
    }
    buf[n] = '\0';
    return 1;
}

static int parse_int_text(const char *t, long long *out)
{
    char buf[80];
    if (!strip_underscores(t, buf, sizeof buf)) return 0;
    const char *p = buf;
    if (*p == '+' || *p == '-') p++;
    int base = 10;
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
        base = 16;
        p += 2;
    }
    if (!*p) return 0;
    for (const char *q = p; *q; q++)
        if (base == 10 ? !isdigit((unsigned char)*q) : !isxdigit((unsigned char)*q)) return 0;
    /* Underscores may only separate digits. */
    if (t[0] == '_' || t[strlen(t) - 1] == '_') return 0;
    errno = 0;
    char *end;
    long long v = strtoll(buf, &end, base == 16 ? 16 : 10);
    if (errno == ERANGE || *end) return 0;
    *out = v;
    return 1;
}

static int parse_float_text(const char *t, double *out)
{
    char buf[80];
    if (!strip_underscores(t, buf, sizeof buf)) return 0;
    const char *p = buf;
    int neg = 0;
    if (*p == '+' || *p == '-') neg = *p++ == '-';
    if (!strcmp(p, ".inf") || !strcmp(p, ".Inf") || !strcmp(p, ".INF")) {
        *out = neg ? -INFINITY : INFINITY;
        return 1;
    }
    if (!strcmp(buf, ".nan") || !strcmp(buf, ".NaN") || !strcmp(buf, ".NAN")) {
        *out = NAN;
        return 1;
    }
    int digits = 0, marks = 0;
    for (const char *q = p; *q; q++) {
        if (isdigit((unsigned char)*q)) digits++;
        else if (*q == '.' || *q == 'e' || *q == 'E') marks++;
        else if (*q != '+' && *q != '-') return 0;
    }
    if (!digits || !marks) return 0;
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    if (*end || errno == ERANGE) return 0;
    *out = v;
    return 1;
}

static int bool_word(const char *t, int *out)
{
    static const char *const yes[] = {"true", "yes", "on"};
    static const char *const no[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
        if (!strcasecmp(t, yes[i])) return *out = 1, 1;
        if (!strcasecmp(t, no[i])) return *out = 0, 1;
    }
    return 0;
}

mesh_cfg_type mesh_cfg_scalar_type(const mesh_cfg_value *v)
{
    if (v->kind != MESH_CFG_SCALAR) return MESH_CFG_STRING;
    const char *t = v->text ? v->text : "";
    /* MaxText turns the string "none" (any case, any quoting) into None. */
    if (!strcasecmp(t, "none")) return MESH_CFG_NULL;
    if (v->quoted) return MESH_CFG_STRING;
    if (!*t || !strcmp(t, "~") || !strcmp(t, "null") || !strcmp(t, "Null") || !strcmp(t, "NULL"))
        return MESH_CFG_NULL;
    int b;
    if (bool_word(t, &b)) return MESH_CFG_BOOL;
    long long i;
    if (parse_int_text(t, &i)) return MESH_CFG_INT;
    double d;
    if (parse_float_text(t, &d)) return MESH_CFG_FLOAT;
    return MESH_CFG_STRING;
}

const char *mesh_cfg_type_name(mesh_cfg_type t)
{
    switch (t) {
    case MESH_CFG_NULL: return "null";
    case MESH_CFG_BOOL: return "a boolean (true or false)";
    case MESH_CFG_INT: return "an integer";
    case MESH_CFG_FLOAT: return "a number";
    case MESH_CFG_STRING: return "a string";
    }
    return "?";
}

static const char *kind_name(const mesh_cfg_value *v)
{
    if (v->kind == MESH_CFG_LIST) return "a list";
    if (v->kind == MESH_CFG_MAP) return "a map";
    return mesh_cfg_type_name(mesh_cfg_scalar_type(v));
}

static sim_status value_type_error(const mesh_cfg_value *v, const char *what, const char *expected)
{
    char where[512];
    char *text = mesh_cfg_value_to_text(v, 0);
    sim_status st = sim_err(SIM_ERR_INPUT, "%s: %s = %s is %s, expected %s",
                            mesh_cfg_value_where(v, where, sizeof where), what, text,
                            kind_name(v), expected);
    free(text);
    return st;
}

sim_status mesh_cfg_value_int(const mesh_cfg_value *v, const char *what, long long *out)
{
    mesh_cfg_type t = mesh_cfg_scalar_type(v);
    if (v->kind == MESH_CFG_SCALAR && t == MESH_CFG_INT && parse_int_text(v->text, out))
        return SIM_OK;
    double d;
    if (v->kind == MESH_CFG_SCALAR && t == MESH_CFG_FLOAT && parse_float_text(v->text, &d) &&
        d == floor(d) && fabs(d) < 9.0e18) {
        *out = (long long)d;
        return SIM_OK;
    }
    return value_type_error(v, what, "an integer");
}

sim_status mesh_cfg_value_double(const mesh_cfg_value *v, const char *what, double *out)
{
    mesh_cfg_type t = mesh_cfg_scalar_type(v);
    long long i;
    if (v->kind == MESH_CFG_SCALAR && t == MESH_CFG_INT && parse_int_text(v->text, &i)) {
        *out = (double)i;
        return SIM_OK;
    }
    if (v->kind == MESH_CFG_SCALAR && t == MESH_CFG_FLOAT && parse_float_text(v->text, out))
        return SIM_OK;
    return value_type_error(v, what, "a number");
}

sim_status mesh_cfg_value_bool(const mesh_cfg_value *v, const char *what, int *out)
{
    if (v->kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(v) == MESH_CFG_BOOL &&
        bool_word(v->text, out))
        return SIM_OK;
    return value_type_error(v, what, "true or false");
}

int mesh_cfg_value_equal(const mesh_cfg_value *a, const mesh_cfg_value *b)
{
    if (a->kind != b->kind || a->n != b->n) return 0;
    if (a->kind == MESH_CFG_SCALAR) {
        mesh_cfg_type ta = mesh_cfg_scalar_type(a), tb = mesh_cfg_scalar_type(b);
        int na = ta == MESH_CFG_INT || ta == MESH_CFG_FLOAT;
        int nb = tb == MESH_CFG_INT || tb == MESH_CFG_FLOAT;
        if (na && nb) {
            double x, y;
            long long i, j;
            if (ta == MESH_CFG_INT && tb == MESH_CFG_INT && parse_int_text(a->text, &i) &&
                parse_int_text(b->text, &j))
                return i == j;
            if (mesh_cfg_value_double(a, "", &x) || mesh_cfg_value_double(b, "", &y)) return 0;
            return x == y;
        }
        if (ta != tb) return 0;
        if (ta == MESH_CFG_NULL) return 1;
        if (ta == MESH_CFG_BOOL) {
            int x = 0, y = 0;
            bool_word(a->text, &x);
            bool_word(b->text, &y);
            return x == y;
        }
        return strcmp(a->text, b->text) == 0;
    }
    for (int i = 0; i < a->n; i++) {
        if (a->kind == MESH_CFG_MAP && strcmp(a->keys[i], b->keys[i]) != 0) return 0;
        if (!mesh_cfg_value_equal(&a->items[i], &b->items[i])) return 0;
    }
    return 1;
}

/* Shortest %g form that reads back to the same double. */
static void put_double(sbuf *b, double d)
{
    if (isnan(d)) {
        sb_putf(b, "NaN");
        return;
    }
    if (isinf(d)) {
        sb_putf(b, d < 0 ? "-Infinity" : "Infinity");
        return;
    }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) break;
    }
    /* Keep it a float for readers that type by syntax (1e-05 -> 1e-05, 2 -> 2.0). */
    if (!strpbrk(tmp, ".eEn")) sb_putf(b, "%s.0", tmp);
    else sb_putf(b, "%s", tmp);
}

static void put_json_string(sbuf *b, const char *s)
{
    sb_putf(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') sb_putf(b, "\\%c", c);
        else if (c == '\n') sb_putf(b, "\\n");
        else if (c == '\t') sb_putf(b, "\\t");
        else if (c < 0x20) sb_putf(b, "\\u%04x", c);
        else sb_putf(b, "%c", c);
    }
    sb_putf(b, "\"");
}

static void put_value(sbuf *b, const mesh_cfg_value *v, int json)
{
    if (v->kind == MESH_CFG_LIST || v->kind == MESH_CFG_MAP) {
        int map = v->kind == MESH_CFG_MAP;
        sb_putf(b, map ? "{" : "[");
        for (int i = 0; i < v->n; i++) {
            if (i) sb_putf(b, ", ");
            if (map) {
                if (json) put_json_string(b, v->keys[i]);
                else sb_putf(b, "%s", v->keys[i]);
                sb_putf(b, ": ");
            }
            put_value(b, &v->items[i], json);
        }
        sb_putf(b, map ? "}" : "]");
        return;
    }
    mesh_cfg_type t = mesh_cfg_scalar_type(v);
    if (json) {
        long long i;
        double d;
        int bo;
        if (t == MESH_CFG_NULL) sb_putf(b, "null");
        else if (t == MESH_CFG_BOOL && bool_word(v->text, &bo)) sb_putf(b, bo ? "true" : "false");
        else if (t == MESH_CFG_INT && parse_int_text(v->text, &i)) sb_putf(b, "%lld", i);
        else if (t == MESH_CFG_FLOAT && parse_float_text(v->text, &d)) put_double(b, d);
        else put_json_string(b, v->text);
        return;
    }
    /* YAML flow: quote strings that were quoted or that flow syntax would split. */
    if (v->quoted || (t == MESH_CFG_STRING && strpbrk(v->text, ",[]{}:#'\"")) ||
        (t == MESH_CFG_STRING && !*v->text)) {
        sb_putf(b, "'");
        for (const char *s = v->text; *s; s++) sb_putf(b, *s == '\'' ? "''" : "%c", *s);
        sb_putf(b, "'");
    } else {
        sb_putf(b, "%s", *v->text ? v->text : "null");
    }
}

char *mesh_cfg_value_to_text(const mesh_cfg_value *v, int json)
{
    sbuf b = {0};
    sb_putf(&b, "%s", "");
    put_value(&b, v, json);
    return b.s;
}

/* ======================================================================== */
/* YAML reading                                                              */
/* ======================================================================== */

/* Bounds of one YAML input.  Aliases make a document a graph: `*a` refers
 * to the node `&a` names, and copying it into values expands every reference,
 * so a few lines of nested aliases ("billion laughs") would expand to 10^9
 * values.  The copy counts the values it makes and stops at YAML_MAX_VALUES;
 * files above YAML_MAX_BYTES are refused before they are parsed. */
enum { YAML_MAX_VALUES = 1 << 20, YAML_MAX_BYTES = 16 << 20 };

typedef struct {
    mesh_cfg *cfg;
    yaml_document_t *doc;
    const char *file;
    long values; /* values made so far */
} yaml_ctx;

/* FNV-1a of a key: the duplicate-key check of large maps and the hash
 * indexes of entries and keys.yml use it. */
static uint64_t key_hash(const char *k)
{
    uint64_t h = 14695981039346656037ULL;
    for (; *k; k++) h = (h ^ (unsigned char)*k) * 1099511628211ULL;
    return h;
}

static sim_status node_to_value(yaml_ctx *c, yaml_node_t *node, int depth, mesh_cfg_value *out)
{
    const char *file = c->file;
    memset(out, 0, sizeof *out);
    out->file = file;
    out->line = file == CLI_SOURCE ? 0 : (int)node->start_mark.line + 1;
    if (depth > YAML_MAX_DEPTH)
        return sim_err(SIM_ERR_INPUT, "%s:%d: YAML nested deeper than %d levels", file, out->line,
                       YAML_MAX_DEPTH);
    if (++c->values > YAML_MAX_VALUES)
        return sim_err(SIM_ERR_INPUT,
                       "%s:%d: the YAML expands to more than %d values (aliases referring to aliases?); "
                       "a config needs far fewer: remove the repeated aliases",
                       file, out->line, YAML_MAX_VALUES);
    switch (node->type) {
    case YAML_SCALAR_NODE:
        out->kind = MESH_CFG_SCALAR;
        out->text = strndup((const char *)node->data.scalar.value, node->data.scalar.length);
        SIM_ASSERT(out->text);
        out->quoted = node->data.scalar.style != YAML_PLAIN_SCALAR_STYLE &&
                      node->data.scalar.style != YAML_ANY_SCALAR_STYLE;
        return SIM_OK;
    case YAML_SEQUENCE_NODE: {
        out->kind = MESH_CFG_LIST;
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
                value_free(out);
                return st;
            }
        }
        return SIM_OK;
    }
    case YAML_MAPPING_NODE: {
        out->kind = MESH_CFG_MAP;
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
            size_t h = (size_t)key_hash(key) & (hcap - 1);
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
            if (st == SIM_OK && file != CLI_SOURCE) out->items[i].line = kline; /* key's line reads best */
        }
        free(slots);
        if (st != SIM_OK) value_free(out);
        return st;
    }
    default:
        return sim_err(SIM_ERR_INPUT, "%s:%d: empty YAML node", file, out->line);
    }
}

/* Parses YAML from a file (path) or a string (text).  Files must hold a map
 * (an empty file is an empty map). */
static sim_status yaml_read(mesh_cfg *cfg, const char *path, const char *text, mesh_cfg_value *out)
{
    yaml_parser_t parser;
    yaml_document_t doc;
    FILE *f = NULL;
    const char *file = text ? CLI_SOURCE : cfg_intern(cfg, path);
    if (!text) {
        f = fopen(path, "rb");
        if (!f) return sim_err(SIM_ERR_IO, "cannot open config file %s: %s", path, strerror(errno));
        struct stat sb;
        if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
            fclose(f);
            return sim_err(SIM_ERR_INPUT, "config file %s is not a regular file; give a YAML file", path);
        }
        if (sb.st_size > YAML_MAX_BYTES) {
            fclose(f);
            return sim_err(SIM_ERR_INPUT, "config file %s has %lld bytes; a config file has at most %d MiB", path,
                           (long long)sb.st_size, YAML_MAX_BYTES >> 20);
        }
    } else if (strlen(text) > YAML_MAX_BYTES) {
        return sim_err(SIM_ERR_INPUT, "a command-line value of %zu bytes is too long (at most %d MiB)", strlen(text),
                       YAML_MAX_BYTES >> 20);
    }
    SIM_ASSERT(yaml_parser_initialize(&parser));
    if (f) yaml_parser_set_input_file(&parser, f);
    else yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    sim_status st = SIM_OK;
    if (!yaml_parser_load(&parser, &doc)) {
        if (text)
            st = sim_err(SIM_ERR_INPUT, "command-line value \"%s\": invalid YAML at column %zu: %s%s%s",
                         text, parser.problem_mark.column + 1,
                         parser.problem ? parser.problem : "syntax error",
                         parser.context ? " " : "", parser.context ? parser.context : "");
        else
            st = sim_err(SIM_ERR_INPUT, "%s:%zu:%zu: invalid YAML: %s%s%s", path,
                         parser.problem_mark.line + 1, parser.problem_mark.column + 1,
                         parser.problem ? parser.problem : "syntax error",
                         parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        if (f) fclose(f);
        return st;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) {
        memset(out, 0, sizeof *out);
        out->kind = text ? MESH_CFG_SCALAR : MESH_CFG_MAP;
        if (text) out->text = xstrdup("");
        out->file = file;
    } else {
        yaml_ctx c = {cfg, &doc, file, 0};
        st = node_to_value(&c, root, 0, out);
        if (st == SIM_OK && !text && out->kind != MESH_CFG_MAP) {
            value_free(out);
            st = sim_err(SIM_ERR_INPUT,
                         "%s:1: a config file must be a map of `key: value` lines at the top level",
                         path);
        }
    }
    yaml_document_delete(&doc);
    /* a second document ("---" then more) would be silently dropped: refuse it */
    if (st == SIM_OK && root) {
        yaml_document_t doc2;
        int more = 0;
        if (!yaml_parser_load(&parser, &doc2)) {
            more = -1;
        } else {
            more = yaml_document_get_root_node(&doc2) != NULL;
            yaml_document_delete(&doc2);
        }
        if (more) {
            value_free(out);
            if (text)
                st = sim_err(SIM_ERR_INPUT, "command-line value \"%s\": %s after the first YAML document; give one value",
                             text, more < 0 ? "invalid YAML" : "a second document");
            else
                st = sim_err(SIM_ERR_INPUT, "%s:%zu: %s after the first YAML document; shardsim reads one document per "
                             "file: merge the documents or split them into separate files",
                             path, parser.mark.line + 1, more < 0 ? "invalid YAML" : "a second document");
        }
    }
    yaml_parser_delete(&parser);
    if (f) fclose(f);
    return st;
}

/* ======================================================================== */
/* config object                                                             */
/* ======================================================================== */

static mesh_cfg *cfg_new(void)
{
    mesh_cfg *cfg = calloc(1, sizeof *cfg);
    SIM_ASSERT(cfg);
    return cfg;
}

void mesh_cfg_free(mesh_cfg *cfg)
{
    if (!cfg) return;
    for (int i = 0; i < cfg->n; i++) {
        free(cfg->entries[i].key);
        free(cfg->entries[i].where);
        value_free(&cfg->entries[i].value);
    }
    free(cfg->entries);
    for (int i = 0; i < cfg->n_strings; i++) free(cfg->strings[i]);
    free(cfg->strings);
    free(cfg->base_file);
    free(cfg->configs_dir);
    free(cfg->model_file);
    free(cfg->custom_file);
    free(cfg->keys_file);
    free(cfg->index);
    free(cfg);
}

static char *where_of(const mesh_cfg_value *v)
{
    char buf[1024];
    return xstrdup(mesh_cfg_value_where(v, buf, sizeof buf));
}

/* Moves the items of a MAP value into entries (the MAP is left empty). */
static void cfg_take_map(mesh_cfg *cfg, mesh_cfg_value *map)
{
    cfg->entries = calloc(map->n > 0 ? (size_t)map->n : 1, sizeof *cfg->entries);
    SIM_ASSERT(cfg->entries);
    cfg->n = map->n;
    for (int i = 0; i < map->n; i++) {
        mesh_cfg_entry *e = &cfg->entries[i];
        e->key = map->keys[i];
        e->value = map->items[i];
        e->where = where_of(&e->value);
    }
    free(map->keys);
    free(map->items);
    memset(map, 0, sizeof *map);
}

/* (Re)builds the hash index of the entries (after entries are added). */
static void cfg_index(mesh_cfg *cfg)
{
    free(cfg->index);
    cfg->index_cap = 16;
    while (cfg->index_cap < 2 * cfg->n + 2) cfg->index_cap *= 2;
    cfg->index = calloc((size_t)cfg->index_cap, sizeof *cfg->index);
    SIM_ASSERT(cfg->index);
    for (int i = 0; i < cfg->n; i++) {
        unsigned h = (unsigned)key_hash(cfg->entries[i].key) & (unsigned)(cfg->index_cap - 1);
        while (cfg->index[h]) h = (h + 1) & (unsigned)(cfg->index_cap - 1);
        cfg->index[h] = i + 1;
    }
    cfg->index_n = cfg->n;
}

const mesh_cfg_entry *mesh_cfg_find(const mesh_cfg *cfg, const char *key)
{
    if (cfg->index && cfg->index_n == cfg->n) {
        unsigned mask = (unsigned)(cfg->index_cap - 1);
        for (unsigned h = (unsigned)key_hash(key) & mask; cfg->index[h]; h = (h + 1) & mask)
            if (!strcmp(cfg->entries[cfg->index[h] - 1].key, key)) return &cfg->entries[cfg->index[h] - 1];
        return NULL;
    }
    for (int i = 0; i < cfg->n; i++)
        if (strcmp(cfg->entries[i].key, key) == 0) return &cfg->entries[i];
    return NULL;
}

static mesh_cfg_entry *cfg_find_mut(mesh_cfg *cfg, const char *key)
{
    return (mesh_cfg_entry *)mesh_cfg_find(cfg, key);
}

const char *mesh_cfg_closest_key(const mesh_cfg *cfg, const char *key)
{
    const char *best = NULL;
    int best_d = INT_MAX;
    for (int i = 0; i < cfg->n; i++) {
        int d = mesh_edit_distance(key, cfg->entries[i].key);
        if (d < best_d) {
            best_d = d;
            best = cfg->entries[i].key;
        }
    }
    return best;
}

sim_status mesh_cfg_entry_get(const mesh_cfg *cfg, const char *key, const mesh_cfg_entry **out)
{
    *out = mesh_cfg_find(cfg, key);
    if (*out) return SIM_OK;
    const char *near = mesh_cfg_closest_key(cfg, key);
    return sim_err(SIM_ERR_INPUT,
                   "config key '%s' is missing: the base config %s does not define it%s%s%s; "
                   "add `%s: <value>` to the base config",
                   key, cfg->base_file ? cfg->base_file : "(none)", near ? " (closest key: '" : "",
                   near ? near : "", near ? "')" : "", key);
}

static sim_status getter_what(const mesh_cfg *cfg, const char *key, const mesh_cfg_entry **e,
                              char *what, size_t cap)
{
    SIM_TRY(mesh_cfg_entry_get(cfg, key, e));
    snprintf(what, cap, "key '%s'", key);
    return SIM_OK;
}

sim_status mesh_cfg_get_int(const mesh_cfg *cfg, const char *key, long long *out)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return mesh_cfg_value_int(&e->value, what, out);
}

sim_status mesh_cfg_get_double(const mesh_cfg *cfg, const char *key, double *out)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return mesh_cfg_value_double(&e->value, what, out);
}

sim_status mesh_cfg_get_bool(const mesh_cfg *cfg, const char *key, int *out)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return mesh_cfg_value_bool(&e->value, what, out);
}

sim_status mesh_cfg_get_str(const mesh_cfg *cfg, const char *key, const char **out)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    if (e->value.kind != MESH_CFG_SCALAR) return value_type_error(&e->value, what, "a string");
    *out = mesh_cfg_scalar_type(&e->value) == MESH_CFG_NULL ? NULL : e->value.text;
    return SIM_OK;
}

sim_status mesh_cfg_get_enum(const mesh_cfg *cfg, const char *key, const char *const *allowed,
                             int n_allowed, int *out)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    if (e->value.kind == MESH_CFG_SCALAR) {
        for (int i = 0; i < n_allowed; i++) {
            if (strcmp(e->value.text, allowed[i]) == 0) {
                *out = i;
                return SIM_OK;
            }
        }
    }
    sbuf b = {0};
    sb_putf(&b, "one of");
    for (int i = 0; i < n_allowed; i++) sb_putf(&b, "%s '%s'", i ? "," : "", allowed[i]);
    sim_status st = value_type_error(&e->value, what, b.s);
    free(b.s);
    return st;
}

sim_status mesh_cfg_get_str_list(const mesh_cfg *cfg, const char *key, const char ***items, int *n)
{
    const mesh_cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    *items = NULL;
    *n = 0;
    if (e->value.kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(&e->value) == MESH_CFG_NULL)
        return SIM_OK;
    if (e->value.kind != MESH_CFG_LIST) return value_type_error(&e->value, what, "a list of names");
    for (int i = 0; i < e->value.n; i++)
        if (e->value.items[i].kind != MESH_CFG_SCALAR)
            return value_type_error(&e->value.items[i], what, "a name (a list item of a flat list)");
    const char **arr = calloc(e->value.n > 0 ? (size_t)e->value.n : 1, sizeof *arr);
    SIM_ASSERT(arr);
    for (int i = 0; i < e->value.n; i++) arr[i] = e->value.items[i].text;
    *items = arr;
    *n = e->value.n;
    return SIM_OK;
}

/* ======================================================================== */
/* loading: files and chains                                                 */
/* ======================================================================== */

static int file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static char *dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash) return xstrdup(".");
    if (slash == path) return xstrdup("/");
    return strndup(path, (size_t)(slash - path));
}

static char *join_path(const char *dir, const char *name)
{
    if (name[0] == '/' || !dir || !*dir) return xstrdup(name);
    return xasprintf("%s/%s", dir, name);
}

/* Names of the *.yml files in dir, for "available: ..." lists. */
static char *list_yml(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return xasprintf("(cannot list %s)", dir);
    char *names[256];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 256) {
        size_t len = strlen(de->d_name);
        if (len > 4 && strcmp(de->d_name + len - 4, ".yml") == 0)
            names[n++] = strndup(de->d_name, len - 4);
    }
    closedir(d);
    /* Insertion sort keeps the message stable. */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    sbuf b = {0};
    sb_putf(&b, "%s", "");
    for (int i = 0; i < n; i++) {
        sb_putf(&b, "%s%s", i ? ", " : "", names[i]);
        free(names[i]);
    }
    if (!n) sb_putf(&b, "(none in %s)", dir);
    return b.s;
}

/* Merges child into parent (child wins; new keys appended, base_config dropped). */
static void map_overlay(mesh_cfg_value *parent, mesh_cfg_value *child)
{
    for (int i = 0; i < child->n; i++) {
        if (strcmp(child->keys[i], "base_config") == 0) continue;
        int k = map_index(parent, child->keys[i]);
        mesh_cfg_value *slot = k >= 0 ? &parent->items[k] : value_push(parent, child->keys[i]);
        if (k >= 0) value_free(slot);
        *slot = child->items[i];
        memset(&child->items[i], 0, sizeof child->items[i]);
    }
}

/* Loads path and its base_config ancestors into *out (merged). chain[] collects
 * the real paths (for cycle checks and overlay base_config checks). */
static sim_status load_chain(mesh_cfg *cfg, const char *path, char **chain, int *n_chain,
                             mesh_cfg_value *out)
{
    char real[PATH_MAX];
    if (!realpath(path, real))
        return sim_err(SIM_ERR_IO, "cannot open config file %s: %s", path, strerror(errno));
    for (int i = 0; i < *n_chain; i++)
        if (strcmp(chain[i], real) == 0)
            return sim_err(SIM_ERR_INPUT, "config file %s: base_config chain loops back to %s",
                           path, real);
    if (*n_chain >= CHAIN_MAX)
        return sim_err(SIM_ERR_INPUT, "config file %s: base_config chain deeper than %d files",
                       path, CHAIN_MAX);
    chain[(*n_chain)++] = xstrdup(real);
    mesh_cfg_value map;
    SIM_TRY(yaml_read(cfg, path, NULL, &map));
    int bi = map_index(&map, "base_config");
    if (bi < 0) {
        *out = map;
        return SIM_OK;
    }
    const mesh_cfg_value *bv = &map.items[bi];
    if (bv->kind != MESH_CFG_SCALAR || mesh_cfg_scalar_type(bv) == MESH_CFG_NULL) {
        sim_status st = value_type_error(bv, "key 'base_config'", "a file name");
        value_free(&map);
        return st;
    }
    char *dir = dir_of(path);
    char *parent = join_path(dir, bv->text);
    free(dir);
    if (!file_exists(parent) && file_exists(bv->text)) {
        free(parent);
        parent = xstrdup(bv->text);
    }
    if (!file_exists(parent)) {
        char where[512];
        sim_status st = sim_err(SIM_ERR_INPUT, "%s: base_config '%s': no such file (looked for %s)",
                                mesh_cfg_value_where(bv, where, sizeof where), bv->text, parent);
        free(parent);
        value_free(&map);
        return st;
    }
    mesh_cfg_value base;
    sim_status st = load_chain(cfg, parent, chain, n_chain, &base);
    free(parent);
    if (st != SIM_OK) {
        value_free(&map);
        return st;
    }
    map_overlay(&base, &map);
    value_free(&map);
    *out = base;
    return SIM_OK;
}

/* ======================================================================== */
/* the key contract (configs/keys.yml)                                      */
/* ======================================================================== */

static const char *const KEY_CLASS_NAMES[] = {"unclassified", "honoured", "inert", "refused"};
static const char *const KEY_TYPES[] = {"bool", "int", "float", "str", "list", "map", "any"};

const char *mesh_key_class_name(mesh_key_class c)
{
    return (unsigned)c < 4 ? KEY_CLASS_NAMES[c] : "?";
}

static const mesh_cfg_value *map_get(const mesh_cfg_value *map, const char *key)
{
    if (!map || map->kind != MESH_CFG_MAP) return NULL;
    int i = map_index(map, key);
    return i >= 0 ? &map->items[i] : NULL;
}

const mesh_cfg_value *mesh_cfg_entry_field(const mesh_cfg_entry *e, const char *field)
{
    return e->spec ? map_get(e->spec, field) : NULL;
}

static const char *field_text(const mesh_cfg_value *spec, const char *field)
{
    const mesh_cfg_value *v = map_get(spec, field);
    return v && v->kind == MESH_CFG_SCALAR ? v->text : NULL;
}

/* Checks one keys.yml line: a map with a known class and type. */
static sim_status registry_check_line(const char *key, const mesh_cfg_value *spec)
{
    char where[512];
    mesh_cfg_value_where(spec, where, sizeof where);
    if (spec->kind != MESH_CFG_MAP)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' must be a map like {class: inert, type: int, default: 0, why: ...}",
                       where, key);
    const char *c = field_text(spec, "class");
    int ok = 0;
    for (int k = 1; c && k < 4; k++) ok |= !strcmp(c, KEY_CLASS_NAMES[k]);
    if (!ok)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' has class '%s'; expected honoured, inert or refused", where, key,
                       c ? c : "(none)");
    const char *t = field_text(spec, "type");
    ok = 0;
    for (size_t k = 0; t && k < sizeof KEY_TYPES / sizeof *KEY_TYPES; k++) ok |= !strcmp(t, KEY_TYPES[k]);
    if (!ok)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' has type '%s'; expected bool, int, float, str, list, map or any",
                       where, key, t ? t : "(none)");
    return SIM_OK;
}

/* ---- a small hash index of names (open addressing) ---- */

typedef struct {
    int cap;   /* power of two, > 2 x count */
    int *slot; /* position + 1, 0 = empty */
} name_index;

/* names(arg, i) gives the i-th name. */
static void name_index_build(name_index *ix, int n, const char *(*names)(const void *, int), const void *arg)
{
    ix->cap = 16;
    while (ix->cap < 2 * n + 2) ix->cap *= 2;
    ix->slot = calloc((size_t)ix->cap, sizeof *ix->slot);
    SIM_ASSERT(ix->slot);
    for (int i = 0; i < n; i++) {
        unsigned h = (unsigned)key_hash(names(arg, i)) & (unsigned)(ix->cap - 1);
        while (ix->slot[h]) h = (h + 1) & (unsigned)(ix->cap - 1);
        ix->slot[h] = i + 1;
    }
}

static int name_index_get(const name_index *ix, const char *key, const char *(*names)(const void *, int),
                          const void *arg)
{
    if (!ix->slot) return -1;
    for (unsigned h = (unsigned)key_hash(key) & (unsigned)(ix->cap - 1); ix->slot[h];
         h = (h + 1) & (unsigned)(ix->cap - 1))
        if (!strcmp(names(arg, ix->slot[h] - 1), key)) return ix->slot[h] - 1;
    return -1;
}

static const char *map_key_at(const void *map, int i) { return ((const mesh_cfg_value *)map)->keys[i]; }
static const char *entry_key_at(const void *cfg, int i) { return ((const mesh_cfg *)cfg)->entries[i].key; }

/* ---- keys.yml, parsed once per process ---- */

/* Loading a config is frequent (parity loads one per configuration, the key
 * test hundreds) and keys.yml is ~800 lines, so its parse is kept for the
 * process, keyed by path and modification time; configs point into it. */
typedef struct {
    char *path;
    struct timespec mtime;
    mesh_cfg *holder; /* owns the parsed file (strings, values) */
    mesh_cfg_value keys;
    name_index ix;
} registry_cache;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static registry_cache registry_cached[4];

static sim_status registry_get(const char *path, const registry_cache **out)
{
    struct stat sb;
    if (stat(path, &sb) != 0) return sim_err(SIM_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    pthread_mutex_lock(&registry_lock);
    registry_cache *c = NULL;
    for (int i = 0; i < 4 && !c; i++)
        if (registry_cached[i].path && !strcmp(registry_cached[i].path, path) &&
            registry_cached[i].mtime.tv_sec == sb.st_mtim.tv_sec && registry_cached[i].mtime.tv_nsec == sb.st_mtim.tv_nsec)
            c = &registry_cached[i];
    sim_status st = SIM_OK;
    if (!c) {
        mesh_cfg *holder = cfg_new();
        mesh_cfg_value doc = {0};
        st = yaml_read(holder, path, NULL, &doc);
        int ki = st == SIM_OK && doc.kind == MESH_CFG_MAP ? map_index(&doc, "keys") : -1;
        if (st == SIM_OK && (ki < 0 || doc.items[ki].kind != MESH_CFG_MAP))
            st = sim_err(SIM_ERR_INPUT, "%s: expected a top-level map `keys:` of key -> {class, type, default, why}",
                         path);
        for (int i = 0; st == SIM_OK && i < doc.items[ki].n; i++)
            st = registry_check_line(doc.items[ki].keys[i], &doc.items[ki].items[i]);
        if (st == SIM_OK) {
            /* the oldest slot makes room (a process rarely sees more than one keys.yml) */
            c = &registry_cached[0];
            for (int i = 0; i < 4; i++)
                if (!registry_cached[i].path) {
                    c = &registry_cached[i];
                    break;
                }
            if (c->path) {
                free(c->path);
                value_free(&c->keys);
                mesh_cfg_free(c->holder);
                free(c->ix.slot);
            }
            c->path = xstrdup(path);
            c->mtime = sb.st_mtim;
            c->holder = holder;
            c->keys = doc.items[ki];
            memset(&doc.items[ki], 0, sizeof doc.items[ki]);
            name_index_build(&c->ix, c->keys.n, map_key_at, &c->keys);
            holder = NULL;
        }
        value_free(&doc);
        mesh_cfg_free(holder);
    }
    pthread_mutex_unlock(&registry_lock);
    *out = c;
    return st;
}

/* Reads <configs_dir>/keys.yml when it exists: classes every entry, adds the
 * keys the base file lacks with their keys.yml default. */
static sim_status registry_apply(mesh_cfg *cfg, const char *configs_dir)
{
    char *path = join_path(configs_dir, "keys.yml");
    if (!file_exists(path)) {
        free(path);
        return SIM_OK;
    }
    const registry_cache *rc = NULL;
    sim_status st = registry_get(path, &rc);
    if (st != SIM_OK) {
        free(path);
        return st;
    }
    cfg->keys_file = path;
    cfg->registry = &rc->keys;
    const mesh_cfg_value *reg = cfg->registry;
    /* every key of the base file needs a class */
    for (int i = 0; i < cfg->n; i++)
        if (name_index_get(&rc->ix, cfg->entries[i].key, map_key_at, reg) < 0)
            return sim_err(SIM_ERR_INPUT,
                           "%s: key '%s' has no line in %s; every key needs a class: add `%s: {class: honoured|inert|"
                           "refused, type: ..., why: ...}` there",
                           cfg->entries[i].where, cfg->entries[i].key, path, cfg->entries[i].key);
    /* keys the base file lacks: the keys.yml default */
    name_index base_ix;
    name_index_build(&base_ix, cfg->n, entry_key_at, cfg);
    int n_base = cfg->n;
    cfg->entries = realloc(cfg->entries, (size_t)(cfg->n + reg->n + 1) * sizeof *cfg->entries);
    SIM_ASSERT(cfg->entries);
    for (int i = 0; i < reg->n && st == SIM_OK; i++) {
        int at = name_index_get(&base_ix, reg->keys[i], entry_key_at, cfg);
        if (at >= 0 && at < n_base) continue;
        const mesh_cfg_value *def = map_get(&reg->items[i], "default");
        if (!def) {
            char where[512];
            st = sim_err(SIM_ERR_INPUT, "%s: key '%s' has no default and the base config %s does not set it; add "
                                        "`default: ...` to its line",
                         mesh_cfg_value_where(&reg->items[i], where, sizeof where), reg->keys[i], cfg->base_file);
            break;
        }
        mesh_cfg_entry *e = &cfg->entries[cfg->n++];
        memset(e, 0, sizeof *e);
        e->key = xstrdup(reg->keys[i]);
        value_copy(&e->value, def);
        e->where = where_of(def);
    }
    free(base_ix.slot);
    for (int i = 0; i < cfg->n && st == SIM_OK; i++) {
        mesh_cfg_entry *e = &cfg->entries[i];
        e->spec = &reg->items[name_index_get(&rc->ix, e->key, map_key_at, reg)];
        const char *c = field_text(e->spec, "class");
        for (int k = 1; k < 4; k++)
            if (!strcmp(c, KEY_CLASS_NAMES[k])) e->cls = (mesh_key_class)k;
        e->why = field_text(e->spec, "why");
    }
    cfg_index(cfg);
    return st;
}

static int value_in_list(const mesh_cfg_value *v, const mesh_cfg_value *list)
{
    if (!list || list->kind != MESH_CFG_LIST) return 0;
    for (int i = 0; i < list->n; i++)
        if (mesh_cfg_value_equal(v, &list->items[i])) return 1;
    return 0;
}

/* After merging: marks changed keys, refuses what is not simulated. */
static sim_status registry_check(mesh_cfg *cfg, const mesh_cfg_value *base_vals, int n_base)
{
    if (!cfg->keys_file) return SIM_OK;
    for (int i = 0; i < cfg->n && i < n_base; i++) {
        mesh_cfg_entry *e = &cfg->entries[i];
        e->changed = !mesh_cfg_value_equal(&e->value, &base_vals[i]);
        if (!e->changed) continue;
        char *text = mesh_cfg_value_to_text(&e->value, 0);
        char *dtext = mesh_cfg_value_to_text(&base_vals[i], 0);
        const mesh_cfg_value *choices = mesh_cfg_entry_field(e, "choices");
        const mesh_cfg_value *sim = mesh_cfg_entry_field(e, "simulated");
        sim_status st = SIM_OK;
        if (choices && !value_in_list(&e->value, choices)) {
            char *ctext = mesh_cfg_value_to_text(choices, 0);
            st = sim_err(SIM_ERR_INPUT, "%s: %s=%s is not a value MaxText accepts; use one of %s (default %s)", e->where,
                         e->key, text, ctext, dtext);
            free(ctext);
        } else if (e->cls == MESH_KEY_REFUSED) {
            st = sim_err(SIM_ERR_INPUT,
                         "%s: %s=%s is refused: %s. shardsim does not simulate this feature and will not answer "
                         "for a configuration it did not simulate; remove the key (default %s) or use MaxText itself",
                         e->where, e->key, text, e->why ? e->why : "not simulated", dtext);
        } else if (sim && !value_in_list(&e->value, sim)) {
            char *stext = mesh_cfg_value_to_text(sim, 0);
            st = sim_err(SIM_ERR_INPUT, "%s: %s=%s is refused: shardsim simulates only %s in %s%s%s%s; choose one of those",
                         e->where, e->key, text, e->key, stext, e->why ? " (" : "", e->why ? e->why : "",
                         e->why ? ")" : "");
            free(stext);
        }
        free(text);
        free(dtext);
        if (st != SIM_OK) return st;
    }
    return SIM_OK;
}

/* ======================================================================== */
/* loading: checks                                                           */
/* ======================================================================== */

static sim_status unknown_key(const mesh_cfg *cfg, const char *key, const mesh_cfg_value *v,
                              const char *layer)
{
    char where[512];
    const char *near = mesh_cfg_closest_key(cfg, key);
    if (cfg->keys_file)
        return sim_err(SIM_ERR_INPUT,
                       "%s: unknown key '%s' in %s: neither MaxText nor shardsim has such a key (%s lists every "
                       "key)%s%s%s; check the spelling (`shardsim keys PATTERN` searches the keys)",
                       mesh_cfg_value_where(v, where, sizeof where), key, layer, cfg->keys_file,
                       near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    return sim_err(SIM_ERR_INPUT,
                   "%s: unknown key '%s' in %s: the base config %s has no such key%s%s%s; "
                   "check the spelling, or add the key to the base config",
                   mesh_cfg_value_where(v, where, sizeof where), key, layer, cfg->base_file,
                   near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
}

/* The value must have the type of the base default (data as schema). */
static sim_status check_type(const mesh_cfg_entry *e, const mesh_cfg_value *base,
                             const mesh_cfg_value *v)
{
    char what[300], where[512];
    snprintf(what, sizeof what, "key '%s'", e->key);
    int v_null = v->kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(v) == MESH_CFG_NULL;
    const char *expected = NULL;
    /* the default itself always passes (MaxText writes '' for some list keys) */
    if (mesh_cfg_value_equal(v, base)) return SIM_OK;
    const char *rtype = e->spec ? field_text(e->spec, "type") : NULL;
    int null_ok = base->kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(base) == MESH_CFG_NULL;
    if (rtype) {
        /* keys.yml types the value (MaxText's type); null only where the default is null */
        mesh_cfg_type vt = mesh_cfg_scalar_type(v);
        long long i;
        if (!strcmp(rtype, "any") || (v_null && null_ok)) expected = NULL;
        else if (!strcmp(rtype, "list")) expected = v->kind == MESH_CFG_LIST || v_null ? NULL : "a list";
        else if (!strcmp(rtype, "map")) expected = v->kind == MESH_CFG_MAP || v_null ? NULL : "a map";
        else if (v->kind != MESH_CFG_SCALAR) expected = !strcmp(rtype, "str") ? "a string" : "a scalar";
        else if (!strcmp(rtype, "bool")) expected = vt == MESH_CFG_BOOL ? NULL : mesh_cfg_type_name(MESH_CFG_BOOL);
        else if (!strcmp(rtype, "int"))
            expected = vt == MESH_CFG_INT || (vt == MESH_CFG_FLOAT && mesh_cfg_value_int(v, what, &i) == SIM_OK)
                           ? NULL
                           : mesh_cfg_type_name(MESH_CFG_INT);
        else if (!strcmp(rtype, "float"))
            expected = vt == MESH_CFG_INT || vt == MESH_CFG_FLOAT ? NULL : mesh_cfg_type_name(MESH_CFG_FLOAT);
        sim_err_clear();
    } else if (base->kind == MESH_CFG_LIST) {
        if (v->kind != MESH_CFG_LIST && !v_null) expected = "a list";
    } else if (base->kind == MESH_CFG_MAP) {
        if (v->kind != MESH_CFG_MAP && !v_null) expected = "a map";
    } else {
        mesh_cfg_type bt = mesh_cfg_scalar_type(base);
        mesh_cfg_type vt = mesh_cfg_scalar_type(v);
        if (bt == MESH_CFG_NULL) {
            /* no default type: anything goes */
        } else if (v->kind != MESH_CFG_SCALAR) {
            expected = bt == MESH_CFG_STRING ? "a string" : mesh_cfg_type_name(bt);
        } else if (bt == MESH_CFG_BOOL) {
            if (vt != MESH_CFG_BOOL) expected = mesh_cfg_type_name(bt);
        } else if (bt == MESH_CFG_INT) {
            long long i;
            if (vt != MESH_CFG_INT && !(vt == MESH_CFG_FLOAT && mesh_cfg_value_int(v, what, &i) == SIM_OK))
                expected = mesh_cfg_type_name(bt);
        } else if (bt == MESH_CFG_FLOAT) {
            if (vt != MESH_CFG_INT && vt != MESH_CFG_FLOAT) expected = mesh_cfg_type_name(bt);
        }
    }
    if (!expected) return SIM_OK;
    char *text = mesh_cfg_value_to_text(v, 0);
    char *btext = mesh_cfg_value_to_text(base, 0);
    sim_status st = sim_err(SIM_ERR_INPUT, "%s: key '%s' = %s is %s, expected %s (its default is %s at %s)",
                            mesh_cfg_value_where(v, where, sizeof where), e->key, text, kind_name(v),
                            expected, btext, e->where);
    free(text);
    free(btext);
    return st;
}

static int is_null(const mesh_cfg_value *v)
{
    return v->kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(v) == MESH_CFG_NULL;
}

/* A logical_axis_rules list: items [name, axes] with axes a name, a list of
 * names, [] or null. */
static sim_status check_rules(const mesh_cfg_value *v)
{
    char where[512];
    if (is_null(v)) return SIM_OK;
    if (v->kind != MESH_CFG_LIST)
        return value_type_error(v, "key 'logical_axis_rules'", "a list of [logical_name, mesh_axes] pairs");
    for (int i = 0; i < v->n; i++) {
        const mesh_cfg_value *r = &v->items[i];
        mesh_cfg_value_where(r, where, sizeof where);
        if (r->kind != MESH_CFG_LIST || r->n != 2 || r->items[0].kind != MESH_CFG_SCALAR ||
            mesh_cfg_scalar_type(&r->items[0]) == MESH_CFG_NULL) {
            char *t = mesh_cfg_value_to_text(r, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "%s: logical_axis_rules item %d is %s; expected a pair "
                                    "[logical_name, mesh_axes] such as ['embed', ['fsdp', 'expert']]",
                                    where, i, t);
            free(t);
            return st;
        }
        const mesh_cfg_value *ax = &r->items[1];
        int ok = ax->kind == MESH_CFG_SCALAR;
        if (ax->kind == MESH_CFG_LIST) {
            ok = 1;
            for (int j = 0; j < ax->n; j++)
                if (ax->items[j].kind != MESH_CFG_SCALAR || is_null(&ax->items[j])) ok = 0;
            for (int j = 0; ok && j < ax->n; j++)
                for (int k = 0; k < j; k++)
                    if (strcmp(ax->items[j].text, ax->items[k].text) == 0) {
                        return sim_err(SIM_ERR_INPUT,
                                       "%s: logical_axis_rules rule '%s' lists mesh axis '%s' twice",
                                       where, r->items[0].text, ax->items[j].text);
                    }
        }
        if (!ok) {
            char *t = mesh_cfg_value_to_text(ax, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "%s: logical_axis_rules rule '%s' maps to %s; expected a mesh "
                                    "axis name, a list of mesh axis names, or []",
                                    where, r->items[0].text, t);
            free(t);
            return st;
        }
    }
    return SIM_OK;
}

/* MaxText's _merge_logical_axis_rules: drop every rule of acc whose name the
 * new list mentions, append the new rules. */
static void rules_merge(mesh_cfg_value *acc, const mesh_cfg_value *add)
{
    if (is_null(add) || add->n == 0) return;
    if (is_null(acc)) {
        value_free(acc);
        acc->kind = MESH_CFG_LIST;
    }
    int w = 0;
    for (int i = 0; i < acc->n; i++) {
        int drop = 0;
        for (int j = 0; j < add->n && !drop; j++)
            drop = strcmp(acc->items[i].items[0].text, add->items[j].items[0].text) == 0;
        if (drop) value_free(&acc->items[i]);
        else acc->items[w++] = acc->items[i];
    }
    acc->n = w;
    for (int j = 0; j < add->n; j++) value_copy(value_push(acc, NULL), &add->items[j]);
}

static sim_status check_name_list(const mesh_cfg_value *v, const char *key, int allow_nested)
{
    if (v->kind != MESH_CFG_LIST) return value_type_error(v, key, "a list of mesh axis names");
    for (int i = 0; i < v->n; i++) {
        const mesh_cfg_value *it = &v->items[i];
        if (allow_nested && it->kind == MESH_CFG_LIST) {
            SIM_TRY(check_name_list(it, key, 0));
            continue;
        }
        if (it->kind != MESH_CFG_SCALAR || is_null(it))
            return value_type_error(it, key, "a mesh axis name");
        for (int j = 0; j < i; j++)
            if (v->items[j].kind == MESH_CFG_SCALAR && strcmp(v->items[j].text, it->text) == 0) {
                char where[512];
                return sim_err(SIM_ERR_INPUT, "%s: %s lists '%s' twice; each mesh axis appears once",
                               mesh_cfg_value_where(it, where, sizeof where), key, it->text);
            }
    }
    return SIM_OK;
}

/* ======================================================================== */
/* loading: the merge                                                        */
/* ======================================================================== */

typedef struct {
    mesh_cfg_value map;   /* MAP of the layer's keys */
    const char *name;     /* "model file x", "file y", "the command line" */
    int config_file;      /* a MaxText config file (base.yml, or a file with base_config):
                             it sits below the model file, as MaxText's argv[1] does */
} layer;

static sim_status parse_override(mesh_cfg *cfg, const char *arg, mesh_cfg_value *map)
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
    mesh_cfg_value v = {0};
    size_t len = strlen(val);
    if (val[0] == '[' || val[0] == '{') {
        sim_status st = yaml_read(cfg, NULL, val, &v);
        if (st != SIM_OK) {
            sim_err_append(" (in %s; lists are YAML flow lists such as [['norm', 'fsdp']])", arg);
            free(key);
            return st;
        }
    } else if (len >= 2 && (val[0] == '\'' || val[0] == '"') && val[len - 1] == val[0]) {
        v.kind = MESH_CFG_SCALAR;
        v.text = strndup(val + 1, len - 2);
        SIM_ASSERT(v.text);
        v.quoted = 1;
    } else {
        v.kind = MESH_CFG_SCALAR;
        v.text = xstrdup(val);
        /* `key=` is an empty string, as OmegaConf reads it, not null. */
        v.quoted = len == 0;
    }
    v.file = CLI_SOURCE;
    v.line = 0;
    mesh_cfg_value *slot = value_push(map, key);
    free(key);
    *slot = v;
    return SIM_OK;
}

/* Checks a layer's keys (known, typed, well-formed rules). */
static sim_status check_layer(const mesh_cfg *cfg, const mesh_cfg_value *base_vals, const layer *l,
                              int allow_base_config)
{
    for (int i = 0; i < l->map.n; i++) {
        const char *key = l->map.keys[i];
        const mesh_cfg_value *v = &l->map.items[i];
        if (allow_base_config && strcmp(key, "base_config") == 0) continue;
        const mesh_cfg_entry *e = mesh_cfg_find(cfg, key);
        if (!e) return unknown_key(cfg, key, v, l->name);
        SIM_TRY(check_type(e, &base_vals[e - cfg->entries], v));
        if (strcmp(key, RULES_KEY) == 0) SIM_TRY(check_rules(v));
        if (strcmp(key, "mesh_axes") == 0) SIM_TRY(check_name_list(v, "key 'mesh_axes'", 0));
    }
    return SIM_OK;
}

/* Sets the layer's values (all but the rules) into the config. */
static void apply_layer(mesh_cfg *cfg, const layer *l, int is_model)
{
    for (int i = 0; i < l->map.n; i++) {
        const char *key = l->map.keys[i];
        if (strcmp(key, RULES_KEY) == 0 || strcmp(key, "base_config") == 0) continue;
        mesh_cfg_entry *e = cfg_find_mut(cfg, key);
        SIM_ASSERT(e);
        value_free(&e->value);
        value_copy(&e->value, &l->map.items[i]);
        free(e->where);
        e->where = where_of(&e->value);
        if (is_model > 0) e->from_model = 1;
        else if (is_model == 0) e->from_user = 1;
    }
}

static int layer_flag(const layer *l, const char *key)
{
    int i = map_index(&l->map, key);
    int b = 0;
    if (i >= 0 && mesh_cfg_value_bool(&l->map.items[i], key, &b) == SIM_OK) return b;
    return 0;
}

static const mesh_cfg_value *layer_value(const layer *l, const char *key)
{
    int i = map_index(&l->map, key);
    return i >= 0 ? &l->map.items[i] : NULL;
}

static void set_rules(mesh_cfg *cfg, mesh_cfg_value *rules, const char *where)
{
    mesh_cfg_entry *e = cfg_find_mut(cfg, RULES_KEY);
    SIM_ASSERT(e);
    value_free(&e->value);
    e->value = *rules;
    memset(rules, 0, sizeof *rules);
    free(e->where);
    e->where = xstrdup(where);
}

/* Sets a derived scalar value with a descriptive source. */
static void set_derived(mesh_cfg *cfg, const char *key, const char *text, const char *where)
{
    mesh_cfg_entry *e = cfg_find_mut(cfg, key);
    SIM_ASSERT(e);
    value_free(&e->value);
    e->value.kind = MESH_CFG_SCALAR;
    e->value.text = xstrdup(text);
    e->value.quoted = 1;
    e->value.file = cfg_intern(cfg, where);
    e->value.line = 0;
    free(e->where);
    e->where = xstrdup(where);
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Finds <dir>/<sub>/<name>.yml among the config dirs. */
static char *find_named_file(char *const *dirs, int n_dirs, const char *sub, const char *name)
{
    for (int i = 0; i < n_dirs; i++) {
        char *p = xasprintf("%s/%s/%s.yml", dirs[i], sub, name);
        if (file_exists(p)) return p;
        free(p);
    }
    return NULL;
}

static sim_status apply_custom(mesh_cfg *cfg, const mesh_cfg_value *base_vals, char *const *dirs,
                               int n_dirs, const mesh_cfg_entry *sel, int user_set_cp)
{
    const char *name = sel->value.text;
    char *path = NULL;
    if (ends_with(name, ".yml") || ends_with(name, ".yaml") || strchr(name, '/'))
        path = file_exists(name) ? xstrdup(name) : NULL;
    else
        path = find_named_file(dirs, n_dirs, "custom_mesh_and_rule", name);
    if (!path) {
        char *sub = xasprintf("%s/custom_mesh_and_rule", dirs[0]);
        char *avail = list_yml(sub);
        sim_status st = sim_err(SIM_ERR_INPUT,
                                "custom_mesh_and_rule=%s (%s): no file %s/%s.yml; available: %s",
                                name, sel->where, sub, name, avail);
        free(sub);
        free(avail);
        return st;
    }
    layer l = {{0}, "a custom_mesh_and_rule file", 0};
    sim_status st = yaml_read(cfg, path, NULL, &l.map);
    if (st == SIM_OK) st = check_layer(cfg, base_vals, &l, 0);
    static const char *const replaced[] = {"mesh_axes", "logical_axis_rules", "data_sharding"};
    for (int k = 0; st == SIM_OK && k < 3; k++) {
        const mesh_cfg_value *v = layer_value(&l, replaced[k]);
        if (!v) continue;
        mesh_cfg_entry *e = cfg_find_mut(cfg, replaced[k]);
        value_free(&e->value);
        value_copy(&e->value, v);
        free(e->where);
        e->where = where_of(v);
    }
    /* context_sharding := first axis of the activation_length rule (types.py
     * infer_cp_axes), unless the user chose it. */
    const mesh_cfg_entry *rules = mesh_cfg_find(cfg, RULES_KEY);
    if (st == SIM_OK && !user_set_cp && rules && mesh_cfg_find(cfg, "context_sharding") &&
        rules->value.kind == MESH_CFG_LIST) {
        for (int i = 0; i < rules->value.n; i++) {
            const mesh_cfg_value *r = &rules->value.items[i];
            if (strcmp(r->items[0].text, "activation_length") != 0) continue;
            const mesh_cfg_value *ax = &r->items[1];
            /* MaxText accepts only these two as context_sharding; the legacy
             * rules start activation_length with 'sequence', so skip others. */
            const char *first = NULL;
            int n_ax = ax->kind == MESH_CFG_LIST ? ax->n : (is_null(ax) ? 0 : 1);
            for (int j = 0; j < n_ax && !first; j++) {
                const char *t = ax->kind == MESH_CFG_LIST ? ax->items[j].text : ax->text;
                if (!strcmp(t, "context") || !strcmp(t, "expert")) first = t;
            }
            if (first) {
                char where[600];
                snprintf(where, sizeof where,
                         "inferred from custom_mesh_and_rule=%s (first axis of rule activation_length)",
                         name);
                set_derived(cfg, "context_sharding", first, where);
            }
            break;
        }
    }
    value_free(&l.map);
    if (st == SIM_OK) {
        free(cfg->custom_file);
        cfg->custom_file = path;
    } else {
        free(path);
    }
    return st;
}

/* compile_topology=NAME (MaxText's ahead-of-time target): the devices and
 * slices of that topology, from <configs>/topologies.yml, and a dry run (there
 * is nothing to train on).  As in MaxText's train_compile, the slice count is
 * compile_topology_num_slices and must be positive. */
static sim_status apply_topology(mesh_cfg *cfg, const char *configs_dir)
{
    const mesh_cfg_entry *t = mesh_cfg_find(cfg, "compile_topology");
    if (!t || t->value.kind != MESH_CFG_SCALAR || is_null(&t->value) || !*t->value.text) return SIM_OK;
    const char *name = t->value.text;
    long long slices;
    SIM_TRY(mesh_cfg_get_int(cfg, "compile_topology_num_slices", &slices));
    if (slices < 1)
        return sim_err(SIM_ERR_INPUT,
                       "compile_topology=%s (%s) needs compile_topology_num_slices >= 1 (it is %lld); MaxText's "
                       "train_compile requires it too: add compile_topology_num_slices=1",
                       name, t->where, slices);
    char *path = join_path(configs_dir, "topologies.yml");
    mesh_cfg_value doc = {0};
    sim_status st = file_exists(path) ? yaml_read(cfg, path, NULL, &doc)
                                      : sim_err(SIM_ERR_INPUT, "compile_topology=%s: no topology table %s", name, path);
    const mesh_cfg_value *table = st == SIM_OK ? map_get(&doc, "topologies") : NULL;
    const mesh_cfg_value *dps = map_get(table, name);
    long long per_slice = 0;
    if (st == SIM_OK && !dps) {
        const char *near = NULL;
        int best = INT_MAX;
        for (int i = 0; table && i < table->n; i++) {
            int d = mesh_edit_distance(name, table->keys[i]);
            if (d < best) best = d, near = table->keys[i];
        }
        st = sim_err(SIM_ERR_INPUT, "compile_topology=%s (%s): not a topology in %s%s%s%s; use a MaxText name like v5p-8",
                     name, t->where, path, near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    }
    if (st == SIM_OK) st = mesh_cfg_value_int(dps, "a topology size", &per_slice);
    if (st == SIM_OK) {
        long long devices = per_slice * slices;
        char nd[32], ns[32], where[600];
        snprintf(nd, sizeof nd, "%lld", devices);
        snprintf(ns, sizeof ns, "%lld", slices);
        snprintf(where, sizeof where, "compile_topology=%s x compile_topology_num_slices=%lld", name, slices);
        /* a device or slice count the user gave must agree with the topology */
        static const char *const keys[] = {"num_devices", "num_slices"};
        const char *vals[] = {nd, ns};
        for (int k = 0; k < 2 && st == SIM_OK; k++) {
            const mesh_cfg_entry *e = mesh_cfg_find(cfg, keys[k]);
            long long v;
            if (e && e->from_user && mesh_cfg_value_int(&e->value, keys[k], &v) == SIM_OK && v != -1 &&
                v != atoll(vals[k]))
                st = sim_err(SIM_ERR_INPUT, "%s=%lld (%s) disagrees with %s (%s devices in %s slices); drop %s",
                             keys[k], v, e->where, where, nd, ns, keys[k]);
            if (st == SIM_OK) sim_err_clear(); /* a non-integer value was not an error here */
            if (st == SIM_OK && e) {
                set_derived(cfg, keys[k], vals[k], where);
                cfg_find_mut(cfg, keys[k])->value.quoted = 0; /* a number, not a string */
            }
        }
        if (st == SIM_OK && mesh_cfg_find(cfg, "dry_run")) {
            set_derived(cfg, "dry_run", "true", where);
            cfg_find_mut(cfg, "dry_run")->value.quoted = 0;
        }
    }
    value_free(&doc);
    free(path);
    return st;
}

/* MaxText's combination checks (configs/types.py, 0.2.5) that concern what is
 * simulated, with MaxText's conditions; run after merging, when the config has
 * the full key set (keys.yml).  Each message names the keys and the fix. */
static sim_status maxtext_combination_rules(const mesh_cfg *cfg)
{
    long long experts, dense, interleave = 1, inhomog = 1;
    double mlp, moe_mlp, update_rate;
    int routed_bias;
    const char *decoder, *cs, *lp, *lfs;
    SIM_TRY(mesh_cfg_get_int(cfg, "num_experts", &experts));
    SIM_TRY(mesh_cfg_get_int(cfg, "first_num_dense_layers", &dense));
    SIM_TRY(mesh_cfg_get_double(cfg, "base_mlp_dim", &mlp));
    SIM_TRY(mesh_cfg_get_double(cfg, "base_moe_mlp_dim", &moe_mlp));
    SIM_TRY(mesh_cfg_get_str(cfg, "decoder_block", &decoder));
    if (mesh_cfg_find(cfg, "interleave_moe_layer_step")) SIM_TRY(mesh_cfg_get_int(cfg, "interleave_moe_layer_step", &interleave));
    if (mesh_cfg_find(cfg, "inhomogeneous_layer_cycle_interval"))
        SIM_TRY(mesh_cfg_get_int(cfg, "inhomogeneous_layer_cycle_interval", &inhomog));
    if (experts > 1) {
        if (moe_mlp <= 0)
            return sim_err(SIM_ERR_INPUT, "num_experts=%lld needs base_moe_mlp_dim > 0 (it is %g): MaxText requires a "
                                          "positive expert width for MoE models; set base_moe_mlp_dim",
                           experts, moe_mlp);
        /* a model whose every layer is MoE has one MLP width */
        if (interleave == 1 && dense == 0 && inhomog == 1 && mlp != moe_mlp)
            return sim_err(SIM_ERR_INPUT,
                           "num_experts=%lld with first_num_dense_layers=0 is a fully MoE model: MaxText requires "
                           "base_mlp_dim (%g) to equal base_moe_mlp_dim (%g); make them equal or keep dense layers",
                           experts, mlp, moe_mlp);
        SIM_TRY(mesh_cfg_get_bool(cfg, "routed_bias", &routed_bias));
        SIM_TRY(mesh_cfg_get_double(cfg, "routed_bias_update_rate", &update_rate));
        if (routed_bias && update_rate > 0 && decoder && strcmp(decoder, "deepseek"))
            return sim_err(SIM_ERR_INPUT, "routed_bias_update_rate=%g with decoder_block=%s: MaxText supports loss-free "
                                          "load balancing only for the DeepSeek decoder",
                           update_rate, decoder);
    }
    SIM_TRY(mesh_cfg_get_str(cfg, "context_sharding", &cs));
    if (!cs || (strcmp(cs, "context") && strcmp(cs, "expert")))
        return sim_err(SIM_ERR_INPUT, "context_sharding=%s: MaxText supports only 'context' or 'expert'",
                       cs ? cs : "None");
    SIM_TRY(mesh_cfg_get_str(cfg, "load_parameters_path", &lp));
    SIM_TRY(mesh_cfg_get_str(cfg, "load_full_state_path", &lfs));
    if (lp && *lp && lfs && *lfs)
        return sim_err(SIM_ERR_INPUT, "load_parameters_path and load_full_state_path are both set: MaxText allows at most "
                                      "one; keep one of them");
    int ckpt_on = 1;
    if (lfs && *lfs) SIM_TRY(mesh_cfg_get_bool(cfg, "enable_checkpointing", &ckpt_on));
    if (!ckpt_on) /* types.py: a full-state resume goes through the checkpoint manager */
        return sim_err(SIM_ERR_INPUT, "load_full_state_path=%s with enable_checkpointing=false: MaxText resumes the full "
                                      "state only with checkpointing on; set enable_checkpointing=true, or use "
                                      "load_parameters_path to start from the parameters alone", lfs);
    return SIM_OK;
}

/* ======================================================================== */
/* combinations MaxText rejects (configs/combinations.yml)                   */
/* ======================================================================== */

/* A scalar's number, when it is one. */
static int scalar_number(const mesh_cfg_value *v, double *out)
{
    if (v->kind != MESH_CFG_SCALAR) return 0;
    mesh_cfg_type t = mesh_cfg_scalar_type(v);
    if (t != MESH_CFG_INT && t != MESH_CFG_FLOAT) return 0;
    if (mesh_cfg_value_double(v, "", out) != SIM_OK) {
        sim_err_clear();
        return 0;
    }
    return 1;
}

/* Whether config value v equals rule value r: numbers and booleans by value, null with null,
 * text without case. */
static int combo_equal(const mesh_cfg_value *v, const mesh_cfg_value *r)
{
    if (v->kind != MESH_CFG_SCALAR || r->kind != MESH_CFG_SCALAR) return 0;
    if (is_null(v) || is_null(r)) return is_null(v) && is_null(r);
    double a, b;
    if (scalar_number(v, &a) && scalar_number(r, &b)) return a == b;
    int x, y;
    if (mesh_cfg_scalar_type(v) == MESH_CFG_BOOL && mesh_cfg_scalar_type(r) == MESH_CFG_BOOL)
        return bool_word(v->text, &x) && bool_word(r->text, &y) && x == y;
    return v->text && r->text && !strcasecmp(v->text, r->text);
}

static int combo_in(const mesh_cfg_value *v, const mesh_cfg_value *list)
{
    for (int i = 0; list->kind == MESH_CFG_LIST && i < list->n; i++)
        if (combo_equal(v, &list->items[i])) return 1;
    return 0;
}

/* Whether condition c (a scalar, or a one-entry map {op: value}) holds for value v. */
static sim_status combo_holds(const mesh_cfg_value *v, const mesh_cfg_value *c, const char *file, int *holds)
{
    *holds = 0;
    if (c->kind != MESH_CFG_MAP) {
        *holds = combo_equal(v, c);
        return SIM_OK;
    }
    if (c->n != 1)
        return sim_err(SIM_ERR_INPUT, "%s:%d: a condition is one {op: value} (ne, gt, ge, lt, le, in, not_in, empty)",
                       file, c->line);
    const char *op = c->keys[0];
    const mesh_cfg_value *r = &c->items[0];
    if (!strcmp(op, "empty")) {
        int want;
        SIM_TRY(mesh_cfg_value_bool(r, "empty", &want));
        int empty = v->kind == MESH_CFG_LIST   ? v->n == 0
                    : v->kind == MESH_CFG_MAP  ? v->n == 0
                                               : is_null(v) || !v->text || !*v->text;
        *holds = empty == want;
        return SIM_OK;
    }
    if (v->kind == MESH_CFG_SCALAR && is_null(v)) return SIM_OK; /* None compares with nothing */
    if (!strcmp(op, "ne")) *holds = !combo_equal(v, r);
    else if (!strcmp(op, "in")) *holds = combo_in(v, r);
    else if (!strcmp(op, "not_in")) *holds = !combo_in(v, r);
    else if (!strcmp(op, "gt") || !strcmp(op, "ge") || !strcmp(op, "lt") || !strcmp(op, "le")) {
        double a, b;
        if (!scalar_number(v, &a) || !scalar_number(r, &b)) return SIM_OK;
        *holds = op[0] == 'g' ? (op[1] == 't' ? a > b : a >= b) : (op[1] == 't' ? a < b : a <= b);
    } else
        return sim_err(SIM_ERR_INPUT, "%s:%d: unknown condition '%s' (ne, gt, ge, lt, le, in, not_in, empty)", file,
                       c->line, op);
    return SIM_OK;
}

/* Applies every rule of combinations.yml (found beside ranges.yml; none, no checks). */
static sim_status check_combinations(mesh_cfg *cfg, char *const *dirs, int n_dirs)
{
    char *path = NULL;
    for (int i = 0; i < n_dirs && !path; i++) {
        char *p = join_path(dirs[i], "combinations.yml");
        if (file_exists(p)) path = p;
        else free(p);
    }
    if (!path) return SIM_OK;
    mesh_cfg_value doc = {0};
    sim_status st = yaml_read(cfg, path, NULL, &doc);
    const mesh_cfg_value *rules = st == SIM_OK ? map_get(&doc, "rules") : NULL;
    if (st == SIM_OK && (!rules || rules->kind != MESH_CFG_LIST))
        st = sim_err(SIM_ERR_INPUT, "%s: expected a list under 'rules'", path);
    const mesh_release *rel = NULL;
    if (st == SIM_OK && mesh_cfg_find(cfg, "maxtext_release")) st = mesh_release_of(cfg, &rel);
    for (int k = 0; st == SIM_OK && k < rules->n; k++) {
        const mesh_cfg_value *r = &rules->items[k], *when = map_get(r, "when"), *says = map_get(r, "says"),
                             *fix = map_get(r, "fix"), *where = map_get(r, "where");
        if (!when || when->kind != MESH_CFG_MAP || !says || !fix || !where) {
            st = sim_err(SIM_ERR_INPUT, "%s:%d: a rule needs where, when (a map of key conditions), says and fix", path,
                         r->line);
            break;
        }
        int all = 1;
        for (int c = 0; st == SIM_OK && all && c < when->n; c++) {
            const mesh_cfg_entry *e = mesh_cfg_find(cfg, when->keys[c]);
            /* a key this config, or the release it follows, does not have: the rule does not apply */
            if (!e || mesh_release_lacks_key(rel, when->keys[c])) {
                all = 0;
                break;
            }
            st = combo_holds(&e->value, &when->items[c], path, &all);
        }
        if (st != SIM_OK || !all) continue;
        sbuf b = {0};
        for (int c = 0; c < when->n; c++) {
            const mesh_cfg_entry *e = mesh_cfg_find(cfg, when->keys[c]);
            char *t = mesh_cfg_value_to_text(&e->value, 0);
            sb_putf(&b, "%s%s=%s", c ? ", " : "", e->key, t);
            free(t);
        }
        st = sim_err(SIM_ERR_INPUT, "%s: MaxText %s rejects this combination (%s): %s; %s", b.s ? b.s : "",
                     mesh_release_maxtext(rel), where->text ? where->text : "?", says->text ? says->text : "?", fix->text ? fix->text : "?");
        free(b.s);
    }
    value_free(&doc);
    free(path);
    return st;
}

static sim_status check_final(const mesh_cfg *cfg)
{
    const mesh_cfg_entry *e = mesh_cfg_find(cfg, "mesh_axes");
    if (e) SIM_TRY(check_name_list(&e->value, "key 'mesh_axes'", 0));
    e = mesh_cfg_find(cfg, RULES_KEY);
    if (e) SIM_TRY(check_rules(&e->value));
    e = mesh_cfg_find(cfg, "data_sharding");
    if (e && !is_null(&e->value)) SIM_TRY(check_name_list(&e->value, "key 'data_sharding'", 1));
    return SIM_OK;
}

/* data_sharding given as a flat list means one group (pyconfig does the same). */
static void normalize_data_sharding(mesh_cfg *cfg)
{
    mesh_cfg_entry *e = cfg_find_mut(cfg, "data_sharding");
    if (!e || e->value.kind != MESH_CFG_LIST || e->value.n == 0 ||
        e->value.items[0].kind != MESH_CFG_SCALAR)
        return;
    mesh_cfg_value inner = e->value;
    memset(&e->value, 0, sizeof e->value);
    e->value.kind = MESH_CFG_LIST;
    e->value.file = inner.file;
    e->value.line = inner.line;
    *value_push(&e->value, NULL) = inner;
}

/* ======================================================================== */
/* value ranges (configs/ranges.yml)                                         */
/* ======================================================================== */

/* One bound of a range entry: *has = 0 when the entry does not set it. */
static sim_status range_bound(const mesh_cfg_value *r, const char *name, const char *key, int *has, double *out)
{
    int i = map_index(r, name);
    *has = i >= 0;
    if (i < 0) return SIM_OK;
    SIM_TRY(mesh_cfg_value_double(&r->items[i], name, out));
    return SIM_OK;
}

static void put_num(sbuf *b, double d)
{
    if (d == floor(d) && fabs(d) < 1e15) sb_putf(b, "%.0f", d);
    else sb_putf(b, "%g", d);
}

/* Checks key=v against range entry r ({gt|ge, lt|le, or: [...]}). */
static sim_status range_check(const mesh_cfg_entry *e, const mesh_cfg_value *r, const char *rfile)
{
    if (r->kind != MESH_CFG_MAP)
        return sim_err(SIM_ERR_INPUT, "%s: the range of '%s' is not a map like {ge: 0, le: 1}", rfile, e->key);
    const mesh_cfg_value *v = &e->value;
    if (v->kind != MESH_CFG_SCALAR || mesh_cfg_scalar_type(v) == MESH_CFG_NULL) return SIM_OK; /* typed elsewhere */
    mesh_cfg_type t = mesh_cfg_scalar_type(v);
    if (t != MESH_CFG_INT && t != MESH_CFG_FLOAT) return SIM_OK; /* check_type refuses non-numbers */
    double x;
    SIM_TRY(mesh_cfg_value_double(v, e->key, &x));
    int has_gt, has_ge, has_lt, has_le;
    double gt, ge, lt, le;
    SIM_TRY(range_bound(r, "gt", e->key, &has_gt, &gt));
    SIM_TRY(range_bound(r, "ge", e->key, &has_ge, &ge));
    SIM_TRY(range_bound(r, "lt", e->key, &has_lt, &lt));
    SIM_TRY(range_bound(r, "le", e->key, &has_le, &le));
    int ok = isfinite(x);
    if (has_gt) ok = ok && x > gt;
    if (has_ge) ok = ok && x >= ge;
    if (has_lt) ok = ok && x < lt;
    if (has_le) ok = ok && x <= le;
    int oi = map_index(r, "or");
    for (int k = 0; !ok && oi >= 0 && k < r->items[oi].n; k++) {
        double y;
        SIM_TRY(mesh_cfg_value_double(&r->items[oi].items[k], "or", &y));
        ok = x == y;
    }
    if (ok) return SIM_OK;
    sbuf b = {0};
    if (has_gt || has_ge) {
        put_num(&b, has_gt ? gt : ge);
        sb_putf(&b, " %s ", has_gt ? "<" : "<=");
    }
    sb_putf(&b, "%s", e->key);
    if (has_lt || has_le) {
        sb_putf(&b, " %s ", has_lt ? "<" : "<=");
        put_num(&b, has_lt ? lt : le);
    }
    for (int k = 0; oi >= 0 && k < r->items[oi].n; k++)
        sb_putf(&b, ", or %s", r->items[oi].items[k].text ? r->items[oi].items[k].text : "?");
    sim_status st = sim_err(SIM_ERR_INPUT,
                            "%s=%s (%s): out of range%s; the valid range is %s (%s); set a value in that range",
                            e->key, v->text, e->where, isfinite(x) ? "" : " (not a finite number)",
                            b.s ? b.s : "?", rfile);
    free(b.s);
    return st;
}

/* Checks every numeric key that has an entry in ranges.yml (found beside
 * the base config or its chain's last file; no file, no checks — a test's
 * own base config has none). */
static sim_status check_ranges(mesh_cfg *cfg, char *const *dirs, int n_dirs)
{
    char *path = NULL;
    for (int i = 0; i < n_dirs && !path; i++) {
        char *p = join_path(dirs[i], "ranges.yml");
        if (file_exists(p)) path = p;
        else free(p);
    }
    if (!path) return SIM_OK;
    mesh_cfg_value map = {0};
    sim_status st = yaml_read(cfg, path, NULL, &map);
    for (int i = 0; st == SIM_OK && i < map.n; i++) {
        const char *pat = map.keys[i];
        if (strchr(pat, '*')) {
            for (int k = 0; st == SIM_OK && k < cfg->n; k++)
                if (fnmatch(pat, cfg->entries[k].key, 0) == 0)
                    st = range_check(&cfg->entries[k], &map.items[i], path);
        } else {
            const mesh_cfg_entry *e = mesh_cfg_find(cfg, pat);
            if (e) st = range_check(e, &map.items[i], path);
        }
    }
    value_free(&map);
    free(path);
    return st;
}

/* ======================================================================== */
/* model files and their decoder blocks                                      */
/* ======================================================================== */

/* keys.yml's decoder_block line: `simulated` (the blocks shardsim runs) and `choices` (MaxText's
 * DecoderBlockType values); NULL without keys.yml or without the field. */
static const mesh_cfg_value *block_field(const mesh_cfg *cfg, const char *field)
{
    const mesh_cfg_entry *e = mesh_cfg_find(cfg, "decoder_block");
    return e ? mesh_cfg_entry_field(e, field) : NULL;
}

static int block_in(const mesh_cfg_value *list, const char *block)
{
    for (int i = 0; list && list->kind == MESH_CFG_LIST && i < list->n; i++)
        if (list->items[i].kind == MESH_CFG_SCALAR && !strcmp(list->items[i].text, block)) return 1;
    return 0;
}

int mesh_cfg_block_simulated(const mesh_cfg *cfg, const char *block)
{
    const mesh_cfg_value *sim = block_field(cfg, "simulated");
    return !sim || block_in(sim, block);
}

char *mesh_cfg_block_about(const mesh_cfg *cfg, const char *block)
{
    char *path = join_path(cfg->configs_dir, "decoder_blocks.yml");
    char *about = NULL;
    if (file_exists(path)) {
        mesh_cfg *holder = cfg_new();
        mesh_cfg_value doc = {0};
        if (yaml_read(holder, path, NULL, &doc) == SIM_OK) {
            const mesh_cfg_value *blocks = map_get(&doc, "blocks");
            const mesh_cfg_value *b = blocks ? map_get(blocks, block) : NULL;
            const char *cls = b ? field_text(b, "layer") : NULL, *has = b ? field_text(b, "has") : NULL;
            if (cls && has) about = xasprintf("%s: %s", cls, has);
        }
        sim_err_clear(); /* a broken description file only loses the description */
        value_free(&doc);
        mesh_cfg_free(holder);
    }
    free(path);
    return about;
}

/* "the llama2 and deepseek decoder blocks" */
static char *simulated_blocks_text(const mesh_cfg *cfg)
{
    const mesh_cfg_value *sim = block_field(cfg, "simulated");
    sbuf b = {0};
    sb_putf(&b, "the ");
    int n = sim && sim->kind == MESH_CFG_LIST ? sim->n : 0;
    for (int i = 0; i < n; i++)
        sb_putf(&b, "%s%s", i == 0 ? "" : i == n - 1 ? " and " : ", ", sim->items[i].text);
    sb_putf(&b, " decoder block%s", n == 1 ? "" : "s");
    return b.s;
}

/* A layer that sets decoder_block to a MaxText block shardsim does not simulate is refused by its
 * block before its keys are checked: its other keys belong to that block's layer
 * (vision_encoder_block, log_moe_bias_norms, ...), and an unknown or refused key would hide the
 * reason.  A value MaxText does not know is left to the registry check (its `choices`). */
static sim_status refuse_block(const mesh_cfg *cfg, const mesh_cfg_value *v, const char *model_name)
{
    if (!v || v->kind != MESH_CFG_SCALAR || is_null(v) || mesh_cfg_block_simulated(cfg, v->text)) return SIM_OK;
    const mesh_cfg_value *choices = block_field(cfg, "choices");
    if (choices && !block_in(choices, v->text)) return SIM_OK;
    char where[512];
    char *about = mesh_cfg_block_about(cfg, v->text);
    char *sim = simulated_blocks_text(cfg);
    char *who = model_name ? xasprintf("model_name=%s is refused: %s sets decoder_block=%s", model_name,
                                       mesh_cfg_value_where(v, where, sizeof where), v->text)
                           : xasprintf("%s: decoder_block=%s is refused", mesh_cfg_value_where(v, where, sizeof where),
                                       v->text);
    sim_status st = sim_err(SIM_ERR_INPUT,
                            "%s: MaxText's %s decoder block%s%s%s is not simulated yet; shardsim simulates %s "
                            "(`shardsim models` lists every model name with its decoder block and status)",
                            who, v->text, about ? " (" : "", about ? about : "", about ? ")" : "", sim);
    free(who);
    free(sim);
    free(about);
    return st;
}

static int model_file_cmp(const void *a, const void *b)
{
    return strcmp(((const mesh_model_file *)a)->name, ((const mesh_model_file *)b)->name);
}

sim_status mesh_cfg_model_files(const mesh_cfg *cfg, mesh_model_file **out, int *n_out)
{
    *out = NULL;
    *n_out = 0;
    char *dir = join_path(cfg->configs_dir, "models");
    DIR *d = opendir(dir);
    if (!d) {
        sim_status st = sim_err(SIM_ERR_INPUT, "cannot list the model files in %s: %s", dir, strerror(errno));
        free(dir);
        return st;
    }
    const mesh_cfg_entry *db = mesh_cfg_find(cfg, "decoder_block");
    const mesh_cfg_value *def = db ? mesh_cfg_entry_field(db, "default") : NULL;
    mesh_model_file *m = NULL;
    int n = 0, cap = 0;
    sim_status st = SIM_OK;
    struct dirent *de;
    while (st == SIM_OK && (de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len <= 4 || strcmp(de->d_name + len - 4, ".yml") != 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            m = realloc(m, (size_t)cap * sizeof *m);
            SIM_ASSERT(m);
        }
        mesh_model_file *f = &m[n++];
        f->name = strndup(de->d_name, len - 4);
        SIM_ASSERT(f->name);
        f->file = join_path(dir, de->d_name);
        mesh_cfg *holder = cfg_new();
        mesh_cfg_value doc = {0};
        st = yaml_read(holder, f->file, NULL, &doc);
        const mesh_cfg_value *b = st == SIM_OK ? map_get(&doc, "decoder_block") : NULL;
        f->block = xstrdup(b && b->kind == MESH_CFG_SCALAR ? b->text
                           : def && def->kind == MESH_CFG_SCALAR ? def->text : "default");
        value_free(&doc);
        mesh_cfg_free(holder);
    }
    closedir(d);
    free(dir);
    if (st != SIM_OK) {
        mesh_model_files_free(m, n);
        return st;
    }
    if (n) qsort(m, (size_t)n, sizeof *m, model_file_cmp);
    *out = m;
    *n_out = n;
    return SIM_OK;
}

void mesh_model_files_free(mesh_model_file *m, int n)
{
    for (int i = 0; i < n; i++) {
        free(m[i].name);
        free(m[i].file);
        free(m[i].block);
    }
    free(m);
}

/* The model names of the configs directory grouped by decoder block, simulated blocks first:
 * "llama2 (simulated): llama2-7b, llama3-8b; ...; gemma (not simulated): gemma-2b, ...". */
static char *models_available(const mesh_cfg *cfg)
{
    mesh_model_file *m = NULL;
    int n = 0;
    if (mesh_cfg_model_files(cfg, &m, &n) != SIM_OK) {
        char *s = xasprintf("(%s)", sim_errmsg());
        sim_err_clear();
        return s;
    }
    sbuf b = {0};
    sb_putf(&b, "%s", n ? "" : "(no model files)");
    int groups = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            int first = 1;
            for (int k = 0; k < i && first; k++) first = strcmp(m[k].block, m[i].block) != 0;
            if (!first || mesh_cfg_block_simulated(cfg, m[i].block) != (pass == 0)) continue;
            sb_putf(&b, "%s%s (%s):", groups++ ? "; " : "", m[i].block, pass == 0 ? "simulated" : "not simulated");
            for (int k = i; k < n; k++)
                if (!strcmp(m[k].block, m[i].block)) sb_putf(&b, " %s", m[k].name);
        }
    mesh_model_files_free(m, n);
    return b.s;
}

/* MaxText's model file name for a model_name: pyconfig drops "-Instruct" (an instruction-tuned
 * model has its base model's architecture, so llama3.1-8b-Instruct reads llama3.1-8b.yml). */
static char *model_file_name(const char *model_name)
{
    sbuf b = {0};
    sb_putf(&b, "%s", "");
    for (const char *s = model_name; *s;) {
        if (!strncmp(s, "-Instruct", 9)) {
            s += 9;
            continue;
        }
        sb_putf(&b, "%c", *s++);
    }
    return b.s;
}

/* maxtext_release (mesh/release.h): a key the release does not know is refused, naming the
 * release; the release's base rule set (mesh_axes, data_sharding, logical_axis_rules) takes the
 * place of the base file's, before the model's and the user's rules merge in, as the release's own
 * base.yml would.  Values a model file or the user set are kept. */
static sim_status apply_release(mesh_cfg *cfg, const layer *user, int n_user)
{
    if (!mesh_cfg_find(cfg, "maxtext_release")) return SIM_OK; /* a base without the key: no release */
    const mesh_release *r;
    SIM_TRY(mesh_release_of(cfg, &r));
    for (int i = 0; i < n_user; i++) {
        if (user[i].config_file) continue;
        for (int k = 0; k < user[i].map.n; k++) {
            if (!mesh_release_lacks_key(r, user[i].map.keys[k])) continue;
            char where[512];
            return sim_err(SIM_ERR_INPUT,
                           "key '%s' (%s): MaxText %s has no such key (maxtext_release=%s follows that release; "
                           "the key came later); drop it, or follow a release that has it (maxtext_release=%s)",
                           user[i].map.keys[k], mesh_cfg_value_where(&user[i].map.items[k], where, sizeof where),
                           mesh_release_maxtext(r), mesh_release_maxtext(r), MESH_RELEASE_DEFAULT);
        }
    }
    const char *br = mesh_release_base_rules(r);
    if (!br) return SIM_OK;
    mesh_cfg_value doc = {0};
    SIM_TRY(yaml_read(cfg, br, NULL, &doc));
    static const char *const replaced[] = {"mesh_axes", "logical_axis_rules", "data_sharding"};
    sim_status st = SIM_OK;
    for (int k = 0; k < 3 && st == SIM_OK; k++) {
        const mesh_cfg_value *v = map_get(&doc, replaced[k]);
        mesh_cfg_entry *e = cfg_find_mut(cfg, replaced[k]);
        if (!v) st = sim_err(SIM_ERR_INPUT, "%s: a release's base_rules file needs %s", br, replaced[k]);
        if (st != SIM_OK || !e || e->from_user || e->from_model) continue;
        value_free(&e->value);
        value_copy(&e->value, v);
        free(e->where);
        e->where = where_of(v);
    }
    value_free(&doc);
    if (st == SIM_OK) st = check_final(cfg);
    return st;
}

sim_status mesh_cfg_load(const mesh_cfg_args *args, mesh_cfg **out)
{
    *out = NULL;
    const char *base_file = args && args->base_file ? args->base_file : "configs/base.yml";
    mesh_cfg *cfg = cfg_new();
    cfg->base_file = xstrdup(base_file);
    char *chain[CHAIN_MAX] = {0};
    int n_chain = 0;
    int n_user = (args ? args->n_files : 0) + 1;
    layer *user = calloc((size_t)n_user, sizeof *user);
    layer model = {{0}, "the model file", 0};
    mesh_cfg_value base_map = {0}, rules = {0}, user_rules = {0};
    mesh_cfg_value *base_vals = NULL;
    int n_base = 0;
    char *dirs[3] = {NULL, NULL, NULL};
    int n_dirs = 0;
    SIM_ASSERT(user);
    sim_status st = SIM_OK;

    /* 1. base chain -> known keys */
    st = load_chain(cfg, base_file, chain, &n_chain, &base_map);
    if (st != SIM_OK) goto done;
    cfg_take_map(cfg, &base_map);
    dirs[n_dirs++] = xstrdup(args && args->configs_dir ? args->configs_dir : "");
    if (!*dirs[0]) {
        free(dirs[0]);
        dirs[0] = dir_of(base_file);
    }
    if (n_chain > 1) dirs[n_dirs++] = dir_of(chain[n_chain - 1]);
    cfg->configs_dir = xstrdup(dirs[0]);
    if ((st = registry_apply(cfg, dirs[0])) != SIM_OK) goto done;
    n_base = cfg->n;
    base_vals = calloc(cfg->n > 0 ? (size_t)cfg->n : 1, sizeof *base_vals);
    SIM_ASSERT(base_vals);
    for (int i = 0; i < cfg->n; i++) value_copy(&base_vals[i], &cfg->entries[i].value);
    if ((st = check_final(cfg)) != SIM_OK) goto done;

    /* user layers: read and check now so that their mistakes surface first */
    for (int i = 0; args && i < args->n_files; i++) {
        layer *l = &user[i];
        l->name = cfg_intern(cfg, args->files[i]);
        if ((st = yaml_read(cfg, args->files[i], NULL, &l->map)) != SIM_OK) goto done;
        const mesh_cfg_value *bc = layer_value(l, "base_config");
        {
            const char *slash = strrchr(args->files[i], '/');
            l->config_file = bc != NULL || !strcmp(slash ? slash + 1 : args->files[i], "base.yml");
        }
        if (bc) {
            /* A user file may name the base it was written against (MaxText
             * style); it must be a file of the loaded base chain. */
            char *d = dir_of(args->files[i]);
            char *p = join_path(d, bc->kind == MESH_CFG_SCALAR ? bc->text : "");
            char real[PATH_MAX];
            int ok = 0;
            if (realpath(p, real) || (bc->kind == MESH_CFG_SCALAR && realpath(bc->text, real)))
                for (int k = 0; k < n_chain; k++) ok |= strcmp(chain[k], real) == 0;
            free(d);
            free(p);
            if (!ok) {
                char where[512];
                st = sim_err(SIM_ERR_INPUT,
                             "%s: base_config '%s' is not the loaded base config %s; pass that file "
                             "as the base config, or drop base_config from %s",
                             mesh_cfg_value_where(bc, where, sizeof where),
                             bc->kind == MESH_CFG_SCALAR ? bc->text : "?", base_file, args->files[i]);
                goto done;
            }
        }
        if ((st = refuse_block(cfg, layer_value(l, "decoder_block"), NULL)) != SIM_OK) goto done;
        if ((st = check_layer(cfg, base_vals, l, 1)) != SIM_OK) goto done;
        /* as MaxText: model and custom mesh-and-rule files beside the config file come first */
        if (l->config_file && n_dirs < 3) {
            memmove(dirs + 1, dirs, (size_t)n_dirs * sizeof *dirs);
            dirs[0] = dir_of(args->files[i]);
            n_dirs++;
        }
    }
    layer *cli = &user[n_user - 1];
    cli->name = "the command line";
    cli->map.kind = MESH_CFG_MAP;
    cli->map.file = CLI_SOURCE;
    for (int i = 0; args && i < args->n_overrides; i++)
        if ((st = parse_override(cfg, args->overrides[i], &cli->map)) != SIM_OK) goto done;
    if ((st = refuse_block(cfg, layer_value(cli, "decoder_block"), NULL)) != SIM_OK) goto done;
    if ((st = check_layer(cfg, base_vals, cli, 0)) != SIM_OK) goto done;

    /* 2. model file, chosen by the model_name the user layers leave */
    const mesh_cfg_value *mn = NULL;
    const mesh_cfg_entry *mne = mesh_cfg_find(cfg, "model_name");
    if (mne) mn = &mne->value;
    for (int i = 0; i < n_user; i++)
        if (layer_value(&user[i], "model_name")) mn = layer_value(&user[i], "model_name");
    if (mn && mn->kind == MESH_CFG_SCALAR && !is_null(mn) && strcmp(mn->text, "default") != 0) {
        /* a model name is a file name in models/, never a path out of it */
        if (strchr(mn->text, '/') || strchr(mn->text, '\\') || mn->text[0] == '.' || !mn->text[0]) {
            char where[512];
            char *avail = models_available(cfg);
            st = sim_err(SIM_ERR_INPUT, "%s: model_name=%s is not a model name (no '/', '\\' or leading '.'); "
                         "the model names by decoder block: %s",
                         mesh_cfg_value_where(mn, where, sizeof where), mn->text, avail);
            free(avail);
            goto done;
        }
        char *file_name = model_file_name(mn->text);
        char *path = find_named_file(dirs, n_dirs, "models", file_name);
        if (!path) {
            char where[512];
            char *sub = xasprintf("%s/models", dirs[0]);
            char *avail = models_available(cfg);
            st = sim_err(SIM_ERR_INPUT, "%s: model_name=%s is not a model name shardsim knows (no %s/%s.yml); "
                         "the model names by decoder block: %s",
                         mesh_cfg_value_where(mn, where, sizeof where), mn->text, sub, file_name, avail);
            free(sub);
            free(avail);
            free(file_name);
            goto done;
        }
        free(file_name);
        cfg->model_file = path;
        if ((st = yaml_read(cfg, path, NULL, &model.map)) != SIM_OK) goto done;
        /* the block refusal first, unless a user layer picks the block itself */
        const mesh_cfg_value *block = layer_value(&model, "decoder_block");
        for (int i = 0; i < n_user; i++)
            if (!user[i].config_file && layer_value(&user[i], "decoder_block")) block = NULL;
        if ((st = refuse_block(cfg, block, mn->text)) != SIM_OK) goto done;
        if ((st = check_layer(cfg, base_vals, &model, 0)) != SIM_OK) goto done;
    }

    /* values: base <- model <- files <- command line */
    for (int i = 0; i < n_user; i++)
        if (user[i].config_file) apply_layer(cfg, &user[i], -1);
    if (model.map.n) apply_layer(cfg, &model, 1);
    for (int i = 0; i < n_user; i++)
        if (!user[i].config_file) apply_layer(cfg, &user[i], 0);

    /* A key set by the model file and, differently, by the user needs
     * override_model_config=true (pyconfig validate_no_keys_overridden_twice). */
    int override_model = 0;
    if (mesh_cfg_find(cfg, "override_model_config"))
        mesh_cfg_get_bool(cfg, "override_model_config", &override_model);
    for (int i = 0; i < model.map.n && !override_model; i++) {
        const char *key = model.map.keys[i];
        /* Rules are merged by name, not overridden, so they never conflict. */
        if (strcmp(key, RULES_KEY) == 0) continue;
        for (int u = n_user - 1; u >= 0; u--) {
            if (user[u].config_file) continue; /* the model file overrides a config file */
            const mesh_cfg_value *uv = layer_value(&user[u], key);
            if (!uv) continue;
            if (!mesh_cfg_value_equal(uv, &model.map.items[i])) {
                char w1[512], w2[512];
                char *t1 = mesh_cfg_value_to_text(&model.map.items[i], 0);
                char *t2 = mesh_cfg_value_to_text(uv, 0);
                st = sim_err(SIM_ERR_INPUT,
                             "key '%s' is set by the model file (%s = %s) and by %s (%s = %s); "
                             "MaxText forbids changing a model's keys unless override_model_config=true: "
                             "add override_model_config=true to override it",
                             key, mesh_cfg_value_where(&model.map.items[i], w1, sizeof w1), t1,
                             user[u].name, mesh_cfg_value_where(uv, w2, sizeof w2), t2);
                free(t1);
                free(t2);
                goto done;
            }
            break;
        }
    }

    if ((st = apply_release(cfg, user, n_user)) != SIM_OK) goto done;

    /* rules: base, merged with the model's, merged with the user layers' */
    {
        const mesh_cfg_entry *re = mesh_cfg_find(cfg, RULES_KEY);
        char *where = xstrdup(re ? re->where : "");
        if (re) value_copy(&rules, &re->value);
        else rules.kind = MESH_CFG_LIST;
        /* a MaxText config file's rules are the base rules, merged by name */
        for (int i = 0; i < n_user; i++) {
            const mesh_cfg_value *cr = user[i].config_file ? layer_value(&user[i], RULES_KEY) : NULL;
            if (!cr || is_null(cr) || cr->n == 0) continue;
            rules_merge(&rules, cr);
            char *w = where_of(cr);
            char *nw = xasprintf("%s, merged with %s", where, w);
            free(w);
            free(where);
            where = nw;
        }
        const mesh_cfg_value *mr = layer_value(&model, RULES_KEY);
        if (mr && !is_null(mr) && mr->n > 0) {
            if (layer_flag(&model, "override_logical_axis_rules")) {
                value_free(&rules);
                value_copy(&rules, mr);
            } else {
                rules_merge(&rules, mr);
            }
            char *w = where_of(mr);
            char *nw = xasprintf("%s, merged with %s", where, w);
            free(w);
            free(where);
            where = nw;
        }
        user_rules.kind = MESH_CFG_LIST;
        int user_replace = 0, any_user_rules = 0;
        for (int i = 0; i < n_user; i++) {
            if (user[i].config_file) continue;
            const mesh_cfg_value *ur = layer_value(&user[i], RULES_KEY);
            if (layer_value(&user[i], "override_logical_axis_rules"))
                user_replace = layer_flag(&user[i], "override_logical_axis_rules");
            if (!ur || is_null(ur) || ur->n == 0) continue;
            any_user_rules = 1;
            rules_merge(&user_rules, ur);
            char *w = where_of(ur);
            char *nw = xasprintf("%s, merged with %s", where, w);
            free(w);
            free(where);
            where = nw;
        }
        if (any_user_rules) {
            if (user_replace) {
                value_free(&rules);
                rules = user_rules;
                memset(&user_rules, 0, sizeof user_rules);
            } else {
                rules_merge(&rules, &user_rules);
            }
        }
        if (re) set_rules(cfg, &rules, where);
        free(where);
    }

    /* 4. custom mesh and rules */
    {
        const mesh_cfg_entry *sel = mesh_cfg_find(cfg, "custom_mesh_and_rule");
        if (sel && sel->value.kind == MESH_CFG_SCALAR && !is_null(&sel->value) && *sel->value.text) {
            int user_set_cp = 0;
            for (int i = 0; i < n_user; i++) user_set_cp |= layer_value(&user[i], "context_sharding") != NULL;
            if ((st = apply_custom(cfg, base_vals, dirs, n_dirs, sel, user_set_cp)) != SIM_OK) goto done;
        }
    }
    normalize_data_sharding(cfg);
    if ((st = apply_topology(cfg, cfg->configs_dir)) != SIM_OK) goto done;
    st = check_final(cfg);
    if (st == SIM_OK) st = registry_check(cfg, base_vals, n_base);
    if (st == SIM_OK) st = check_ranges(cfg, dirs, n_dirs);
    if (st == SIM_OK && cfg->keys_file) st = maxtext_combination_rules(cfg);
    if (st == SIM_OK && cfg->keys_file) st = check_combinations(cfg, dirs, n_dirs);

done:
    for (int i = 0; i < n_chain; i++) free(chain[i]);
    for (int i = 0; i < n_user; i++) value_free(&user[i].map);
    free(user);
    value_free(&model.map);
    value_free(&base_map);
    value_free(&rules);
    value_free(&user_rules);
    if (base_vals)
        for (int i = 0; i < n_base; i++) value_free(&base_vals[i]);
    free(base_vals);
    for (int i = 0; i < n_dirs; i++) free(dirs[i]);
    if (st != SIM_OK) {
        mesh_cfg_free(cfg);
        return st;
    }
    *out = cfg;
    return SIM_OK;
}

sim_status mesh_cfg_load_argv(const char *base_file, int argc, const char *const *argv, mesh_cfg **out)
{
    const char **files = calloc((size_t)(argc + 1), sizeof *files);
    const char **ovr = calloc((size_t)(argc + 1), sizeof *ovr);
    SIM_ASSERT(files && ovr);
    mesh_cfg_args a = {base_file, NULL, files, 0, ovr, 0};
    sim_status st = SIM_OK;
    for (int i = 0; i < argc && st == SIM_OK; i++) {
        const char *s = argv[i];
        if (strchr(s, '=')) ovr[a.n_overrides++] = s;
        else if (ends_with(s, ".yml") || ends_with(s, ".yaml")) files[a.n_files++] = s;
        else
            st = sim_err(SIM_ERR_INPUT,
                         "argument '%s' is neither a config file (*.yml) nor key=value", s);
    }
    if (st == SIM_OK) st = mesh_cfg_load(&a, out);
    free(files);
    free(ovr);
    return st;
}

sim_status mesh_cfg_load_file(const char *path, mesh_cfg **out)
{
    mesh_cfg *cfg = cfg_new();
    cfg->base_file = xstrdup(path);
    cfg->configs_dir = dir_of(path);
    mesh_cfg_value map;
    sim_status st = yaml_read(cfg, path, NULL, &map);
    if (st != SIM_OK) {
        mesh_cfg_free(cfg);
        return st;
    }
    cfg_take_map(cfg, &map);
    *out = cfg;
    return SIM_OK;
}

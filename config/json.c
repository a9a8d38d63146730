/* json.c — JSON through libjansson, copied into cfg_json trees.
 *
 * Jansson parses (RFC 8259, UTF-8 validated, depth capped at its
 * JSON_PARSER_MAX_DEPTH, duplicate object keys refused so that a header can
 * never say two things about one name, \u0000 refused because every string
 * here is a C string).  The copy keeps object keys in insertion order, which
 * jansson preserves.  The copy recurses no deeper than jansson allowed. */
#include "config/json.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/jsonout.h"

static void json_free_value(cfg_json *v)
{
    free(v->str);
    for (int i = 0; i < v->n; i++) {
        json_free_value(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
}

static char *dup_or_die(const char *s)
{
    char *d = strdup(s);
    SIM_ASSERT(d);
    return d;
}

/* Copies jansson value j into v (zeroed by the caller). */
static sim_status copy_value(const json_t *j, cfg_json *v, const char *what)
{
    char num[40];
    switch (json_typeof(j)) {
    case JSON_NULL: v->kind = CFG_JSON_NULL; return SIM_OK;
    case JSON_TRUE:
        v->kind = CFG_JSON_BOOL;
        v->boolean = 1;
        return SIM_OK;
    case JSON_FALSE:
        v->kind = CFG_JSON_BOOL;
        v->boolean = 0;
        return SIM_OK;
    case JSON_INTEGER:
        v->kind = CFG_JSON_NUMBER;
        v->is_integer = 1;
        v->integer = (long long)json_integer_value(j);
        v->number = (double)v->integer;
        snprintf(num, sizeof num, "%lld", v->integer);
        v->str = dup_or_die(num);
        return SIM_OK;
    case JSON_REAL:
        v->kind = CFG_JSON_NUMBER;
        v->number = json_real_value(j);
        snprintf(num, sizeof num, "%.17g", v->number);
        v->str = dup_or_die(num);
        return SIM_OK;
    case JSON_STRING:
        v->kind = CFG_JSON_STRING;
        v->str = dup_or_die(json_string_value(j));
        return SIM_OK;
    case JSON_ARRAY: {
        v->kind = CFG_JSON_ARRAY;
        size_t n = json_array_size(j);
        if (n > (size_t)(1 << 30))
            return sim_err(SIM_ERR_INPUT, "%s: a JSON array of %zu items is too large (at most 2^30)", what, n);
        if (n) {
            v->items = calloc(n, sizeof *v->items);
            SIM_ASSERT(v->items);
        }
        for (size_t i = 0; i < n; i++) {
            v->n = (int)i + 1;
            SIM_TRY(copy_value(json_array_get(j, i), &v->items[i], what));
        }
        return SIM_OK;
    }
    case JSON_OBJECT: {
        v->kind = CFG_JSON_OBJECT;
        size_t n = json_object_size(j);
        if (n > (size_t)(1 << 30))
            return sim_err(SIM_ERR_INPUT, "%s: a JSON object of %zu keys is too large (at most 2^30)", what, n);
        if (n) {
            v->items = calloc(n, sizeof *v->items);
            v->keys = calloc(n, sizeof *v->keys);
            SIM_ASSERT(v->items && v->keys);
        }
        const char *key;
        json_t *val;
        size_t i = 0;
        json_object_foreach((json_t *)j, key, val)
        {
            SIM_ASSERT(i < n);
            v->keys[i] = dup_or_die(key);
            v->n = (int)i + 1;
            SIM_TRY(copy_value(val, &v->items[i], what));
            i++;
        }
        return SIM_OK;
    }
    }
    return sim_err(SIM_ERR_INTERNAL, "%s: unknown JSON value type from jansson", what);
}

sim_status cfg_json_parse(const char *text, size_t len, const char *what, cfg_json **out)
{
    what = what ? what : "<json>";
    /* Skip a UTF-8 byte order mark (some editors write one). */
    if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
        text += 3;
        len -= 3;
    }
    json_error_t e;
    json_t *j = json_loadb(text, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &e);
    if (!j)
        return sim_err(SIM_ERR_INPUT, "%s:%d:%d: invalid JSON: %s; fix the file or regenerate it", what, e.line,
                       e.column, e.text);
    cfg_json *root = calloc(1, sizeof *root);
    SIM_ASSERT(root);
    sim_status st = copy_value(j, root, what);
    json_decref(j);
    if (st != SIM_OK) {
        cfg_json_free(root);
        return st;
    }
    *out = root;
    return SIM_OK;
}

sim_status cfg_json_read_file(const char *path, cfg_json **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return sim_err(SIM_ERR_IO, "cannot open JSON file %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    SIM_ASSERT(buf);
    for (;;) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        cap *= 2;
        buf = realloc(buf, cap);
        SIM_ASSERT(buf);
    }
    int failed = ferror(f);
    fclose(f);
    if (failed) {
        free(buf);
        return sim_err(SIM_ERR_IO, "cannot read JSON file %s", path);
    }
    sim_status st = cfg_json_parse(buf, n, path, out);
    free(buf);
    return st;
}

void cfg_json_free(cfg_json *root)
{
    if (!root) return;
    json_free_value(root);
    free(root);
}

const cfg_json *cfg_json_get(const cfg_json *v, const char *key)
{
    if (!v || v->kind != CFG_JSON_OBJECT) return NULL;
    for (int i = 0; i < v->n; i++)
        if (strcmp(v->keys[i], key) == 0) return &v->items[i];
    return NULL;
}

const char *cfg_json_kind_name(cfg_json_kind k)
{
    switch (k) {
    case CFG_JSON_NULL: return "null";
    case CFG_JSON_BOOL: return "boolean";
    case CFG_JSON_NUMBER: return "number";
    case CFG_JSON_STRING: return "string";
    case CFG_JSON_ARRAY: return "array";
    case CFG_JSON_OBJECT: return "object";
    }
    return "?";
}

int cfg_json_equal(const cfg_json *a, const cfg_json *b)
{
    if (a->kind != b->kind) return 0;
    switch (a->kind) {
    case CFG_JSON_NULL: return 1;
    case CFG_JSON_BOOL: return a->boolean == b->boolean;
    case CFG_JSON_NUMBER: return a->number == b->number;
    case CFG_JSON_STRING: return !strcmp(a->str, b->str);
    case CFG_JSON_ARRAY:
        if (a->n != b->n) return 0;
        for (int i = 0; i < a->n; i++)
            if (!cfg_json_equal(&a->items[i], &b->items[i])) return 0;
        return 1;
    case CFG_JSON_OBJECT:
        if (a->n != b->n) return 0;
        for (int i = 0; i < a->n; i++) {
            const cfg_json *y = cfg_json_get(b, a->keys[i]);
            if (!y || !cfg_json_equal(&a->items[i], y)) return 0;
        }
        return 1;
    }
    return 0;
}

/* ======================================================================== */
/* writing                                                                  */
/* ======================================================================== */

void cfg_jw_init(cfg_jw *w) { memset(w, 0, sizeof *w); }

/* Adds v (a new reference) to the innermost container, or makes it the root. */
static void jw_add(cfg_jw *w, json_t *v)
{
    SIM_ASSERT(v);
    if (w->depth == 0) {
        SIM_ASSERT(!w->root);
        w->root = v;
        return;
    }
    json_t *c = w->open[w->depth - 1];
    if (json_is_object(c)) {
        SIM_ASSERT(w->after_key);
        w->after_key = 0;
        SIM_ASSERT(json_object_set_new(c, w->key, v) == 0);
    } else {
        SIM_ASSERT(!w->after_key);
        SIM_ASSERT(json_array_append_new(c, v) == 0);
    }
}

static void jw_open(cfg_jw *w, json_t *c)
{
    SIM_ASSERT(w->depth < CFG_JW_MAX_DEPTH);
    jw_add(w, c);
    w->open[w->depth++] = c; /* borrowed: the parent (or root) owns it */
}

void cfg_jw_obj(cfg_jw *w) { jw_open(w, json_object()); }
void cfg_jw_arr(cfg_jw *w) { jw_open(w, json_array()); }

void cfg_jw_end(cfg_jw *w)
{
    SIM_ASSERT(w->depth > 0 && !w->after_key);
    w->depth--;
}

void cfg_jw_key(cfg_jw *w, const char *k)
{
    SIM_ASSERT(w->depth > 0 && json_is_object(w->open[w->depth - 1]) && !w->after_key);
    SIM_ASSERT(strlen(k) < sizeof w->key);
    strcpy(w->key, k);
    w->after_key = 1;
}

void cfg_jw_str(cfg_jw *w, const char *s)
{
    /* jansson refuses invalid UTF-8; such text (from a user's argv) is kept readable with its
     * bad bytes replaced by '?' */
    json_t *v = s ? json_string(s) : json_null();
    if (!v) {
        char *t = dup_or_die(s);
        for (char *p = t; *p; p++)
            if ((unsigned char)*p >= 0x80) *p = '?';
        v = json_string(t);
        free(t);
    }
    jw_add(w, v);
}

void cfg_jw_null(cfg_jw *w) { jw_add(w, json_null()); }
void cfg_jw_bool(cfg_jw *w, int b) { jw_add(w, json_boolean(b)); }
void cfg_jw_int(cfg_jw *w, long long v) { jw_add(w, json_integer((json_int_t)v)); }

void cfg_jw_u64(cfg_jw *w, unsigned long long v)
{
    /* byte counts stay below 2^63; a larger one would be a broken counter */
    SIM_ASSERT(v <= (unsigned long long)INT64_MAX);
    jw_add(w, json_integer((json_int_t)v));
}

void cfg_jw_double(cfg_jw *w, double d) { jw_add(w, isfinite(d) ? json_real(d) : json_null()); }

void cfg_jw_num(cfg_jw *w, double d, int digits)
{
    if (!isfinite(d)) {
        jw_add(w, json_null());
        return;
    }
    char text[64];
    snprintf(text, sizeof text, "%.*g", digits, d);
    if (!strpbrk(text, ".eEn")) {
        errno = 0;
        char *end;
        long long i = strtoll(text, &end, 10);
        if (errno == 0 && !*end) {
            jw_add(w, json_integer((json_int_t)i));
            return;
        }
    }
    jw_add(w, json_real(strtod(text, NULL)));
}

void cfg_jw_tree(cfg_jw *w, json_t *v) { jw_add(w, v); }

json_t *cfg_jw_take(cfg_jw *w)
{
    SIM_ASSERT(w->depth == 0 && w->root);
    json_t *root = w->root;
    w->root = NULL;
    return root;
}

void cfg_jw_discard(cfg_jw *w)
{
    json_decref(w->root);
    cfg_jw_init(w);
}

/* v written through the one writer (sim/jsonout.h), as json_dumpf would write it */
static void jw_emit(sim_json *j, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        sim_json_obj(j);
        json_object_foreach((json_t *)v, k, x)
        { /* jansson 2.14 keeps (and iterates) an object's keys in insertion order */
            sim_json_key(j, k);
            jw_emit(j, x);
        }
        sim_json_end(j);
        break;
    }
    case JSON_ARRAY:
        sim_json_arr(j);
        for (size_t i = 0; i < json_array_size(v); i++) jw_emit(j, json_array_get(v, i));
        sim_json_end(j);
        break;
    case JSON_STRING: sim_json_str(j, json_string_value(v)); break;
    case JSON_INTEGER: sim_json_i64(j, (int64_t)json_integer_value(v)); break;
    case JSON_REAL: sim_json_real(j, json_real_value(v)); break;
    case JSON_TRUE: sim_json_bool(j, true); break;
    case JSON_FALSE: sim_json_bool(j, false); break;
    case JSON_NULL: sim_json_null(j); break;
    }
}

static sim_status jw_dump(cfg_jw *w, FILE *f, cfg_jw_layout layout, int precision, const char *what)
{
    static const int layouts[] = {[CFG_JW_INDENT2] = 2, [CFG_JW_LINE] = SIM_JSON_LINE, [CFG_JW_INDENT1] = 1,
                                  [CFG_JW_COMPACT] = SIM_JSON_COMPACT};
    json_t *root = cfg_jw_take(w);
    sim_json *j;
    sim_status st = sim_json_new(f, layouts[layout], layout == CFG_JW_INDENT2, precision, &j);
    if (st == SIM_OK) {
        jw_emit(j, root);
        st = sim_json_close(j, NULL, what);
    }
    json_decref(root);
    return st;
}

void cfg_jw_write(cfg_jw *w, FILE *f, cfg_jw_layout layout, int precision)
{
    /* a write error shows in ferror(f), which the caller (cli_artifact_write) checks */
    (void)jw_dump(w, f, layout, precision, "a JSON document");
}

char *cfg_jw_dumps(cfg_jw *w, cfg_jw_layout layout, int precision)
{
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    SIM_ASSERT(f);
    sim_status st = jw_dump(w, f, layout, precision, "a JSON text");
    SIM_ASSERT(fclose(f) == 0 && st == SIM_OK && s);
    return s;
}

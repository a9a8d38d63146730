/* value.c — config values: scalar typing, typed reads, equality, flow text (see value.h); and the
 * small text helpers the rest of config/ shares (internal.h). */
#include "config/value.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

void cfg_sb_putf(cfg_sbuf *b, const char *fmt, ...)
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

char *cfg_strdup(const char *s)
{
    char *d = strdup(s ? s : "");
    SIM_ASSERT(d);
    return d;
}

char *cfg_asprintf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int k = vasprintf(&s, fmt, ap);
    va_end(ap);
    SIM_ASSERT(k >= 0 && s);
    return s;
}

int cfg_edit_distance(const char *a, const char *b)
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

/* FNV-1a of a key: the duplicate-key check of large maps and the hash
 * indexes of entries and keys.yml use it. */
uint64_t cfg_hash(const char *k)
{
    uint64_t h = 14695981039346656037ULL;
    for (; *k; k++) h = (h ^ (unsigned char)*k) * 1099511628211ULL;
    return h;
}

void cfg_value_free(cfg_value *v)
{
    free(v->text);
    for (int i = 0; i < v->n; i++) {
        cfg_value_free(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    memset(v, 0, sizeof *v);
}

void cfg_value_copy(cfg_value *dst, const cfg_value *src)
{
    *dst = *src;
    dst->text = src->text ? cfg_strdup(src->text) : NULL;
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
            cfg_value_copy(&dst->items[i], &src->items[i]);
            if (src->keys) dst->keys[i] = cfg_strdup(src->keys[i]);
        }
    }
}

/* Appends an item (and key for maps); returns the new slot. */
cfg_value *cfg_value_push(cfg_value *v, const char *key)
{
    v->items = realloc(v->items, (size_t)(v->n + 1) * sizeof *v->items);
    SIM_ASSERT(v->items);
    if (v->kind == CFG_MAP) {
        v->keys = realloc(v->keys, (size_t)(v->n + 1) * sizeof *v->keys);
        SIM_ASSERT(v->keys);
        v->keys[v->n] = cfg_strdup(key);
    }
    cfg_value *slot = &v->items[v->n++];
    memset(slot, 0, sizeof *slot);
    return slot;
}

int cfg_map_index(const cfg_value *map, const char *key)
{
    for (int i = map->n - 1; i >= 0; i--)
        if (strcmp(map->keys[i], key) == 0) return i;
    return -1;
}

const cfg_value *cfg_map_get(const cfg_value *map, const char *key)
{
    if (!map || map->kind != CFG_MAP) return NULL;
    int i = cfg_map_index(map, key);
    return i >= 0 ? &map->items[i] : NULL;
}

const char *cfg_map_text(const cfg_value *spec, const char *field)
{
    const cfg_value *v = cfg_map_get(spec, field);
    return v && v->kind == CFG_SCALAR ? v->text : NULL;
}

int cfg_is_null(const cfg_value *v) { return v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_NULL; }

const char *cfg_value_where(const cfg_value *v, char *buf, int cap)
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

int cfg_parse_int(const char *t, long long *out)
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

int cfg_parse_float(const char *t, double *out)
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

int cfg_bool_word(const char *t, int *out)
{
    static const char *const yes[] = {"true", "yes", "on"};
    static const char *const no[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
        if (!strcasecmp(t, yes[i])) return *out = 1, 1;
        if (!strcasecmp(t, no[i])) return *out = 0, 1;
    }
    return 0;
}

cfg_type cfg_scalar_type(const cfg_value *v)
{
    if (v->kind != CFG_SCALAR) return CFG_STRING;
    const char *t = v->text ? v->text : "";
    /* MaxText turns the string "none" (any case, any quoting) into None. */
    if (!strcasecmp(t, "none")) return CFG_NULL;
    if (v->quoted) return CFG_STRING;
    if (!*t || !strcmp(t, "~") || !strcmp(t, "null") || !strcmp(t, "Null") || !strcmp(t, "NULL")) return CFG_NULL;
    int b;
    if (cfg_bool_word(t, &b)) return CFG_BOOL;
    long long i;
    if (cfg_parse_int(t, &i)) return CFG_INT;
    double d;
    if (cfg_parse_float(t, &d)) return CFG_FLOAT;
    return CFG_STRING;
}

const char *cfg_type_name(cfg_type t)
{
    switch (t) {
    case CFG_NULL: return "null";
    case CFG_BOOL: return "a boolean (true or false)";
    case CFG_INT: return "an integer";
    case CFG_FLOAT: return "a number";
    case CFG_STRING: return "a string";
    }
    return "?";
}

const char *cfg_kind_name(const cfg_value *v)
{
    if (v->kind == CFG_LIST) return "a list";
    if (v->kind == CFG_MAP) return "a map";
    return cfg_type_name(cfg_scalar_type(v));
}

sim_status cfg_value_error(const cfg_value *v, const char *what, const char *expected)
{
    char where[512];
    char *text = cfg_value_to_text(v, 0);
    sim_status st = sim_err(SIM_ERR_INPUT, "%s: %s = %s is %s, expected %s", cfg_value_where(v, where, sizeof where),
                            what, text, cfg_kind_name(v), expected);
    free(text);
    return st;
}

sim_status cfg_value_int(const cfg_value *v, const char *what, long long *out)
{
    cfg_type t = cfg_scalar_type(v);
    if (v->kind == CFG_SCALAR && t == CFG_INT && cfg_parse_int(v->text, out)) return SIM_OK;
    double d;
    if (v->kind == CFG_SCALAR && t == CFG_FLOAT && cfg_parse_float(v->text, &d) && d == floor(d) && fabs(d) < 9.0e18) {
        *out = (long long)d;
        return SIM_OK;
    }
    return cfg_value_error(v, what, "an integer");
}

sim_status cfg_value_double(const cfg_value *v, const char *what, double *out)
{
    cfg_type t = cfg_scalar_type(v);
    long long i;
    if (v->kind == CFG_SCALAR && t == CFG_INT && cfg_parse_int(v->text, &i)) {
        *out = (double)i;
        return SIM_OK;
    }
    if (v->kind == CFG_SCALAR && t == CFG_FLOAT && cfg_parse_float(v->text, out)) return SIM_OK;
    return cfg_value_error(v, what, "a number");
}

sim_status cfg_value_bool(const cfg_value *v, const char *what, int *out)
{
    if (v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_BOOL && cfg_bool_word(v->text, out)) return SIM_OK;
    return cfg_value_error(v, what, "true or false");
}

int cfg_value_equal(const cfg_value *a, const cfg_value *b)
{
    if (a->kind != b->kind || a->n != b->n) return 0;
    if (a->kind == CFG_SCALAR) {
        cfg_type ta = cfg_scalar_type(a), tb = cfg_scalar_type(b);
        int na = ta == CFG_INT || ta == CFG_FLOAT;
        int nb = tb == CFG_INT || tb == CFG_FLOAT;
        if (na && nb) {
            double x, y;
            long long i, j;
            if (ta == CFG_INT && tb == CFG_INT && cfg_parse_int(a->text, &i) && cfg_parse_int(b->text, &j))
                return i == j;
            if (cfg_value_double(a, "", &x) || cfg_value_double(b, "", &y)) return 0;
            return x == y;
        }
        if (ta != tb) return 0;
        if (ta == CFG_NULL) return 1;
        if (ta == CFG_BOOL) {
            int x = 0, y = 0;
            cfg_bool_word(a->text, &x);
            cfg_bool_word(b->text, &y);
            return x == y;
        }
        return strcmp(a->text, b->text) == 0;
    }
    for (int i = 0; i < a->n; i++) {
        if (a->kind == CFG_MAP && strcmp(a->keys[i], b->keys[i]) != 0) return 0;
        if (!cfg_value_equal(&a->items[i], &b->items[i])) return 0;
    }
    return 1;
}

/* The fewest significant digits (1-17) whose %g reads back to d. */
static int shortest_digits(double d)
{
    char tmp[40];
    for (int prec = 1; prec < 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) return prec;
    }
    return 17;
}

/* The most digits a real of v needs to read back (1 when it has none). */
static int value_digits(const cfg_value *v)
{
    if (v->kind != CFG_SCALAR) {
        int p = 1;
        for (int i = 0; i < v->n; i++) {
            int q = value_digits(&v->items[i]);
            if (q > p) p = q;
        }
        return p;
    }
    double d;
    if (cfg_scalar_type(v) == CFG_FLOAT && cfg_parse_float(v->text, &d) && isfinite(d)) return shortest_digits(d);
    return 1;
}

void cfg_value_json(cfg_jw *w, const cfg_value *v)
{
    if (v->kind == CFG_LIST || v->kind == CFG_MAP) {
        int map = v->kind == CFG_MAP;
        if (map) cfg_jw_obj(w);
        else cfg_jw_arr(w);
        for (int i = 0; i < v->n; i++) {
            if (map) cfg_jw_key(w, v->keys[i]);
            cfg_value_json(w, &v->items[i]);
        }
        cfg_jw_end(w);
        return;
    }
    long long i;
    double d;
    int b;
    switch (cfg_scalar_type(v)) {
    case CFG_NULL: cfg_jw_null(w); return;
    case CFG_BOOL:
        if (cfg_bool_word(v->text, &b)) {
            cfg_jw_bool(w, b);
            return;
        }
        break;
    case CFG_INT:
        if (cfg_value_int(v, "", &i) == SIM_OK) {
            cfg_jw_int(w, i);
            return;
        }
        break;
    case CFG_FLOAT:
        if (cfg_value_double(v, "", &d) == SIM_OK) {
            cfg_jw_double(w, d);
            return;
        }
        break;
    case CFG_STRING: break;
    }
    sim_err_clear();
    cfg_jw_str(w, v->text ? v->text : "");
}

/* YAML flow text: strings quoted when they were, or when flow syntax would split them. */
static void put_flow(cfg_sbuf *b, const cfg_value *v)
{
    if (v->kind == CFG_LIST || v->kind == CFG_MAP) {
        int map = v->kind == CFG_MAP;
        cfg_sb_putf(b, map ? "{" : "[");
        for (int i = 0; i < v->n; i++) {
            if (i) cfg_sb_putf(b, ", ");
            if (map) cfg_sb_putf(b, "%s: ", v->keys[i]);
            put_flow(b, &v->items[i]);
        }
        cfg_sb_putf(b, map ? "}" : "]");
        return;
    }
    cfg_type t = cfg_scalar_type(v);
    if (v->quoted || (t == CFG_STRING && strpbrk(v->text, ",[]{}:#'\"")) || (t == CFG_STRING && !*v->text)) {
        cfg_sb_putf(b, "'");
        for (const char *s = v->text; *s; s++) cfg_sb_putf(b, *s == '\'' ? "''" : "%c", *s);
        cfg_sb_putf(b, "'");
    } else {
        cfg_sb_putf(b, "%s", *v->text ? v->text : "null");
    }
}

char *cfg_value_to_text(const cfg_value *v, int json)
{
    if (json) { /* the one JSON writer, one line, each real in the fewest digits that read back */
        cfg_jw w;
        cfg_jw_init(&w);
        cfg_value_json(&w, v);
        return cfg_jw_dumps(&w, CFG_JW_LINE, value_digits(v));
    }
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "%s", "");
    put_flow(&b, v);
    return b.s;
}

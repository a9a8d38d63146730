/* jsonout.c — the one JSON writer (see jsonout.h).  The separators, escapes and number texts follow
 * jansson 2.14's dump.c (do_dump, dump_indent, dump_string) and strconv.c (jsonp_dtostr). */
#include "sim/jsonout.h"

#include <stdlib.h>
#include <string.h>

#include "sim/textout.h"

typedef struct {
    bool obj;   /* an object (else an array) */
    bool lines; /* sim_json_arr_lines */
    size_t n;   /* items written */
} level;

struct sim_json {
    sim_textout t;
    int layout;
    bool ascii;
    int precision;
    int depth;      /* open containers */
    bool after_key; /* the next value goes under a key just written */
    bool done;      /* the document's value is complete */
    level lv[SIM_JSON_MAX_DEPTH];
};

sim_status sim_json_new(FILE *f, int layout, bool ascii, int precision, sim_json **out)
{
    SIM_ASSERT(precision >= 1 && precision <= 17 && layout >= SIM_JSON_COMPACT);
    sim_json *j = calloc(1, sizeof *j);
    if (!j) return sim_err(SIM_ERR_OOM, "JSON writer: out of host memory");
    sim_textout_init(&j->t, f);
    j->layout = layout;
    j->ascii = ascii;
    j->precision = precision;
    *out = j;
    return SIM_OK;
}

/* jansson's dump_indent: a new line and depth levels of indent, or one space between items on one
 * line (space), or nothing */
static void indent(sim_json *j, int depth, bool space)
{
    if (j->layout > 0) {
        sim_textout_char(&j->t, '\n');
        for (int i = 0; i < depth * j->layout; i++) sim_textout_char(&j->t, ' ');
    } else if (space && j->layout == SIM_JSON_LINE) {
        sim_textout_char(&j->t, ' ');
    }
}

/* Before a value (or a key): the separator and line break its container's layout puts there. */
static void item(sim_json *j)
{
    if (j->depth == 0) {
        SIM_ASSERT(!j->done); /* one value a document */
        return;
    }
    level *l = &j->lv[j->depth - 1];
    if (l->obj && j->after_key) { /* the value of the key just written */
        j->after_key = false;
        return;
    }
    SIM_ASSERT(!l->obj || !j->after_key);
    if (l->n) sim_textout_char(&j->t, ',');
    if (l->lines) sim_textout_char(&j->t, '\n');
    else indent(j, j->depth, l->n > 0);
    l->n++;
}

/* After a value: the document is complete when it was the outermost one. */
static void value_done(sim_json *j)
{
    if (j->depth == 0) j->done = true;
}

static void open(sim_json *j, bool obj, bool lines, char bracket)
{
    if (j->depth) SIM_ASSERT(j->lv[j->depth - 1].obj == j->after_key); /* a key before an object's value */
    item(j);
    SIM_ASSERT(j->depth < SIM_JSON_MAX_DEPTH);
    j->lv[j->depth++] = (level){.obj = obj, .lines = lines, .n = 0};
    sim_textout_char(&j->t, bracket);
}

void sim_json_obj(sim_json *j) { open(j, true, false, '{'); }
void sim_json_arr(sim_json *j) { open(j, false, false, '['); }
void sim_json_arr_lines(sim_json *j) { open(j, false, true, '['); }

void sim_json_end(sim_json *j)
{
    SIM_ASSERT(j->depth > 0 && !j->after_key);
    level *l = &j->lv[--j->depth];
    if (l->lines) sim_textout_char(&j->t, '\n');
    else if (l->n) indent(j, j->depth, false);
    sim_textout_char(&j->t, l->obj ? '}' : ']');
    value_done(j);
}

/* The length of the UTF-8 sequence at s (at most n bytes) and its code point, 0 when it is not one
 * (jansson's utf8_check_first/_full: no overlong forms, surrogates or values past U+10FFFF). */
static size_t utf8_char(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned char c = s[0];
    size_t len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        v = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        v = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        v = c & 0x07;
    } else {
        return 0;
    }
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF) || (len == 3 && v < 0x800) || (len == 4 && v < 0x10000))
        return 0;
    *cp = v;
    return len;
}

static bool utf8_valid(const unsigned char *s, size_t n)
{
    uint32_t cp;
    for (size_t i = 0, k; i < n; i += k)
        if (!(k = utf8_char(s + i, n - i, &cp))) return false;
    return true;
}

static void put_u4(sim_textout *t, uint32_t v)
{
    static const char hex[] = "0123456789ABCDEF";
    char e[6] = {'\\', 'u', hex[v >> 12 & 15], hex[v >> 8 & 15], hex[v >> 4 & 15], hex[v & 15]};
    sim_textout_mem(t, e, sizeof e);
}

/* dump_string of valid UTF-8 s */
static void put_string(sim_json *j, const unsigned char *s, size_t n)
{
    sim_textout *t = &j->t;
    sim_textout_char(t, '"');
    size_t run = 0, i = 0;
    while (i < n) {
        uint32_t cp;
        size_t k = utf8_char(s + i, n - i, &cp);
        if (cp != '"' && cp != '\\' && cp >= 0x20 && !(j->ascii && cp > 0x7F)) {
            i += k;
            continue;
        }
        sim_textout_mem(t, (const char *)s + run, i - run);
        switch (cp) {
        case '"': sim_textout_mem(t, "\\\"", 2); break;
        case '\\': sim_textout_mem(t, "\\\\", 2); break;
        case '\b': sim_textout_mem(t, "\\b", 2); break;
        case '\f': sim_textout_mem(t, "\\f", 2); break;
        case '\n': sim_textout_mem(t, "\\n", 2); break;
        case '\r': sim_textout_mem(t, "\\r", 2); break;
        case '\t': sim_textout_mem(t, "\\t", 2); break;
        default:
            if (cp < 0x10000) {
                put_u4(t, cp);
            } else { /* a UTF-16 surrogate pair */
                uint32_t v = cp - 0x10000;
                put_u4(t, 0xD800 | (v >> 10 & 0x3FF));
                put_u4(t, 0xDC00 | (v & 0x3FF));
            }
        }
        i += k;
        run = i;
    }
    sim_textout_mem(t, (const char *)s + run, n - run);
    sim_textout_char(t, '"');
}

static void put_text(sim_json *j, const char *s)
{
    size_t n = 0;
    for (unsigned char c; (c = (unsigned char)s[n]) >= 0x20 && c < 0x7F && c != '"' && c != '\\';) n++;
    if (!s[n]) { /* printable ASCII without an escape (nearly every name): as it is, in one pass */
        sim_textout_char(&j->t, '"');
        sim_textout_mem(&j->t, s, n);
        sim_textout_char(&j->t, '"');
        return;
    }
    n += strlen(s + n);
    if (utf8_valid((const unsigned char *)s, n)) {
        put_string(j, (const unsigned char *)s, n);
        return;
    }
    /* not UTF-8 (a user's argv, a file name): readable, with its bytes >= 0x80 as '?' */
    unsigned char *c = malloc(n + 1);
    SIM_ASSERT(c);
    for (size_t i = 0; i <= n; i++) c[i] = (unsigned char)s[i] >= 0x80 ? '?' : (unsigned char)s[i];
    put_string(j, c, n);
    free(c);
}

void sim_json_key(sim_json *j, const char *k)
{
    SIM_ASSERT(j->depth > 0 && j->lv[j->depth - 1].obj && !j->after_key);
    item(j);
    put_text(j, k);
    sim_textout_str(&j->t, j->layout == SIM_JSON_COMPACT ? ":" : ": ");
    j->after_key = true;
}

/* A scalar: its separator, then its text. */
static void scalar(sim_json *j)
{
    if (j->depth) SIM_ASSERT(j->lv[j->depth - 1].obj == j->after_key);
    item(j);
}

void sim_json_str(sim_json *j, const char *s)
{
    if (!s) {
        sim_json_null(j);
        return;
    }
    scalar(j);
    put_text(j, s);
    value_done(j);
}

void sim_json_null(sim_json *j)
{
    scalar(j);
    sim_textout_str(&j->t, "null");
    value_done(j);
}

void sim_json_bool(sim_json *j, bool b)
{
    scalar(j);
    sim_textout_str(&j->t, b ? "true" : "false");
    value_done(j);
}

void sim_json_i64(sim_json *j, int64_t v)
{
    scalar(j);
    sim_textout_i64(&j->t, v);
    value_done(j);
}

void sim_json_u64(sim_json *j, uint64_t v)
{
    scalar(j);
    sim_textout_u64(&j->t, v);
    value_done(j);
}

void sim_json_real(sim_json *j, double d)
{
    char buf[64];
    int n = snprintf(buf, sizeof buf, "%.*g", j->precision, d);
    SIM_ASSERT(n > 0 && (size_t)n < sizeof buf - 3);
    if (!strchr(buf, '.') && !strchr(buf, 'e')) { /* still a real when read back */
        memcpy(buf + n, ".0", 3);
        n += 2;
    }
    char *e = strchr(buf, 'e');
    if (e) { /* jsonp_dtostr: no '+' and no leading zeros in the exponent */
        char *start = e + 1, *end = start + 1;
        if (*start == '-') start++;
        while (*end == '0') end++;
        if (end != start) {
            memmove(start, end, strlen(end) + 1);
            n -= (int)(end - start);
        }
    }
    scalar(j);
    sim_textout_mem(&j->t, buf, (size_t)n);
    value_done(j);
}

void sim_json_milli(sim_json *j, uint64_t v)
{
    scalar(j);
    sim_textout_milli(&j->t, v);
    value_done(j);
}

sim_status sim_json_close(sim_json *j, const char *tail, const char *what)
{
    SIM_ASSERT(j->depth == 0 && j->done);
    if (tail) sim_textout_str(&j->t, tail);
    sim_textout_flush(&j->t);
    FILE *f = j->t.f;
    free(j);
    if (fflush(f) != 0 || ferror(f)) return sim_err(SIM_ERR_IO, "could not write %s", what);
    return SIM_OK;
}

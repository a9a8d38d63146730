/* json.c — recursive-descent JSON reader.
 *
 * One pass over the text with a cursor; nesting depth is capped so a hostile
 * file cannot blow the stack.  Errors name the input, the line and column and
 * what was expected. */
#include "mesh/json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { JSON_MAX_DEPTH = 256 };

typedef struct {
    const char *s;
    size_t len, pos;
    int line;
    size_t line_start;
    const char *what;
} jparser;

static sim_status jerr(const jparser *p, const char *expected)
{
    char got[24];
    if (p->pos >= p->len) {
        snprintf(got, sizeof got, "end of input");
    } else {
        size_t k = 0;
        while (k < 12 && p->pos + k < p->len && p->s[p->pos + k] != '\n') k++;
        snprintf(got, sizeof got, "'%.*s'", (int)k, p->s + p->pos);
    }
    return sim_err(SIM_ERR_INPUT, "%s:%d:%zu: invalid JSON: expected %s, got %s",
                   p->what, p->line, p->pos - p->line_start + 1, expected, got);
}

static void skip_ws(jparser *p)
{
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c == '\n') {
            p->line++;
            p->line_start = p->pos + 1;
        } else if (c != ' ' && c != '\t' && c != '\r') {
            break;
        }
        p->pos++;
    }
}

static void json_free_value(mesh_json *v)
{
    free(v->str);
    for (int i = 0; i < v->n; i++) {
        json_free_value(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
}

static void put_utf8(char *out, size_t *n, unsigned cp)
{
    if (cp < 0x80) {
        out[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*n)++] = (char)(0xC0 | (cp >> 6));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out[(*n)++] = (char)(0xE0 | (cp >> 12));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*n)++] = (char)(0xF0 | (cp >> 18));
        out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Parses a string at p->pos (which is '"'); *out is malloc'd. */
static sim_status parse_string(jparser *p, char **out)
{
    size_t start = ++p->pos;
    size_t end = start;
    while (end < p->len && p->s[end] != '"') {
        if (p->s[end] == '\\') end++;
        end++;
    }
    if (end >= p->len) return jerr(p, "a closing '\"'");
    /* Decoded text is never longer than the escaped text. */
    char *buf = malloc(end - start + 1);
    SIM_ASSERT(buf);
    size_t n = 0;
    while (p->pos < end) {
        char c = p->s[p->pos];
        if ((unsigned char)c < 0x20) {
            free(buf);
            return jerr(p, "no raw control character inside a string");
        }
        if (c != '\\') {
            buf[n++] = c;
            p->pos++;
            continue;
        }
        char e = p->s[p->pos + 1];
        p->pos += 2;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (p->pos + 4 > end || !hex4(p->s + p->pos, &cp)) {
                free(buf);
                return jerr(p, "four hex digits after \\u");
            }
            p->pos += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && p->pos + 6 <= end && p->s[p->pos] == '\\' &&
                p->s[p->pos + 1] == 'u') {
                unsigned lo;
                if (hex4(p->s + p->pos + 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p->pos += 6;
                }
            }
            put_utf8(buf, &n, cp);
            break;
        }
        default:
            p->pos -= 2;
            free(buf);
            return jerr(p, "a valid escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
        }
    }
    buf[n] = '\0';
    p->pos = end + 1;
    *out = buf;
    return SIM_OK;
}

static sim_status parse_value(jparser *p, mesh_json *v, int depth);

static sim_status push_item(mesh_json *v, int *cap)
{
    if (v->n == *cap) {
        *cap = *cap ? 2 * *cap : 8;
        v->items = realloc(v->items, (size_t)*cap * sizeof *v->items);
        SIM_ASSERT(v->items);
        if (v->kind == MESH_JSON_OBJECT) {
            v->keys = realloc(v->keys, (size_t)*cap * sizeof *v->keys);
            SIM_ASSERT(v->keys);
        }
    }
    memset(&v->items[v->n], 0, sizeof v->items[0]);
    if (v->kind == MESH_JSON_OBJECT) v->keys[v->n] = NULL;
    v->n++;
    return SIM_OK;
}

static sim_status parse_container(jparser *p, mesh_json *v, int depth)
{
    int is_obj = p->s[p->pos] == '{';
    char close = is_obj ? '}' : ']';
    v->kind = is_obj ? MESH_JSON_OBJECT : MESH_JSON_ARRAY;
    int cap = 0;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return SIM_OK;
    }
    for (;;) {
        skip_ws(p);
        push_item(v, &cap);
        if (is_obj) {
            if (p->pos >= p->len || p->s[p->pos] != '"') return jerr(p, "an object key in double quotes");
            SIM_TRY(parse_string(p, &v->keys[v->n - 1]));
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') return jerr(p, "':' after an object key");
            p->pos++;
        }
        SIM_TRY(parse_value(p, &v->items[v->n - 1], depth + 1));
        skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->s[p->pos] == close) {
            p->pos++;
            return SIM_OK;
        }
        return jerr(p, is_obj ? "',' or '}'" : "',' or ']'");
    }
}

static int match_word(jparser *p, const char *w)
{
    size_t n = strlen(w);
    if (p->pos + n <= p->len && memcmp(p->s + p->pos, w, n) == 0) {
        p->pos += n;
        return 1;
    }
    return 0;
}

static sim_status parse_value(jparser *p, mesh_json *v, int depth)
{
    if (depth > JSON_MAX_DEPTH) return jerr(p, "nesting no deeper than 256");
    skip_ws(p);
    v->line = p->line;
    if (p->pos >= p->len) return jerr(p, "a value");
    char c = p->s[p->pos];
    if (c == '{' || c == '[') return parse_container(p, v, depth);
    if (c == '"') {
        v->kind = MESH_JSON_STRING;
        return parse_string(p, &v->str);
    }
    if (match_word(p, "null")) {
        v->kind = MESH_JSON_NULL;
        return SIM_OK;
    }
    if (match_word(p, "true")) {
        v->kind = MESH_JSON_BOOL;
        v->boolean = 1;
        return SIM_OK;
    }
    if (match_word(p, "false")) {
        v->kind = MESH_JSON_BOOL;
        return SIM_OK;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        /* Grammar check: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
        size_t q = p->pos;
        if (p->s[q] == '-') q++;
        size_t digits = q;
        while (q < p->len && p->s[q] >= '0' && p->s[q] <= '9') q++;
        int ok = q > digits && !(p->s[digits] == '0' && q - digits > 1);
        if (ok && q < p->len && p->s[q] == '.') {
            size_t f = ++q;
            while (q < p->len && p->s[q] >= '0' && p->s[q] <= '9') q++;
            ok = q > f;
        }
        if (ok && q < p->len && (p->s[q] == 'e' || p->s[q] == 'E')) {
            q++;
            if (q < p->len && (p->s[q] == '+' || p->s[q] == '-')) q++;
            size_t e = q;
            while (q < p->len && p->s[q] >= '0' && p->s[q] <= '9') q++;
            ok = q > e;
        }
        if (!ok) return jerr(p, "a number");
        v->kind = MESH_JSON_NUMBER;
        v->str = strndup(p->s + p->pos, q - p->pos);
        SIM_ASSERT(v->str);
        v->number = strtod(v->str, NULL);
        p->pos = q;
        return SIM_OK;
    }
    return jerr(p, "a value (object, array, string, number, true, false or null)");
}

sim_status mesh_json_parse(const char *text, size_t len, const char *what, mesh_json **out)
{
    jparser p = {text, len, 0, 1, 0, what ? what : "<json>"};
    mesh_json *root = calloc(1, sizeof *root);
    SIM_ASSERT(root);
    /* Skip a UTF-8 byte order mark. */
    if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) p.pos = 3;
    sim_status st = parse_value(&p, root, 0);
    if (st == SIM_OK) {
        skip_ws(&p);
        if (p.pos != p.len) st = jerr(&p, "end of input after the top-level value");
    }
    if (st != SIM_OK) {
        mesh_json_free(root);
        return st;
    }
    *out = root;
    return SIM_OK;
}

sim_status mesh_json_read_file(const char *path, mesh_json **out)
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
    sim_status st = mesh_json_parse(buf, n, path, out);
    free(buf);
    return st;
}

void mesh_json_free(mesh_json *root)
{
    if (!root) return;
    json_free_value(root);
    free(root);
}

const mesh_json *mesh_json_get(const mesh_json *v, const char *key)
{
    if (!v || v->kind != MESH_JSON_OBJECT) return NULL;
    for (int i = 0; i < v->n; i++)
        if (strcmp(v->keys[i], key) == 0) return &v->items[i];
    return NULL;
}

const char *mesh_json_kind_name(mesh_json_kind k)
{
    switch (k) {
    case MESH_JSON_NULL: return "null";
    case MESH_JSON_BOOL: return "boolean";
    case MESH_JSON_NUMBER: return "number";
    case MESH_JSON_STRING: return "string";
    case MESH_JSON_ARRAY: return "array";
    case MESH_JSON_OBJECT: return "object";
    }
    return "?";
}

int mesh_json_equal(const mesh_json *a, const mesh_json *b)
{
    if (a->kind != b->kind) return 0;
    switch (a->kind) {
    case MESH_JSON_NULL: return 1;
    case MESH_JSON_BOOL: return a->boolean == b->boolean;
    case MESH_JSON_NUMBER: return a->number == b->number;
    case MESH_JSON_STRING: return !strcmp(a->str, b->str);
    case MESH_JSON_ARRAY:
        if (a->n != b->n) return 0;
        for (int i = 0; i < a->n; i++)
            if (!mesh_json_equal(&a->items[i], &b->items[i])) return 0;
        return 1;
    case MESH_JSON_OBJECT:
        if (a->n != b->n) return 0;
        for (int i = 0; i < a->n; i++) {
            const mesh_json *y = mesh_json_get(b, a->keys[i]);
            if (!y || !mesh_json_equal(&a->items[i], y)) return 0;
        }
        return 1;
    }
    return 0;
}

/* spec.c — PartitionSpec: invariants, text and JSON forms, shard geometry. */
#include "mesh/spec.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void mesh_spec_init(mesh_spec *s, int rank)
{
    SIM_ASSERT(rank >= 0 && rank <= MESH_SPEC_MAX_RANK);
    memset(s, 0, sizeof *s);
    s->rank = rank;
}

static void axes_list(const mesh_shape *m, char *buf, size_t cap)
{
    size_t k = 0;
    buf[0] = '\0';
    for (int i = 0; i < m->n_axes && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", m->names[i]);
}

uint32_t mesh_spec_dim_axes(const mesh_spec *s)
{
    uint32_t used = 0;
    for (int d = 0; d < s->rank; d++)
        for (int j = 0; j < s->n_axes[d]; j++) used |= 1u << s->axes[d][j];
    return used;
}

int mesh_spec_axis_dim(const mesh_spec *s, int a)
{
    for (int d = 0; d < s->rank; d++)
        for (int j = 0; j < s->n_axes[d]; j++)
            if (s->axes[d][j] == a) return d;
    return -1;
}

sim_status mesh_spec_check(const mesh_spec *s, const mesh_shape *m)
{
    if (s->rank < 0 || s->rank > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "PartitionSpec rank %d: shardsim supports rank 0 to %d", s->rank,
                       MESH_SPEC_MAX_RANK);
    uint32_t seen = 0;
    for (int d = 0; d < s->rank; d++) {
        if (s->n_axes[d] < 0 || s->n_axes[d] > m->n_axes)
            return sim_err(SIM_ERR_INTERNAL, "PartitionSpec dim %d has %d axes", d, s->n_axes[d]);
        for (int j = 0; j < s->n_axes[d]; j++) {
            int a = s->axes[d][j];
            if (a < 0 || a >= m->n_axes)
                return sim_err(SIM_ERR_INTERNAL, "PartitionSpec dim %d names axis index %d of a %d-axis mesh", d, a,
                               m->n_axes);
            if (seen & (1u << a))
                return sim_err(SIM_ERR_INPUT, "PartitionSpec uses mesh axis '%s' twice; an axis may shard only one dim",
                               m->names[a]);
            seen |= 1u << a;
        }
    }
    if (s->partial >> m->n_axes)
        return sim_err(SIM_ERR_INTERNAL, "PartitionSpec partial set names an axis beyond the mesh");
    for (int a = 0; a < m->n_axes; a++)
        if ((s->partial & seen) & (1u << a))
            return sim_err(SIM_ERR_INPUT,
                           "PartitionSpec has mesh axis '%s' both on a dim and as a partial (unreduced) "
                           "axis; a partial axis cannot also shard a dim",
                           m->names[a]);
    return SIM_OK;
}

sim_status mesh_spec_set_dim(mesh_spec *s, const mesh_shape *m, int d, int n, const int *axes)
{
    SIM_ASSERT(d >= 0 && d < s->rank && n >= 0 && n <= MESH_MAX_AXES);
    mesh_spec t = *s;
    t.n_axes[d] = n;
    for (int j = 0; j < n; j++) t.axes[d][j] = (int8_t)axes[j];
    SIM_TRY(mesh_spec_check(&t, m));
    *s = t;
    return SIM_OK;
}

int mesh_spec_equal(const mesh_spec *a, const mesh_spec *b)
{
    if (a->rank != b->rank || a->partial != b->partial) return 0;
    for (int d = 0; d < a->rank; d++) {
        if (a->n_axes[d] != b->n_axes[d]) return 0;
        for (int j = 0; j < a->n_axes[d]; j++)
            if (a->axes[d][j] != b->axes[d][j]) return 0;
    }
    return 1;
}

void mesh_spec_drop_size_one(mesh_spec *s, const mesh_shape *m)
{
    for (int d = 0; d < s->rank; d++) {
        int w = 0;
        for (int j = 0; j < s->n_axes[d]; j++)
            if (m->sizes[s->axes[d][j]] != 1) s->axes[d][w++] = s->axes[d][j];
        s->n_axes[d] = w;
    }
    for (int a = 0; a < m->n_axes; a++)
        if (m->sizes[a] == 1) s->partial &= ~(1u << a);
}

/* ======================================================================== */
/* text form                                                                 */
/* ======================================================================== */

typedef enum { T_END, T_IDENT, T_STRING, T_PUNCT, T_BAD } tok_kind;

typedef struct {
    const char *text;
    size_t pos;        /* cursor */
    tok_kind kind;     /* current token */
    size_t start, len; /* its span in text */
    char punct;
} lexer;

static void lex_next(lexer *lx)
{
    const char *s = lx->text;
    while (s[lx->pos] && isspace((unsigned char)s[lx->pos])) lx->pos++;
    lx->start = lx->pos;
    char c = s[lx->pos];
    if (!c) {
        lx->kind = T_END;
        lx->len = 0;
    } else if (isalpha((unsigned char)c) || c == '_') {
        while (isalnum((unsigned char)s[lx->pos]) || s[lx->pos] == '_' || s[lx->pos] == '.') lx->pos++;
        lx->kind = T_IDENT;
        lx->len = lx->pos - lx->start;
    } else if (c == '\'' || c == '"') {
        size_t q = lx->pos + 1;
        while (s[q] && s[q] != c) q++;
        if (!s[q]) {
            lx->kind = T_BAD;
            lx->len = q - lx->start;
            lx->pos = q;
            return;
        }
        lx->kind = T_STRING;
        lx->start = lx->pos + 1;
        lx->len = q - lx->start;
        lx->pos = q + 1;
    } else if (strchr("()[]{},=", c)) {
        lx->kind = T_PUNCT;
        lx->punct = c;
        lx->len = 1;
        lx->pos++;
    } else {
        lx->kind = T_BAD;
        lx->len = 1;
        lx->pos++;
    }
}

static int is_ident(const lexer *lx, const char *w)
{
    return lx->kind == T_IDENT && lx->len == strlen(w) && strncmp(lx->text + lx->start, w, lx->len) == 0;
}

static int is_punct(const lexer *lx, char c) { return lx->kind == T_PUNCT && lx->punct == c; }

static sim_status lex_error(const lexer *lx, const char *expected)
{
    char got[64];
    if (lx->kind == T_END) snprintf(got, sizeof got, "the end of the text");
    else if (lx->kind == T_STRING)
        snprintf(got, sizeof got, "'%.*s'", (int)(lx->len > 40 ? 40 : lx->len), lx->text + lx->start);
    else if (lx->kind == T_BAD && (lx->text[lx->start] == '\'' || lx->text[lx->start] == '"'))
        snprintf(got, sizeof got, "an unterminated string");
    else snprintf(got, sizeof got, "'%.*s'", (int)(lx->len > 40 ? 40 : lx->len), lx->text + lx->start);
    /* Strings start after their quote; point at the quote. */
    size_t col = lx->kind == T_STRING ? lx->start : lx->start + 1;
    return sim_err(SIM_ERR_INPUT, "PartitionSpec \"%s\": at position %zu: expected %s, got %s", lx->text, col, expected,
                   got);
}

static sim_status lex_axis(const lexer *lx, const mesh_shape *m, int *axis)
{
    char name[MESH_AXIS_NAME_MAX + 1];
    if (lx->len < sizeof name) {
        memcpy(name, lx->text + lx->start, lx->len);
        name[lx->len] = '\0';
        *axis = mesh_shape_axis_index(m, name);
        if (*axis >= 0) return SIM_OK;
    }
    char axes[MESH_MAX_AXES * MESH_AXIS_NAME_MAX];
    axes_list(m, axes, sizeof axes);
    return sim_err(SIM_ERR_INPUT,
                   "PartitionSpec \"%s\": at position %zu: '%.*s' is not a mesh axis; the mesh axes are: %s", lx->text,
                   lx->start, (int)lx->len, lx->text + lx->start, axes);
}

/* Reads `'a'`, `None`, or a tuple/list/set of names, into axes[]. */
static sim_status parse_axis_group(lexer *lx, const mesh_shape *m, int allow_set, int *axes, int *n)
{
    *n = 0;
    if (is_ident(lx, "None")) {
        lex_next(lx);
        return SIM_OK;
    }
    if (lx->kind == T_STRING) {
        SIM_TRY(lex_axis(lx, m, &axes[0]));
        *n = 1;
        lex_next(lx);
        return SIM_OK;
    }
    char close = is_punct(lx, '(') ? ')' : is_punct(lx, '[') ? ']' : (allow_set && is_punct(lx, '{')) ? '}' : 0;
    if (!close) return lex_error(lx, "None, a quoted mesh axis name, or a tuple of names");
    lex_next(lx);
    while (!is_punct(lx, close)) {
        if (lx->kind != T_STRING) return lex_error(lx, "a quoted mesh axis name");
        if (*n >= MESH_MAX_AXES) return lex_error(lx, "fewer axes in one tuple");
        SIM_TRY(lex_axis(lx, m, &axes[*n]));
        (*n)++;
        lex_next(lx);
        if (is_punct(lx, ',')) lex_next(lx);
        else if (!is_punct(lx, close)) {
            char want[32];
            snprintf(want, sizeof want, "',' or '%c'", close);
            return lex_error(lx, want);
        }
    }
    lex_next(lx);
    return SIM_OK;
}

sim_status mesh_spec_parse(const char *text, const mesh_shape *m, mesh_spec *out)
{
    lexer lx = {text, 0, T_END, 0, 0, 0};
    mesh_spec s;
    mesh_spec_init(&s, 0);
    lex_next(&lx);
    if (!is_ident(&lx, "P") && !is_ident(&lx, "PartitionSpec")) return lex_error(&lx, "P( or PartitionSpec(");
    lex_next(&lx);
    if (!is_punct(&lx, '(')) return lex_error(&lx, "'('");
    lex_next(&lx);
    int seen_keyword = 0;
    while (!is_punct(&lx, ')')) {
        int axes[MESH_MAX_AXES], n;
        size_t item_start = lx.start;
        if (is_ident(&lx, "unreduced") || is_ident(&lx, "partial")) {
            lex_next(&lx);
            if (!is_punct(&lx, '=')) return lex_error(&lx, "'=' after unreduced/partial");
            lex_next(&lx);
            SIM_TRY(parse_axis_group(&lx, m, 1, axes, &n));
            for (int j = 0; j < n; j++) {
                if (s.partial & (1u << axes[j]))
                    return sim_err(SIM_ERR_INPUT, "PartitionSpec \"%s\": partial axis '%s' listed twice", text,
                                   m->names[axes[j]]);
                s.partial |= 1u << axes[j];
            }
            seen_keyword = 1;
        } else {
            if (seen_keyword) return lex_error(&lx, "')' (dims come before unreduced=/partial=)");
            if (s.rank >= MESH_SPEC_MAX_RANK)
                return sim_err(SIM_ERR_INPUT, "PartitionSpec \"%s\": at position %zu: more than %d dims", text,
                               item_start + 1, MESH_SPEC_MAX_RANK);
            SIM_TRY(parse_axis_group(&lx, m, 0, axes, &n));
            s.rank++;
            s.n_axes[s.rank - 1] = n;
            for (int j = 0; j < n; j++) s.axes[s.rank - 1][j] = (int8_t)axes[j];
        }
        if (is_punct(&lx, ',')) lex_next(&lx);
        else if (!is_punct(&lx, ')')) return lex_error(&lx, "',' or ')'");
    }
    lex_next(&lx);
    if (lx.kind != T_END) return lex_error(&lx, "the end of the text after ')'");
    if (mesh_spec_check(&s, m) != SIM_OK) {
        sim_err_append(" (in PartitionSpec \"%s\")", text);
        return SIM_ERR_INPUT;
    }
    *out = s;
    return SIM_OK;
}

typedef struct {
    char *buf;
    int cap, n;
} wbuf;

static void wput(wbuf *w, const char *fmt, const char *arg)
{
    int room = w->n < w->cap ? w->cap - w->n : 0;
    int k = snprintf(room ? w->buf + w->n : NULL, (size_t)room, fmt, arg);
    w->n += k;
}

int mesh_spec_format(const mesh_spec *s, const mesh_shape *m, char *buf, int cap)
{
    wbuf w = {buf, cap, 0};
    if (cap > 0) buf[0] = '\0';
    wput(&w, "%s", "P(");
    for (int d = 0; d < s->rank; d++) {
        if (d) wput(&w, "%s", ", ");
        if (s->n_axes[d] == 0) wput(&w, "%s", "None");
        else if (s->n_axes[d] == 1) wput(&w, "'%s'", m->names[s->axes[d][0]]);
        else {
            for (int j = 0; j < s->n_axes[d]; j++) wput(&w, j ? ", '%s'" : "('%s'", m->names[s->axes[d][j]]);
            wput(&w, "%s", ")");
        }
    }
    /* Python's 1-tuple comma: P(None,) / P('fsdp', unreduced={...}). */
    if (s->rank == 1) wput(&w, "%s", s->partial ? ", " : ",");
    else if (s->rank > 1 && s->partial) wput(&w, "%s", ", ");
    if (s->partial) {
        wput(&w, "%s", "unreduced={");
        int first = 1;
        for (int a = 0; a < m->n_axes; a++)
            if (s->partial & (1u << a)) {
                wput(&w, first ? "'%s'" : ", '%s'", m->names[a]);
                first = 0;
            }
        wput(&w, "%s", "}");
    }
    wput(&w, "%s", ")");
    return w.n;
}

int mesh_spec_format_json(const mesh_spec *s, const mesh_shape *m, char *buf, int cap)
{
    wbuf w = {buf, cap, 0};
    if (cap > 0) buf[0] = '\0';
    wput(&w, "%s", "[");
    for (int d = 0; d < s->rank; d++) {
        if (d) wput(&w, "%s", ", ");
        if (s->n_axes[d] == 0) wput(&w, "%s", "null");
        else if (s->n_axes[d] == 1) wput(&w, "\"%s\"", m->names[s->axes[d][0]]);
        else {
            for (int j = 0; j < s->n_axes[d]; j++) wput(&w, j ? ", \"%s\"" : "[\"%s\"", m->names[s->axes[d][j]]);
            wput(&w, "%s", "]");
        }
    }
    wput(&w, "%s", "]");
    return w.n;
}

static sim_status json_axis(const cfg_json *v, const mesh_shape *m, const char *what, int *axis)
{
    if (v->kind != CFG_JSON_STRING)
        return sim_err(SIM_ERR_INPUT, "%s: partition_spec entry is a %s, expected a mesh axis name", what,
                       cfg_json_kind_name(v->kind));
    *axis = mesh_shape_axis_index(m, v->str);
    if (*axis >= 0) return SIM_OK;
    char axes[MESH_MAX_AXES * MESH_AXIS_NAME_MAX];
    axes_list(m, axes, sizeof axes);
    return sim_err(SIM_ERR_INPUT, "%s: '%s' is not a mesh axis; the mesh axes are: %s", what, v->str, axes);
}

sim_status mesh_spec_from_json(const cfg_json *v, const mesh_shape *m, const char *what, mesh_spec *out)
{
    if (v->kind != CFG_JSON_ARRAY)
        return sim_err(SIM_ERR_INPUT, "%s: partition_spec is a %s, expected a list", what, cfg_json_kind_name(v->kind));
    if (v->n > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "%s: partition_spec has %d dims; shardsim supports %d", what, v->n,
                       MESH_SPEC_MAX_RANK);
    mesh_spec s;
    mesh_spec_init(&s, v->n);
    for (int d = 0; d < v->n; d++) {
        const cfg_json *it = &v->items[d];
        if (it->kind == CFG_JSON_NULL) continue;
        if (it->kind == CFG_JSON_ARRAY) {
            if (it->n > MESH_MAX_AXES) return sim_err(SIM_ERR_INPUT, "%s: too many axes on one dim", what);
            for (int j = 0; j < it->n; j++) {
                int a = -1;
                SIM_TRY(json_axis(&it->items[j], m, what, &a));
                s.axes[d][j] = (int8_t)a;
            }
            s.n_axes[d] = it->n;
        } else {
            int a = -1;
            SIM_TRY(json_axis(it, m, what, &a));
            s.axes[d][0] = (int8_t)a;
            s.n_axes[d] = 1;
        }
    }
    if (mesh_spec_check(&s, m) != SIM_OK) {
        sim_err_append(" (in %s)", what);
        return SIM_ERR_INPUT;
    }
    *out = s;
    return SIM_OK;
}

/* ======================================================================== */
/* geometry                                                                  */
/* ======================================================================== */

int64_t mesh_spec_dim_shards(const mesh_spec *s, const mesh_shape *m, int d)
{
    int64_t k = 1;
    for (int j = 0; j < s->n_axes[d]; j++) k *= m->sizes[s->axes[d][j]];
    return k;
}

sim_status mesh_spec_check_shape(const mesh_spec *s, const mesh_shape *m, int rank, const int64_t *shape,
                                 const char *tensor)
{
    const char *name = tensor ? tensor : "(unnamed)";
    if (rank != s->rank) {
        char spec[256];
        mesh_spec_format(s, m, spec, sizeof spec);
        return sim_err(SIM_ERR_INPUT, "tensor '%s' has rank %d but its PartitionSpec %s has %d dims", name, rank, spec,
                       s->rank);
    }
    for (int d = 0; d < rank; d++) {
        int64_t k = mesh_spec_dim_shards(s, m, d);
        if (shape[d] < 0)
            return sim_err(SIM_ERR_INPUT, "tensor '%s' dim %d has negative size %lld", name, d, (long long)shape[d]);
        if (shape[d] % k == 0) continue;
        char axes[512];
        size_t n = 0;
        for (int j = 0; j < s->n_axes[d] && n < sizeof axes; j++)
            n += (size_t)snprintf(axes + n, sizeof axes - n, "%s%s=%d", j ? " x " : "", m->names[s->axes[d][j]],
                                  m->sizes[s->axes[d][j]]);
        return sim_err(SIM_ERR_INPUT,
                       "tensor '%s' dim %d has size %lld, which does not divide into %lld shards "
                       "over mesh axes %s; change the mesh or the sharding rules so that %lld divides it",
                       name, d, (long long)shape[d], (long long)k, axes, (long long)k);
    }
    return SIM_OK;
}

void mesh_spec_shard(const mesh_spec *s, const mesh_shape *m, const int64_t *shape, int device, mesh_dim_shard *out)
{
    int coords[MESH_MAX_AXES];
    mesh_shape_coords(m, device, coords);
    for (int d = 0; d < s->rank; d++) {
        int64_t block = 0, k = 1;
        for (int j = 0; j < s->n_axes[d]; j++) {
            int a = s->axes[d][j];
            block = block * m->sizes[a] + coords[a];
            k *= m->sizes[a];
        }
        SIM_ASSERT(shape[d] % k == 0);
        out[d].nshards = k;
        out[d].block = block;
        out[d].local = shape[d] / k;
        out[d].offset = block * out[d].local;
    }
}

void mesh_spec_local_shape(const mesh_spec *s, const mesh_shape *m, const int64_t *shape, int64_t *local)
{
    for (int d = 0; d < s->rank; d++) {
        int64_t k = mesh_spec_dim_shards(s, m, d);
        SIM_ASSERT(shape[d] % k == 0);
        local[d] = shape[d] / k;
    }
}

/* value.h — a config value: a YAML scalar (kept as the text written, typed on demand), list or map.
 *
 * Every value keeps where it was written (file:line, or "command line").  A scalar's type is read
 * from its text as YAML 1.1 does, plus MaxText's "None"; numbers compare by value (10_000 equals
 * 10000.0), lists and maps item by item.  The config (config.h) and the files config/ reads
 * (keys.yml, ranges.yml, hardware profiles, ...) are trees of these values. */
#ifndef CONFIG_VALUE_H
#define CONFIG_VALUE_H

#include <stddef.h>
#include <stdint.h>

#include "config/json.h"
#include "sim/status.h"

typedef enum { CFG_SCALAR, CFG_LIST, CFG_MAP } cfg_kind;

/* What a scalar's text parses as (YAML 1.1 style, plus MaxText's "None"). */
typedef enum {
    CFG_NULL,  /* unquoted "", ~, null, or None/none in any quoting */
    CFG_BOOL,  /* unquoted true/false, yes/no, on/off (any case) */
    CFG_INT,   /* [+-]digits, '_' separators allowed (10_000), 0x hex */
    CFG_FLOAT, /* a number with '.', an exponent, or .inf/.nan */
    CFG_STRING /* anything else, and every other quoted scalar */
} cfg_type;

typedef struct cfg_value cfg_value;
struct cfg_value {
    cfg_kind kind;
    char *text;       /* SCALAR: the text without quotes */
    int quoted;       /* SCALAR: written in quotes (so never a number/bool) */
    int n;            /* LIST/MAP: number of items */
    cfg_value *items; /* LIST/MAP: items (MAP: the values) */
    char **keys;      /* MAP: the keys */
    const char *file; /* where it was written: a path, or "command line" */
    int line;         /* 1-based line in file (0 when not from a file) */
};

/* ---- values ---------------------------------------------------------------- */
cfg_type cfg_scalar_type(const cfg_value *v);
const char *cfg_type_name(cfg_type t);
/* Value-level parsers; `what` names the value in messages ("key 'x'"). */
sim_status cfg_value_int(const cfg_value *v, const char *what, long long *out);
sim_status cfg_value_double(const cfg_value *v, const char *what, double *out);
sim_status cfg_value_bool(const cfg_value *v, const char *what, int *out);
/* Semantic equality: numbers by value (10_000 == 10000.0), lists item by item. */
int cfg_value_equal(const cfg_value *a, const cfg_value *b);
/* Flow text of a value, malloc'd: YAML flow (`['a', 1, null]`) when json is
 * 0, JSON (`["a", 1, null]`) when json is 1. */
char *cfg_value_to_text(const cfg_value *v, int json);
/* Writes v as typed JSON (scalars by their YAML type: null, true/false, integers, reals, else
 * strings) into the writer. */
void cfg_value_json(cfg_jw *w, const cfg_value *v);
/* "file:line" of a value (or "command line"), into buf. */
const char *cfg_value_where(const cfg_value *v, char *buf, int cap);

/* Levenshtein distance (for "did you mean" suggestions elsewhere too). */
int cfg_edit_distance(const char *a, const char *b);

/* ---- for config/'s own files: text buffers and value trees ------------------ */
typedef struct {
    char *s;
    size_t n, cap;
} cfg_sbuf;
void cfg_sb_putf(cfg_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
char *cfg_strdup(const char *s); /* never NULL; NULL gives "" */
char *cfg_asprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* FNV-1a of a key: the duplicate-key check of large maps and the hash indexes of entries and
 * keys.yml use it. */
uint64_t cfg_hash(const char *k);

void cfg_value_free(cfg_value *v);
void cfg_value_copy(cfg_value *dst, const cfg_value *src);
/* Appends an item (and key for maps); returns the new, zeroed slot. */
cfg_value *cfg_value_push(cfg_value *v, const char *key);
/* Index of key in a MAP (the last one), or -1. */
int cfg_map_index(const cfg_value *map, const char *key);
/* The value under key, or NULL when map is not a map or has no such key. */
const cfg_value *cfg_map_get(const cfg_value *map, const char *key);
/* The scalar text under key, or NULL. */
const char *cfg_map_text(const cfg_value *map, const char *key);
int cfg_is_null(const cfg_value *v);
int cfg_parse_int(const char *t, long long *out);
int cfg_parse_float(const char *t, double *out);
int cfg_bool_word(const char *t, int *out);
/* "a list", "a map", or the scalar's type name. */
const char *cfg_kind_name(const cfg_value *v);
/* SIM_ERR_INPUT: "<where>: <what> = <value> is <kind>, expected <expected>". */
sim_status cfg_value_error(const cfg_value *v, const char *what, const char *expected);

#endif

/* json.h — JSON (RFC 8259) through Debian's libjansson: read into a plain tree of values, and
 * written, for every JSON file and line the program writes, by one writer (cfg_jw).
 *
 * Used to read MaxText's sharding dumps (named_shardings.json,
 * logical_shardings.json, input_shardings.json), our own artifacts and
 * safetensors headers.  Jansson does the parsing (strict RFC 8259, UTF-8
 * checked, nesting depth capped, duplicate keys refused); this module copies
 * its result into open structs so callers index items directly.  Objects keep
 * their keys in file order.  Numbers keep a double, their integer value when
 * they are integers, and a text.  The whole tree is owned by its root: free
 * it with cfg_json_free. */
#ifndef CONFIG_JSON_H
#define CONFIG_JSON_H

#include <stddef.h>
#include <stdio.h>

#include "sim/status.h"

typedef enum {
    CFG_JSON_NULL,
    CFG_JSON_BOOL,
    CFG_JSON_NUMBER,
    CFG_JSON_STRING,
    CFG_JSON_ARRAY,
    CFG_JSON_OBJECT
} cfg_json_kind;

typedef struct cfg_json cfg_json;
struct cfg_json {
    cfg_json_kind kind;
    int boolean;       /* BOOL: 0 or 1 */
    double number;     /* NUMBER: value */
    int is_integer;    /* NUMBER: written without fraction or exponent (fits int64) */
    long long integer; /* NUMBER: the value when is_integer */
    char *str;         /* STRING: decoded text; NUMBER: the number's text (integers exact,
                         others %.17g) */
    int n;             /* ARRAY/OBJECT: number of items */
    cfg_json *items;   /* ARRAY/OBJECT: the items (OBJECT: the values) */
    char **keys;       /* OBJECT: the keys, in file order */
};

/* Parses text (len bytes).  `what` names the input in error messages
 * (a file name; errors read "what:line:column: invalid JSON: reason").
 * On success *out is a heap root to free with cfg_json_free. */
sim_status cfg_json_parse(const char *text, size_t len, const char *what, cfg_json **out);
/* Reads and parses a file; SIM_ERR_IO when it cannot be read. */
sim_status cfg_json_read_file(const char *path, cfg_json **out);
void cfg_json_free(cfg_json *root);

/* Object member by key (first match), NULL when absent or v is not an object. */
const cfg_json *cfg_json_get(const cfg_json *v, const char *key);
const char *cfg_json_kind_name(cfg_json_kind k);

/* Semantic equality: numbers by value, arrays item by item, objects key by
 * key in any order. */
int cfg_json_equal(const cfg_json *a, const cfg_json *b);

/* ---- writing ----------------------------------------------------------------
 * The writer builds a jansson tree in call order (cfg_jw_obj/_key/_str/.../_end) and dumps it
 * whole through the one JSON writer (sim/jsonout.h), so no caller escapes a string or formats a
 * number by hand.  Layouts: Python's
 * json.dumps(obj, indent=2) (one item per line, ": " after a key, non-ASCII as \uXXXX: the MaxText
 * sharding dump byte for byte, and every artifact) and one line ({"a": 1, "b": [2, 3]}: MaxText's
 * metrics_file lines, embedded data), and the indent-1 and compact ones of plan.json and the
 * safetensors header.  Reals print with the document's precision (%.<p>g, with
 * ".0" added to an integral value); cfg_jw_num keeps a figure to fewer digits. */
struct json_t; /* jansson's value */

enum { CFG_JW_MAX_DEPTH = 32 };

typedef enum {
    CFG_JW_INDENT2, /* json.dumps(indent=2, ensure_ascii=True) */
    CFG_JW_LINE,    /* one line, ", " and ": " separators, UTF-8 as is */
    CFG_JW_INDENT1, /* one item per line, one space a level, UTF-8 as is (plan.json) */
    CFG_JW_COMPACT  /* one line without spaces, UTF-8 as is (a safetensors header) */
} cfg_jw_layout;

typedef struct {
    struct json_t *root;                   /* the document (NULL until the first value) */
    int depth;                             /* open containers */
    struct json_t *open[CFG_JW_MAX_DEPTH]; /* the open containers, outermost first (borrowed) */
    char key[1024];                        /* the pending object key */
    int after_key;                         /* the next value goes under key */
} cfg_jw;

void cfg_jw_init(cfg_jw *w);
/* Opens an object or array (as the root, an array item, or the value of the pending key). */
void cfg_jw_obj(cfg_jw *w);
void cfg_jw_arr(cfg_jw *w);
/* Closes the innermost open container. */
void cfg_jw_end(cfg_jw *w);
/* The next value's key in the open object. */
void cfg_jw_key(cfg_jw *w, const char *k);
/* A string (NULL: null); bytes that are not UTF-8 become '?', so any user text can be written. */
void cfg_jw_str(cfg_jw *w, const char *s);
void cfg_jw_null(cfg_jw *w);
void cfg_jw_bool(cfg_jw *w, int b);
void cfg_jw_int(cfg_jw *w, long long v);
void cfg_jw_u64(cfg_jw *w, unsigned long long v);
/* A real at the document's precision; null when not finite. */
void cfg_jw_double(cfg_jw *w, double d);
/* The number printf's %.<digits>g writes for d, as JSON reads that text: an integer when the
 * text has no '.', exponent or sign of a real ("%.6g" of 12.0 is 12), else a real of that
 * value; null when not finite. */
void cfg_jw_num(cfg_jw *w, double d, int digits);
/* Adds a jansson value (the writer takes the reference). */
void cfg_jw_tree(cfg_jw *w, struct json_t *v);
/* The finished document (every container closed); the caller owns it, the writer is empty. */
struct json_t *cfg_jw_take(cfg_jw *w);
/* Frees a document left unfinished (a failure while building it). */
void cfg_jw_discard(cfg_jw *w);
/* Dumps the finished document to f in a layout, reals at `precision` significant digits (1-17),
 * without a final newline, and frees it.  A write error shows in ferror(f). */
void cfg_jw_write(cfg_jw *w, FILE *f, cfg_jw_layout layout, int precision);
/* The same into a malloc'd string. */
char *cfg_jw_dumps(cfg_jw *w, cfg_jw_layout layout, int precision);

#endif

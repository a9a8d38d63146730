/* json.h — JSON (RFC 8259) through Debian's libjansson: read into a plain tree of values, and
 * written, for every JSON file and line the program writes, by one writer (mesh_jw).
 *
 * Used to read MaxText's sharding dumps (named_shardings.json,
 * logical_shardings.json, input_shardings.json), our own artifacts and
 * safetensors headers.  Jansson does the parsing (strict RFC 8259, UTF-8
 * checked, nesting depth capped, duplicate keys refused); this module copies
 * its result into open structs so callers index items directly.  Objects keep
 * their keys in file order.  Numbers keep a double, their integer value when
 * they are integers, and a text.  The whole tree is owned by its root: free
 * it with mesh_json_free. */
#ifndef CONFIG_JSON_H
#define CONFIG_JSON_H

#include <stddef.h>
#include <stdio.h>

#include "sim/status.h"

typedef enum {
    MESH_JSON_NULL,
    MESH_JSON_BOOL,
    MESH_JSON_NUMBER,
    MESH_JSON_STRING,
    MESH_JSON_ARRAY,
    MESH_JSON_OBJECT
} mesh_json_kind;

typedef struct mesh_json mesh_json;
struct mesh_json {
    mesh_json_kind kind;
    int boolean;      /* BOOL: 0 or 1 */
    double number;    /* NUMBER: value */
    int is_integer;   /* NUMBER: written without fraction or exponent (fits int64) */
    long long integer;/* NUMBER: the value when is_integer */
    char *str;        /* STRING: decoded text; NUMBER: the number's text (integers exact,
                         others %.17g) */
    int n;            /* ARRAY/OBJECT: number of items */
    mesh_json *items; /* ARRAY/OBJECT: the items (OBJECT: the values) */
    char **keys;      /* OBJECT: the keys, in file order */
};

/* Parses text (len bytes).  `what` names the input in error messages
 * (a file name; errors read "what:line:column: invalid JSON: reason").
 * On success *out is a heap root to free with mesh_json_free. */
sim_status mesh_json_parse(const char *text, size_t len, const char *what, mesh_json **out);
/* Reads and parses a file; SIM_ERR_IO when it cannot be read. */
sim_status mesh_json_read_file(const char *path, mesh_json **out);
void mesh_json_free(mesh_json *root);

/* Object member by key (first match), NULL when absent or v is not an object. */
const mesh_json *mesh_json_get(const mesh_json *v, const char *key);
const char *mesh_json_kind_name(mesh_json_kind k);

/* Semantic equality: numbers by value, arrays item by item, objects key by
 * key in any order. */
int mesh_json_equal(const mesh_json *a, const mesh_json *b);

/* ---- writing ----------------------------------------------------------------
 * The writer builds a jansson tree in call order (mesh_jw_obj/_key/_str/.../_end) and dumps it
 * whole, so no caller escapes a string or formats a number by hand.  Two layouts: Python's
 * json.dumps(obj, indent=2) (one item per line, ": " after a key, non-ASCII as \uXXXX: the MaxText
 * sharding dump byte for byte, and every artifact) and one line ({"a": 1, "b": [2, 3]}: MaxText's
 * metrics_file lines, embedded data).  Reals print with the document's precision (%.<p>g, with
 * ".0" added to an integral value); mesh_jw_num keeps a figure to fewer digits. */
struct json_t; /* jansson's value */

enum { MESH_JW_MAX_DEPTH = 32 };

typedef enum {
    MESH_JW_INDENT2, /* json.dumps(indent=2, ensure_ascii=True) */
    MESH_JW_LINE     /* one line, ", " and ": " separators, UTF-8 as is */
} mesh_jw_layout;

typedef struct {
    struct json_t *root;                     /* the document (NULL until the first value) */
    int depth;                               /* open containers */
    struct json_t *open[MESH_JW_MAX_DEPTH];  /* the open containers, outermost first (borrowed) */
    char key[1024];                          /* the pending object key */
    int after_key;                           /* the next value goes under key */
} mesh_jw;

void mesh_jw_init(mesh_jw *w);
/* Opens an object or array (as the root, an array item, or the value of the pending key). */
void mesh_jw_obj(mesh_jw *w);
void mesh_jw_arr(mesh_jw *w);
/* Closes the innermost open container. */
void mesh_jw_end(mesh_jw *w);
/* The next value's key in the open object. */
void mesh_jw_key(mesh_jw *w, const char *k);
/* A string (NULL: null); bytes that are not UTF-8 become '?', so any user text can be written. */
void mesh_jw_str(mesh_jw *w, const char *s);
void mesh_jw_null(mesh_jw *w);
void mesh_jw_bool(mesh_jw *w, int b);
void mesh_jw_int(mesh_jw *w, long long v);
void mesh_jw_u64(mesh_jw *w, unsigned long long v);
/* A real at the document's precision; null when not finite. */
void mesh_jw_double(mesh_jw *w, double d);
/* The number printf's %.<digits>g writes for d, as JSON reads that text: an integer when the
 * text has no '.', exponent or sign of a real ("%.6g" of 12.0 is 12), else a real of that
 * value; null when not finite. */
void mesh_jw_num(mesh_jw *w, double d, int digits);
/* Adds a jansson value (the writer takes the reference). */
void mesh_jw_tree(mesh_jw *w, struct json_t *v);
/* The finished document (every container closed); the caller owns it, the writer is empty. */
struct json_t *mesh_jw_take(mesh_jw *w);
/* Frees a document left unfinished (a failure while building it). */
void mesh_jw_discard(mesh_jw *w);
/* Dumps the finished document to f in a layout, reals at `precision` significant digits (1-17),
 * without a final newline, and frees it.  A write error shows in ferror(f). */
void mesh_jw_write(mesh_jw *w, FILE *f, mesh_jw_layout layout, int precision);
/* The same into a malloc'd string. */
char *mesh_jw_dumps(mesh_jw *w, mesh_jw_layout layout, int precision);

#endif

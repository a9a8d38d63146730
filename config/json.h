/* json.h — JSON (RFC 8259) read through Debian's libjansson into a plain
 * tree of values.
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

#endif

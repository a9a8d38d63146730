/* jsonout.h — the one JSON writer: every JSON byte the program writes (the artifacts of
 * output_dir, plan.json, the checkpoint's safetensors header, metrics_file's lines, trace.json)
 * comes out of this streaming writer, so strings are escaped and numbers formatted in one place.
 *
 * Values are written in call order (sim_json_obj / _key / _str / ... / _end) straight to a FILE*
 * through sim_textout's buffer, so a document of any size (a trace of millions of events) costs
 * no memory beyond the open containers.  The text is jansson 2.14's json_dumpf's for the same
 * values and flags, byte for byte (the writer replaced it; tests/test_sim_jsonout.c compares the
 * two): strings escape '"', '\\' and control characters (\b \f \n \r \t, others \u00XX), and with
 * `ascii` every non-ASCII character as \uXXXX (a surrogate pair beyond the BMP); text that is not
 * UTF-8 has its bytes >= 0x80 written as '?', so any user text can be written; reals print as
 * jansson's jsonp_dtostr at the document's precision ("%.<p>g", ".0" added to an integral value,
 * the exponent without '+' or leading zeros).  The layouts:
 *   indent > 0   one item per line, `indent` spaces a level, ": " after a key (Python's
 *                json.dumps(indent=2) when ascii is set: MaxText's sharding dumps, every artifact);
 *   SIM_JSON_LINE     one line, ", " and ": " separators (MaxText's metrics_file lines);
 *   SIM_JSON_COMPACT  no spaces at all (the safetensors header, trace.json).
 * An array opened with sim_json_arr_lines puts each item on a line of its own and its closing
 * bracket on the next, whatever the layout (trace.json's event list). */
#ifndef SIM_JSONOUT_H
#define SIM_JSONOUT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "sim/status.h"

enum { SIM_JSON_MAX_DEPTH = 64 };

typedef enum {
    SIM_JSON_COMPACT = -1, /* "," and ":" */
    SIM_JSON_LINE = 0      /* ", " and ": " on one line; > 0: that many spaces of indent a level */
} sim_json_layout;

typedef struct sim_json sim_json;

/* A writer on f: layout (SIM_JSON_COMPACT, SIM_JSON_LINE or an indent > 0), non-ASCII as \uXXXX
 * when ascii, reals at `precision` significant digits (1-17). */
sim_status sim_json_new(FILE *f, int layout, bool ascii, int precision, sim_json **out);
/* Opens an object or array: the document, an array item, or the value of the pending key. */
void sim_json_obj(sim_json *j);
void sim_json_arr(sim_json *j);
/* An array whose items start on lines of their own, its closing bracket on the next line. */
void sim_json_arr_lines(sim_json *j);
/* Closes the innermost open container. */
void sim_json_end(sim_json *j);
/* The next value's key in the open object. */
void sim_json_key(sim_json *j, const char *k);
/* A string (NULL: null). */
void sim_json_str(sim_json *j, const char *s);
void sim_json_null(sim_json *j);
void sim_json_bool(sim_json *j, bool b);
void sim_json_i64(sim_json *j, int64_t v);
void sim_json_u64(sim_json *j, uint64_t v);
/* A real at the document's precision (a finite value: the caller writes null for others). */
void sim_json_real(sim_json *j, double d);
/* A count of thousandths as a decimal with three places ("%.3f" of v / 1000: trace.json's
 * microseconds from nanoseconds, exact where a double would round). */
void sim_json_milli(sim_json *j, uint64_t v);
/* Ends the document (every container closed), writes `tail` after it (NULL: nothing), flushes and
 * frees j: SIM_ERR_IO naming `what` when a write failed. */
sim_status sim_json_close(sim_json *j, const char *tail, const char *what);

#endif

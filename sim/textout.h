/* textout.h — buffered text output for the large artifacts (trace.json,
 * collectives.csv: tens of MB, hundreds of thousands of lines, written by
 * one thread at the end of a run).  Lines are assembled in a 64 KiB buffer
 * with hand-written number formatting and handed to stdio in big writes:
 * printf's format parsing was most of that serial tail.  Every function
 * prints exactly what the printf conversion named beside it prints. */
#ifndef SIM_TEXTOUT_H
#define SIM_TEXTOUT_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    FILE *f;
    size_t n; /* bytes pending in buf */
    char buf[1 << 16];
} sim_textout;

static inline void sim_textout_init(sim_textout *o, FILE *f)
{
    o->f = f;
    o->n = 0;
}

static inline void sim_textout_flush(sim_textout *o)
{
    if (o->n) fwrite(o->buf, 1, o->n, o->f);
    o->n = 0;
}

static inline void sim_textout_mem(sim_textout *o, const char *s, size_t len)
{
    if (len > sizeof o->buf - o->n) {
        sim_textout_flush(o);
        if (len > sizeof o->buf) {
            fwrite(s, 1, len, o->f);
            return;
        }
    }
    memcpy(o->buf + o->n, s, len);
    o->n += len;
}

/* "%s" */
static inline void sim_textout_str(sim_textout *o, const char *s) { sim_textout_mem(o, s, strlen(s)); }

static inline void sim_textout_char(sim_textout *o, char c)
{
    if (o->n == sizeof o->buf) sim_textout_flush(o);
    o->buf[o->n++] = c;
}

/* "%llu" */
static inline void sim_textout_u64(sim_textout *o, uint64_t v)
{
    char d[20];
    int k = (int)sizeof d;
    do d[--k] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    sim_textout_mem(o, d + k, sizeof d - (size_t)k);
}

/* "%lld" (and "%d", "%zu" through their casts) */
static inline void sim_textout_i64(sim_textout *o, int64_t v)
{
    if (v < 0) {
        sim_textout_char(o, '-');
        sim_textout_u64(o, (uint64_t)0 - (uint64_t)v);
    } else {
        sim_textout_u64(o, (uint64_t)v);
    }
}

/* "%.3f" of a count of thousandths: the digits of v / 1000, a point, the
 * three digits of v % 1000. */
static inline void sim_textout_milli(sim_textout *o, uint64_t v)
{
    sim_textout_u64(o, v / 1000);
    char d[4] = {'.', (char)('0' + v / 100 % 10), (char)('0' + v / 10 % 10), (char)('0' + v % 10)};
    sim_textout_mem(o, d, sizeof d);
}

#endif

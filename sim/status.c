/* status.c — thread-local error messages behind sim_status. */
#include "sim/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MSG_CAP = 4096, TRAIL_CAP = 1024 };
static _Thread_local char tl_msg[MSG_CAP];
static _Thread_local char tl_trail[TRAIL_CAP];

sim_status sim_verr(sim_status st, const char *fmt, va_list ap)
{
    vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
    tl_trail[0] = '\0';
    return st;
}

sim_status sim_err(sim_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sim_verr(st, fmt, ap);
    va_end(ap);
    return st;
}

void sim_err_append(const char *fmt, ...)
{
    size_t n = strlen(tl_msg);
    if (n + 1 >= sizeof tl_msg) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_msg + n, sizeof tl_msg - n, fmt, ap);
    va_end(ap);
}

const char *sim_errmsg(void) { return tl_msg; }

_Static_assert(SIM_ERR_STATE_BYTES == MSG_CAP + TRAIL_CAP, "the saved state holds the message and the trail");

void sim_err_state_save(char *buf)
{
    memcpy(buf, tl_msg, strnlen(tl_msg, MSG_CAP - 1) + 1);
    memcpy(buf + MSG_CAP, tl_trail, strnlen(tl_trail, TRAIL_CAP - 1) + 1);
}

void sim_err_state_restore(const char *buf)
{
    memcpy(tl_msg, buf, strnlen(buf, MSG_CAP - 1) + 1);
    memcpy(tl_trail, buf + MSG_CAP, strnlen(buf + MSG_CAP, TRAIL_CAP - 1) + 1);
}
void sim_err_state_init(char *buf)
{
    buf[0] = '\0';
    buf[MSG_CAP] = '\0';
}

const char *sim_err_trail(void) { return tl_trail; }

void sim_err_clear(void)
{
    tl_msg[0] = '\0';
    tl_trail[0] = '\0';
}

void sim_err_trace(const char *file, int line)
{
    size_t n = strlen(tl_trail);
    if (n + 1 < sizeof tl_trail) snprintf(tl_trail + n, sizeof tl_trail - n, "%s  at %s:%d", n ? "\n" : "", file, line);
}

const char *sim_status_name(sim_status st)
{
    switch (st) {
    case SIM_OK: return "ok";
    case SIM_ERR_INPUT: return "bad input";
    case SIM_ERR_IO: return "i/o error";
    case SIM_ERR_OOM: return "out of device memory";
    case SIM_ERR_MISMATCH: return "collective mismatch";
    case SIM_ERR_DEADLOCK: return "collective deadlock";
    case SIM_ERR_SHARDING: return "sharding error";
    case SIM_ERR_CHECK: return "check failed";
    case SIM_ERR_ABORTED: return "aborted";
    case SIM_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

int sim_status_exit_code(sim_status st)
{
    if (st == SIM_OK) return 0;
    if (st == SIM_ERR_INPUT || st == SIM_ERR_IO) return 2;
    return 1;
}

void sim_assert_fail(const char *cond, const char *file, int line)
{
    fprintf(stderr, "shardsim: internal assertion failed: %s (%s:%d)\n", cond, file, line);
    abort();
}

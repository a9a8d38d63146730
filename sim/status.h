/* status.h — one status enum for the whole project, and error messages.
 *
 * Functions that can fail return a sim_status and leave a human-readable
 * message in a thread-local buffer (sim_errmsg()).  The message names the bad
 * input, what was expected and how to fix it.  SIM_TRY passes a failure up and
 * remembers file:line so that `SHARDSIM_DEBUG=1` can print where it travelled;
 * SIM_TRY_GOTO does the same for a function that must free what it holds first.
 * Only main() turns a status into an exit code (sim_status_exit_code). */
#ifndef SIM_STATUS_H
#define SIM_STATUS_H

#include <stdarg.h>

typedef enum {
    SIM_OK = 0,
    SIM_ERR_INPUT,    /* bad user input: config key, flag, spec, file (exit 2) */
    SIM_ERR_IO,       /* a file could not be read or written (exit 2) */
    SIM_ERR_OOM,      /* simulated device ran out of its memory capacity (exit 1) */
    SIM_ERR_MISMATCH, /* group members called different collectives (exit 1) */
    SIM_ERR_DEADLOCK, /* every live device waits on a collective that cannot complete (exit 1) */
    SIM_ERR_SHARDING, /* explicit-mode sharding error (exit 1) */
    SIM_ERR_CHECK,    /* a check failed: parity, gradient, ... (exit 1) */
    SIM_ERR_ABORTED,  /* another device failed first; this one stopped (exit 1) */
    SIM_ERR_INTERNAL  /* broken internal contract or system failure (exit 1) */
} sim_status;

/* Sets the thread's error message (printf-style) and returns st. */
sim_status sim_err(sim_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
sim_status sim_verr(sim_status st, const char *fmt, va_list ap);
/* Appends text to the thread's current message (for context lines). */
void sim_err_append(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The thread's last error message ("" when none). */
const char *sim_errmsg(void);
void sim_err_clear(void);
/* Records that a failure passed through file:line (kept for SHARDSIM_DEBUG). */
void sim_err_trace(const char *file, int line);
/* The file:line trail of the last failure ("" when none). */
const char *sim_err_trail(void);
/* The thread's message and trail, saved and put back by the simulator when one OS thread runs
 * several devices in turn (sim/fiber.c), so each device keeps its own; buf holds
 * SIM_ERR_STATE_BYTES.  Copies only the strings' lengths: a swap between devices stays cheap. */
enum { SIM_ERR_STATE_BYTES = 4096 + 1024 };
void sim_err_state_save(char *buf);
void sim_err_state_restore(const char *buf);
/* An empty saved state in buf (no message, no trail), as sim_err_clear leaves a thread. */
void sim_err_state_init(char *buf);
const char *sim_status_name(sim_status st);
/* 0 ok, 2 bad usage or input, 1 every other failure. */
int sim_status_exit_code(sim_status st);

#define SIM_TRY(expr)                                                                                                  \
    do {                                                                                                               \
        sim_status sim_try_st_ = (expr);                                                                               \
        if (sim_try_st_ != SIM_OK) {                                                                                   \
            sim_err_trace(__FILE__, __LINE__);                                                                         \
            return sim_try_st_;                                                                                        \
        }                                                                                                              \
    } while (0)

/* The one cleanup idiom of a function that owns resources (NCCL's NCCLCHECKGOTO): every call that
 * can fail goes through SIM_TRY_GOTO, which stores its status in st, records file:line as SIM_TRY
 * does, and jumps to the function's single label `fail`.  The code under `fail:` runs on every
 * path (the success path falls through to it with st == SIM_OK): it frees what the function holds
 * for itself, and what it built for the caller only when st != SIM_OK.  A refusal made on the
 * spot is SIM_TRY_GOTO(sim_err(...), st, fail). */
#define SIM_TRY_GOTO(expr, st, label)                                                                                  \
    do {                                                                                                               \
        (st) = (expr);                                                                                                 \
        if ((st) != SIM_OK) {                                                                                          \
            sim_err_trace(__FILE__, __LINE__);                                                                         \
            goto label;                                                                                                \
        }                                                                                                              \
    } while (0)

/* Always-on assertion for internal contracts (never for user input). */
#define SIM_ASSERT(cond)                                                                                               \
    do {                                                                                                               \
        if (!(cond)) sim_assert_fail(#cond, __FILE__, __LINE__);                                                       \
    } while (0)
_Noreturn void sim_assert_fail(const char *cond, const char *file, int line);

#endif

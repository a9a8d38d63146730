/* fiber.h — many devices per OS thread.  When a machine has more devices
 * than the host has cores, each device runs as a fiber (its own stack, a
 * ucontext) on one of a few worker threads, one worker per core: a device
 * that waits at a collective hands its worker to the next runnable device
 * of that worker instead of sleeping in the kernel, so a step costs a
 * context swap per wait, not a futex sleep and wake-up.  A worker with no
 * runnable device sleeps on its condition variable (never spins) until a
 * peer posts one of its devices or a device's watchdog deadline passes.
 * Private to the simulator (machine.c). */
#ifndef SIM_FIBER_H
#define SIM_FIBER_H

#include <stdbool.h>
#include <stddef.h>
#include <time.h>

typedef struct sim_fibers sim_fibers;
typedef struct sim_fiber sim_fiber;

/* Whether this build can run fibers: not under AddressSanitizer or
 * ThreadSanitizer (their shadow stacks would need fiber annotations), so
 * sanitizer builds keep one thread per device. */
bool sim_fibers_available(void);

/* n fibers on `workers` threads (fiber i on worker i % workers), each to run
 * body(arg, i) with a stack of `stack_bytes`; NULL when the stacks or threads
 * cannot be had (the caller then runs threads). */
sim_fibers *sim_fibers_new(int n, int workers, size_t stack_bytes);
sim_fiber *sim_fibers_at(sim_fibers *p, int i);
/* The worker fiber i runs on. */
int sim_fiber_worker(const sim_fiber *f);
/* Runs every fiber to its end; each worker calls pin(arg, worker) first
 * when pin is set.  False when a worker thread could not start (then no
 * fiber ran). */
bool sim_fibers_run(sim_fibers *p, void (*body)(void *arg, int i), void (*pin)(void *arg, int worker), void *arg);
void sim_fibers_free(sim_fibers *p);

/* A counting semaphore per fiber, as sem_post / sem_timedwait: post from any
 * thread; wait only from the fiber itself.  Wait returns 0 when it took a
 * post, ETIMEDOUT when `deadline` (CLOCK_REALTIME, NULL: none) passed. */
void sim_fiber_post(sim_fiber *f);
int sim_fiber_wait(sim_fiber *f, const struct timespec *deadline);

#endif

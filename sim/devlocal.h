/* devlocal.h — thread-local pointers that belong to a device, not to the thread running it.
 * A layer keeps per-device state in a thread-local (a rule table); when one OS thread runs
 * several devices as fibers (fiber.c), the fiber scheduler saves every registered slot when a
 * device swaps out and puts it back when the device resumes, and a device starts with every
 * slot NULL, as a fresh thread would.  The registry is its own module so that the scheduler
 * (below the machine) and the layers (above it) share it without the machine in between. */
#ifndef SIM_DEVLOCAL_H
#define SIM_DEVLOCAL_H

enum { SIM_DEVICE_LOCALS_MAX = 8 };

/* Registers a slot by its accessors: get() reads this thread's pointer, set() writes it.
 * Register before the first run (up to SIM_DEVICE_LOCALS_MAX slots; registering again is a
 * no-op). */
void sim_device_local_register(void *(*get)(void), void (*set)(void *));
/* Reads every registered slot of the calling thread into slots[0..SIM_DEVICE_LOCALS_MAX). */
void sim_device_locals_save(void **slots);
/* Writes slots[0..) back into the calling thread's registered slots. */
void sim_device_locals_restore(void *const *slots);

#endif

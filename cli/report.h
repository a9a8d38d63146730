/* report.h — what a run prints on the console: the config box at start, one
 * fixed-width line per step, a progress bar on long work, and at the end the
 * collective traffic table (op x mesh axes x phase) and the memory table (per
 * device, by category, at peak).  Also the parity table of `shardsim parity`.
 *
 * Everything here reads plain structs the command fills (or the machine's
 * records and arenas after a run) and writes to the FILE* it is given:
 * results go to stdout, the progress bar to stderr and only on a terminal.
 * Tables are fixed-width with one unit per column, named in the header. */
#ifndef CLI_REPORT_H
#define CLI_REPORT_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "mesh/mesh_shape.h"
#include "sim/arena.h"
#include "sim/collectives.h"
#include "sim/machine.h"

/* ---- config box ------------------------------------------------------------ */

/* One row of the config box. */
typedef struct {
    const char *key;   /* "model", "mesh", "batch", ... */
    const char *value; /* any text; long values wrap onto continuation lines */
} cli_kv;

/* A boxed two-column table; title (may be NULL) goes in the top row.
 *   +--------+---------------------------+
 *   | model  | llama2-7b                 |   */
void cli_report_config_box(FILE *f, const char *title, const cli_kv *rows, int n);
/* "data=2 fsdp=4 (8 devices)": axes of size > 1 in mesh order, then the
 * device count ("1 device" for a single device).  Returns buf. */
const char *cli_mesh_summary(const mesh_shape *m, char *buf, size_t cap);

/* "48 B", "336.0 KiB", "1.59 MiB": bytes in the binary unit that fits them
 * (three significant digits from KiB up).  Returns buf. */
const char *cli_bytes_text(double bytes, char *buf, size_t cap);

/* ---- step lines ------------------------------------------------------------- */

typedef struct {
    int step;             /* step number */
    double loss;          /* mean loss of the step */
    double grad_norm;     /* global norm of the gradients applied, after clipping (MaxText's learning/grad_norm) */
    double lr;            /* learning rate used by the step */
    double time_s;        /* wall time of the step, seconds */
    double tokens_per_s;  /* global tokens / time_s */
    size_t peak_bytes;    /* highest arena peak over the devices, bytes */
    bool dry;             /* dry run: no loss or grad norms ("-" is printed, null written) */
    double mtp_loss;      /* of loss, the multi-token prediction loss (when has_mtp) */
    bool has_mtp;         /* mtp_num_layers > 0: mtp_loss is reported (MaxText's learning/mtp_loss) */
    double raw_grad_norm; /* global gradient norm before clipping (MaxText's learning/raw_grad_norm) */
} cli_step_metrics;

/* Header line matching cli_report_step_line (units in the header). */
void cli_report_step_header(FILE *f);
void cli_report_step_line(FILE *f, const cli_step_metrics *s);

/* ---- progress --------------------------------------------------------------- */

/* "\r[=========>          ] 42% label" on f when f is a terminal, nothing
 * otherwise; frac is clamped to [0, 1].  Call cli_progress_done at the end. */
void cli_progress(FILE *f, double frac, const char *label);
/* Clears the progress line (terminal only). */
void cli_progress_done(FILE *f);
/* The bar text without the leading '\r' (what cli_progress prints). */
const char *cli_progress_format(double frac, const char *label, char *buf, size_t cap);

/* ---- collective records -------------------------------------------------------- */

/* Inclusive range of step numbers. */
typedef struct {
    int first, last;
} cli_step_range;
static inline cli_step_range cli_steps_all(void)
{
    cli_step_range r = {INT_MIN, INT_MAX};
    return r;
}
static inline cli_step_range cli_steps(int first, int last)
{
    cli_step_range r = {first, last};
    return r;
}

/* The collective records of every device of a machine (borrowed: valid until
 * the next collective or clear on the machine). */
typedef struct {
    sim_mesh_desc mesh; /* axis names for labels */
    int n_devices;
    const sim_record *recs[SIM_MAX_DEVICES]; /* as stored: walk them with cli_records_walk */
    size_t nstored[SIM_MAX_DEVICES];
    size_t n[SIM_MAX_DEVICES]; /* device d's records, its repeated blocks expanded */
    const sim_repeat *reps[SIM_MAX_DEVICES]; /* the blocks a dry run repeats (sim_repeat) */
    size_t nreps[SIM_MAX_DEVICES];
} cli_records;

/* A walk over device d's records, its repeated blocks expanded (sim_walk_next_record). */
void cli_records_walk(const cli_records *r, int d, sim_walk *w);

void cli_records_from_machine(sim_machine *m, cli_records *out);
/* "data+fsdp"; "-" for no axes.  Returns buf. */
const char *cli_axes_text(const sim_mesh_desc *mesh, sim_axes axes, char *buf, size_t cap);

/* ---- traffic pivot ------------------------------------------------------------ */

/* One op x axes x phase cell.  "Per device" figures divide by every device
 * of the machine (a device that made no such call counts as 0). */
typedef struct {
    sim_op op;
    sim_axes axes; /* group axes, in rank order */
    sim_phase phase;
    uint64_t calls;      /* calls summed over devices */
    uint64_t calls_max;  /* most calls made by one device */
    uint64_t bytes;      /* bytes sent, summed over devices */
    uint64_t bytes_dcn;  /* of bytes, sent to devices in other slices (DCN), summed over devices */
    uint64_t bytes_recv; /* bytes received, summed over devices */
    uint64_t bytes_max;  /* most bytes sent by one device */
    uint64_t bytes_min;  /* fewest bytes sent by one device */
    double bytes_mean;   /* bytes / n_devices */
    double share;        /* bytes / total bytes (0 when nothing moved) */
} cli_traffic_row;

typedef struct {
    sim_mesh_desc mesh; /* for axis labels */
    int n_devices;
    cli_step_range steps; /* the records counted */
    int n_rows;
    cli_traffic_row *rows; /* bytes descending, then calls descending, then op, axes, phase */
    cli_traffic_row total; /* sums over all rows (op, axes, phase unused) */
} cli_traffic;

/* Pivots the records whose step lies in `steps`. */
sim_status cli_traffic_build(const cli_records *recs, cli_step_range steps, cli_traffic *out);
void cli_traffic_free(cli_traffic *t);
/* The traffic table with a total row.  Calls are per device; bytes per
 * device, each in the unit that fits it; max shown only where devices
 * differ; on a mesh of several slices a "dcn/device" column gives the part
 * of the mean that crosses slices (the rest stays on the slices' ICI). */
void cli_report_traffic(FILE *f, const cli_traffic *t);

/* ---- memory ----------------------------------------------------------------- */

/* Arena statistics of every device (stats[0 .. n_devices)). */
void cli_memory_collect(sim_machine *m, sim_arena_stats *stats);
/* Highest arena peak over the devices (cli_step_metrics.peak_bytes). */
size_t cli_memory_max_peak(sim_machine *m);
/* Per device x category at each device's peak (sim_arena_stats.at_peak_by),
 * devices with identical rows collapsed ("0-7", "0-3,8-11"). */
void cli_report_memory(FILE *f, const sim_arena_stats *stats, int n_devices);
/* Under mpirun: the ranks, their devices, and the bytes the ranks sent each other per step (the
 * simulator's own messages, outside the simulated traffic above); for a dry run (run whole on every
 * rank) each rank's share of the arena peaks instead.  Nothing in one process. */
void cli_report_xrank(FILE *f, sim_machine *m);

/* ---- parity ----------------------------------------------------------------- */

typedef struct {
    const char *label;     /* short name shown in the table ("fsdp=4") */
    const char *overrides; /* the config's key=value overrides, as given */
    const double *losses;  /* loss per step, n_steps values */
    /* what the configuration costs, for parity.json (each optional: 0 / NULL when not known) */
    const char *mesh;               /* "fsdp=4 tensor=2 (8 devices)" */
    int n_devices;                  /* devices of its mesh: mem[0 .. n_devices) */
    const sim_arena_stats *mem;     /* each device's arena after the run (peak, by category at the peak) */
    const cli_traffic *traffic;     /* the collectives of one step (traffic->steps) */
    struct json_t *step_time_model; /* the step-time model's estimate of that step (model_tm_json), or NULL */
} cli_parity_config;

typedef struct {
    int n_configs; /* the first is the reference */
    const cli_parity_config *configs;
    int n_steps;
    int first_step;             /* step number of losses[0] */
    double rtol;                /* parity_rtol */
    int diverge_step;           /* first step a gradient diverged, or -1: from the losses */
    const char *diverge_param;  /* first diverging parameter, or NULL when unknown */
    const char *diverge_config; /* label of the diverging config, or NULL: from the losses */
} cli_parity;

/* |loss_c - loss_ref| / |loss_ref| (the absolute difference when loss_ref is
 * 0; infinity when either is not finite and they differ). */
double cli_rel_diff(double loss, double ref);
/* Largest relative difference to the reference config at step index i, and
 * (when worst != NULL) the config index where it occurs (0 when n_configs < 2). */
double cli_parity_step_diff(const cli_parity *p, int i, int *worst);
/* Index of the first step whose difference exceeds rtol, or -1. */
int cli_parity_first_failure(const cli_parity *p);
/* Table of losses per step and config, the max relative difference per step,
 * then PASS or FAIL with the first diverging step (and parameter when known). */
void cli_report_parity(FILE *f, const cli_parity *p);

#endif

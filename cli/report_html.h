/* report_html.h — report.html in an output directory: a self-contained page
 * (no network, no external scripts) drawing the run from the artifacts
 * already written there.  train: the loss curve, traffic by op x mesh axes x
 * phase and by layer, memory per device by category, the mesh as a device
 * grid, and the sharding view (every parameter and one layer's activations
 * on the device grid, with logical and physical specs).  parity: the verdict
 * (the first diverging step and parameter when it fails), the losses of every
 * configuration overlaid and tabled, and the configurations side by side —
 * memory per device by category, bytes per collective x mesh axes x phase and
 * the modelled step time, each with its difference against the first. */
#ifndef CLI_REPORT_HTML_H
#define CLI_REPORT_HTML_H

#include "sim/status.h"

/* Writes dir/report.html from dir's run.json, metrics.json, parity.json,
 * traffic.csv and collectives.csv (each optional). */
sim_status cli_write_report_html(const char *dir);

#endif

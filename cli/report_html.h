/* report_html.h — report.html in an output directory: a self-contained page
 * (no network, no external scripts) drawing the run from the artifacts
 * already written there: the loss curve (every configuration overlaid for
 * parity), traffic by op x mesh axes x phase and by layer, memory per device
 * by category, the mesh as a device grid, and the parity table. */
#ifndef CLI_REPORT_HTML_H
#define CLI_REPORT_HTML_H

#include "sim/status.h"

/* Writes dir/report.html from dir's run.json, metrics.json, parity.json,
 * traffic.csv and collectives.csv (each optional). */
sim_status cli_write_report_html(const char *dir);

#endif

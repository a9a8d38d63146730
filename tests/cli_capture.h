/* cli_capture.h — test support: runs a shardsim command with its stdout and
 * stderr captured in memory. */
#ifndef TESTS_CLI_CAPTURE_H
#define TESTS_CLI_CAPTURE_H

#include <stdio.h>

typedef struct {
    int rc;          /* the command's exit code */
    char *out, *err; /* what it wrote (free with cli_capture_free) */
} cli_capture;

typedef int (*cli_command)(int argc, char **argv, FILE *out, FILE *err);

cli_capture cli_capture_run(cli_command cmd, int argc, const char **argv);
void cli_capture_free(cli_capture *r);

#endif

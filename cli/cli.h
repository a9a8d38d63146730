/* cli.h — the `shardsim` commands; each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 a check failed, 2 bad usage). */
#ifndef CLI_CLI_H
#define CLI_CLI_H

#include <stdio.h>

int cli_demo(int argc, char **argv);
/* shardsim explain mesh=... shape=... from=... to=... */
int cli_explain(int argc, char **argv, FILE *out, FILE *err);

#endif

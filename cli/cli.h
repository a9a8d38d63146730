/* cli.h — the `shardsim` commands; each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 a check failed, 2 bad usage). */
#ifndef CLI_CLI_H
#define CLI_CLI_H

#include <stdio.h>

int cli_demo(int argc, char **argv);
int cli_collectives_demo(int argc, char **argv);
/* shardsim explain mesh=... shape=... from=... to=... */
int cli_explain(int argc, char **argv, FILE *out, FILE *err);

/* shardsim train [file.yml ...] [key=value ...] */
int cli_train(int argc, char **argv, FILE *out, FILE *err);
/* shardsim dump [file.yml ...] [key=value ...] output_dir=DIR */
int cli_dump(int argc, char **argv, FILE *out, FILE *err);

/* shardsim parity [file.yml ...] [key=value ...] configs="<overrides>;<overrides>;..." */
int cli_cmd_parity(int argc, char **argv, FILE *out, FILE *err);

/* shardsim keys [pattern]: the key contract as a table */
int cli_keys(int argc, char **argv, FILE *out, FILE *err);

/* shardsim models [pattern|block=NAME]: every model name with its decoder block and status */
int cli_models(int argc, char **argv, FILE *out, FILE *err);

/* shardsim plan [file.yml ...] [key=value ...] [--explain K]: cli/plan.h */
int cli_plan(int argc, char **argv, FILE *out, FILE *err);

#endif

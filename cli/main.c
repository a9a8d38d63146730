/* main.c — `shardsim COMMAND [args]`: dispatches to the commands in cli/;
 * `shardsim help COMMAND` and `COMMAND --help` print one command's usage.
 * Under mpirun (sim/xrank.h) every rank runs the same command on its share of the devices;
 * rank 0 prints and writes the files, and a failure on any rank ends the job. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_coretype.h"
#include "cli/artifacts.h"
#include "cli/cli.h"
#include "cli/common.h"
#include "sim/xrank.h"

typedef struct {
    const char *name;
    const char *summary; /* one line for the command list */
    const char *usage;   /* the command's full usage */
} command_help;

static const command_help COMMANDS[] = {
    {"train", "train a model (or size it: dry_run=true, compile_topology=...)",
     "usage: shardsim train [file.yml ...] [key=value ...]\n"
     "\n"
     "Trains the configured model on simulated devices: a config box, one line per step, then the\n"
     "traffic table and the memory table.  YAML files (MaxText's base.yml, model files, your own)\n"
     "apply on top of configs/base.yml in order, then key=value overrides.  Every MaxText key is\n"
     "known: `shardsim keys` lists them with their class (honoured, inert or refused).\n"
     "\n"
     "  output_dir=DIR                 write run.json, metrics.json, collectives.csv, traffic.csv,\n"
     "                                 trace.json and the sharding dump into DIR\n"
     "  base_output_directory=B run_name=R   as MaxText: outputs go to B/R (checkpoints in\n"
     "                                 B/R/checkpoints when enable_checkpointing=true)\n"
     "  dry_run=true                   shapes, shardings, traffic and memory only\n"
     "  compile_topology=v5p-8         size for that topology (devices and slices), implies dry_run\n"
     "  metrics_file=FILE              one JSON line of metrics per step (MaxText's format)\n"
     "\n"
     "Exit codes: 0 success, 1 a check failed (simulated OOM, explicit-mode sharding error),\n"
     "2 bad usage or input (including a refused key).\n"},
    {"plan", "rank the meshes, rule sets and remat policies that fit a topology by modelled step time",
     "usage: shardsim plan [file.yml ...] [key=value ...] compile_topology=v5p-8 compile_topology_num_slices=1\n"
     "       shardsim plan ... num_devices=N [num_slices=S] hardware_profile=NAME\n"
     "\n"
     "Enumerates the configurations of configs/plan.yml for the model the keys define (meshes over\n"
     "MaxText's ici and dcn axes, custom_mesh_and_rule sets, shard_mode, shard_optimizer_over_data,\n"
     "remat_policy, gradient_accumulation_steps, pipeline microbatches), rejects what train would\n"
     "refuse (with its message), prunes what cannot fit (parameters + gradients + optimizer state\n"
     "above the HBM), dry-runs the rest within a budget and prints the fastest by modelled step time,\n"
     "each with MFU, peak memory and its parts, bytes per mesh axis, what bounds it, and the train\n"
     "command line that reproduces it.  A key you set is kept fixed.\n"
     "\n"
     "  per_device_batch_size=P | plan_global_batch=G   rows per step (G = P x devices)\n"
     "  plan_top=10                    candidates printed\n"
     "  plan_dry_runs=0                candidates dry-run at most (0: 48 - devices / 8, >= 24)\n"
     "  plan_verify=1                  top candidates dry-run in full (every layer) to confirm\n"
     "  --explain K | explain_candidate=K   why the candidate ranked K ranks there\n"
     "  output_dir=DIR                 write plan.json (every candidate: outcome, figures, command\n"
     "                                 line, reason) and report.html (step time vs peak memory with\n"
     "                                 the Pareto front and the HBM, the winner's breakdown)\n"
     "\n"
     "Exit codes: 0 a candidate fits, 1 none fits, 2 bad usage or input.\n"},
    {"parity", "compare losses and gradients across configurations",
     "usage: shardsim parity [file.yml ...] [key=value ...] configs=\"<overrides>;<overrides>;...\"\n"
     "\n"
     "Runs the same model on the same data under every listed configuration and compares each\n"
     "step's loss and every gradient with the first configuration; exits 1 when a difference\n"
     "exceeds parity_rtol (default 1e-4).\n"},
    {"dump", "write MaxText's sharding dump files",
     "usage: shardsim dump [file.yml ...] [key=value ...] output_dir=DIR\n"
     "\n"
     "Writes named_shardings.json, logical_shardings.json, input_shardings.json (MaxText's\n"
     "format) and shardings.json (all three) from a dry forward pass.\n"},
    {"explain", "the collectives that turn one sharding into another",
     "usage: shardsim explain mesh=data=2,fsdp=2,tensor=2 shape=8,16 from=SPEC to=SPEC\n"
     "       shardsim explain shape=8,16 from_logical=a,b to_logical=c,d [key=value ...]\n"
     "\n"
     "Plans the resharding from one PartitionSpec (or logical axes) to another, prints the\n"
     "collectives and bytes per device, and pictures both shardings.  Bytes are counted as train\n"
     "counts them: in the config's weight_dtype for a weight (tensor=weight, or logical names\n"
     "that are all axes of the model's parameters; in its dtype on a hardware profile whose\n"
     "compiler casts weights before gathering them), in its dtype for an activation\n"
     "(tensor=activation, the default).  dtype=float32|bfloat16|int32 here sets the array's dtype\n"
     "itself (the config's dtype key comes from a YAML file).\n"},
    {"keys", "list the config keys with class, default and reason",
     "usage: shardsim keys [pattern]\n"
     "\n"
     "Lists every key shardsim knows (all of MaxText's base.yml and shardsim's own) with its\n"
     "class, default and a one-line description or reason.  pattern: a substring of the key\n"
     "name, a glob (ici_*), or class=honoured|inert|refused.\n"
     "\n"
     "  honoured  read by the simulator with MaxText's meaning\n"
     "  inert     cannot change losses, shardings, memory or traffic; accepted and listed in\n"
     "            run.json under inert_keys_set when set\n"
     "  refused   a feature not simulated: a non-default value exits 2 naming the key\n"},
    {"models", "list the model names (configs/models) with decoder block and status",
     "usage: shardsim models [pattern|block=NAME]\n"
     "\n"
     "Lists every model file of configs/models (MaxText 0.2.5's model files: model_name=NAME\n"
     "reads configs/models/NAME.yml) with its decoder_block and whether shardsim runs it:\n"
     "\n"
     "  simulated  model_name=NAME loads and the model is defined (train, dump, parity work)\n"
     "  refused    with the message train would print: the decoder block is not simulated\n"
     "             (configs/decoder_blocks.yml says what it computes), or a key the model file\n"
     "             sets (or a setting it needs) is refused\n"
     "\n"
     "pattern: a substring of the name; block=NAME: one decoder block.\n"},
    {"demo", "train a small Llama on 8 simulated devices, then check parity with 1 device", "usage: shardsim demo\n"},
    {"collectives", "run every collective on an 8-device mesh and show the counted bytes",
     "usage: shardsim collectives\n"},
    {"help", "this text, or one command's usage", "usage: shardsim help [command]\n"},
};
enum { N_COMMANDS = (int)(sizeof COMMANDS / sizeof COMMANDS[0]) };

static const command_help *find_command(const char *name)
{
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(COMMANDS[i].name, name)) return &COMMANDS[i];
    return NULL;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: shardsim COMMAND [file.yml ...] [key=value ...]\n\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-12s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "\n`shardsim help COMMAND` or `shardsim COMMAND --help` shows a command's usage;\n"
               "`shardsim --version` the version.\n");
}

static int is_help_flag(const char *s) { return !strcmp(s, "--help") || !strcmp(s, "-h"); }

/* ---- MPI ranks */

/* Under a launcher: MPI up, the same OpenBLAS kernels on every rank (different kernels give
 * different bits: the run would not be the one-process run), and the ranks > 0 quiet on stdout
 * (their errors still reach stderr: cli_fail).  Returns an exit code, 0 = go on. */
static int xrank_start(void)
{
    if (sim_xrank_init() != SIM_OK) { /* every rank's (the same) refusal: rank 0 says it */
        if (sim_xrank_rank() == 0) fprintf(stderr, "shardsim: %s\n", sim_errmsg());
        return 1;
    }
    int R = sim_xrank_size(), me = sim_xrank_rank();
    if (R < 2) return 0;
    enum { CORE = 32 };
    char mine[CORE] = {0}, *all = calloc((size_t)R, CORE);
    if (!all) return 1;
    snprintf(mine, sizeof mine, "%s", bk_coretype_current()->core);
    int rc = 0;
    if (sim_xrank_allgather(mine, CORE, all) != SIM_OK) {
        fprintf(stderr, "shardsim: rank %d: %s\n", me, sim_errmsg());
        rc = 1;
    }
    for (int r = 1; r < R && !rc; r++)
        if (strncmp(all + (size_t)r * CORE, all, CORE)) {
            if (me == 0)
                fprintf(stderr,
                        "shardsim: MPI rank %d runs the OpenBLAS kernels '%.31s' but rank 0 runs '%.31s': "
                        "their sums differ in the last bits, so the run would not be the one-process run; "
                        "set OPENBLAS_CORETYPE=%.31s on every rank (mpirun -x OPENBLAS_CORETYPE=%.31s)\n",
                        r, all + (size_t)r * CORE, all, all, all);
            rc = 2;
        }
    free(all);
    if (rc || me == 0) return rc;
    fflush(stdout);
    return freopen("/dev/null", "w", stdout) ? 0 : 1;
}

static int run_command(int argc, char **argv);

int main(int argc, char **argv)
{
    int rc = xrank_start();
    if (rc == 0) rc = run_command(argc, argv);
    return cli_end_job(rc, stderr);
}

static int run_command(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("%s\n", CLI_SHARDSIM_VERSION);
        return 0;
    }
    if (is_help_flag(cmd) || (!strcmp(cmd, "help") && argc == 2)) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "help")) {
        const command_help *c = find_command(argv[2]);
        if (!c || argc > 3) {
            fprintf(stderr, "shardsim help: unknown command '%s'\n", argv[2]);
            usage(stderr);
            return 2;
        }
        fputs(c->usage, stdout);
        return 0;
    }
    const command_help *c = find_command(cmd);
    if (c && argc >= 3 && is_help_flag(argv[2])) {
        fputs(c->usage, stdout);
        return 0;
    }
    if (!strcmp(cmd, "demo")) return cli_demo(argc - 2, argv + 2);
    if (!strcmp(cmd, "collectives")) return cli_collectives_demo(argc - 2, argv + 2);
    if (!strcmp(cmd, "train")) return cli_train(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(cmd, "parity")) return cli_cmd_parity(argc - 2, argv + 2, stdout, stderr);
    if (sim_xrank_size() > 1 &&
        (!strcmp(cmd, "dump") || !strcmp(cmd, "explain") || !strcmp(cmd, "keys") || !strcmp(cmd, "plan"))) {
        /* nothing of theirs spreads over ranks: R copies would only write the same files at once */
        if (sim_xrank_rank() == 0)
            fprintf(stderr,
                    "shardsim %s under mpirun (%d ranks): only train, parity, demo and collectives spread over "
                    "MPI ranks; run %s without mpirun\n",
                    cmd, sim_xrank_size(), cmd);
        return 2;
    }
    if (!strcmp(cmd, "dump")) return cli_dump(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(cmd, "explain")) return cli_explain(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(cmd, "keys")) return cli_keys(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(cmd, "models")) return cli_models(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(cmd, "plan")) return cli_plan(argc - 2, argv + 2, stdout, stderr);
    fprintf(stderr, "shardsim: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}

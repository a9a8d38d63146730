/* main.c — `shardsim COMMAND [args]`: dispatches to the commands in cli/. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shardsim COMMAND [file.yml ...] [key=value ...]\n"
            "\n"
            "commands:\n"
            "  train     train a model: shardsim train [file.yml ...] [key=value ...]\n"
            "  parity    compare losses and gradients across configurations:\n"
            "            shardsim parity ... configs=\"<overrides>;<overrides>;...\"\n"
            "  dump      write MaxText's sharding dump files: shardsim dump ... output_dir=DIR\n"
            "  explain   the collectives that turn one sharding into another:\n"
            "            shardsim explain mesh=data=2,fsdp=2,tensor=2 shape=8,16 \\\n"
            "                from=\"P(('data','fsdp'),None)\" to=\"P(None,'tensor')\"\n"
            "  demo      train a small Llama on 8 simulated devices, then check parity with 1 device\n"
            "  collectives  run every collective on an 8-device mesh and show the counted bytes\n"
            "  help      this text\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "demo")) return cli_demo(argc - 2, argv + 2);
    if (!strcmp(argv[1], "collectives")) return cli_collectives_demo(argc - 2, argv + 2);
    if (!strcmp(argv[1], "train")) return cli_train(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(argv[1], "parity")) return cli_cmd_parity(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(argv[1], "dump")) return cli_dump(argc - 2, argv + 2, stdout, stderr);
    if (!strcmp(argv[1], "explain")) return cli_explain(argc - 2, argv + 2, stdout, stderr);
    fprintf(stderr, "shardsim: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

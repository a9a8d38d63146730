/* cli_capture.c — see cli_capture.h. */
#include "tests/cli_capture.h"

#include <stdlib.h>

cli_capture cli_capture_run(cli_command cmd, int argc, const char **argv)
{
    cli_capture r;
    size_t no, ne;
    FILE *o = open_memstream(&r.out, &no), *e = open_memstream(&r.err, &ne);
    r.rc = cmd(argc, (char **)argv, o, e);
    fclose(o);
    fclose(e);
    return r;
}

void cli_capture_free(cli_capture *r)
{
    free(r->out);
    free(r->err);
}

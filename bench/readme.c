/* readme.c — every command of the README's "Using it" block, run as a user
 * would, with its wall time and peak memory against the budget the README
 * promises (a minute, 1 GB).
 *
 * The commands are read from README.md itself (lines starting with "$B ",
 * joined with their "\" continuation lines, $B standing for the program), so
 * the README and this benchmark cannot drift apart.  Each command runs in
 * its own child shell; its peak resident memory is the child's ru_maxrss.
 * Reported as ratios to the budget, from one run; never an assertion. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/lib/bench_host.h"

enum { MAX_CMDS = 64, CMD_CAP = 4096 };

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Appends src to dst (cap bytes), replacing "$B" with prog. */
static void append_cmd(char *dst, size_t cap, const char *src, const char *prog)
{
    size_t n = strlen(dst);
    for (const char *p = src; *p && n + 1 < cap; p++) {
        if (p[0] == '$' && p[1] == 'B') {
            n += (size_t)snprintf(dst + n, cap - n, "%s", prog);
            p++;
        } else {
            dst[n++] = *p;
            dst[n] = '\0';
        }
    }
}

int main(int argc, char **argv)
{
    const char *readme = argc > 1 ? argv[1] : "README.md";
    const char *prog = argc > 2 ? argv[2] : "build/shardsim";
    FILE *f = fopen(readme, "r");
    if (!f) {
        fprintf(stderr, "readme: cannot open %s (run from the repository root)\n", readme);
        return 2;
    }
    static char cmds[MAX_CMDS][CMD_CAP];
    int n = 0, in_block = 0, cont = 0;
    char line[CMD_CAP];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "## Using it", 11)) in_block = 1;
        else if (in_block && !strncmp(line, "## ", 3)) break;
        if (!in_block) continue;
        line[strcspn(line, "\n")] = '\0';
        size_t len = strlen(line);
        int more = len > 0 && line[len - 1] == '\\';
        if (more) line[len - 1] = ' ';
        if (cont) {
            append_cmd(cmds[n - 1], CMD_CAP, line, prog);
        } else if (!strncmp(line, "$B ", 3) && n < MAX_CMDS) {
            cmds[n][0] = '\0';
            append_cmd(cmds[n++], CMD_CAP, line, prog);
        } else {
            more = 0;
        }
        cont = more;
    }
    fclose(f);
    if (!n) {
        fprintf(stderr, "readme: no \"$B ...\" commands under \"## Using it\" in %s\n", readme);
        return 2;
    }
    printf("README commands, each in its own process (budget: 60 s and 1 GB each)\n");
    bench_host_print(stdout);
    printf("%3s %9s %10s %8s %8s %4s  %s\n", "#", "time (s)", "peak (MB)", "t/60s", "mem/1GB", "rc", "command");
    int over = 0;
    for (int i = 0; i < n; i++) {
        fflush(stdout); /* else the child's freopen writes our buffer a second time */
        double t0 = now();
        pid_t pid = fork();
        if (pid == 0) {
            if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(127);
            execl("/bin/sh", "sh", "-c", cmds[i], (char *)NULL);
            _exit(127);
        }
        int status = 0;
        struct rusage ru;
        if (pid < 0 || wait4(pid, &status, 0, &ru) < 0) {
            perror("readme: fork/wait");
            return 1;
        }
        double secs = now() - t0, mb = (double)ru.ru_maxrss * 1024.0 / 1e6;
        int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        over += rc != 0 || secs > 60.0 || mb > 1000.0;
        printf("%3d %9.2f %10.1f %8.2f %8.2f %4d  %.100s%s\n", i + 1, secs, mb, secs / 60.0, mb / 1000.0, rc,
               cmds[i] + strlen(prog) + 1, strlen(cmds[i]) > strlen(prog) + 101 ? " ..." : "");
        fflush(stdout);
    }
    printf("%d of %d commands within budget and exiting 0\n", n - over, n);
    return 0;
}

/* readme.c — every command of the README and of docs/, run as a user would,
 * with its exit code, wall time and peak memory against the budget the
 * README promises (a minute, 1 GB).
 *
 * The commands are read from the Markdown files themselves, so the pages and
 * this benchmark cannot drift apart.  The convention (docs/README.md, "Commands
 * on these pages"):
 *   - a block fenced with ```sh holds commands to run, from the repository root;
 *   - ```sh mpi holds mpirun commands for this one machine: run with Open MPI's
 *     settings for it (as root, oversubscribed, unbound: docs/guides/mpi.md) when
 *     mpirun is installed, else listed as skipped;
 *   - ```sh norun holds commands that are not run here (mpirun across hosts, a
 *     program outside the repository), and any other fence (```, ```text) holds
 *     output;
 *   - a logical line is one command: "\" continues it, as do an open quote, a
 *     trailing "|" or "&&", and a "do ... done" loop;
 *   - NAME=value lines (and "export ...") are kept and prefixed to the block's
 *     later commands; $B and ./shardsim stand for build/shardsim;
 *   - a trailing comment "# exit N" says the command is meant to exit N.
 * Each command runs in its own child shell; its peak resident memory is the
 * child's ru_maxrss (the largest process of the command).  Reported from one
 * run, never an assertion; the last line counts the commands within budget. */
#include <ctype.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/lib/bench_host.h"

enum { MAX_CMDS = 512, CMD_CAP = 8192, LINE_CAP = 4096 };

typedef struct {
    char file[128];
    int line;     /* first line of the command in its file */
    int expect;   /* expected exit code */
    int mpi;      /* from a ```sh mpi block */
    char *prefix; /* the block's assignments before it */
    char *cmd;
} readme_cmd;

static readme_cmd cmds[MAX_CMDS];
static int n_cmds;
static int block_mpi; /* the block being read is ```sh mpi */

/* Open MPI on one machine as root, more ranks than cores, no binding (docs/guides/mpi.md) */
static const char mpi_env[] = "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                              "OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none "
                              "OMPI_MCA_hwloc_base_binding_policy=none\n";

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void append(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(dst), m = strlen(src);
    if (n + m + 1 > cap) m = cap - n - 1;
    memcpy(dst + n, src, m);
    dst[n + m] = '\0';
}

/* Quote state after src, starting from *q (0, '"' or '\''). */
static void scan_quotes(const char *src, int *q)
{
    for (const char *p = src; *p; p++) {
        if (*q == '\'') {
            if (*p == '\'') *q = 0;
        } else if (*p == '\\' && p[1]) {
            p++;
        } else if (*p == *q && *q) {
            *q = 0;
        } else if (!*q && (*p == '"' || *p == '\'')) {
            *q = *p;
        } else if (!*q && *p == '#' && (p == src || isspace((unsigned char)p[-1]))) {
            return; /* a comment: quotes after it do not count */
        }
    }
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    while (n && isspace((unsigned char)s[n - 1])) n--;
    return n >= m && !strncmp(s + n - m, suffix, m) && (n == m || isspace((unsigned char)s[n - m - 1]) ||
                                                        !isalpha((unsigned char)suffix[0]));
}

/* A command's text without its trailing comment (outside quotes). */
static const char *comment_of(const char *s)
{
    int q = 0;
    for (const char *p = s; *p; p++) {
        if (q == '\'') {
            if (*p == '\'') q = 0;
        } else if (*p == '\\' && p[1]) {
            p++;
        } else if (*p == q && q) {
            q = 0;
        } else if (!q && (*p == '"' || *p == '\'')) {
            q = *p;
        } else if (!q && *p == '#' && (p == s || isspace((unsigned char)p[-1]))) {
            return p;
        }
    }
    return NULL;
}

/* 1 when the logical line only sets variables: NAME=value [NAME=value ...] or export .... */
static int is_assignment(const char *s)
{
    while (isspace((unsigned char)*s)) s++;
    if (!strncmp(s, "export ", 7)) return 1;
    const char *p = s;
    if (!isalpha((unsigned char)*p) && *p != '_') return 0;
    while (isalnum((unsigned char)*p) || *p == '_') p++;
    if (*p != '=') return 0;
    /* skip the value, quoted or not, and require nothing but a comment after it */
    p++;
    int q = 0;
    for (; *p; p++) {
        if (q == '\'') {
            if (*p == '\'') q = 0;
        } else if (*p == '\\' && p[1]) {
            p++;
        } else if (*p == q && q) {
            q = 0;
        } else if (!q && (*p == '"' || *p == '\'')) {
            q = *p;
        } else if (!q && isspace((unsigned char)*p)) {
            break;
        }
    }
    while (isspace((unsigned char)*p)) p++;
    return !*p || *p == '#';
}

/* Replaces "$B" (not "$B..." of a longer name) and a leading "./shardsim" with prog. */
static char *expand(const char *src, const char *prog)
{
    size_t cap = strlen(src) * 2 + strlen(prog) * 8 + 64;
    char *out = calloc(1, cap);
    size_t n = 0;
    for (const char *p = src; *p && n + strlen(prog) + 2 < cap;) {
        int at_word = p == src || isspace((unsigned char)p[-1]) || p[-1] == ';' || p[-1] == '(';
        if (p[0] == '$' && p[1] == 'B' && !isalnum((unsigned char)p[2]) && p[2] != '_') {
            n += (size_t)snprintf(out + n, cap - n, "%s", prog);
            p += 2;
        } else if (at_word && !strncmp(p, "./shardsim", 10) && !isalnum((unsigned char)p[10])) {
            n += (size_t)snprintf(out + n, cap - n, "%s", prog);
            p += 10;
        } else {
            out[n++] = *p++;
        }
    }
    return out;
}

static void add_cmd(const char *file, int line, const char *prefix, const char *text, const char *prog)
{
    if (n_cmds >= MAX_CMDS) return;
    readme_cmd *c = &cmds[n_cmds++];
    snprintf(c->file, sizeof c->file, "%s", file);
    c->line = line;
    c->expect = 0;
    c->mpi = block_mpi;
    const char *hash = comment_of(text);
    if (hash) {
        const char *e = strstr(hash, "# exit ");
        if (e) c->expect = atoi(e + 7);
    }
    c->prefix = expand(prefix, prog);
    c->cmd = expand(text, prog);
}

/* Reads every ```sh block of one file. */
static void read_file(const char *path, const char *prog)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    static char line[LINE_CAP], cmd[CMD_CAP], prefix[CMD_CAP];
    int in_sh = 0, in_other = 0, lineno = 0, start = 0, building = 0, q = 0, depth = 0, prev_more = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        line[strcspn(line, "\n")] = '\0';
        if (!strncmp(line, "```", 3)) {
            if (in_sh || in_other) {
                in_sh = in_other = 0;
                building = 0;
                continue;
            }
            const char *info = line + 3;
            if (!strncmp(info, "sh", 2) && (!info[2] || isspace((unsigned char)info[2])) &&
                !strstr(info, "norun")) {
                in_sh = 1;
                block_mpi = strstr(info, "mpi") != NULL;
                prefix[0] = '\0';
            } else {
                in_other = 1;
            }
            continue;
        }
        if (!in_sh) continue;
        if (!building) {
            const char *s = line;
            while (isspace((unsigned char)*s)) s++;
            if (!*s || *s == '#') continue;
            cmd[0] = '\0';
            start = lineno;
            building = 1;
            q = 0;
            depth = 0;
            prev_more = 0;
        }
        size_t len = strlen(line);
        int more = 0, was_q = q;
        if (len && line[len - 1] == '\\') {
            line[len - 1] = ' ';
            more = 1;
        }
        scan_quotes(line, &q);
        const char *s = line;
        while (isspace((unsigned char)*s)) s++;
        if (!strncmp(s, "done", 4) && (!s[4] || s[4] == ';' || isspace((unsigned char)s[4]))) depth--;
        if (ends_with(line, "do") || ends_with(line, "then")) depth++;
        /* a new line of the script unless the previous one ended in "\" or inside quotes */
        if (*cmd && !prev_more && !was_q) append(cmd, sizeof cmd, "\n");
        append(cmd, sizeof cmd, line);
        if (q) append(cmd, sizeof cmd, "\n");
        prev_more = more;
        if (more || q || depth > 0 || ends_with(line, "|") || ends_with(line, "&&")) continue;
        building = 0;
        if (is_assignment(cmd)) {
            append(prefix, sizeof prefix, cmd);
            append(prefix, sizeof prefix, "\n");
        } else {
            add_cmd(path, start, prefix, cmd, prog);
        }
    }
    fclose(f);
}

int main(int argc, char **argv)
{
    /* readme [--list] [FILE-SUBSTRING [PROGRAM]]: --list prints the commands without running them */
    int list = argc > 1 && !strcmp(argv[1], "--list");
    if (list) argc--, argv++;
    const char *only = argc > 1 ? argv[1] : NULL;
    const char *prog = argc > 2 ? argv[2] : "build/shardsim";
    if (access("README.md", R_OK) != 0) {
        fprintf(stderr, "readme: no README.md here (run from the repository root)\n");
        return 2;
    }
    const char *patterns[] = {"README.md", "docs/*.md", "docs/*/*.md", "docs/*/*/*.md"};
    for (size_t i = 0; i < sizeof patterns / sizeof *patterns; i++) {
        glob_t g;
        if (glob(patterns[i], 0, NULL, &g) == 0) {
            for (size_t j = 0; j < g.gl_pathc; j++)
                if (!only || strstr(g.gl_pathv[j], only)) read_file(g.gl_pathv[j], prog);
            globfree(&g);
        }
    }
    if (!n_cmds) {
        fprintf(stderr, "readme: no ```sh commands found in README.md or docs/\n");
        return 2;
    }
    if (list) {
        for (int i = 0; i < n_cmds; i++)
            printf("%s:%d (exit %d)\n%s%s\n\n", cmds[i].file, cmds[i].line, cmds[i].expect, cmds[i].prefix,
                   cmds[i].cmd);
        return 0;
    }
    printf("Commands of README.md and docs/, each in its own process (budget: 60 s and 1 GB each)\n");
    bench_host_print(stdout);
    printf("%3s %-34s %8s %9s %4s %4s  %s\n", "#", "file:line", "time (s)", "peak (MB)", "rc", "want", "command");
    int over = 0, skipped = 0;
    int have_mpirun = system("command -v mpirun >/dev/null 2>&1") == 0;
    for (int i = 0; i < n_cmds; i++) {
        readme_cmd *c = &cmds[i];
        if (c->mpi && !have_mpirun) {
            printf("%3d %.120s:%d skipped: mpirun is not installed\n", i + 1, c->file, c->line);
            skipped++;
            continue;
        }
        size_t len = strlen(c->prefix) + strlen(c->cmd) + sizeof mpi_env + 64;
        char *script = malloc(len);
        snprintf(script, len, "%s%s%s\n", c->mpi ? mpi_env : "", c->prefix, c->cmd);
        fflush(stdout); /* else the child's freopen writes our buffer a second time */
        double t0 = now();
        pid_t pid = fork();
        if (pid == 0) {
            if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(127);
            execl("/bin/bash", "bash", "-c", script, (char *)NULL);
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
        int bad = rc != c->expect || secs > 60.0 || mb > 1000.0;
        over += bad;
        /* one line of the command, its program path shortened */
        char shown[101];
        const char *text = c->cmd;
        if (!strncmp(text, prog, strlen(prog))) text += strlen(prog) + 1;
        snprintf(shown, sizeof shown, "%s", text);
        for (char *p = shown; *p; p++)
            if (*p == '\n') *p = ' ';
        char where[160];
        snprintf(where, sizeof where, "%.120s:%d", c->file, c->line);
        printf("%3d %-34s %8.2f %9.1f %4d %4d  %s%s%s\n", i + 1, where, secs, mb, rc, c->expect, shown,
               strlen(text) > 100 ? " ..." : "", bad ? "  <-- OVER" : "");
        fflush(stdout);
        free(script);
    }
    printf("%d of %d commands within budget and exiting as the page says", n_cmds - over - skipped, n_cmds);
    if (skipped) printf(" (%d mpirun commands skipped: no mpirun)", skipped);
    printf("\n");
    return 0;
}

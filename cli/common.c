/* common.c — shared command-line helpers. */
#include "cli/common.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mesh/array.h"
#include "sim/types.h"
#include "sim/xrank.h"

static int is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

const char *cli_configs_dir(void)
{
    static char dir[PATH_MAX];
    if (dir[0]) return dir;
    const char *env = getenv("SHARDSIM_CONFIGS");
    if (env && *env) {
        snprintf(dir, sizeof dir, "%s", env);
        return dir;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        /* <root>/build[/variant]/shardsim -> <root>/configs (a build tree);
         * <prefix>/bin/shardsim -> <prefix>/share/shardsim/configs (make install) */
        static const char *const below[] = {"configs", "share/shardsim/configs"};
        for (int up = 0; up < 3; up++) {
            char *slash = strrchr(exe, '/');
            if (!slash) break;
            *slash = '\0';
            for (size_t b = 0; b < sizeof below / sizeof below[0]; b++) {
                char cand[PATH_MAX + 32];
                snprintf(cand, sizeof cand, "%s/%s", exe, below[b]);
                if (is_dir(cand) && strlen(cand) < sizeof dir) {
                    memcpy(dir, cand, strlen(cand) + 1);
                    return dir;
                }
            }
        }
    }
    snprintf(dir, sizeof dir, "configs");
    return dir;
}

sim_status cli_configs_check(void)
{
    const char *dir = cli_configs_dir();
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/base.yml", dir);
    if (access(path, R_OK) == 0) return SIM_OK;
    const char *env = getenv("SHARDSIM_CONFIGS");
    if (env && *env)
        return sim_err(SIM_ERR_INPUT,
                       "SHARDSIM_CONFIGS=%s: no readable base.yml there (it must name shardsim's "
                       "configs/ directory, the one holding base.yml, models/ and custom_mesh_and_rule/)",
                       env);
    return sim_err(SIM_ERR_INPUT, "shardsim's data directory (configs/ with base.yml) was not found: looked beside "
                                  "the program (configs/ or share/shardsim/configs/ up to three levels above it) "
                                  "and in the current directory; set SHARDSIM_CONFIGS=/path/to/shardsim/configs, "
                                  "or install with `make install PREFIX=...`");
}

const char *cli_base_config(void)
{
    static char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/base.yml", cli_configs_dir());
    return path;
}

sim_status cli_split_args(int argc, char **argv, const char *const *own, int n_own, cli_args *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < argc; i++) {
        const char *w = argv[i], *eq = strchr(w, '=');
        int mine = 0;
        for (int k = 0; eq && k < n_own; k++)
            if ((size_t)(eq - w) == strlen(own[k]) && !strncmp(w, own[k], (size_t)(eq - w))) {
                if (out->n_own == 32) return sim_err(SIM_ERR_INPUT, "too many arguments");
                out->own_key[out->n_own] = own[k];
                out->own_val[out->n_own++] = eq + 1;
                mine = 1;
            }
        if (mine) continue;
        if (out->n_cfg == 256) return sim_err(SIM_ERR_INPUT, "too many arguments (at most 256)");
        out->cfg[out->n_cfg++] = w;
    }
    return SIM_OK;
}

const char *cli_arg(const cli_args *a, const char *key)
{
    const char *v = NULL;
    for (int i = 0; i < a->n_own; i++)
        if (!strcmp(a->own_key[i], key)) v = a->own_val[i]; /* the last one wins */
    return v;
}

sim_status cli_parse_shape(const char *text, const char *what, int *rank, int64_t *shape)
{
    *rank = 0;
    const char *p = text;
    /* the element count is bounded so that byte counts (x8) and every
     * product of sizes stays far inside 64 bits */
    const long long max_elems = 1LL << 48;
    long long elems = 1;
    if (*p == '(' || *p == '[') p++;
    while (*p && *p != ')' && *p != ']') {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || (*end && *end != ',' && *end != ' ' && *end != ')' && *end != ']'))
            return sim_err(SIM_ERR_INPUT, "%s='%s': expected positive sizes separated by commas, like %s=8,16", what,
                           text, what);
        if (errno == ERANGE || v > max_elems / elems)
            return sim_err(SIM_ERR_INPUT, "%s='%s': the array would have more than 2^48 elements; give a smaller shape",
                           what, text);
        elems *= v;
        if (*rank == MESH_SPEC_MAX_RANK)
            return sim_err(SIM_ERR_INPUT, "%s='%s': at most %d dims", what, text, MESH_SPEC_MAX_RANK);
        shape[(*rank)++] = v;
        p = end;
        while (*p == ' ') p++;
        if (*p == ',') p++;
        while (*p == ' ') p++;
    }
    if (*rank == 0) return sim_err(SIM_ERR_INPUT, "%s='%s': no sizes given; expected e.g. %s=8,16", what, text, what);
    return SIM_OK;
}

sim_status cli_parse_mesh(const char *text, mesh_shape *m)
{
    char names[MESH_MAX_AXES][MESH_AXIS_NAME_MAX];
    const char *np[MESH_MAX_AXES];
    int sizes[MESH_MAX_AXES], n = 0;
    const char *p = text;
    while (*p) {
        const char *eq = strchr(p, '='), *comma = strchr(p, ',');
        if (!eq || (comma && comma < eq) || eq == p)
            return sim_err(SIM_ERR_INPUT,
                           "mesh='%s': expected axis=size pairs separated by commas, like mesh=data=2,fsdp=4", text);
        if (n == MESH_MAX_AXES) return sim_err(SIM_ERR_INPUT, "mesh='%s': at most %d axes", text, MESH_MAX_AXES);
        size_t len = (size_t)(eq - p);
        if (len >= MESH_AXIS_NAME_MAX) return sim_err(SIM_ERR_INPUT, "mesh='%s': axis name too long", text);
        memcpy(names[n], p, len);
        names[n][len] = '\0';
        char *end;
        errno = 0;
        long v = strtol(eq + 1, &end, 10);
        if (end == eq + 1 || v < 1 || (*end && *end != ','))
            return sim_err(SIM_ERR_INPUT, "mesh='%s': axis '%s' needs a positive size", text, names[n]);
        if (errno == ERANGE || v > SIM_MAX_DEVICES)
            return sim_err(SIM_ERR_INPUT, "mesh='%s': axis '%s' has size %s; a mesh has at most %d devices", text,
                           names[n], eq + 1, SIM_MAX_DEVICES);
        np[n] = names[n];
        sizes[n++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) return sim_err(SIM_ERR_INPUT, "mesh='': expected axis=size pairs, like mesh=data=2,fsdp=4");
    return mesh_shape_init(m, n, np, sizes);
}

sim_status cli_rank_placement(const cfg_config *cfg, const mesh_shape *mesh)
{
    const char *text = NULL;
    SIM_TRY(cfg_get_str(cfg, "rank_placement", &text));
    SIM_TRY(sim_xrank_set_placement(text));
    sim_mesh_desc md;
    SIM_TRY(mesh_shape_to_sim(mesh, &md));
    int *owner = calloc((size_t)mesh->num_devices, sizeof *owner);
    SIM_ASSERT(owner);
    /* the axes named must be the mesh's, with or without mpirun; the split over R ranks is checked
     * where R is known (sim_machine_new) */
    sim_status st = sim_mesh_place_ranks(&md, 1, owner);
    free(owner);
    return st;
}

/* Under mpirun the first failure's message, kept for the job's end (cli_end_job). */
static char rank_failure[8192];

int cli_fail(FILE *err, sim_status st)
{
    if (sim_xrank_size() > 1) {
        /* under mpirun: the other ranks hear of it at once (they may be waiting on this one), and
         * the job's end prints it once, on rank 0 (cli_end_job) */
        if (!rank_failure[0]) snprintf(rank_failure, sizeof rank_failure, "%s", sim_errmsg());
        sim_xrank_post_failure(st, sim_errmsg());
    } else {
        fprintf(err, "shardsim: %s\n", sim_errmsg());
    }
    if (getenv("SHARDSIM_DEBUG") && sim_err_trail()[0]) fprintf(err, "%s\n", sim_err_trail());
    return sim_status_exit_code(st);
}

int cli_end_job(int rc, FILE *err)
{
    static char msg[8192 + 256];
    int job = sim_xrank_conclude(rc, rank_failure, msg, sizeof msg);
    if (job && msg[0] && sim_xrank_size() > 1) fprintf(err, "shardsim: %s\n", msg);
    fflush(stdout);
    fflush(err);
    sim_xrank_finalize();
    return job;
}

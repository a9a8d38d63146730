/* helpers.h — test support shared by the test files: whole files read and written, JSON artifacts
 * read, temporary trees removed, meshes and machines made, a fixed pseudo-random stream, and the
 * paths of the test configurations kept as YAML in tests/data/.  Failures end the test (cmocka). */
#ifndef TESTS_HELPERS_H
#define TESTS_HELPERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "mesh/array.h"
#include "config/json.h"
#include "mesh/mesh_shape.h"
#include "mesh/spec.h"
#include "sim/collectives.h"
#include "sim/machine.h"

/* ---- test configurations (YAML files in tests/data/), passed as config-file words; key=value words
 * given with them override them, whatever their order */
#define TINY_DEEPSEEK_YML "tests/data/tiny-deepseek.yml"     /* 1 dense + 2 MoE layers, 8 experts top-2 */
#define MOE_TRAINING_YML "tests/data/moe-training.yml"       /* seed, rate and aux losses of MoE parity */
#define TINY_LLAMA_YML "tests/data/tiny-llama.yml"           /* width 16, 4 query heads over 2 KV heads */
#define TINY_LLAMA_MHA_YML "tests/data/tiny-llama-mha.yml"   /* width 16, 2 heads, MLP 32 */
#define SMALL_LLAMA_YML "tests/data/small-llama.yml"         /* width 32, 4 heads, vocabulary 256 */
#define LLAMA2_NARROW_YML "tests/data/llama2-7b-narrow.yml"  /* llama2-7b at width 64, 2 layers */
#define TINY_BATCHSPLIT_YML "tests/data/tiny-batchsplit.yml" /* deepseek3-671b-batchsplit at width 64, 5 layers */

/* ---- self-contained HTML reports, rendered in headless Chromium */

/* The page as headless Chromium leaves it after its scripts ran (dumped under workdir); NULL, after
 * saying so and skipping the test, when no browser is installed. */
char *helper_render_html(const char *workdir, const char *html);
/* Fails the test when the page loads anything from elsewhere (scripts, styles, imports, URLs). */
void helper_assert_self_contained(const char *html);

/* ---- files */

/* The whole file, NUL-terminated (*len, when given, excludes the NUL); fails the test when it
 * cannot be read. */
char *helper_read_file(const char *path, size_t *len);
/* The same, NULL when the file cannot be opened. */
char *helper_read_file_opt(const char *path, size_t *len);
/* helper_read_file of dir/name. */
char *helper_read_in(const char *dir, const char *name, size_t *len);
/* Writes n bytes of b to path (replacing it); fails the test when it cannot. */
void helper_write_file(const char *path, const void *b, size_t n);
/* Removes path and, for a folder, everything under it (no shell); a missing path is no error. */
void helper_rm_rf(const char *path);
/* Parses dir/name (just name when dir is NULL) as JSON; fails the test when it cannot. */
cfg_json *helper_read_json(const char *dir, const char *name);
/* The member `key` of object v; fails the test when there is none. */
const cfg_json *helper_json_get(const cfg_json *v, const char *key);
/* A new empty folder /tmp/shardsim_<tag>.XXXXXX (free the returned path). */
char *helper_tmpdir(const char *tag);
/* Entries of a folder, "." and ".." not counted. */
int helper_count_entries(const char *dir);
/* MaxText's reference data (maxtext/configs, maxtext/goldens): $SHARDSIM_REFERENCE, else tests/data
 * beside the configs/ the program uses, else tests/data from here; fails the test when missing. */
const char *helper_reference_dir(void);

/* ---- the program */

/* The shardsim of this test's own build (<build>/tests/test_x -> <build>/shardsim, so a sanitizer
 * build runs its own program), or NULL when it is not there. */
const char *helper_program(void);
/* Runs cmd through the shell; its stdout (and whatever the command redirects there) into out
 * (NUL-terminated, at most cap - 1 bytes).  Returns the exit code (128 + the signal if killed). */
int helper_run_shell(const char *cmd, char *out, size_t cap);

/* ---- assertions */

/* Fails the test (at the caller's line), showing hay, unless hay contains needle. */
#define assert_contains(hay, needle)                                                                                   \
    do {                                                                                                               \
        const char *hay_ = (hay), *needle_ = (needle);                                                                 \
        if (!hay_ || !strstr(hay_, needle_)) fail_msg("'%s' not found in:\n%s", needle_, hay_ ? hay_ : "(null)");      \
    } while (0)

/* ---- meshes and machines */

/* The mesh names[i] x sizes[i] (n axes); fails the test when mesh_shape_init refuses it. */
mesh_shape helper_mesh(int n, const char *const *names, const int *sizes);
/* The PartitionSpec text on m (mesh_spec_parse); fails the test when it is refused. */
mesh_spec helper_spec(const mesh_shape *m, const char *text);
/* A quiet machine with one simulated device per device of m (dry: accounting only). */
sim_machine *helper_machine(const mesh_shape *m, bool dry);
/* The same from the simulator's own mesh description (the sim/ tests, below mesh/). */
sim_machine *helper_sim_machine(int naxes, const char *const *names, const int *sizes, bool dry);
/* The same with the options o (made quiet). */
sim_machine *helper_sim_machine_opts(int naxes, const char *const *names, const int *sizes, sim_machine_opts o);

/* ---- a machine's collective records */

/* Bytes sent and calls of device d's records of one op and phase whose tag starts with prefix (any
 * tag when prefix is NULL). */
typedef struct {
    uint64_t bytes, calls;
} helper_sum;
helper_sum helper_sum_records(sim_machine *m, int d, sim_op op, sim_phase ph, const char *prefix);

/* ---- a fixed pseudo-random stream (splitmix64) and values from it */

uint64_t helper_rng_next(uint64_t *state);
/* A spec of rank `rank` over m in which each axis goes nowhere, to a random dimension (at a random
 * position in its list) or, when allow_partial, possibly to the partial set. */
mesh_spec helper_random_spec(const mesh_shape *m, int rank, uint64_t *rng, bool allow_partial);
/* A deterministic value in [-scale, scale], a hash of i (multiples of scale / 1000). */
float helper_det_val(uint32_t i, float scale);

#endif

/* test_models_checkpoint.c — safetensors checkpoints move between meshes.
 *
 * A small model (an unscanned embedding and norm, a scanned kernel, a scanned
 * norm whose layers are the LAST stacked dim) is initialised under one mesh,
 * saved, and loaded under others: every device's shards must equal the
 * mesh-independent init, and files saved under different meshes must be
 * byte-identical.  The file is read back as plain safetensors (header JSON,
 * offsets, stacked row-major data).  Corrupt and mismatched files give errors
 * naming the file and the tensor. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config/json.h"
#include "models/core/checkpoint.h"
#include "models/core/init.h"
#include "tests/helpers.h"

enum { NP = 4, MAXL = 4 };

static char g_dir[64];

typedef struct {
    const char *path;
    int rank;
    int64_t shape[3];
    int scan_dim;
    model_init_kind init;
} pdesc;

/* V=16 E=8 L=4 */
static const pdesc model_a[NP] = {
    {"params.token_embedder.embedding", 2, {16, 8}, -1, MODEL_INIT_NORMAL},
    {"params.decoder.layers.mlp.wi_0.kernel", 3, {8, 4, 12}, 1, MODEL_INIT_TRUNC_NORMAL},
    {"params.decoder.layers.pre_self_attention_layer_norm.scale", 2, {8, 4}, 1, MODEL_INIT_NORMAL},
    {"params.decoder.decoder_norm.scale", 1, {8}, -1, MODEL_INIT_NORMAL},
};

typedef struct {
    int naxes;
    const char *names[3];
    int sizes[3];
    const char *specs[NP]; /* stacked specs */
} mesh_desc;

static const mesh_desc mesh_fsdp4 = {
    1, {"fsdp"}, {4}, {"P(None, 'fsdp')", "P('fsdp', None, None)", "P('fsdp', None)", "P()"}};
static const mesh_desc mesh_dt = {2,
                                  {"data", "tensor"},
                                  {2, 2},
                                  {"P('tensor', None)", "P('data', None, 'tensor')", "P('tensor', None)", "P('data')"}};
static const mesh_desc mesh_one = {1, {"data"}, {1}, {"P()", "P()", "P()", "P()"}};
static const mesh_desc mesh_stage = {
    2, {"stage", "fsdp"}, {2, 2}, {"P('fsdp', None)", "P('fsdp', 'stage', None)", "P(None, 'stage')", "P()"}};

typedef enum { DO_SAVE, DO_LOAD, DO_LOAD_PARAMS } action;

typedef struct {
    const mesh_shape *m;
    const pdesc *model;
    const char *specs[NP];
    action act;
    const char *file; /* load */
    long long step;   /* save: the step; load: the step read */
    int64_t bad[SIM_MAX_DEVICES];
    int64_t checked[SIM_MAX_DEVICES];
} ck_case;

static const uint64_t SEED = 42;

/* The per-layer global values of parameter p layer l, kind 0 = w, 1 = mu, 2 = nu. */
static void expected_layer(const pdesc *pd, int l, int which, float *out, int64_t nel)
{
    char name[256], base[200];
    snprintf(base, sizeof base, "%s%s", which == 0 ? "" : which == 1 ? "mu:" : "nu:", pd->path);
    model_init_layer_name(base, pd->scan_dim >= 0 ? l : -1, name, sizeof name);
    model_init_global(out, nel, name, which ? MODEL_INIT_NORMAL : pd->init, 0.5, SEED);
}

static int64_t layer_elems(const pdesc *pd)
{
    int64_t n = 1;
    for (int i = 0; i < pd->rank; i++)
        if (i != pd->scan_dim) n *= pd->shape[i];
    return n;
}

static bool holds_layer(sim_device *d, const model_param *p, int l, const mesh_shape *m)
{
    int sd = p->def.scan_dim;
    if (sd < 0 || p->spec.n_axes[sd] == 0) return true;
    int ax = p->spec.axes[sd][0];
    return l / (p->n_layers / m->sizes[ax]) == sim_device_coord(d, ax);
}

static sim_status ck_device(sim_device *d, void *arg)
{
    ck_case *c = arg;
    model_param p[NP];
    mesh_array store[NP][3][MAXL];
    memset(p, 0, sizeof p);
    for (int i = 0; i < NP; i++) {
        const pdesc *pd = &c->model[i];
        snprintf(p[i].def.path, sizeof p[i].def.path, "%s", pd->path);
        p[i].def.rank = pd->rank;
        memcpy(p[i].def.shape, pd->shape, sizeof pd->shape);
        p[i].def.scan_dim = pd->scan_dim;
        p[i].def.init = pd->init;
        p[i].def.scale = 0.5;
        p[i].n_layers = pd->scan_dim >= 0 ? (int)pd->shape[pd->scan_dim] : 1;
        SIM_TRY(mesh_spec_parse(c->specs[i], c->m, &p[i].spec));
        int rank;
        int64_t shape[MESH_SPEC_MAX_RANK];
        mesh_spec spec;
        model_param_layer_shape(&p[i], &rank, shape);
        model_param_layer_spec(&p[i], &spec);
        mesh_array *arr[3] = {store[i][0], store[i][1], store[i][2]};
        p[i].w = arr[0];
        p[i].n_slots = 2;
        p[i].slot_name[0] = "mu", p[i].slot_name[1] = "nu";
        p[i].slot[0] = arr[1];
        p[i].slot[1] = arr[2];
        for (int w = 0; w < 3; w++)
            for (int l = 0; l < p[i].n_layers; l++) {
                SIM_TRY(mesh_array_new(d, c->m, pd->path, rank, shape, &spec, SIM_F32, SIM_MEM_PARAMS, &arr[w][l]));
                if (c->act == DO_SAVE) {
                    char name[256], base[200];
                    snprintf(base, sizeof base, "%s%s", w == 0 ? "" : w == 1 ? "mu:" : "nu:", pd->path);
                    model_init_layer_name(base, pd->scan_dim >= 0 ? l : -1, name, sizeof name);
                    /* layers a device does not hold (stage split) get junk that must not reach the file */
                    if (holds_layer(d, &p[i], l, c->m))
                        SIM_TRY(
                            model_init_fill(d, c->m, &arr[w][l], name, w ? MODEL_INIT_NORMAL : pd->init, 0.5, SEED));
                    else SIM_TRY(model_init_fill(d, c->m, &arr[w][l], "junk", MODEL_INIT_NORMAL, 1e3, 1));
                }
            }
    }
    if (c->act == DO_SAVE) {
        SIM_TRY(model_checkpoint_save(d, c->m, g_dir, c->step, p, NP));
    } else {
        long long step = -5;
        SIM_TRY(model_checkpoint_load(d, c->m, c->file, p, NP, c->act == DO_LOAD, &step));
        if (sim_device_id(d) == 0) c->step = step;
        /* every shard of every held layer equals the init */
        int dev = sim_device_id(d);
        for (int i = 0; i < NP; i++) {
            int64_t nel = layer_elems(&c->model[i]);
            float *g = malloc((size_t)nel * sizeof *g), *want = malloc((size_t)nel * sizeof *want);
            for (int w = 0; w < (c->act == DO_LOAD ? 3 : 1); w++)
                for (int l = 0; l < p[i].n_layers; l++) {
                    if (!holds_layer(d, &p[i], l, c->m)) continue;
                    mesh_array *a = w == 0 ? &p[i].w[l] : &p[i].slot[w - 1][l];
                    expected_layer(&c->model[i], l, w, g, nel);
                    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
                    mesh_spec_shard(&a->spec, c->m, a->shape, dev, sh);
                    int64_t start[MESH_SPEC_MAX_RANK];
                    for (int k = 0; k < a->rank; k++) start[k] = sh[k].offset;
                    mesh_copy_block(want, g, a->rank, a->shape, a->local, start, sizeof(float));
                    if (memcmp(want, a->data, a->nlocal * sizeof(float))) c->bad[dev]++;
                    c->checked[dev]++;
                }
            free(g);
            free(want);
        }
    }
    for (int i = 0; i < NP; i++)
        for (int l = 0; l < p[i].n_layers; l++) {
            mesh_array_free(d, &p[i].w[l]);
            mesh_array_free(d, &p[i].slot[0][l]);
            mesh_array_free(d, &p[i].slot[1][l]);
        }
    return SIM_OK;
}

/* Runs one action on a mesh; returns the status (message in sim_errmsg()). */
static sim_status run(const mesh_desc *md, const pdesc *model, action act, const char *file, long long *step,
                      int64_t *checked)
{
    mesh_shape m;
    assert_int_equal(mesh_shape_init(&m, md->naxes, md->names, md->sizes), SIM_OK);
    sim_machine *mach = helper_machine(&m, false);
    ck_case *c = calloc(1, sizeof *c);
    c->m = &m;
    c->model = model;
    memcpy(c->specs, md->specs, sizeof c->specs);
    c->act = act;
    c->file = file;
    c->step = step ? *step : 0;
    sim_status st = sim_machine_run(mach, ck_device, c);
    if (st == SIM_OK && act != DO_SAVE) {
        int64_t total = 0;
        for (int dv = 0; dv < m.num_devices; dv++) {
            if (c->bad[dv])
                fail_msg("device %d: %lld of %lld shards differ from the init", dv, (long long)c->bad[dv],
                         (long long)c->checked[dv]);
            total += c->checked[dv];
        }
        if (checked) *checked = total;
        if (step) *step = c->step;
    }
    free(c);
    sim_machine_free(mach);
    return st;
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/shardsim_ckpt_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------ tests */

static void test_save_load_across_meshes(void **state)
{
    (void)state;
    long long step = 7;
    if (run(&mesh_fsdp4, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    char file[256], tmp[300];
    assert_int_equal(model_checkpoint_path(g_dir, 7, file, sizeof file), SIM_OK);
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    assert_int_equal(access(file, R_OK), 0);
    assert_true(access(tmp, F_OK) != 0); /* the temporary is gone */

    const mesh_desc *targets[] = {&mesh_dt, &mesh_one, &mesh_stage, &mesh_fsdp4};
    for (int k = 0; k < 4; k++) {
        long long got = -1;
        int64_t checked = 0;
        if (run(targets[k], model_a, DO_LOAD, file, &got, &checked) != SIM_OK) fail_msg("load %d: %s", k, sim_errmsg());
        assert_int_equal(got, 7);
        assert_true(checked > 0);
        if (run(targets[k], model_a, DO_LOAD_PARAMS, file, &got, &checked) != SIM_OK)
            fail_msg("load params %d: %s", k, sim_errmsg());
    }

    /* a save under every other mesh writes the very same bytes */
    size_t n0, n1;
    char *ref = helper_read_file_opt(file, &n0);
    const mesh_desc *savers[] = {&mesh_dt, &mesh_one, &mesh_stage};
    for (int k = 0; k < 3; k++) {
        step = 7;
        if (run(savers[k], model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save %d: %s", k, sim_errmsg());
        char *b = helper_read_file_opt(file, &n1);
        assert_int_equal(n0, n1);
        if (memcmp(ref, b, n0)) fail_msg("the file saved under mesh %d differs from the fsdp=4 one", k);
        free(b);
    }
    free(ref);
}

static void test_file_is_safetensors(void **state)
{
    (void)state;
    long long step = 3;
    if (run(&mesh_dt, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    char file[256];
    assert_int_equal(model_checkpoint_path(g_dir, 3, file, sizeof file), SIM_OK);
    size_t n;
    unsigned char *b = (unsigned char *)helper_read_file_opt(file, &n);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | b[i];
    assert_int_equal(hl % 8, 0);
    assert_true(b[8] == '{');
    cfg_json *root;
    if (cfg_json_parse((const char *)b + 8, hl, file, &root) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(root->kind, CFG_JSON_OBJECT);
    const cfg_json *md = cfg_json_get(root, "__metadata__");
    assert_non_null(md);
    assert_string_equal(cfg_json_get(md, "step")->str, "3");
    assert_int_equal(root->n, 1 + 3 * NP);
    /* names in order, shapes stacked, offsets contiguous from 0 to the end of the file */
    uint64_t off = 0;
    for (int w = 0; w < 3; w++)
        for (int i = 0; i < NP; i++) {
            char name[256];
            snprintf(name, sizeof name, "%s%s",
                     w == 0   ? ""
                     : w == 1 ? "opt_state.mu."
                              : "opt_state.nu.",
                     model_a[i].path);
            const cfg_json *e = cfg_json_get(root, name);
            if (!e) fail_msg("no tensor %s", name);
            assert_string_equal(root->keys[1 + w * NP + i], name);
            assert_string_equal(cfg_json_get(e, "dtype")->str, "F32");
            const cfg_json *sh = cfg_json_get(e, "shape"), *of = cfg_json_get(e, "data_offsets");
            assert_int_equal(sh->n, model_a[i].rank);
            int64_t nel = 1;
            for (int k = 0; k < model_a[i].rank; k++) {
                assert_int_equal((int64_t)sh->items[k].number, model_a[i].shape[k]);
                nel *= model_a[i].shape[k];
            }
            assert_int_equal((uint64_t)of->items[0].number, off);
            assert_int_equal((uint64_t)of->items[1].number, off + (uint64_t)nel * 4);
            /* the data: stacked row-major, element (.., l, ..) from layer l of the init */
            if (w < 2) {
                const pdesc *pd = &model_a[i];
                int64_t lel = layer_elems(pd);
                float *g = malloc((size_t)lel * sizeof *g);
                int L = pd->scan_dim >= 0 ? (int)pd->shape[pd->scan_dim] : 1;
                int64_t inner = 1;
                for (int k = pd->scan_dim + 1; k < pd->rank && pd->scan_dim >= 0; k++) inner *= pd->shape[k];
                const float *data = (const float *)(b + 8 + hl + off);
                for (int l = 0; l < L; l++) {
                    expected_layer(pd, l, w, g, lel);
                    for (int64_t e2 = 0; e2 < lel; e2++) {
                        int64_t o = e2, s = 0;
                        if (pd->scan_dim >= 0) /* outer part, layer, inner part */
                            s = (o / inner) * (L * inner) + (int64_t)l * inner + o % inner;
                        else s = o;
                        if (memcmp(&data[s], &g[e2], 4))
                            fail_msg("%s layer %d element %lld misplaced", name, l, (long long)e2);
                    }
                }
                free(g);
            }
            off += (uint64_t)nel * 4;
        }
    assert_int_equal(8 + hl + off, n);
    cfg_json_free(root);
    free(b);
}

static void test_errors(void **state)
{
    (void)state;
    long long step = 5;
    if (run(&mesh_fsdp4, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    char file[256], bad[300];
    assert_int_equal(model_checkpoint_path(g_dir, 5, file, sizeof file), SIM_OK);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", g_dir);
    size_t n;
    char *b = helper_read_file_opt(file, &n);

    /* a model with another shape: names the file, the tensor and both shapes */
    pdesc other[NP];
    memcpy(other, model_a, sizeof other);
    other[0].shape[0] = 32;
    const mesh_desc one = mesh_one;
    assert_int_equal(run(&one, other, DO_LOAD_PARAMS, file, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), file);
    assert_contains(sim_errmsg(), "params.token_embedder.embedding");
    assert_contains(sim_errmsg(), "[16, 8]");
    assert_contains(sim_errmsg(), "[32, 8]");

    /* a model that lacks a tensor of the file, and one with a tensor the file lacks */
    memcpy(other, model_a, sizeof other);
    other[3].path = "params.decoder.final_norm.scale";
    assert_int_equal(run(&one, other, DO_LOAD_PARAMS, file, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "params.decoder.decoder_norm.scale"); /* the file's extra tensor */

    /* a file without one optimizer tensor: the full state fails naming it, parameters alone load */
    char *c = malloc(n);
    memcpy(c, b, n);
    char *mu = strstr(c + 8, "\"opt_state.mu.params.decoder.decoder_norm.scale\"");
    assert_non_null(mu);
    memcpy(mu + 1, "opt_state.mx", 12);
    helper_write_file(bad, c, n);
    /* (a name the model does not know is refused whatever is loaded: no
     * tensor of a file goes unchecked) */
    assert_int_equal(run(&one, model_a, DO_LOAD, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);
    assert_contains(sim_errmsg(), "holds tensor 'opt_state.mx.params.decoder.decoder_norm.scale'");
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "opt_state.mx.params.decoder.decoder_norm.scale");

    /* header length beyond the file */
    memcpy(c, b, n);
    c[5] = 0x7f;
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);
    assert_contains(sim_errmsg(), "header length");

    /* truncated data */
    helper_write_file(bad, b, n - 100);
    assert_int_equal(run(&one, model_a, DO_LOAD, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);
    assert_contains(sim_errmsg(), "data_offsets");

    /* broken JSON */
    memcpy(c, b, n);
    c[8] = '#';
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);

    /* another dtype */
    memcpy(c, b, n);
    char *dt = strstr(c + 8, "\"F32\"");
    assert_non_null(dt);
    memcpy(dt, "\"F16\"", 5);
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "dtype F16");
    assert_contains(sim_errmsg(), "params.token_embedder.embedding");

    /* a header that is valid JSON but not an object (once a use-after-free):
     * an array, a string and a number, each padded to the header length */
    const char *not_obj[] = {"[1, 2, 3]", "\"params\"", "42"};
    for (int k = 0; k < 3; k++) {
        char h[16 + 8];
        memset(h, 0, sizeof h);
        size_t hl = 16;
        for (int i = 0; i < 8; i++) h[i] = (char)((hl >> (8 * i)) & 0xff);
        memset(h + 8, ' ', hl);
        memcpy(h + 8, not_obj[k], strlen(not_obj[k]));
        helper_write_file(bad, h, sizeof h);
        assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), bad);
        assert_contains(sim_errmsg(), "expected an object");
        assert_contains(sim_errmsg(), k == 0 ? "JSON array" : k == 1 ? "JSON string" : "JSON number");
    }

    free(c);
    free(b);
    assert_int_equal(run(&one, model_a, DO_LOAD, "/dev/null/step_1.safetensors", NULL, NULL), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "/dev/null/step_1.safetensors");

    /* a save that cannot create its directory fails cleanly (under a regular file: not even root
     * can make it, whatever exists on the machine) */
    char dir2[sizeof g_dir];
    snprintf(dir2, sizeof dir2, "%s", g_dir);
    snprintf(g_dir, sizeof g_dir, "/dev/null/dir");
    step = 1;
    assert_int_equal(run(&mesh_dt, model_a, DO_SAVE, NULL, &step, NULL), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "/dev/null/dir");
    snprintf(g_dir, sizeof g_dir, "%s", dir2);
}

/* FNV-1a 64, written out here from its definition (offset basis
 * 14695981039346656037, prime 1099511628211), to patch checksums. */
static uint64_t fnv(const unsigned char *p, size_t n)
{
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* Header length, and where tensor name's data_offsets begin in the data section. */
static uint64_t header_len(const char *b)
{
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | (unsigned char)b[i];
    return hl;
}

static uint64_t data_begin(const char *b, const char *name, uint64_t *end)
{
    cfg_json *root;
    uint64_t hl = header_len(b);
    if (cfg_json_parse(b + 8, hl, "t", &root) != SIM_OK) fail_msg("%s", sim_errmsg());
    const cfg_json *of = cfg_json_get(cfg_json_get(root, name), "data_offsets");
    assert_non_null(of);
    uint64_t x = (uint64_t)of->items[0].integer;
    *end = (uint64_t)of->items[1].integer;
    cfg_json_free(root);
    return x;
}

/* Replaces the text of `from` (first occurrence after the length) with `to` (same length). */
static void patch(char *b, const char *from, const char *to)
{
    assert_int_equal(strlen(from), strlen(to));
    char *p = strstr(b + 8, from);
    if (!p) fail_msg("'%s' not in the header", from);
    memcpy(p, to, strlen(to));
}

static void test_corrupt_files(void **state)
{
    (void)state;
    long long step = 6;
    if (run(&mesh_fsdp4, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    char file[256], bad[300];
    assert_int_equal(model_checkpoint_path(g_dir, 6, file, sizeof file), SIM_OK);
    snprintf(bad, sizeof bad, "%s/corrupt.safetensors", g_dir);
    size_t n;
    char *b = helper_read_file_opt(file, &n), *c = malloc(n);
    const mesh_desc one = mesh_one;
    uint64_t hl = header_len(b);
    const char *emb = "params.token_embedder.embedding", *fin = "params.decoder.decoder_norm.scale";
    uint64_t e_end, f_end, e_b = data_begin(b, emb, &e_end), f_b = data_begin(b, fin, &f_end);

    /* every tensor carries a checksum equal to FNV-1a of its bytes */
    char key[300], val[64];
    snprintf(key, sizeof key, "\"checksum.%s\":\"fnv1a64:%016llx\"", emb,
             (unsigned long long)fnv((const unsigned char *)b + 8 + hl + e_b, e_end - e_b));
    assert_non_null(strstr(b + 8, key));

    /* one flipped data bit: refused naming the tensor */
    memcpy(c, b, n);
    c[8 + hl + e_b + 5] ^= 0x10;
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);
    assert_contains(sim_errmsg(), emb);
    assert_contains(sim_errmsg(), "checksum");

    /* aliased offsets: the norm scale (8 floats) pointed at the embedding's first bytes */
    char from[64], to[64];
    snprintf(from, sizeof from, "[%llu,%llu]", (unsigned long long)f_b, (unsigned long long)f_end);
    snprintf(to, sizeof to, "[%llu,%llu]", (unsigned long long)e_b, (unsigned long long)(e_b + 32));
    /* pad to the same text length with leading zeros is not JSON: use spaces */
    while (strlen(to) < strlen(from)) memmove(to + 1, to, strlen(to) + 1), to[0] = ' ';
    memcpy(c, b, n);
    patch(c, from, to);
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), bad);
    assert_contains(sim_errmsg(), "overlap");

    /* trailing bytes after the last tensor */
    memcpy(c, b, n);
    char *longer = malloc(n + 8);
    memcpy(longer, b, n);
    memset(longer + n, 0, 8);
    helper_write_file(bad, longer, n + 8);
    free(longer);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "trailing bytes");

    /* NaN in the data, with a checksum that matches it: refused as NaN */
    memcpy(c, b, n);
    const float qnan = NAN;
    memcpy(c + 8 + hl + f_b + 4 * 3, &qnan, 4);
    snprintf(from, sizeof from, "fnv1a64:%016llx",
             (unsigned long long)fnv((const unsigned char *)b + 8 + hl + f_b, f_end - f_b));
    snprintf(val, sizeof val, "fnv1a64:%016llx",
             (unsigned long long)fnv((const unsigned char *)c + 8 + hl + f_b, f_end - f_b));
    patch(c, from, val);
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), fin);
    assert_contains(sim_errmsg(), "NaN at element 3");

    /* a checksum missing from the metadata */
    memcpy(c, b, n);
    snprintf(from, sizeof from, "\"checksum.%s\"", fin);
    snprintf(to, sizeof to, "\"chexksum.%s\"", fin);
    patch(c, from, to);
    helper_write_file(bad, c, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, bad, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "no checksum for tensor");

    /* a .tmp file is never loaded */
    char tmp[320];
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    helper_write_file(tmp, b, n);
    assert_int_equal(run(&one, model_a, DO_LOAD_PARAMS, tmp, NULL, NULL), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "temporary file");
    /* and the next save removes it */
    step = 9;
    if (run(&mesh_dt, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    assert_int_equal(access(tmp, F_OK), -1);
    free(b);
    free(c);
}

/* SIGKILL at random points of a save, many times: every step file present
 * is byte-identical to an uninterrupted save's (so it loads bitwise equal),
 * a leftover .tmp file is refused, and the next save cleans up. */
static void test_killed_saves(void **state)
{
    (void)state;
    long long step = 4;
    if (run(&mesh_dt, model_a, DO_SAVE, NULL, &step, NULL) != SIM_OK) fail_msg("save: %s", sim_errmsg());
    char ref_path[256], file[256], tmp[300];
    assert_int_equal(model_checkpoint_path(g_dir, 4, ref_path, sizeof ref_path), SIM_OK);
    size_t rn;
    char *ref = helper_read_file_opt(ref_path, &rn);
    char top[sizeof g_dir];
    snprintf(top, sizeof top, "%s", g_dir);
    assert_true(strlen(top) + 3 <= sizeof g_dir);
    strcat(g_dir, "/k");
    assert_int_equal(model_checkpoint_path(g_dir, 4, file, sizeof file), SIM_OK);
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    uint64_t rng = 12345; /* fixed seed: the same kill points every run */
    int whole = 0, absent = 0, tmp_left = 0;
    for (int rep = 0; rep < 60; rep++) {
        unlink(file);
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        useconds_t delay = (useconds_t)((rng >> 33) % 40000); /* 0..40 ms: a forked save takes about 10-20 */
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            long long s2 = 4;
            _exit(run(&mesh_dt, model_a, DO_SAVE, NULL, &s2, NULL) == SIM_OK ? 0 : 3);
        }
        usleep(delay);
        kill(pid, SIGKILL);
        int ws;
        waitpid(pid, &ws, 0);
        size_t fn;
        char *got = helper_read_file_opt(file, &fn);
        if (got) {
            if (fn != rn || memcmp(got, ref, rn))
                fail_msg("kill after %u us: %s is not the whole checkpoint", delay, file);
            whole++;
            free(got);
            if (run(&mesh_one, model_a, DO_LOAD, file, NULL, NULL) != SIM_OK) fail_msg("%s", sim_errmsg());
        } else {
            absent++;
        }
        if (access(tmp, F_OK) == 0) {
            tmp_left++;
            assert_int_equal(run(&mesh_one, model_a, DO_LOAD_PARAMS, tmp, NULL, NULL), SIM_ERR_INPUT);
        }
    }
    print_message("  killed saves: %d whole, %d absent, %d left a .tmp (refused)\n", whole, absent, tmp_left);
    assert_int_equal(whole + absent, 60);
    snprintf(g_dir, sizeof g_dir, "%s", top);
    free(ref);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_load_across_meshes),
        cmocka_unit_test(test_file_is_safetensors),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_corrupt_files),
        cmocka_unit_test(test_killed_saves),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

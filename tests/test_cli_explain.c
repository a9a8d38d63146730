/* test_cli_explain.c — `shardsim explain` end to end: output shape (steps,
 * the closing total line, the grids), logical specs through the config's
 * rules, bad input exiting 2 with a message that names it, and bytes in the
 * dtype train counts: a weight's and an activation's reshard cost what a
 * tiny training run records for the same reshard, in both dtypes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

typedef cli_capture result;

static result run(int argc, const char **argv) { return cli_capture_run(cli_explain, argc, argv); }
static void done(result *r) { cli_capture_free(r); }

/* s without its spaces (a grid's cells are padded to scale: compare labels). */
static char *squash(const char *s)
{
    char *t = malloc(strlen(s) + 1), *o = t;
    for (; *s; s++)
        if (*s != ' ') *o++ = *s;
    *o = '\0';
    return t;
}

/* Lines and widest line of the grid that follows `marker` in s (up to the
 * next empty line). */
static void grid_size(const char *s, const char *marker, int *lines, int *width)
{
    const char *p = strstr(s, marker);
    assert_non_null(p);
    p = strchr(p, '\n') + 1;
    *lines = *width = 0;
    while (*p == '+' || *p == '|' || !strncmp(p, "rows:", 5) || !strncmp(p, "columns:", 8)) {
        const char *e = strchr(p, '\n');
        if (*p == '+' || *p == '|') {
            (*lines)++;
            if ((int)(e - p) > *width) *width = (int)(e - p);
        }
        p = e + 1;
    }
}

/* The last non-empty line of s. */
static const char *last_line(const char *s, char *buf, size_t cap)
{
    const char *end = s + strlen(s);
    while (end > s && end[-1] == '\n') end--;
    const char *start = end;
    while (start > s && start[-1] != '\n') start--;
    snprintf(buf, cap, "%.*s", (int)(end - start), start);
    return buf;
}

static void test_issue_example(void **state)
{
    (void)state;
    const char *argv[] = {"mesh=data=2,fsdp=2,tensor=2", "shape=8,16", "dtype=float32", "from=P(('data','fsdp'),None)",
                          "to=P(None,'tensor')"};
    result r = run(5, argv);
    assert_int_equal(r.rc, 0);
    char buf[256];
    /* slice tensor on dim 1 (local 2x8), then all-gather dim 0 over (data, fsdp): 3 * 64 B */
    assert_string_equal(last_line(r.out, buf, sizeof buf), "total bytes sent per device: 192");
    assert_non_null(strstr(r.out, "step 1: slice"));
    assert_non_null(strstr(r.out, "step 2: all-gather     dim 0            over (data, fsdp)"));
    assert_non_null(strstr(r.out, "values preserved, counted bytes equal the plan"));
    /* grids: four row blocks of two devices each; two column blocks of four */
    char *sq = squash(r.out);
    assert_non_null(strstr(sq, "|6,7|"));
    assert_non_null(strstr(sq, "|0,2,4,6|1,3,5,7|"));
    free(sq);
    done(&r);
}

static void test_logical_specs(void **state)
{
    (void)state;
    /* data=2 fsdp=4 mesh: activation_batch -> (data, fsdp); embed -> fsdp under the base rules */
    const char *argv[] = {"mesh=data=2,fsdp=4", "shape=16,32", "from_logical=activation_batch,activation_embed",
                          "to_logical=embed,mlp"};
    result r = run(4, argv);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "from: P(('data', 'fsdp'), None)"));
    assert_non_null(strstr(r.out, "to:   P('fsdp', None)"));
    done(&r);
}

/* Rank 3: with two sharded dims a grid over them (device r*2+c in row r,
 * column c of P(('data','fsdp'), None, 'tensor') on data=2 fsdp=2 tensor=2);
 * with three, one line per block with its index ranges. */
static void test_rank3(void **state)
{
    (void)state;
    const char *argv[] = {"mesh=data=2,fsdp=2,tensor=2", "shape=8,64,16", "from=P('data','fsdp','tensor')",
                          "to=P(('data','fsdp'),None,'tensor')"};
    result r = run(4, argv);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "rows: dim 0, columns: dim 2"));
    char *sq = squash(r.out);
    for (int row = 0; row < 4; row++) {
        char cells[32];
        snprintf(cells, sizeof cells, "|%d|%d|", 2 * row, 2 * row + 1);
        assert_non_null(strstr(sq, cells));
    }
    free(sq);
    /* from: device d = 4*data + 2*fsdp + tensor holds data block d/4 (rows 4 each), fsdp block (d/2)%2 (32
     * each) and tensor block d%2 (8 each) */
    for (int d = 0; d < 8; d++) {
        char line[96];
        snprintf(line, sizeof line, "  [%d:%d, %d:%d, %d:%d]  devices %d\n", 4 * (d / 4), 4 * (d / 4) + 4,
                 32 * ((d / 2) % 2), 32 * ((d / 2) % 2) + 32, 8 * (d % 2), 8 * (d % 2) + 8, d);
        if (!strstr(r.out, line)) fail_msg("missing block line '%s' in:\n%s", line, r.out);
    }
    done(&r);
}

/* Grids are to scale: a wide array gives a wide, flat grid; a tall one a
 * narrow, tall grid. */
static void test_grid_to_scale(void **state)
{
    (void)state;
    const char *wide[] = {"mesh=fsdp=4", "shape=8,1024", "from=P(None,'fsdp')", "to=P()", "verify=false"};
    const char *tall[] = {"mesh=fsdp=4", "shape=1024,8", "from=P('fsdp',None)", "to=P()", "verify=false"};
    result rw = run(5, wide), rt = run(5, tall);
    assert_int_equal(rw.rc, 0);
    assert_int_equal(rt.rc, 0);
    int wl, ww, tl, tw;
    grid_size(rw.out, "from:", &wl, &ww);
    grid_size(rt.out, "from:", &tl, &tw);
    assert_true(ww > 2 * tw); /* wider */
    assert_true(tl > 2 * wl); /* taller */
    assert_true(ww <= 81);    /* within 80 columns (+ the closing bar) */
    done(&rw);
    done(&rt);
}

/* Without mesh= the output says where the mesh came from; a logical name no
 * rule mentions is an error naming it, with the close name suggested. */
static void test_mesh_source_and_unknown_logical_name(void **state)
{
    (void)state;
    const char *ok[] = {"shape=16,32", "from_logical=activation_batch,activation_embed", "to_logical=embed,mlp",
                        "ici_fsdp_parallelism=8"};
    result r = run(4, ok);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "from the config's ici_*/dcn_* flags"));
    done(&r);
    const char *bad[] = {"shape=16,32", "from_logical=activation_bach,activation_embed", "to_logical=embed,mlp",
                         "ici_fsdp_parallelism=8"};
    r = run(4, bad);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "'activation_bach' is not a logical axis name"));
    assert_non_null(strstr(r.err, "did you mean 'activation_batch'?"));
    done(&r);
}

static void test_bad_input(void **state)
{
    (void)state;
    const char *a1[] = {"mesh=data=2", "shape=8,16", "from=P('fsdp')", "to=P()"};
    result r = run(4, a1);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "'fsdp' is not a mesh axis"));
    assert_string_equal(r.out, "");
    done(&r);
    const char *a2[] = {"mesh=x=4", "shape=6,16", "from=P('x', None)", "to=P()"};
    r = run(4, a2);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "dim 0 has size 6"));
    done(&r);
    const char *a3[] = {"mesh=x=4", "shape=8", "from=P('x')"};
    r = run(3, a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "to="));
    done(&r);
    const char *a4[] = {"shape=8,16", "from_logical=embed,mlp", "to_logical=mlp,embed", "ici_tensr_parallelism=2"};
    r = run(4, a4);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "ici_tensor_parallelism"));
    done(&r);
    const char *a5[] = {"mesh=x=4", "shape=8,a", "from=P()", "to=P()"};
    r = run(4, a5);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "shape='8,a'"));
    done(&r);
}

/* ---- explain's bytes against train's ---- */

/* tests/data/tiny-llama-mha.yml on fsdp=2 x tensor=2 */
static const char *const TINY[] = {TINY_LLAMA_MHA_YML, "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
enum { NTINY = sizeof TINY / sizeof TINY[0] };

/* Device 0's bytes sent by the forward record of op over `axis` tagged `tag` in step 0 of a 4-device,
 * 4-row run of TINY with the words dt[0..2) and dt[2] when not NULL (a hardware profile); 0 when absent. */
static uint64_t train_bytes(const char *const *dt, sim_op op, const char *axis, const char *tag)
{
    model_run r;
    model_run_open(&r, TINY, NTINY, 4, dt, dt[2] ? 3 : 2, 4, 1);
    model_run_train(&r, false);
    int ax = mesh_shape_axis_index(&r.def->mesh, axis);
    size_t n;
    const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
    uint64_t b = 0;
    for (size_t i = 0; i < n && !b; i++)
        if (rec[i].op == op && rec[i].phase == SIM_PHASE_FORWARD && !strcmp(rec[i].tag, tag) && rec[i].axes.n == 1 &&
            rec[i].axes.axis[0] == ax)
            b = rec[i].bytes_sent;
    model_run_close(&r);
    return b;
}

/* explain's total bytes per device for TINY with dt[0..2) (and dt[2] when not NULL) and the words w[0..nw).
 * The dtypes come in a YAML file: on explain's command line dtype= is its own override of the array's dtype. */
static uint64_t explain_bytes(const char *const *dt, const char *const *w, int nw, const char *want_dtype_line)
{
    char yml[] = "/tmp/shardsim-explain-XXXXXX.yml";
    int fd = mkstemps(yml, 4);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    for (int i = 0; i < 3 && dt[i]; i++)
        fprintf(f, "%.*s: %s\n", (int)(strchr(dt[i], '=') - dt[i]), dt[i], strchr(dt[i], '=') + 1);
    fclose(f);
    const char *argv[NTINY + 8];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    argv[argc++] = yml;
    for (int i = 0; i < nw; i++) argv[argc++] = w[i];
    result r = run(argc, argv);
    remove(yml);
    if (r.rc) fail_msg("%s", r.err);
    if (!strstr(r.out, want_dtype_line)) fail_msg("no '%s' in:\n%s", want_dtype_line, r.out);
    char buf[256];
    unsigned long long b = 0;
    if (sscanf(last_line(r.out, buf, sizeof buf), "total bytes sent per device: %llu", &b) != 1)
        fail_msg("no total line in:\n%s", r.out);
    done(&r);
    return b;
}

static void test_bytes_equal_train(void **state)
{
    (void)state;
    /* with a hardware profile whose compiler casts float32 weights to a narrower dtype before moving
     * them (v5p: XLA:TPU; h100: XLA:GPU's CollectiveQuantizer), a weight's gather moves dtype */
    static const char *const dts[6][3] = {{"dtype=bfloat16", "weight_dtype=float32", NULL},
                                          {"dtype=float32", "weight_dtype=float32", NULL},
                                          {"dtype=bfloat16", "weight_dtype=bfloat16", NULL},
                                          {"dtype=bfloat16", "weight_dtype=float32", "hardware_profile=v5p"},
                                          {"dtype=float32", "weight_dtype=float32", "hardware_profile=v5p"},
                                          {"dtype=bfloat16", "weight_dtype=float32", "hardware_profile=h100"}};
    /* mlp/wi_0's kernel of one layer (embed 16, mlp 32), sharded P('fsdp', 'tensor'), gathered over fsdp
     * for its dot: (k-1) x 8 x 16 elements in weight_dtype (or dtype where a profile casts first) */
    const char *weight[] = {"shape=16,32", "from_logical=embed,mlp", "to=P(None,'tensor')"};
    /* the attention's input (batch 4, length 16, embed 16), embed on tensor, gathered over tensor before
     * the query projection: (k-1) x 2 x 16 x 8 elements in dtype */
    const char *act[] = {"shape=4,16,16", "from_logical=activation_batch,activation_length,activation_embed",
                         "to_logical=activation_batch,activation_length,None"};
    for (int i = 0; i < 6; i++) {
        uint64_t wes = strstr(dts[i][1], "float32") ? 4 : 2, aes = strstr(dts[i][0], "float32") ? 4 : 2;
        bool cast = dts[i][2] && aes < wes; /* both profiles cast a float32 weight to bfloat16 first */
        if (cast) wes = aes;
        uint64_t tw = train_bytes(dts[i], SIM_OP_ALL_GATHER, "fsdp", "decoder/layers_0/mlp/wi_0");
        uint64_t ta = train_bytes(dts[i], SIM_OP_ALL_GATHER, "tensor", "decoder/layers_0/self_attention/query");
        assert_int_equal(tw, 1 * 8 * 16 * wes);
        assert_int_equal(ta, 1 * 2 * 16 * 8 * aes);
        char wl[64], al[64];
        snprintf(wl, sizeof wl, "dtype: %s, the config's %s", wes == 4 ? "float32" : "bfloat16",
                 cast ? "dtype" : "weight_dtype");
        snprintf(al, sizeof al, "dtype: %s, the config's dtype", aes == 4 ? "float32" : "bfloat16");
        assert_int_equal(explain_bytes(dts[i], weight, 3, wl), tw);
        assert_int_equal(explain_bytes(dts[i], act, 3, al), ta);
        /* tensor= says which it is; dtype= overrides both */
        const char *wt[] = {weight[0], weight[1], weight[2], "tensor=activation"};
        assert_int_equal(explain_bytes(dts[i], wt, 4, "tensor=activation"), 8 * 16 * aes);
        const char *at[] = {act[0], act[1], act[2], "tensor=weight"};
        assert_int_equal(explain_bytes(dts[i], at, 4, "tensor=weight"), 2 * 16 * 8 * wes);
        const char *ad[] = {act[0], act[1], act[2], "dtype=int32"};
        assert_int_equal(explain_bytes(dts[i], ad, 4, "dtype: int32 (dtype=; train counts this activation"),
                         2 * 16 * 8 * 4);
    }
}

/* Without tensor= or logical names the array is an activation; tensor= takes only weight or activation;
 * the config's model is needed only to classify logical names. */
static void test_dtype_choice(void **state)
{
    (void)state;
    const char *a1[] = {"mesh=fsdp=4", "shape=8,16", "from=P('fsdp',None)", "to=P()"};
    result r = run(4, a1);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "array: bfloat16 (8, 16), 256 bytes\n"));
    assert_non_null(strstr(r.out, "an activation: no tensor= or logical names given"));
    done(&r);
    const char *a2[] = {"mesh=fsdp=4", "shape=8,16", "from=P('fsdp',None)", "to=P()", "tensor=weights"};
    r = run(5, a2);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "tensor='weights': expected weight"));
    assert_string_equal(r.out, "");
    done(&r);
    /* logical names are classified by the config's model: a model that cannot be defined is an error
     * naming it and the way around it; tensor= or dtype= need no model */
    const char *a3[] = {"mesh=x=2", "shape=4,4", "from_logical=embed,mlp", "to=P()", "base_num_kv_heads=3"};
    r = run(5, a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "base_num_kv_heads=3"));
    assert_non_null(strstr(r.err, "give tensor=weight or tensor=activation, or dtype="));
    assert_string_equal(r.out, "");
    done(&r);
    const char *a4[] = {"mesh=x=2", "shape=4,4",           "from_logical=embed,mlp",
                        "to=P()",   "base_num_kv_heads=3", "tensor=weight"};
    r = run(6, a4);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "array: float32 (4, 4), 64 bytes\n"));
    done(&r);
    const char *a5[] = {"mesh=x=2", "shape=4,4",           "from_logical=embed,mlp",
                        "to=P()",   "base_num_kv_heads=3", "dtype=bfloat16"};
    r = run(6, a5);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "array: bfloat16 (4, 4), 32 bytes\ndtype: bfloat16 (dtype=)\n"));
    done(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_issue_example),
        cmocka_unit_test(test_logical_specs),
        cmocka_unit_test(test_rank3),
        cmocka_unit_test(test_grid_to_scale),
        cmocka_unit_test(test_mesh_source_and_unknown_logical_name),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_bytes_equal_train),
        cmocka_unit_test(test_dtype_choice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

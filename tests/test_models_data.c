/* test_models_data.c — batches are a function of (config, seed, step).
 *
 * The text stream is checked byte by byte against the offset formula on a
 * small file written here; the synthetic stream against its recurrence; the
 * CP reorder against MaxText's examples and by round trip; batch sizes
 * against MaxText's fractional per_device_batch_size rule. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/core/data.h"
#include "tests/helpers.h"

/* A file of n bytes: byte i = (i * 7 + i / 13) mod 256. */
static unsigned char file_byte(int64_t i) { return (unsigned char)((i * 7 + i / 13) % 256); }

static void write_file(const char *path, int64_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    for (int64_t i = 0; i < n; i++) fputc(file_byte(i), f);
    fclose(f);
}

static void test_text_offsets(void **state)
{
    (void)state;
    char path[] = "/tmp/shardsim_test_data_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    const int64_t N = 1000, T = 16, B = 3;
    write_file(path, N);
    model_data d;
    assert_int_equal(model_data_open(&d, MODEL_DATA_TEXT, 256, T, 0, path), SIM_OK);
    int32_t in[3 * 16], tg[3 * 16], pos[3 * 16];
    const int64_t steps[] = {0, 1, 2, 20, 21, 12345};
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        int64_t s = steps[k];
        assert_int_equal(model_batch_global(&d, s, B, in, tg, pos), SIM_OK);
        for (int64_t r = 0; r < B; r++) {
            int64_t off = ((s * B + r) * T) % (N - T - 1);
            for (int64_t t = 0; t < T; t++) {
                assert_int_equal(in[r * T + t], file_byte(off + t));
                assert_int_equal(tg[r * T + t], file_byte(off + t + 1));
                assert_int_equal(pos[r * T + t], t);
            }
        }
    }
    /* two rows by hand: step 21 row 2 starts at ((21*3+2)*16) mod 983 = 1040 mod 983 = 57 */
    assert_int_equal(model_batch_global(&d, 21, B, in, tg, NULL), SIM_OK);
    assert_int_equal(in[2 * T + 0], file_byte(57));
    assert_int_equal(tg[2 * T + 15], file_byte(57 + 16));
    /* step 0 row 1 starts at 16 */
    assert_int_equal(model_batch_global(&d, 0, B, in, NULL, NULL), SIM_OK);
    assert_int_equal(in[T], file_byte(16));
    model_data_close(&d);

    /* exactly T+2 bytes works (one start offset: 0); T+1 bytes is an error naming file and sizes */
    write_file(path, T + 2);
    assert_int_equal(model_data_open(&d, MODEL_DATA_TEXT, 256, T, 0, path), SIM_OK);
    assert_int_equal(model_batch_global(&d, 7, B, in, tg, NULL), SIM_OK);
    for (int64_t r = 0; r < B; r++) assert_int_equal(in[r * T], file_byte(0));
    model_data_close(&d);
    write_file(path, T + 1);
    assert_int_equal(model_data_open(&d, MODEL_DATA_TEXT, 256, T, 0, path), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), path);
    assert_contains(sim_errmsg(), "17 bytes");
    assert_contains(sim_errmsg(), "at least 18");
    /* byte tokenizer needs vocab >= 256 */
    write_file(path, N);
    assert_int_equal(model_data_open(&d, MODEL_DATA_TEXT, 255, T, 0, path), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "vocab_size=255");
    assert_int_equal(model_data_open(&d, MODEL_DATA_TEXT, 256, T, 0, "/dev/null/x.txt"), SIM_ERR_IO);
    assert_contains(sim_errmsg(), "/dev/null/x.txt");

    /* through the config */
    char ovr_path[300];
    snprintf(ovr_path, sizeof ovr_path, "dataset_path=%s", path);
    const char *ovr[] = {"dataset_type=text", ovr_path, "vocab_size=300", "max_target_length=16"};
    mesh_cfg_args a = {NULL, NULL, NULL, 0, ovr, 4};
    mesh_cfg *cfg;
    if (mesh_cfg_load(&a, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(model_data_from_config(cfg, &d), SIM_OK);
    assert_int_equal(d.type, MODEL_DATA_TEXT);
    assert_int_equal(d.seq, 16);
    assert_int_equal(d.file_size, N);
    model_data_close(&d);
    mesh_cfg_free(cfg);
    unlink(path);
}

static void test_synthetic(void **state)
{
    (void)state;
    const int64_t T = 64, B = 16;
    const int64_t vocabs[] = {2, 50, 256, 32000};
    for (size_t k = 0; k < 4; k++) {
        model_data d;
        assert_int_equal(model_data_open(&d, MODEL_DATA_SYNTHETIC, vocabs[k], T, 5, NULL), SIM_OK);
        int64_t V = d.syn_vocab;
        assert_int_equal(V, vocabs[k] < 256 ? vocabs[k] : 256);
        int32_t *in = malloc(B * T * 4), *tg = malloc(B * T * 4), *in2 = malloc(B * T * 4), *in3 = malloc(B * T * 4);
        assert_int_equal(model_batch_global(&d, 3, B, in, tg, NULL), SIM_OK);
        assert_int_equal(model_batch_global(&d, 3, B, in2, NULL, NULL), SIM_OK);
        assert_memory_equal(in, in2, B * T * 4); /* deterministic */
        assert_int_equal(model_batch_global(&d, 4, B, in3, NULL, NULL), SIM_OK);
        int same_start = 0;
        for (int64_t r = 0; r < B; r++) {
            same_start += in[r * T] == in3[r * T];
            for (int64_t t = 0; t < T; t++) {
                int32_t x = in[r * T + t];
                assert_true(x >= 0 && x < V);
                assert_int_equal(tg[r * T + t], (d.syn_a * x + d.syn_c) % V); /* the pattern */
                if (t + 1 < T) assert_int_equal(in[r * T + t + 1], tg[r * T + t]);
            }
        }
        if (V >= 50) assert_true(same_start < B / 2); /* other step, other start tokens */
        /* the map is a permutation of 0..Vs-1 */
        char *seen = calloc((size_t)V, 1);
        for (int64_t x = 0; x < V; x++) seen[(d.syn_a * x + d.syn_c) % V] = 1;
        for (int64_t x = 0; x < V; x++) assert_true(seen[x]);
        free(seen);
        free(in), free(tg), free(in2), free(in3);
        model_data_close(&d);
    }
    /* a different seed, a different batch */
    model_data d1, d2;
    assert_int_equal(model_data_open(&d1, MODEL_DATA_SYNTHETIC, 1000, 8, 1, NULL), SIM_OK);
    assert_int_equal(model_data_open(&d2, MODEL_DATA_SYNTHETIC, 1000, 8, 2, NULL), SIM_OK);
    int32_t a[64], b[64];
    assert_int_equal(model_batch_global(&d1, 0, 8, a, NULL, NULL), SIM_OK);
    assert_int_equal(model_batch_global(&d2, 0, 8, b, NULL, NULL), SIM_OK);
    assert_true(memcmp(a, b, sizeof a) != 0);
    assert_int_equal(model_data_open(&d1, MODEL_DATA_SYNTHETIC, 1, 8, 1, NULL), SIM_ERR_INPUT);
}

static void test_batch_rows(void **state)
{
    (void)state;
    int64_t load, train;
    assert_int_equal(model_batch_rows(8, 0.25, &load, &train), SIM_OK);
    assert_int_equal(load, 8);
    assert_int_equal(train, 2);
    assert_int_equal(model_batch_rows(4, 1.5, &load, &train), SIM_OK);
    assert_int_equal(load, 6);
    assert_int_equal(train, 6);
    assert_int_equal(model_batch_rows(3, 0.5, &load, &train), SIM_OK); /* int(1.5) = 1 */
    assert_int_equal(load, 3);
    assert_int_equal(train, 1);
    assert_int_equal(model_batch_rows(16, 12.0, &load, &train), SIM_OK);
    assert_int_equal(load, 192);
    assert_int_equal(train, 192);
    assert_int_equal(model_batch_rows(8, 0.375, &load, &train), SIM_OK);
    assert_int_equal(train, 3);
    assert_int_equal(model_batch_rows(4, 0.1, &load, &train), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "per_device_batch_size=0.1");
    assert_contains(sim_errmsg(), ">= 0.25");
}

static void test_reorder(void **state)
{
    (void)state;
    int32_t r8[8];
    for (int i = 0; i < 8; i++) r8[i] = i;
    assert_int_equal(model_reorder_load_balanced(r8, 1, 8, 2), SIM_OK);
    const int32_t want8[] = {0, 1, 6, 7, 2, 3, 4, 5};
    assert_memory_equal(r8, want8, sizeof want8);

    int32_t r16[2 * 16];
    for (int i = 0; i < 32; i++) r16[i] = i % 16 + 100 * (i / 16);
    assert_int_equal(model_reorder_load_balanced(r16, 2, 16, 4), SIM_OK);
    /* dev0 [0,1,14,15], dev1 [2,3,12,13], dev2 [4,5,10,11], dev3 [6,7,8,9] */
    const int32_t want16[] = {0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9};
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 16; t++) assert_int_equal(r16[b * 16 + t], want16[t] + 100 * b);
    assert_int_equal(model_reorder_load_balanced_inverse(r16, 2, 16, 4), SIM_OK);
    for (int i = 0; i < 32; i++) assert_int_equal(r16[i], i % 16 + 100 * (i / 16));

    /* round trips on random rows, every cp dividing T/2 */
    const int64_t T = 48, B = 5;
    int32_t x[5 * 48], y[5 * 48];
    uint32_t s = 1;
    for (int i = 0; i < B * T; i++) x[i] = (int32_t)((s = s * 1664525u + 1013904223u) >> 8);
    for (int cp = 1; cp <= 24; cp++) {
        if (T % (2 * cp)) continue;
        memcpy(y, x, sizeof x);
        assert_int_equal(model_reorder_load_balanced(y, B, T, cp), SIM_OK);
        if (cp > 1) assert_true(memcmp(x, y, sizeof x) != 0);
        assert_int_equal(model_reorder_load_balanced_inverse(y, B, T, cp), SIM_OK);
        assert_memory_equal(x, y, sizeof x);
    }
    /* positions reordered alike tell every token where it came from */
    int32_t pos[16];
    for (int i = 0; i < 16; i++) pos[i] = i;
    assert_int_equal(model_reorder_load_balanced(pos, 1, 16, 4), SIM_OK);
    assert_memory_equal(pos, want16, sizeof pos);

    assert_int_equal(model_reorder_load_balanced(r8, 1, 8, 3), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "max_target_length=8");
    assert_contains(sim_errmsg(), "6 chunks");
    assert_int_equal(model_reorder_load_balanced(r8, 1, 8, 0), SIM_ERR_INPUT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_offsets),
        cmocka_unit_test(test_synthetic),
        cmocka_unit_test(test_batch_rows),
        cmocka_unit_test(test_reorder),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

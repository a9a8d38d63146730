/* data.c — synthetic and byte-text batches, batch sizes, CP reorder (see data.h). */
#include "models/core/data.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define GOLDEN 0x9E3779B97F4A7C15ull

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* (a * b) mod m without overflow, for a, b < m. */
static uint64_t mulmod(uint64_t a, uint64_t b, uint64_t m)
{
    if (a < (1ull << 32) && b < (1ull << 32)) return (a * b) % m;
    uint64_t r = 0;
    a %= m;
    while (b) {
        if (b & 1) r = (r >= m - a) ? r - (m - a) : r + a;
        a = (a >= m - a) ? a - (m - a) : a + a;
        b >>= 1;
    }
    return r;
}

sim_status model_data_open(model_data *d, model_data_type type, int64_t vocab, int64_t seq, uint64_t seed,
                           const char *path)
{
    memset(d, 0, sizeof *d);
    d->fd = -1;
    d->type = type;
    d->vocab = vocab;
    d->seq = seq;
    d->seed = seed;
    if (seq < 1)
        return sim_err(SIM_ERR_INPUT, "max_target_length=%lld: a sequence needs at least 1 token", (long long)seq);
    if (type == MODEL_DATA_SYNTHETIC) {
        if (vocab < 2)
            return sim_err(SIM_ERR_INPUT, "vocab_size=%lld: dataset_type=synthetic needs vocab_size >= 2",
                           (long long)vocab);
        d->syn_vocab = vocab < MODEL_SYNTHETIC_VOCAB_MAX ? vocab : MODEL_SYNTHETIC_VOCAB_MAX;
        d->syn_a = 5;
        while (gcd64(d->syn_a, d->syn_vocab) != 1) d->syn_a++;
        d->syn_c = 3 % d->syn_vocab;
        return SIM_OK;
    }
    if (vocab < 256)
        return sim_err(SIM_ERR_INPUT,
                       "vocab_size=%lld is too small for dataset_type=text: its byte tokenizer has 256 tokens; "
                       "set vocab_size=256 or more",
                       (long long)vocab);
    if (!path || !path[0])
        return sim_err(SIM_ERR_INPUT, "dataset_type=text needs dataset_path=FILE (a text file read as bytes)");
    if (strlen(path) >= sizeof d->path)
        return sim_err(SIM_ERR_INPUT, "dataset_path is longer than %d characters", MODEL_DATA_PATH_MAX - 1);
    snprintf(d->path, sizeof d->path, "%s", path);
    d->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (d->fd < 0) return sim_err(SIM_ERR_IO, "dataset_path=%s: cannot open it (%s)", path, strerror(errno));
    struct stat st;
    if (fstat(d->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        model_data_close(d);
        return sim_err(SIM_ERR_INPUT, "dataset_path=%s is not a regular file", path);
    }
    d->file_size = (int64_t)st.st_size;
    if (d->file_size < seq + 2) {
        int64_t size = d->file_size;
        model_data_close(d);
        return sim_err(SIM_ERR_INPUT,
                       "dataset_path=%s has %lld bytes; max_target_length=%lld needs at least %lld "
                       "(T+2: one row is T+1 bytes and the offsets cycle over size-T-1 starts); "
                       "use a longer file or a shorter max_target_length",
                       path, (long long)size, (long long)seq, (long long)(seq + 2));
    }
    return SIM_OK;
}

sim_status model_data_from_config(const cfg_config *cfg, model_data *d)
{
    static const char *const types[] = {"synthetic", "text"};
    int type;
    long long vocab, seq, seed;
    const char *path;
    SIM_TRY(cfg_get_enum(cfg, "dataset_type", types, 2, &type));
    SIM_TRY(cfg_get_int(cfg, "vocab_size", &vocab));
    SIM_TRY(cfg_get_int(cfg, "max_target_length", &seq));
    SIM_TRY(cfg_get_int(cfg, "data_shuffle_seed", &seed));
    SIM_TRY(cfg_get_str(cfg, "dataset_path", &path));
    return model_data_open(d, (model_data_type)type, vocab, seq, (uint64_t)seed, path);
}

void model_data_close(model_data *d)
{
    if (d->fd >= 0) close(d->fd);
    d->fd = -1;
}

/* ---------------------------------------------------------------- batches */

static void synthetic_row(const model_data *d, int64_t step, int64_t r, int32_t *row /* (T+1) */)
{
    uint64_t h = mix64(mix64(mix64(d->seed + GOLDEN) + (uint64_t)step * GOLDEN) + (uint64_t)(r + 1) * GOLDEN);
    int64_t x = (int64_t)(h % (uint64_t)d->syn_vocab);
    for (int64_t t = 0; t <= d->seq; t++) {
        row[t] = (int32_t)x;
        x = (d->syn_a * x + d->syn_c) % d->syn_vocab;
    }
}

static sim_status text_row(const model_data *d, int64_t step, int64_t rows, int64_t r, unsigned char *buf, int32_t *row)
{
    uint64_t m = (uint64_t)(d->file_size - d->seq - 1);
    uint64_t k = (mulmod((uint64_t)step % m, (uint64_t)rows % m, m) + (uint64_t)r % m) % m; /* (s*B + r) mod m */
    uint64_t off = mulmod(k, (uint64_t)d->seq % m, m);
    size_t want = (size_t)d->seq + 1, got = 0;
    while (got < want) {
        ssize_t n = pread(d->fd, buf + got, want - got, (off_t)(off + got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            return sim_err(SIM_ERR_IO, "dataset_path=%s: reading %zu bytes at offset %llu failed (%s)", d->path, want,
                           (unsigned long long)(off + got), n < 0 ? strerror(errno) : "file shrank");
        got += (size_t)n;
    }
    for (size_t t = 0; t < want; t++) row[t] = buf[t];
    return SIM_OK;
}

sim_status model_batch_global(const model_data *d, int64_t step, int64_t rows, int32_t *inputs, int32_t *targets,
                              int32_t *positions)
{
    if (step < 0) return sim_err(SIM_ERR_INTERNAL, "batch of step %lld: steps count from 0", (long long)step);
    int64_t T = d->seq;
    int32_t *row = malloc((size_t)(T + 1) * sizeof *row);
    unsigned char *buf = malloc((size_t)T + 1);
    if (!row || !buf) {
        free(row);
        free(buf);
        return sim_err(SIM_ERR_INTERNAL, "out of host memory for a batch row of %lld tokens", (long long)T);
    }
    sim_status st = SIM_OK;
    for (int64_t r = 0; r < rows && st == SIM_OK; r++) {
        if (d->type == MODEL_DATA_SYNTHETIC) synthetic_row(d, step, r, row);
        else st = text_row(d, step, rows, r, buf, row);
        if (st != SIM_OK) break;
        if (inputs) memcpy(inputs + r * T, row, (size_t)T * sizeof *row);
        if (targets) memcpy(targets + r * T, row + 1, (size_t)T * sizeof *row);
        if (positions)
            for (int64_t t = 0; t < T; t++) positions[r * T + t] = (int32_t)t;
    }
    free(row);
    free(buf);
    return st;
}

sim_status model_batch_rows(int num_devices, double per_device_batch_size, int64_t *rows_loaded, int64_t *rows_trained)
{
    /* Python's int(num_devices * pdbs): the double product, truncated */
    double prod = (double)num_devices * per_device_batch_size;
    int64_t trained = prod >= 1.0 ? (int64_t)prod : 0;
    if (num_devices < 1 || trained < 1)
        return sim_err(SIM_ERR_INPUT,
                       "per_device_batch_size=%g on %d devices trains on int(%d * %g) = %lld rows; it needs at "
                       "least 1: set per_device_batch_size >= %g",
                       per_device_batch_size, num_devices, num_devices, per_device_batch_size, (long long)trained,
                       num_devices > 0 ? 1.0 / num_devices : 1.0);
    *rows_trained = trained;
    *rows_loaded = per_device_batch_size < 1.0 ? num_devices : trained;
    return SIM_OK;
}

/* ---------------------------------------------------------------- CP reorder */

static sim_status reorder(int32_t *rows, int64_t B, int64_t T, int cp, int inverse)
{
    if (cp < 1) return sim_err(SIM_ERR_INPUT, "context parallelism of %d: it must be >= 1", cp);
    if (T % (2 * cp))
        return sim_err(SIM_ERR_INPUT,
                       "load-balanced context parallelism cuts the sequence into 2*cp = %d chunks, but "
                       "max_target_length=%lld does not divide by %d; change max_target_length or the context axis, "
                       "or set context_parallel_load_balance=false",
                       2 * cp, (long long)T, 2 * cp);
    if (cp == 1) return SIM_OK; /* chunks c0, c1: already in order */
    int64_t c = T / (2 * cp);
    int32_t *tmp = malloc((size_t)T * sizeof *tmp);
    if (!tmp) return sim_err(SIM_ERR_INTERNAL, "out of host memory for a row of %lld tokens", (long long)T);
    size_t cb = (size_t)c * sizeof *tmp;
    for (int64_t b = 0; b < B; b++) {
        int32_t *row = rows + b * T;
        memcpy(tmp, row, (size_t)T * sizeof *tmp);
        for (int k = 0; k < cp; k++) {
            int lo = k, hi = 2 * cp - 1 - k; /* contiguous chunks that land in slots 2k, 2k+1 */
            if (!inverse) {
                memcpy(row + (2 * k) * c, tmp + lo * c, cb);
                memcpy(row + (2 * k + 1) * c, tmp + hi * c, cb);
            } else {
                memcpy(row + lo * c, tmp + (2 * k) * c, cb);
                memcpy(row + hi * c, tmp + (2 * k + 1) * c, cb);
            }
        }
    }
    free(tmp);
    return SIM_OK;
}

sim_status model_reorder_load_balanced(int32_t *rows, int64_t B, int64_t T, int cp)
{
    return reorder(rows, B, T, cp, 0);
}

sim_status model_reorder_load_balanced_inverse(int32_t *rows, int64_t B, int64_t T, int cp)
{
    return reorder(rows, B, T, cp, 1);
}

/* checkpoint.c — safetensors save/load by shard (see checkpoint.h).
 *
 * Geometry: a tensor's stacked shape G has the layers at scan_dim; a device
 * holds the block SO..SO+SL of it (its per-layer shard, and along the scan
 * dim the layers it stores).  Let k be the innermost dim where SL != G: the
 * block is prod(SL[0..k)) runs, each contiguous in the file.  Runs are moved
 * in chunks of whole rows (rows = the last dim) through one bounce buffer:
 * gather rows from the per-layer arrays, one pwrite per chunk (or one pread,
 * then scatter).  The buffer (at most 4 MiB) is host memory, not the
 * device's arena: checkpoint I/O stands for a device-to-host copy. */
#include "models/core/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config/json.h"
#include "models/core/optimizer.h" /* model_layer_primary */

enum { CK_NAME_MAX = MODEL_PATH_MAX + 32, CK_CHUNK = 1 << 20, CK_HEADER_MAX = 100 << 20 };

typedef struct {
    char name[CK_NAME_MAX];
    model_param *p;
    int which;        /* 0 the parameter, k + 1 its optimizer slot k */
    int64_t nel;      /* elements of the stacked tensor */
    uint64_t begin;   /* data_offsets[0], from the start of the data section */
    model_param view; /* what p points to: the parameter, or one layer of it (scan_layers=false) */
} ck_tensor;

static mesh_array *ck_arrays(const ck_tensor *t) { return t->which == 0 ? t->p->w : t->p->slot[t->which - 1]; }

static int64_t numel(const model_param_def *def)
{
    int64_t n = 1;
    for (int i = 0; i < def->rank; i++) n *= def->shape[i];
    return n;
}

/* ---------------------------------------------------------------- header text */

/* The header text (jansson, compact) padded with spaces to a multiple of 8. */
typedef struct {
    char *s;
    size_t n;
} sbuf;

/* The tensor list of a model: the parameters, then (with_opt) slot 0 of every parameter that has
 * one, slot 1 ..., each named "opt_state.<slot name>.<path>" (AdamW: mu, then nu; a Muon leaf has
 * mu only; a MoEBiasVar none). */
static sim_status ck_tensors(model_param *params, int n, bool with_opt, ck_tensor **out, int *nt)
{
    int per = 0; /* MaxText's tensors: an unscanned stack is one tensor per layer */
    for (int i = 0; i < n; i++) per += model_param_def_tensors(&params[i].def);
    ck_tensor *t = calloc((size_t)((1 + MODEL_OPT_SLOTS_MAX) * per + 1), sizeof *t);
    if (!t) return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory");
    int k = 0;
    uint64_t off = 0;
    for (int which = 0; which < (with_opt ? 1 + MODEL_OPT_SLOTS_MAX : 1); which++)
        for (int i = 0; i < n; i++) {
            if (which && (which > params[i].n_slots || !params[i].slot[which - 1])) continue;
            for (int l = 0; l < model_param_def_tensors(&params[i].def); l++) {
                model_param_tensor_view(&params[i], l, &t[k].view);
                if (which)
                    snprintf(t[k].name, sizeof t[k].name, "opt_state.%s.%s", params[i].slot_name[which - 1],
                             t[k].view.def.path);
                else snprintf(t[k].name, sizeof t[k].name, "%s", t[k].view.def.path);
                t[k].p = &t[k].view;
                t[k].which = which;
                t[k].nel = numel(&t[k].view.def);
                t[k].begin = off;
                off += (uint64_t)t[k].nel * 4;
                k++;
            }
        }
    *out = t;
    *nt = k;
    return SIM_OK;
}

/* Whether the parameters carry optimizer state (saved with them). */
static bool ck_with_opt(const model_param *params, int n)
{
    for (int i = 0; i < n; i++)
        if (params[i].n_slots > 0) return true;
    return false;
}

/* The __metadata__ key of tensor name's checksum, and its value:
 * "fnv1a64:" and 16 hex digits (fixed width, so the header keeps its length
 * when the placeholder is replaced by the real sum). */
static void ck_sum_key(const char *name, char *buf, size_t cap) { snprintf(buf, cap, "checksum.%s", name); }
static void ck_sum_text(uint64_t sum, char *buf, size_t cap)
{
    snprintf(buf, cap, "fnv1a64:%016llx", (unsigned long long)sum);
}

/* FNV-1a 64 over a buffer, continuing from h. */
static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}
#define FNV_START 14695981039346656037ULL

/* The padded header; *data_bytes = size of the data section.  sums: the
 * checksum of each tensor (NULL: placeholders of the same width). */
static sim_status ck_header(const ck_tensor *t, int nt, long long step, const uint64_t *sums, sbuf *b,
                            uint64_t *data_bytes)
{
    memset(b, 0, sizeof *b);
    char num[32];
    snprintf(num, sizeof num, "%lld", step);
    cfg_jw w;
    cfg_jw_init(&w);
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "__metadata__");
    cfg_jw_obj(&w);
    cfg_jw_key(&w, "format");
    cfg_jw_str(&w, "shardsim");
    cfg_jw_key(&w, "step");
    cfg_jw_str(&w, num);
    for (int i = 0; i < nt; i++) {
        char key[CK_NAME_MAX + 16], val[32];
        ck_sum_key(t[i].name, key, sizeof key);
        ck_sum_text(sums ? sums[i] : 0, val, sizeof val);
        cfg_jw_key(&w, key);
        cfg_jw_str(&w, val);
    }
    cfg_jw_end(&w);
    uint64_t end = 0;
    for (int i = 0; i < nt; i++) {
        const model_param_def *def = &t[i].p->def;
        end = t[i].begin + (uint64_t)t[i].nel * 4;
        cfg_jw_key(&w, t[i].name);
        cfg_jw_obj(&w);
        cfg_jw_key(&w, "dtype");
        cfg_jw_str(&w, "F32");
        cfg_jw_key(&w, "shape");
        cfg_jw_arr(&w);
        for (int d = 0; d < def->rank; d++) cfg_jw_int(&w, def->shape[d]);
        cfg_jw_end(&w);
        cfg_jw_key(&w, "data_offsets");
        cfg_jw_arr(&w);
        cfg_jw_u64(&w, t[i].begin);
        cfg_jw_u64(&w, end);
        cfg_jw_end(&w);
        cfg_jw_end(&w);
    }
    cfg_jw_end(&w);
    char *text = cfg_jw_dumps(&w, CFG_JW_COMPACT, 17);
    if (!text) return sim_err(SIM_ERR_INTERNAL, "checkpoint: cannot build the header (out of host memory)");
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    b->s = realloc(text, padded + 1);
    if (!b->s) {
        free(text);
        return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory for the header");
    }
    memset(b->s + n, ' ', padded - n);
    b->s[padded] = 0;
    b->n = padded;
    *data_bytes = end;
    return SIM_OK;
}

/* ---------------------------------------------------------------- shard I/O */

static sim_status io_all(int fd, void *buf, size_t len, uint64_t off, bool write, const char *file)
{
    char *p = buf;
    size_t done = 0;
    while (done < len) {
        ssize_t k = write ? pwrite(fd, p + done, len - done, (off_t)(off + done))
                          : pread(fd, p + done, len - done, (off_t)(off + done));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return sim_err(SIM_ERR_IO, "checkpoint %s: %s of %zu bytes at offset %llu failed (%s)", file,
                           write ? "writing" : "reading", len - done, (unsigned long long)(off + done),
                           k < 0 ? strerror(errno) : "the file is shorter than its header says");
        done += (size_t)k;
    }
    return SIM_OK;
}

/* Moves this device's block of tensor t between its per-layer arrays and
 * the file (data of t starting at file offset base). */
static sim_status ck_tensor_io(sim_device *d, const mesh_shape *m, const ck_tensor *t, int fd, uint64_t base,
                               bool write, const char *file)
{
    model_param *p = t->p;
    mesh_array *a = ck_arrays(t);
    const model_param_def *def = &p->def;
    int L = p->n_layers, sd = def->scan_dim, dev = sim_device_id(d);
    if (!a) return sim_err(SIM_ERR_INTERNAL, "checkpoint: '%s' has no storage", t->name);
    if (!a[0].data) return SIM_OK; /* dry run */
    if (!write)                    /* a load writes the shards in place */
        for (int l = 0; l < p->n_layers; l++) mesh_array_owned(&a[l]);
    /* per-layer geometry, identical for all layers */
    int lrank;
    int64_t lshape[MESH_SPEC_MAX_RANK];
    model_param_layer_shape(p, &lrank, lshape);
    for (int l = 0; l < L; l++) {
        if (a[l].dtype != SIM_F32 || a[l].rank != lrank || memcmp(a[l].shape, lshape, (size_t)lrank * sizeof *lshape) ||
            !mesh_spec_equal(&a[l].spec, &a[0].spec))
            return sim_err(
                SIM_ERR_INTERNAL,
                "checkpoint: '%s' layer %d is not a float32 array of the per-layer shape and spec of layer 0", t->name,
                l);
    }
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a[0].spec, m, a[0].shape, dev, sh);
    /* the stacked block: per-layer dims plus the scan dim's held layers */
    int r = def->rank;
    int64_t G[MESH_SPEC_MAX_RANK] = {0}, SO[MESH_SPEC_MAX_RANK] = {0}, SL[MESH_SPEC_MAX_RANK] = {0};
    int64_t lfirst = 0, lcount = L;
    if (sd >= 0 && p->spec.rank > sd && p->spec.n_axes[sd] > 0) {
        int64_t block = 0, nb = 1;
        for (int i = 0; i < p->spec.n_axes[sd]; i++) {
            int ax = p->spec.axes[sd][i];
            block = block * m->sizes[ax] + sim_device_coord(d, ax);
            nb *= m->sizes[ax];
        }
        lcount = L / nb;
        lfirst = block * lcount;
    }
    for (int i = 0, li = 0; i < r; i++) {
        G[i] = def->shape[i];
        if (i == sd) {
            SO[i] = lfirst;
            SL[i] = lcount;
        } else {
            SO[i] = sh[li].offset;
            SL[i] = a[0].local[li];
            li++;
        }
    }
    if (r == 0) { /* a scalar: one row of one element */
        r = 1;
        G[0] = SL[0] = 1;
        SO[0] = 0;
    }
    if (write) {
        bool primary;
        SIM_TRY(model_layer_primary(m, p, &a[lfirst], (int)lfirst, dev, &primary));
        if (!primary) return SIM_OK;
    }
    int64_t W = SL[r - 1], total = 1;
    for (int i = 0; i < r; i++) total *= SL[i];
    if (total == 0) return SIM_OK;
    int k = 0; /* innermost dim that is split */
    for (int i = r - 1; i >= 0; i--)
        if (SL[i] != G[i]) {
            k = i;
            break;
        }
    int64_t run = 1;
    for (int i = k; i < r; i++) run *= SL[i];
    int64_t rows_per_run = run / W, rows_total = total / W;
    int64_t rows_per_chunk = CK_CHUNK / W > 0 ? CK_CHUNK / W : 1;
    if (rows_per_chunk > rows_per_run) rows_per_chunk = rows_per_run;
    float *buf = malloc((size_t)(rows_per_chunk * W) * sizeof *buf);
    if (!buf)
        return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory for a %lld-element buffer",
                       (long long)(rows_per_chunk * W));
    /* strides: global stacked, and per-layer local */
    int64_t gstride[MESH_SPEC_MAX_RANK], lstride[MESH_SPEC_MAX_RANK];
    gstride[r - 1] = 1;
    for (int i = r - 2; i >= 0; i--) gstride[i] = gstride[i + 1] * G[i + 1];
    if (lrank > 0) {
        lstride[lrank - 1] = 1;
        for (int i = lrank - 2; i >= 0; i--) lstride[i] = lstride[i + 1] * a[0].local[i + 1];
    }
    int64_t idx[MESH_SPEC_MAX_RANK] = {0}; /* row index over dims 0..r-2 of the block */
    sim_status st = SIM_OK;
    for (int64_t row0 = 0; row0 < rows_total && st == SIM_OK;) {
        int64_t nrows = rows_per_run - row0 % rows_per_run;
        if (nrows > rows_per_chunk) nrows = rows_per_chunk;
        uint64_t foff = (uint64_t)SO[r - 1];
        for (int i = 0; i < r - 1; i++) foff += (uint64_t)((SO[i] + idx[i]) * gstride[i]);
        foff = base + foff * 4;
        size_t bytes = (size_t)(nrows * W) * sizeof *buf;
        if (!write) st = io_all(fd, buf, bytes, foff, false, file);
        for (int64_t q = 0; q < nrows && st == SIM_OK; q++) {
            float *row = buf + q * W;
            /* per-layer local offset of this row's first element, and its layer */
            int64_t loff = 0, layer = 0;
            for (int i = 0, li = 0; i < r - 1; i++) {
                if (i == sd) {
                    layer = idx[i];
                    continue;
                }
                loff += idx[i] * lstride[li++];
            }
            if (sd == r - 1) { /* layers along the row: one element from each */
                for (int64_t e = 0; e < W; e++) {
                    float *x = (float *)a[lfirst + e].data + loff;
                    if (write) row[e] = *x;
                    else *x = row[e];
                }
            } else {
                float *x = (float *)a[lfirst + layer].data + loff;
                if (write) memcpy(row, x, (size_t)W * sizeof *x);
                else memcpy(x, row, (size_t)W * sizeof *x);
            }
            for (int i = r - 2; i >= 0; i--) {
                if (++idx[i] < SL[i]) break;
                idx[i] = 0;
            }
        }
        if (write && st == SIM_OK) st = io_all(fd, buf, bytes, foff, true, file);
        row0 += nrows;
    }
    free(buf);
    return st;
}

/* ---------------------------------------------------------------- save */

sim_status model_checkpoint_path(const char *dir, long long step, char *buf, size_t cap)
{
    int k = snprintf(buf, cap, "%s/step_%lld.safetensors", dir, step);
    if (k < 0 || (size_t)k >= cap)
        return sim_err(SIM_ERR_INPUT, "checkpoint_dir=%s is too long (a path of at most %zu characters)", dir, cap - 1);
    return SIM_OK;
}

static bool little_endian(void)
{
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* Device 0: create DIR if missing, write the length and header into tmp, size the file. */
static sim_status ck_create(const char *dir, const char *tmp, const sbuf *h, uint64_t data_bytes)
{
    (void)dir;
    int fd = open(tmp, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) return sim_err(SIM_ERR_IO, "checkpoint %s: cannot create it (%s)", tmp, strerror(errno));
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)h->n >> (8 * i));
    sim_status st;
    SIM_TRY_GOTO(io_all(fd, len, 8, 0, true, tmp), st, fail);
    SIM_TRY_GOTO(io_all(fd, h->s, h->n, 8, true, tmp), st, fail);
    if (ftruncate(fd, (off_t)(8 + h->n + data_bytes)) != 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint %s: cannot size it to %llu bytes (%s)", tmp,
                             (unsigned long long)(8 + h->n + data_bytes), strerror(errno)),
                     st, fail);
fail:
    if (close(fd) != 0 && st == SIM_OK)
        st = sim_err(SIM_ERR_IO, "checkpoint %s: close failed (%s)", tmp, strerror(errno));
    return st;
}

/* Removes DIR/ *.safetensors.tmp left by a killed save (they are never
 * loaded: the loader refuses a .tmp path and a file whose checksums are
 * placeholders).  Returns how many were removed. */
static int ck_remove_stale(const char *dir)
{
    DIR *dh = opendir(dir);
    if (!dh) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dh))) {
        size_t len = strlen(e->d_name);
        static const char suf[] = ".safetensors.tmp";
        if (len <= sizeof suf - 1 || strcmp(e->d_name + len - (sizeof suf - 1), suf)) continue;
        char p[4096];
        if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) < (int)sizeof p && unlink(p) == 0) n++;
    }
    closedir(dh);
    return n;
}

/* Device 0, after every device wrote its shards into tmp: reads the data
 * back tensor by tensor, writes the header with the real checksums (same
 * length), fsyncs the file, renames it into place and fsyncs the directory,
 * so that after a crash the file is either whole or absent. */
static sim_status ck_finish(const char *dir, const char *tmp, const char *path, const ck_tensor *t, int nt,
                            long long step, uint64_t hlen)
{
    uint64_t *sums = calloc((size_t)nt + 1, sizeof *sums);
    char *buf = malloc(CK_CHUNK);
    sbuf hd = {0};
    uint64_t data_bytes;
    sim_status st;
    int fd = -1;
    if (!sums || !buf) SIM_TRY_GOTO(sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory"), st, fail);
    fd = open(tmp, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint %s: cannot reopen it (%s)", tmp, strerror(errno)), st, fail);
    for (int i = 0; i < nt; i++) {
        uint64_t h = FNV_START, left = (uint64_t)t[i].nel * 4, off = 8 + hlen + t[i].begin;
        while (left) {
            size_t k = left < CK_CHUNK ? (size_t)left : CK_CHUNK;
            SIM_TRY_GOTO(io_all(fd, buf, k, off, false, tmp), st, fail);
            h = fnv1a(h, buf, k);
            off += k;
            left -= k;
        }
        sums[i] = h;
    }
    SIM_TRY_GOTO(ck_header(t, nt, step, sums, &hd, &data_bytes), st, fail);
    if (hd.n != hlen)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INTERNAL, "checkpoint %s: the header changed length with its checksums", tmp), st,
                     fail);
    SIM_TRY_GOTO(io_all(fd, hd.s, hd.n, 8, true, tmp), st, fail);
    if (fsync(fd) != 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint %s: fsync failed (%s)", tmp, strerror(errno)), st, fail);
    int cl = close(fd);
    fd = -1;
    if (cl != 0) SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint %s: close failed (%s)", tmp, strerror(errno)), st, fail);
    if (rename(tmp, path) != 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint: cannot rename %s to %s (%s)", tmp, path, strerror(errno)), st,
                     fail);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0)
        st = sim_err(SIM_ERR_IO, "checkpoint_dir=%s: fsync of the directory failed (%s)", dir, strerror(errno));
    if (dfd >= 0) close(dfd);
fail:
    if (fd >= 0 && close(fd) != 0 && st == SIM_OK)
        st = sim_err(SIM_ERR_IO, "checkpoint %s: close failed (%s)", tmp, strerror(errno));
    free(hd.s);
    free(sums);
    free(buf);
    return st;
}

sim_status model_checkpoint_save(sim_device *d, const mesh_shape *m, const char *dir, long long step,
                                 model_param *params, int n)
{
    if (sim_device_dry(d)) return SIM_OK;
    SIM_ASSERT(little_endian());
    char path[4096], tmp[4096 + 8];
    SIM_TRY(model_checkpoint_path(dir, step, path, sizeof path));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    bool with_opt = ck_with_opt(params, n);
    ck_tensor *t;
    int nt;
    SIM_TRY(ck_tensors(params, n, with_opt, &t, &nt));
    sbuf h = {0};
    uint64_t data_bytes = 0;
    bool lead = sim_device_id(d) == 0, created = false;
    sim_status st;
    SIM_TRY_GOTO(ck_header(t, nt, step, NULL, &h, &data_bytes), st, fail);
    if (lead) {
        if (mkdir(dir, 0777) != 0 && errno != EEXIST)
            SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint_dir=%s: cannot create it (%s)", dir, strerror(errno)), st,
                         fail);
        ck_remove_stale(dir);
        SIM_TRY_GOTO(ck_create(dir, tmp, &h, data_bytes), st, fail);
        created = true;
    }
    SIM_TRY_GOTO(sim_device_barrier(d), st, fail);
    int fd = open(tmp, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        SIM_TRY_GOTO(sim_err(SIM_ERR_IO, "checkpoint %s: cannot open it for writing (%s)%s", tmp, strerror(errno),
                             sim_machine_ranks(sim_device_machine(d)) > 1
                                 ? "; under mpirun device 0's rank made it: checkpoint_dir must be on a file system "
                                   "every rank shares"
                                 : ""),
                     st, fail);
    for (int i = 0; i < nt && st == SIM_OK; i++) st = ck_tensor_io(d, m, &t[i], fd, 8 + h.n + t[i].begin, true, tmp);
    if (close(fd) != 0 && st == SIM_OK)
        st = sim_err(SIM_ERR_IO, "checkpoint %s: close failed (%s)", tmp, strerror(errno));
    SIM_TRY_GOTO(st, st, fail);
    SIM_TRY_GOTO(sim_device_barrier(d), st, fail);
    if (lead) SIM_TRY_GOTO(ck_finish(dir, tmp, path, t, nt, step, h.n), st, fail);
    created = false;
    SIM_TRY_GOTO(sim_device_barrier(d), st, fail); /* nobody returns before the file is in place */
fail:
    if (created) unlink(tmp); /* this save failed somewhere: leave nothing half-written */
    free(h.s);
    free(t);
    return st;
}

/* ---------------------------------------------------------------- load */

static sim_status shape_text(const cfg_json *v, char *buf, size_t cap)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; v && v->kind == CFG_JSON_ARRAY && i < v->n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", v->items[i].str ? v->items[i].str : "?");
    if (k < cap) snprintf(buf + k, cap - k, "]");
    return SIM_OK;
}

static void def_shape_text(const model_param_def *def, char *buf, size_t cap)
{
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < def->rank && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)def->shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

static bool json_uint(const cfg_json *v, uint64_t *out)
{
    if (!v || v->kind != CFG_JSON_NUMBER || v->number < 0 || v->number > 9007199254740992.0 ||
        v->number != (double)(uint64_t)v->number)
        return false;
    *out = (uint64_t)v->number;
    return true;
}

/* Checks tensor t against the header entry e; *begin = its data_offsets[0]. */
static sim_status ck_check_entry(const char *file, const ck_tensor *t, const cfg_json *e, uint64_t data_bytes,
                                 uint64_t *begin)
{
    const model_param_def *def = &t->p->def;
    char want[256], got[256];
    if (!e)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s has no tensor '%s', which the model needs; it was saved from "
                       "another model config%s",
                       file, t->name, t->which ? " or without optimizer state (use load_parameters_path)" : "");
    if (e->kind != CFG_JSON_OBJECT)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s: tensor '%s' is a JSON %s, expected an object with dtype, shape "
                       "and data_offsets",
                       file, t->name, cfg_json_kind_name(e->kind));
    const cfg_json *dt = cfg_json_get(e, "dtype"), *sh = cfg_json_get(e, "shape"),
                   *off = cfg_json_get(e, "data_offsets");
    if (!dt || dt->kind != CFG_JSON_STRING || strcmp(dt->str, "F32"))
        return sim_err(SIM_ERR_INPUT, "checkpoint %s: tensor '%s' has dtype %s; shardsim reads F32 only", file, t->name,
                       dt && dt->kind == CFG_JSON_STRING ? dt->str : "(missing)");
    def_shape_text(def, want, sizeof want);
    bool ok = sh && sh->kind == CFG_JSON_ARRAY && sh->n == def->rank;
    for (int i = 0; ok && i < def->rank; i++) {
        uint64_t x;
        ok = json_uint(&sh->items[i], &x) && x == (uint64_t)def->shape[i];
    }
    if (!ok) {
        shape_text(sh, got, sizeof got);
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s: tensor '%s' has shape %s but the model's is %s; the checkpoint "
                       "was saved from another model config",
                       file, t->name, got, want);
    }
    uint64_t b, en;
    if (!off || off->kind != CFG_JSON_ARRAY || off->n != 2 || !json_uint(&off->items[0], &b) ||
        !json_uint(&off->items[1], &en) || en < b || en - b != (uint64_t)t->nel * 4 || en > data_bytes)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s: tensor '%s' has bad data_offsets (expected [b, b + %lld] "
                       "inside the %llu data bytes); the file is corrupt or truncated",
                       file, t->name, (long long)t->nel * 4, (unsigned long long)data_bytes);
    *begin = b;
    return SIM_OK;
}

/* Reads and parses the header of file (fd open). */
static sim_status ck_read_header(int fd, const char *file, cfg_json **root, uint64_t *hlen, uint64_t *data_bytes)
{
    struct stat sb;
    if (fstat(fd, &sb) != 0) return sim_err(SIM_ERR_IO, "checkpoint %s: cannot stat it (%s)", file, strerror(errno));
    uint64_t size = (uint64_t)sb.st_size;
    unsigned char len[8];
    if (size < 8)
        return sim_err(SIM_ERR_INPUT, "checkpoint %s has %llu bytes: too short for a safetensors file", file,
                       (unsigned long long)size);
    SIM_TRY(io_all(fd, len, 8, 0, false, file));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | len[i];
    if (n < 2 || n > CK_HEADER_MAX || n > size - 8)
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s: header length %llu does not fit the %llu-byte file; it is not "
                       "a safetensors file or it is truncated",
                       file, (unsigned long long)n, (unsigned long long)size);
    char *text = malloc((size_t)n);
    if (!text)
        return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory for a %llu-byte header",
                       (unsigned long long)n);
    sim_status st = io_all(fd, text, (size_t)n, 8, false, file);
    if (st == SIM_OK) st = cfg_json_parse(text, (size_t)n, file, root);
    free(text);
    SIM_TRY(st);
    if ((*root)->kind != CFG_JSON_OBJECT) {
        /* the message needs the kind: read it before the tree is freed */
        cfg_json_kind kind = (*root)->kind;
        cfg_json_free(*root);
        *root = NULL;
        return sim_err(SIM_ERR_INPUT, "checkpoint %s: the header is a JSON %s, expected an object", file,
                       cfg_json_kind_name(kind));
    }
    *hlen = n;
    *data_bytes = size - 8 - n;
    return SIM_OK;
}

/* The "step" of the header's __metadata__: the training step the state was
 * saved after (-1 when absent or not a decimal count). */
static long long ck_meta_step(const cfg_json *root)
{
    const cfg_json *md = cfg_json_get(root, "__metadata__"), *sv = md ? cfg_json_get(md, "step") : NULL;
    if (!sv || sv->kind != CFG_JSON_STRING || !*sv->str) return -1;
    for (const char *c = sv->str; *c; c++)
        if (*c < '0' || *c > '9') return -1;
    char *end;
    errno = 0;
    long long v = strtoll(sv->str, &end, 10);
    return errno == 0 && !*end ? v : -1;
}

static sim_status ck_no_step(const char *path)
{
    return sim_err(SIM_ERR_INPUT,
                   "checkpoint %s: __metadata__ has no step (\"step\": \"<n>\"), so it cannot resume the "
                   "full state; give it as load_parameters_path to start from its parameters at step 0",
                   path);
}

typedef struct {
    uint64_t b, e;
    const char *name;
} ck_span;

static int span_cmp(const void *x, const void *y)
{
    const ck_span *a = x, *b = y;
    return a->b < b->b ? -1 : a->b > b->b;
}

/* Checks the whole header against the model: every key is one of the
 * model's tensors (parameters or Adam moments) or __metadata__, every entry
 * is well formed, and the entries tile the data section exactly (sorted by
 * offset: the first starts at 0, each starts where the previous ends, the
 * last ends at the end of the file) — so no two tensors alias and no byte is
 * unaccounted for.  Fills all[i].begin for the entries present. */
static sim_status ck_check_layout(const char *file, const cfg_json *root, ck_tensor *all, int nall, uint64_t data_bytes)
{
    ck_span *sp = calloc((size_t)root->n + 1, sizeof *sp);
    if (!sp) return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory");
    int ns = 0;
    sim_status st = SIM_OK;
    for (int i = 0; st == SIM_OK && i < root->n; i++) {
        const char *key = root->keys[i];
        if (!strcmp(key, "__metadata__")) {
            if (root->items[i].kind != CFG_JSON_OBJECT)
                st = sim_err(SIM_ERR_INPUT, "checkpoint %s: __metadata__ is a JSON %s, expected an object of strings",
                             file, cfg_json_kind_name(root->items[i].kind));
            continue;
        }
        int j = 0;
        while (j < nall && strcmp(all[j].name, key)) j++;
        if (j == nall) {
            st = sim_err(SIM_ERR_INPUT,
                         "checkpoint %s holds tensor '%s', which the model does not have; it was saved "
                         "from another model config",
                         file, key);
            break;
        }
        uint64_t begin = 0;
        st = ck_check_entry(file, &all[j], &root->items[i], data_bytes, &begin);
        all[j].begin = begin;
        sp[ns++] = (ck_span){begin, begin + (uint64_t)all[j].nel * 4, all[j].name};
    }
    if (st == SIM_OK) {
        qsort(sp, (size_t)ns, sizeof *sp, span_cmp);
        uint64_t at = 0;
        for (int i = 0; st == SIM_OK && i < ns; i++) {
            if (sp[i].b != at)
                st = sim_err(SIM_ERR_INPUT,
                             "checkpoint %s: tensor '%s' starts at data offset %llu, but %s ends at %llu: "
                             "tensors %s; the file is corrupt",
                             file, sp[i].name, (unsigned long long)sp[i].b,
                             i ? sp[i - 1].name : "the data section start", (unsigned long long)at,
                             sp[i].b < at ? "overlap" : "leave a gap");
            at = sp[i].e;
        }
        if (st == SIM_OK && at != data_bytes)
            st = sim_err(SIM_ERR_INPUT,
                         "checkpoint %s: the tensors end at data offset %llu but the data section has %llu "
                         "bytes; the file is corrupt or has trailing bytes",
                         file, (unsigned long long)at, (unsigned long long)data_bytes);
    }
    free(sp);
    return st;
}

/* Device 0: every tensor's checksum from __metadata__ against the data, and
 * the tensors to load (load[0..nl)) finite. */
static sim_status ck_verify_data(int fd, const char *file, const cfg_json *root, const ck_tensor *all, int nall,
                                 uint64_t hlen)
{
    const cfg_json *md = cfg_json_get(root, "__metadata__");
    char *buf = malloc(CK_CHUNK);
    if (!buf) return sim_err(SIM_ERR_INTERNAL, "checkpoint: out of host memory");
    sim_status st = SIM_OK;
    for (int i = 0; st == SIM_OK && i < nall; i++) {
        if (!cfg_json_get(root, all[i].name)) continue; /* absent: not needed, or refused already */
        char key[CK_NAME_MAX + 16], want[32];
        ck_sum_key(all[i].name, key, sizeof key);
        const cfg_json *sv = md ? cfg_json_get(md, key) : NULL;
        if (!sv || sv->kind != CFG_JSON_STRING) {
            st = sim_err(SIM_ERR_INPUT,
                         "checkpoint %s: __metadata__ has no checksum for tensor '%s' (\"%s\"); the file "
                         "was not written by a complete shardsim save: save it again",
                         file, all[i].name, key);
            break;
        }
        uint64_t h = FNV_START, left = (uint64_t)all[i].nel * 4, off = 8 + hlen + all[i].begin, el = 0;
        while (st == SIM_OK && left) {
            size_t k = left < CK_CHUNK ? (size_t)left : CK_CHUNK;
            st = io_all(fd, buf, k, off, false, file);
            h = fnv1a(h, buf, k);
            const float *f = (const float *)buf;
            for (size_t q = 0; st == SIM_OK && q < k / 4; q++, el++)
                if (!isfinite(f[q]))
                    st = sim_err(SIM_ERR_INPUT,
                                 "checkpoint %s: tensor '%s' holds %s at element %llu; the run that "
                                 "saved it diverged: load an earlier checkpoint",
                                 file, all[i].name, isnan(f[q]) ? "NaN" : "an infinity", (unsigned long long)el);
            off += k;
            left -= k;
        }
        ck_sum_text(h, want, sizeof want);
        if (st == SIM_OK && strcmp(sv->str, want))
            st = sim_err(SIM_ERR_INPUT,
                         "checkpoint %s: tensor '%s' has checksum %s but its data hashes to %s; the file "
                         "is corrupt: load another checkpoint",
                         file, all[i].name, sv->str, want);
    }
    free(buf);
    return st;
}

static sim_status ck_load_checked(sim_device *d, const mesh_shape *m, const char *path, int fd, model_param *params,
                                  int n, bool opt_state, long long *step)
{
    cfg_json *root;
    uint64_t hlen = 0, data_bytes = 0;
    SIM_TRY(ck_read_header(fd, path, &root, &hlen, &data_bytes));
    ck_tensor *t = NULL, *all = NULL;
    int nt = 0, nall = 0;
    sim_status st = ck_tensors(params, n, opt_state, &t, &nt);
    if (st == SIM_OK) st = ck_tensors(params, n, true, &all, &nall); /* every name the model knows */
    if (st == SIM_OK) st = ck_check_layout(path, root, all, nall, data_bytes);
    /* the tensors to load must all be there */
    for (int i = 0; st == SIM_OK && i < nt; i++) {
        uint64_t b;
        st = ck_check_entry(path, &t[i], cfg_json_get(root, t[i].name), data_bytes, &b);
        t[i].begin = b;
    }
    if (st == SIM_OK && step) {
        *step = ck_meta_step(root);
        if (opt_state && *step < 0) st = ck_no_step(path);
    }
    /* the data: device 0 checks every checksum (and that the values are
     * finite) while the others wait, so nobody reads a corrupt file */
    bool dry = t && nt > 0 && ck_arrays(&t[0]) && !ck_arrays(&t[0])[0].data;
    if (st == SIM_OK && !dry && sim_device_id(d) == 0) st = ck_verify_data(fd, path, root, all, nall, hlen);
    if (st == SIM_OK && !dry) st = sim_device_barrier(d);
    for (int i = 0; st == SIM_OK && i < nt; i++) st = ck_tensor_io(d, m, &t[i], fd, 8 + hlen + t[i].begin, false, path);
    free(t);
    free(all);
    cfg_json_free(root);
    return st;
}

/* Opens a checkpoint for reading; a .tmp file (a save that did not finish) is refused. */
static sim_status ck_open(const char *path, int *fd)
{
    size_t plen = strlen(path);
    if (plen >= 4 && !strcmp(path + plen - 4, ".tmp"))
        return sim_err(SIM_ERR_INPUT,
                       "checkpoint %s is the temporary file of a save that did not finish; it is never "
                       "loaded: give the step_<n>.safetensors file",
                       path);
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) return sim_err(SIM_ERR_IO, "checkpoint %s: cannot open it (%s)", path, strerror(errno));
    return SIM_OK;
}

sim_status model_checkpoint_load(sim_device *d, const mesh_shape *m, const char *path, model_param *params, int n,
                                 bool opt_state, long long *step)
{
    SIM_ASSERT(little_endian());
    if (opt_state)
        for (int i = 0; i < n; i++)
            for (int k = 0; k < params[i].n_slots; k++)
                if (!params[i].slot[k] || !params[i].slot_name[k])
                    return sim_err(SIM_ERR_INTERNAL, "checkpoint load: '%s' has no storage for optimizer slot %d",
                                   params[i].def.path, k);
    int fd;
    SIM_TRY(ck_open(path, &fd));
    sim_status st = ck_load_checked(d, m, path, fd, params, n, opt_state, step);
    close(fd);
    return st;
}

/* ---------------------------------------------------------------- resume */

sim_status model_checkpoint_step(const char *path, long long *step)
{
    int fd;
    SIM_TRY(ck_open(path, &fd));
    cfg_json *root = NULL;
    uint64_t hlen, data_bytes;
    sim_status st = ck_read_header(fd, path, &root, &hlen, &data_bytes);
    close(fd);
    SIM_TRY(st);
    *step = ck_meta_step(root);
    cfg_json_free(root);
    return *step < 0 ? ck_no_step(path) : SIM_OK;
}

/* n when name is exactly "step_<n>.safetensors" (decimal, no sign, at most
 * 18 digits), else -1. */
static long long ck_name_step(const char *name)
{
    static const char pre[] = "step_", suf[] = ".safetensors";
    if (strncmp(name, pre, sizeof pre - 1)) return -1;
    const char *d = name + sizeof pre - 1, *e = d;
    long long v = 0;
    while (*e >= '0' && *e <= '9' && e - d < 18) v = v * 10 + (*e++ - '0');
    return e > d && !strcmp(e, suf) ? v : -1;
}

sim_status model_checkpoint_latest(const char *dir, char *path, size_t cap, long long *step, int *stale)
{
    *step = -1;
    *stale = 0;
    if (cap) path[0] = '\0';
    DIR *dh = opendir(dir);
    if (!dh) {
        if (errno == ENOENT) return SIM_OK; /* a new run: nothing to resume */
        return sim_err(SIM_ERR_IO, "checkpoint_dir=%s: cannot list it (%s)", dir, strerror(errno));
    }
    long long best = -1;
    struct dirent *e;
    while ((e = readdir(dh))) {
        size_t len = strlen(e->d_name);
        static const char tmp[] = ".safetensors.tmp";
        if (len > sizeof tmp - 1 && !strcmp(e->d_name + len - (sizeof tmp - 1), tmp)) (*stale)++;
        long long n = ck_name_step(e->d_name);
        if (n > best) best = n;
    }
    closedir(dh);
    if (best < 0) return SIM_OK;
    SIM_TRY(model_checkpoint_path(dir, best, path, cap));
    long long held;
    sim_status st = model_checkpoint_step(path, &held);
    if (st == SIM_OK && held != best)
        st = sim_err(SIM_ERR_INPUT,
                     "checkpoint %s is named step %lld but its __metadata__ says step %lld; it was "
                     "renamed or not written by shardsim: move it out of checkpoint_dir",
                     path, best, held);
    if (st != SIM_OK) {
        sim_err_append("; it is the latest checkpoint of checkpoint_dir=%s, which this run would resume from (set "
                       "enable_checkpointing=false or another checkpoint_dir to start over)",
                       dir);
        return st;
    }
    *step = best;
    return SIM_OK;
}

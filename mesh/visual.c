/* visual.c — the device-grid picture of a sharding.
 *
 * A grid is drawn over at most two dims: for rank 1 and 2 the array's own
 * dims; for rank >= 3 the (at most two) sharded dims, the others being whole
 * on every device.  The grid is to scale, as jax.debug.visualize_array_sharding
 * draws it: its width and height follow the two dims' sizes (a text line is
 * about twice as tall as a character is wide), within 80 columns and 12
 * lines, and every cell is wide and tall enough for its device label.  With more than two sharded dims
 * no flat picture exists; the blocks are listed instead, each with its index
 * ranges and the devices that hold it. */
#include "mesh/visual.h"

#include <stdlib.h>
#include <string.h>

/* "0-3,8-11" for a sorted device list. */
static void format_devices(const int *dev, int n, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len < cap;) {
        int j = i;
        while (j + 1 < n && dev[j + 1] == dev[j] + 1) j++;
        if (j - i >= 2) len += (size_t)snprintf(buf + len, cap - len, "%s%d-%d", i ? "," : "", dev[i], dev[j]);
        else
            for (int x = i; x <= j && len < cap; x++)
                len += (size_t)snprintf(buf + len, cap - len, "%s%d", x ? "," : "", dev[x]);
        i = j + 1;
    }
}

static void rule(FILE *f, int64_t cols, size_t width)
{
    for (int64_t c = 0; c < cols; c++) {
        fputc('+', f);
        for (size_t i = 0; i < width; i++) fputc('-', f);
    }
    fprintf(f, "+\n");
}

static void print_shape(FILE *f, int rank, const int64_t *shape)
{
    fputc('(', f);
    for (int i = 0; i < rank; i++) fprintf(f, "%s%lld", i ? ", " : "", (long long)shape[i]);
    fprintf(f, "%s)", rank == 1 ? "," : "");
}

/* The grid over dims dr (rows; -1: one row) and dc (columns; -1: one column). */
static void draw_grid(FILE *f, const mesh_shape *m, const mesh_spec *s, const int64_t *shape, int dr, int dc)
{
    int64_t rows = dr >= 0 ? mesh_spec_dim_shards(s, m, dr) : 1;
    int64_t cols = dc >= 0 ? mesh_spec_dim_shards(s, m, dc) : 1;
    int64_t ncell = rows * cols;
    int *count = calloc((size_t)ncell, sizeof *count);
    int *devs = calloc((size_t)ncell * (size_t)m->num_devices, sizeof *devs);
    if (!count || !devs) {
        fprintf(f, "(no picture: out of host memory)\n");
        free(count);
        free(devs);
        return;
    }
    for (int d = 0; d < m->num_devices; d++) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(s, m, shape, d, sh);
        int64_t r = dr >= 0 ? sh[dr].block : 0, c = dc >= 0 ? sh[dc].block : 0, cell = r * cols + c;
        devs[cell * m->num_devices + count[cell]++] = d;
    }
    char label[256];
    size_t width = 4;
    for (int64_t c = 0; c < ncell; c++) {
        format_devices(devs + c * m->num_devices, count[c], label, sizeof label);
        if (strlen(label) + 2 > width) width = strlen(label) + 2;
    }
    /* to scale: total width : total height = columns extent : rows extent,
     * a text line counting as two characters; at most 80 columns and 12
     * lines, as wide as the labels need (a 1-D array is one strip) */
    double ext_r = dr >= 0 ? (double)shape[dr] : 0.0, ext_c = dc >= 0 ? (double)shape[dc] : 1.0;
    double q = ext_r / ext_c / 2.0; /* lines per column */
    double total_w = 80.0, total_h = total_w * q;
    if (total_h > 12.0) {
        total_h = 12.0;
        total_w = total_h / q;
    }
    double inner = total_w - (double)(cols + 1); /* less the cell borders */
    if (inner > (double)((size_t)cols * width)) width = (size_t)(inner / (double)cols);
    int height = dr >= 0 ? (int)(total_h / (double)rows + 0.5) : 1; /* text lines per cell */
    if (height < 1) height = 1;
    for (int64_t r = 0; r < rows; r++) {
        rule(f, cols, width);
        for (int line = 0; line < height; line++) {
            for (int64_t c = 0; c < cols; c++) {
                if (line == (height - 1) / 2) {
                    format_devices(devs + (r * cols + c) * m->num_devices, count[r * cols + c], label, sizeof label);
                } else {
                    label[0] = '\0';
                }
                size_t pad = width - strlen(label), left = pad / 2;
                fprintf(f, "|%*s%s%*s", (int)left, "", label, (int)(pad - left), "");
            }
            fprintf(f, "|\n");
        }
    }
    rule(f, cols, width);
    free(count);
    free(devs);
}

/* More than two sharded dims: each distinct block, its index ranges and its devices. */
static void list_blocks(FILE *f, const mesh_shape *m, const mesh_spec *s, int rank, const int64_t *shape)
{
    int n = m->num_devices;
    int *order = malloc((size_t)n * sizeof *order);
    mesh_dim_shard(*sh)[MESH_SPEC_MAX_RANK] = malloc((size_t)n * sizeof *sh);
    if (!order || !sh) {
        fprintf(f, "(no listing: out of host memory)\n");
        free(order);
        free(sh);
        return;
    }
    for (int d = 0; d < n; d++) mesh_spec_shard(s, m, shape, d, sh[d]);
    fprintf(f, "more than two dims are sharded: one line per block (index ranges per dim; the devices holding it)\n");
    int *used = calloc((size_t)n, sizeof *used);
    for (int d = 0; d < n && used; d++) {
        if (used[d]) continue;
        int k = 0;
        for (int e = d; e < n; e++) {
            int same = 1;
            for (int i = 0; i < rank && same; i++) same = sh[e][i].block == sh[d][i].block;
            if (same) {
                used[e] = 1;
                order[k++] = e;
            }
        }
        char devs[512];
        format_devices(order, k, devs, sizeof devs);
        fprintf(f, "  [");
        for (int i = 0; i < rank; i++) {
            if (sh[d][i].nshards == 1) fprintf(f, "%s:", i ? ", " : "");
            else
                fprintf(f, "%s%lld:%lld", i ? ", " : "", (long long)sh[d][i].offset,
                        (long long)(sh[d][i].offset + sh[d][i].local));
        }
        fprintf(f, "]  devices %s\n", devs);
    }
    free(used);
    free(order);
    free(sh);
}

void mesh_visualize(FILE *f, const mesh_shape *m, const mesh_spec *s, int rank, const int64_t *shape)
{
    char spec[256];
    mesh_spec_format(s, m, spec, sizeof spec);
    fprintf(f, "%s on shape ", spec);
    print_shape(f, rank, shape);
    if (rank == 0) {
        fprintf(f, ": a scalar, on every device\n");
        return;
    }
    int sharded[MESH_SPEC_MAX_RANK], ns = 0;
    for (int i = 0; i < rank; i++)
        if (mesh_spec_dim_shards(s, m, i) > 1) sharded[ns++] = i;
    fprintf(f, ": blocks of ");
    int64_t local[MESH_SPEC_MAX_RANK];
    mesh_spec_local_shape(s, m, shape, local);
    print_shape(f, rank, local);
    int dr, dc;
    if (rank <= 2) {
        dr = rank == 2 ? 0 : -1;
        dc = rank - 1;
    } else if (ns <= 2) {
        dr = ns == 2 ? sharded[0] : -1;
        dc = ns >= 1 ? sharded[ns - 1] : -1;
    } else {
        fprintf(f, "\n");
        list_blocks(f, m, s, rank, shape);
        dr = dc = -2;
    }
    if (dc != -2) {
        int64_t rows = dr >= 0 ? mesh_spec_dim_shards(s, m, dr) : 1,
                cols = dc >= 0 ? mesh_spec_dim_shards(s, m, dc) : 1;
        fprintf(f, ", %lld x %lld\n", (long long)rows, (long long)cols);
        if (rank > 2) {
            if (ns == 0) fprintf(f, "no dim is sharded: every device holds the whole array\n");
            else if (ns == 1)
                fprintf(f, "columns: dim %d (the only sharded dim); the other dims are whole on every device\n", dc);
            else
                fprintf(f,
                        "rows: dim %d, columns: dim %d (the sharded dims); the other dims are whole on every device\n",
                        dr, dc);
        }
        draw_grid(f, m, s, shape, dr, dc);
    }
    if (s->partial) {
        fprintf(f, "partial sums over:");
        for (int a = 0; a < m->n_axes; a++)
            if (s->partial & (1u << a)) fprintf(f, " %s", m->names[a]);
        fprintf(f, " (each cell's devices hold addends that sum to the block)\n");
    }
}

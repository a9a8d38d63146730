/* visual.c — the device-grid picture of a sharding. */
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
        if (j - i >= 2)
            len += (size_t)snprintf(buf + len, cap - len, "%s%d-%d", i ? "," : "", dev[i], dev[j]);
        else
            for (int x = i; x <= j && len < cap; x++) len += (size_t)snprintf(buf + len, cap - len, "%s%d", x ? "," : "", dev[x]);
        i = j + 1;
    }
}

void mesh_visualize(FILE *f, const mesh_shape *m, const mesh_spec *s, int rank, const int64_t *shape)
{
    char spec[256];
    mesh_spec_format(s, m, spec, sizeof spec);
    if (rank < 1 || rank > 2) {
        fprintf(f, "%s (rank %d: no grid drawn)\n", spec, rank);
        return;
    }
    int64_t rows = rank == 2 ? mesh_spec_dim_shards(s, m, 0) : 1;
    int64_t cols = mesh_spec_dim_shards(s, m, rank - 1);
    int64_t ncell = rows * cols;
    int *count = calloc((size_t)ncell, sizeof *count);
    int *devs = calloc((size_t)ncell * (size_t)m->num_devices, sizeof *devs);
    for (int d = 0; d < m->num_devices; d++) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(s, m, shape, d, sh);
        int64_t r = rank == 2 ? sh[0].block : 0, c = sh[rank - 1].block, cell = r * cols + c;
        devs[cell * m->num_devices + count[cell]++] = d;
    }
    char label[256];
    size_t width = 4;
    for (int64_t c = 0; c < ncell; c++) {
        format_devices(devs + c * m->num_devices, count[c], label, sizeof label);
        if (strlen(label) + 2 > width) width = strlen(label) + 2;
    }
    int64_t lr = rank == 2 ? shape[0] / rows : 1, lc = shape[rank - 1] / cols;
    fprintf(f, "%s on shape (", spec);
    for (int i = 0; i < rank; i++) fprintf(f, "%s%lld", i ? ", " : "", (long long)shape[i]);
    fprintf(f, "): %lld x %lld blocks of (", (long long)rows, (long long)cols);
    if (rank == 2) fprintf(f, "%lld, ", (long long)lr);
    fprintf(f, "%lld)\n", (long long)lc);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            fputc('+', f);
            for (size_t i = 0; i < width; i++) fputc('-', f);
        }
        fprintf(f, "+\n");
        for (int64_t c = 0; c < cols; c++) {
            format_devices(devs + (r * cols + c) * m->num_devices, count[r * cols + c], label, sizeof label);
            size_t pad = width - strlen(label), left = pad / 2;
            fprintf(f, "|%*s%s%*s", (int)left, "", label, (int)(pad - left), "");
        }
        fprintf(f, "|\n");
    }
    for (int64_t c = 0; c < cols; c++) {
        fputc('+', f);
        for (size_t i = 0; i < width; i++) fputc('-', f);
    }
    fprintf(f, "+\n");
    if (s->partial) {
        fprintf(f, "partial sums over:");
        for (int a = 0; a < m->n_axes; a++)
            if (s->partial & (1u << a)) fprintf(f, " %s", m->names[a]);
        fprintf(f, " (each cell's devices hold addends that sum to the block)\n");
    }
    free(count);
    free(devs);
}

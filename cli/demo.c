/* demo.c — the built-in jobs.
 * `shardsim demo` (the README's main job): trains a small Llama on 8
 * simulated devices under a mixed mesh (data=2, fsdp=2, tensor=2), showing
 * the falling losses and the traffic and memory tables, then checks parity
 * of three steps against the 1-device run.
 * `shardsim collectives`: runs every collective on the same mesh with real
 * data, checks each result against its definition, and prints what each
 * device sent next to the formula. */
#include "cli/cli.h"
#include "cli/common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/collectives.h"
#include "sim/xrank.h"

enum { DEMO_N = 1 << 18 }; /* floats per device buffer: 1 MiB */

typedef struct {
    int bad[SIM_MAX_DEVICES]; /* result mismatches seen per device */
} demo_state;

static float demo_val(int dev, size_t i) { return (float)((dev * 7 + (int)(i % 1000)) % 97); }

static sim_status demo_device(sim_device *d, void *arg)
{
    demo_state *ds = arg;
    int id = sim_device_id(d);
    sim_arena *a = sim_device_arena(d);
    float *x, *y;
    SIM_TRY(sim_arena_alloc(a, DEMO_N * sizeof(float), SIM_MEM_ACTIVATIONS, "demo/x", false, (void **)&x));
    SIM_TRY(sim_arena_alloc(a, 8 * (size_t)DEMO_N * sizeof(float), SIM_MEM_COMM, "demo/y", false, (void **)&y));
    for (size_t i = 0; i < DEMO_N; i++) x[i] = demo_val(id, i);
    sim_axes fsdp = sim_axes_1(1), data_fsdp = sim_axes_2(0, 1), data = sim_axes_1(0), tensor = sim_axes_1(2);
    int bad = 0;

    SIM_TRY(sim_all_gather(d, x, y, DEMO_N / 4, SIM_F32, fsdp, sim_meta_tag("demo/all-gather")));
    for (int q = 0; q < 2; q++) { /* block q came from the device with fsdp = q */
        int peer = sim_device_group_member(d, fsdp, q);
        for (size_t i = 0; i < DEMO_N / 4; i += 997) bad += y[(size_t)q * DEMO_N / 4 + i] != demo_val(peer, i);
    }
    SIM_TRY(sim_reduce_scatter(d, x, y, DEMO_N, SIM_F32, data_fsdp, sim_meta_tag("demo/reduce-scatter")));
    SIM_TRY(sim_all_reduce(d, x, y, DEMO_N, SIM_F32, data, sim_meta_tag("demo/all-reduce")));
    for (size_t i = 0; i < DEMO_N; i += 991) {
        float s = 0;
        for (int q = 0; q < 2; q++) s += demo_val(sim_device_group_member(d, data, q), i);
        bad += y[i] != s;
    }
    SIM_TRY(sim_all_to_all(d, x, y, DEMO_N, SIM_F32, tensor, sim_meta_tag("demo/all-to-all")));
    int perm[2] = {1, 0};
    SIM_TRY(sim_ppermute(d, x, y, DEMO_N / 2, perm, SIM_F32, fsdp, sim_meta_tag("demo/ppermute")));
    /* ragged: rank r sends (r + 2q + 1) * 1024 elements to rank q of (fsdp, tensor) */
    sim_axes ft = sim_axes_2(1, 2);
    int r = sim_device_group_rank(d, ft);
    size_t so[4], sn[4], ro[4], rn[4], st = 0, rt = 0;
    for (int q = 0; q < 4; q++) {
        sn[q] = (size_t)(r + 2 * q + 1) * 1024;
        rn[q] = (size_t)(q + 2 * r + 1) * 1024;
        so[q] = st;
        ro[q] = rt;
        st += sn[q];
        rt += rn[q];
    }
    SIM_TRY(sim_ragged_all_to_all(d, x, y, 8 * (size_t)DEMO_N, so, sn, ro, rn, SIM_F32, ft,
                                  sim_meta_tag("demo/ragged-all-to-all")));
    ds->bad[id] = bad;
    sim_arena_release(a, y, 8 * (size_t)DEMO_N * sizeof(float), SIM_MEM_COMM);
    sim_arena_release(a, x, DEMO_N * sizeof(float), SIM_MEM_ACTIVATIONS);
    return SIM_OK;
}

int cli_collectives_demo(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const char *names[] = {"data", "fsdp", "tensor"};
    int sizes[] = {2, 2, 2};
    sim_mesh_desc md;
    sim_machine *m = NULL;
    sim_machine_opts o = {0};
    o.pin_threads = true;
    if (sim_mesh_desc_make(3, names, sizes, &md) || sim_machine_new(&md, &o, &m)) {
        fprintf(stderr, "shardsim: %s\n", sim_errmsg());
        return 1;
    }
    printf("shardsim demo: counted collectives on 8 simulated devices, mesh data=2 fsdp=2 tensor=2\n");
    printf("each device holds a %d KiB float32 buffer; results checked against their definitions\n\n",
           (int)(DEMO_N * sizeof(float) / 1024));
    demo_state ds;
    memset(&ds, 0, sizeof ds);
    uint64_t t0 = sim_now_ns();
    sim_status st = sim_machine_run(m, demo_device, &ds);
    double secs = (double)(sim_now_ns() - t0) / 1e9;
    if (st != SIM_OK) {
        fprintf(stderr, "shardsim: %s\n", sim_errmsg());
        sim_machine_free(m);
        return sim_status_exit_code(st);
    }
    int bad = 0;
    for (int i = 0; i < 8; i++) bad += ds.bad[i];
    uint64_t worst = (uint64_t)bad; /* under mpirun each rank checked its own devices */
    if (sim_xrank_max_u64(&worst) == SIM_OK) bad = (int)worst;
    size_t nrec;
    const sim_record *rec = sim_device_records(sim_machine_device(m, 0), &nrec);
    printf("%-18s %-16s %5s %14s %14s  %s\n", "op", "axes", "k", "sent/dev (B)", "formula (B)", "formula");
    for (size_t i = 0; i < nrec; i++) {
        const sim_record *r = &rec[i];
        char ax[64];
        uint64_t k = (uint64_t)r->group_size, e = 4, n = r->elements * e, want = 0;
        const char *f = "";
        switch (r->op) {
        case SIM_OP_ALL_GATHER:
            want = (k - 1) * n;
            f = "(k-1)*s";
            break;
        case SIM_OP_REDUCE_SCATTER:
            want = (k - 1) * n / k;
            f = "(k-1)*n/k";
            break;
        case SIM_OP_ALL_REDUCE:
            want = 2 * (k - 1) * n / k;
            f = "2(k-1)*n/k";
            break;
        case SIM_OP_ALL_TO_ALL:
            want = (k - 1) * n / k;
            f = "(k-1)*n/k";
            break;
        case SIM_OP_PPERMUTE:
            want = n;
            f = "n (peer is another device)";
            break;
        case SIM_OP_RAGGED_ALL_TO_ALL: /* device 0 is rank 0: it sends (2q+1)*1024 to rank q */
            for (uint64_t q = 1; q < k; q++) want += (2 * q + 1) * 1024 * e;
            f = "sum sent to other devices";
            break;
        default: break;
        }
        printf("%-18s %-16s %5d %14llu %14llu  %s%s\n", sim_op_name(r->op),
               sim_axes_label(sim_machine_mesh(m), r->axes, ax, sizeof ax), r->group_size,
               (unsigned long long)r->bytes_sent, (unsigned long long)want, f,
               r->bytes_sent == want ? "" : "  MISMATCH");
        bad += r->bytes_sent != want;
    }
    printf("\n%s in %.3f s; %d wrong values or byte counts\n", bad ? "FAILED" : "all collectives correct", secs, bad);
    sim_machine_free(m);
    return bad ? 1 : 0;
}

/* The demo's model is configs/small.yml (data, not code). */
static const char *small_yml(void)
{
    static char path[4096 + 16];
    snprintf(path, sizeof path, "%s/small.yml", cli_configs_dir());
    return path;
}

int cli_demo(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const char *train[8];
    int n = 0;
    train[n++] = small_yml();
    train[n++] = "ici_data_parallelism=2";
    train[n++] = "ici_fsdp_parallelism=2";
    train[n++] = "ici_tensor_parallelism=2";
    train[n++] = "per_device_batch_size=2";
    train[n++] = "steps=30";
    printf("== 1. train a small Llama (GQA, SwiGLU, RoPE) on 8 simulated devices: data=2 fsdp=2 tensor=2\n\n");
    fflush(stdout);
    int rc = cli_train(n, (char **)train, stdout, stderr);
    if (rc) return rc;
    const char *par[4];
    n = 0;
    par[n++] = small_yml();
    par[n++] = "per_device_batch_size=16";
    par[n++] = "steps=3";
    par[n++] = "configs=ici_fsdp_parallelism=1;ici_data_parallelism=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2;"
               "ici_data_parallelism=2 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 shard_mode=explicit";
    printf("\n== 2. parity: the same model and tokens on 1 device and on the 8-device mesh (auto and explicit)\n\n");
    fflush(stdout);
    return cli_cmd_parity(n, (char **)par, stdout, stderr);
}

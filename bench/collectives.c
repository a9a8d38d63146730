/* collectives.c — collective bandwidth on the simulated machine.
 *
 * For each op, group size k in {2, 4, 8, 64} (a 1-D mesh of k devices) and
 * per-device buffer size S from 4 KiB to 64 MiB (S is the larger of the
 * input and output buffer of one device), it reports, nccl-tests style:
 * time per call, bytes each device sent to others, the aggregate copy
 * bandwidth (bytes moved between devices by all devices / time), and that
 * bandwidth over the memcpy bandwidth of all cores measured in the same run.
 * Every configuration's result is checked before it is timed.
 *
 * Target: all-gather and all-to-all of 64 MiB over 8 devices reach
 * at least 0.5 of the memcpy bandwidth.
 *
 * Over 64 devices the sizes stop at 4 MiB by default (64 devices x 2
 * buffers x 64 MiB would hold 8 GiB and take minutes); --full runs them
 * all, --quick stops every group at 4 MiB. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/lib/bench_host.h"
#include "sim/collectives.h"
#include "sim/topology.h"

enum { NOPS = 6 };
static const sim_op OPS[NOPS] = {SIM_OP_ALL_GATHER, SIM_OP_REDUCE_SCATTER, SIM_OP_ALL_REDUCE,
                                 SIM_OP_ALL_TO_ALL, SIM_OP_PPERMUTE,       SIM_OP_RAGGED_ALL_TO_ALL};

typedef struct {
    sim_op op;
    size_t S; /* bytes per device buffer */
    int iters;
    int k;
    uint64_t ns;    /* measured by device 0 */
    uint64_t moved; /* bytes received from other devices, all devices, one call */
    uint64_t sent0; /* bytes device 0 sent, one call */
    int wrong;
} bench_case;

static sim_status one_call(sim_device *d, bench_case *bc, float *x, float *y, size_t *cnt)
{
    int k = bc->k;
    size_t n = bc->S / sizeof(float);
    sim_axes ax = sim_axes_1(0);
    sim_meta mt = sim_meta_tag("bench");
    switch (bc->op) {
    case SIM_OP_ALL_GATHER: return sim_all_gather(d, x, y, n / (size_t)k, SIM_F32, ax, mt);
    case SIM_OP_REDUCE_SCATTER: return sim_reduce_scatter(d, x, y, n, SIM_F32, ax, mt);
    case SIM_OP_ALL_REDUCE: return sim_all_reduce(d, x, y, n, SIM_F32, ax, mt);
    case SIM_OP_ALL_TO_ALL: return sim_all_to_all(d, x, y, n, SIM_F32, ax, mt);
    case SIM_OP_PPERMUTE: {
        int perm[64];
        for (int q = 0; q < k; q++) perm[q] = (q + 1) % k;
        return sim_ppermute(d, x, y, n, perm, SIM_F32, ax, mt);
    }
    case SIM_OP_RAGGED_ALL_TO_ALL: { /* uneven: rank r sends (n/k)*((r+q)%3+1)/3 to rank q */
        size_t *so = cnt, *sn = cnt + k, *ro = cnt + 2 * k, *rn = cnt + 3 * k;
        int r = sim_device_group_rank(d, ax);
        size_t s = 0, rr = 0;
        for (int q = 0; q < k; q++) {
            sn[q] = n / (size_t)k * (size_t)((r + q) % 3 + 1) / 3;
            so[q] = s;
            s += sn[q];
            rn[q] = n / (size_t)k * (size_t)((q + r) % 3 + 1) / 3;
            ro[q] = rr;
            rr += rn[q];
        }
        return sim_ragged_all_to_all(d, x, y, n, so, sn, ro, rn, SIM_F32, ax, mt);
    }
    default: return SIM_ERR_INTERNAL;
    }
}

static sim_status bench_device(sim_device *d, void *arg)
{
    bench_case *bc = arg;
    size_t n = bc->S / sizeof(float);
    float *x = NULL, *y = NULL;
    size_t cnt[4 * 64];
    SIM_TRY(sim_arena_alloc(sim_device_arena(d), bc->S, SIM_MEM_COMM, "x", false, (void **)&x));
    SIM_TRY(sim_arena_alloc(sim_device_arena(d), bc->S, SIM_MEM_COMM, "y", false, (void **)&y));
    int id = sim_device_id(d), k = bc->k;
    for (size_t i = 0; i < n; i++) x[i] = (float)((id + 1) * ((int)i % 64));
    sim_device_clear_records(d);
    SIM_TRY(one_call(d, bc, x, y, cnt)); /* checked call */
    int wrong = 0;
    if (bc->op == SIM_OP_ALL_GATHER) {
        size_t c = n / (size_t)k;
        for (int q = 0; q < k; q++)
            for (size_t i = 0; i < c; i += 61) wrong += y[(size_t)q * c + i] != (float)((q + 1) * ((int)i % 64));
    } else if (bc->op == SIM_OP_ALL_REDUCE) {
        for (size_t i = 0; i < n; i += 61) wrong += y[i] != (float)(k * (k + 1) / 2 * ((int)i % 64));
    } else if (bc->op == SIM_OP_ALL_TO_ALL) {
        size_t c = n / (size_t)k;
        for (int q = 0; q < k; q++)
            for (size_t i = 0; i < c; i += 61)
                wrong += y[(size_t)q * c + i] != (float)((q + 1) * ((int)((size_t)id * c + i) % 64));
    }
    size_t nr;
    const sim_record *rec = sim_device_records(d, &nr);
    __atomic_add_fetch(&bc->moved, rec[0].bytes_recv, __ATOMIC_RELAXED);
    __atomic_add_fetch(&bc->wrong, wrong, __ATOMIC_RELAXED);
    if (id == 0) bc->sent0 = rec[0].bytes_sent;
    SIM_TRY(sim_device_barrier(d));
    uint64_t t0 = sim_now_ns();
    for (int it = 0; it < bc->iters; it++) SIM_TRY(one_call(d, bc, x, y, cnt));
    SIM_TRY(sim_device_barrier(d));
    if (id == 0) bc->ns = (sim_now_ns() - t0) / (uint64_t)bc->iters;
    sim_device_clear_records(d);
    sim_arena_release(sim_device_arena(d), y, bc->S, SIM_MEM_COMM);
    sim_arena_release(sim_device_arena(d), x, bc->S, SIM_MEM_COMM);
    return SIM_OK;
}

/* ------------------------------------------------------------ memcpy roofline */

typedef struct {
    size_t bytes;
    int reps;
    char *a, *b;
} mc_arg;

static void *mc_thread(void *p)
{
    mc_arg *a = p;
    for (int r = 0; r < a->reps; r++) memcpy(a->b, a->a, a->bytes);
    return NULL;
}

/* Aggregate memcpy GB/s of `threads` threads each copying `bytes`. */
static double memcpy_bw(int threads, size_t bytes, int reps)
{
    pthread_t th[64];
    mc_arg args[64];
    for (int t = 0; t < threads; t++) {
        args[t].bytes = bytes;
        args[t].reps = reps;
        args[t].a = malloc(bytes);
        args[t].b = malloc(bytes);
        memset(args[t].a, t + 1, bytes);
        memset(args[t].b, 0, bytes);
    }
    uint64_t t0 = sim_now_ns();
    for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, mc_thread, &args[t]);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    double secs = (double)(sim_now_ns() - t0) / 1e9;
    for (int t = 0; t < threads; t++) {
        free(args[t].a);
        free(args[t].b);
    }
    return (double)bytes * reps * threads / secs / 1e9;
}

int main(int argc, char **argv)
{
    bench_host_print(stdout);
    int quick = argc > 1 && !strcmp(argv[1], "--quick"), full = argc > 1 && !strcmp(argv[1], "--full");
    if (argc > 2 || (argc > 1 && !quick && !full)) {
        fprintf(stderr, "collectives: unknown argument '%s'; usage: collectives [--quick|--full]\n", argv[argc - 1]);
        return 2;
    }
    int cores = sim_topology_cores();
    memcpy_bw(cores, 64u << 20, 1); /* warm up */
    double mc = memcpy_bw(cores, 64u << 20, 4);
    printf("memcpy bandwidth, %d threads x 64 MiB: %.2f GB/s (aggregate)\n\n", cores, mc);
    printf("%-18s %4s %10s %12s %14s %12s %8s %6s\n", "op", "k", "size(B)", "time(us)", "sent/dev(B)", "copy GB/s",
           "/memcpy", "#wrong");
    static const int ks[] = {2, 4, 8, 64};
    double ag8 = 0, a2a8 = 0;
    int total_wrong = 0;
    for (size_t ki = 0; ki < 4; ki++) {
        int k = ks[ki];
        const char *names[] = {"x"};
        sim_mesh_desc md;
        sim_machine *m;
        sim_machine_opts o = {0};
        o.pin_threads = true;
        o.quiet = true;
        if (sim_mesh_desc_make(1, names, &k, &md) || sim_machine_new(&md, &o, &m)) {
            fprintf(stderr, "%s\n", sim_errmsg());
            return 1;
        }
        for (int oi = 0; oi < NOPS; oi++) {
            for (size_t S = 4096; S <= (64u << 20); S *= 4) {
                if ((quick || (k > 8 && !full)) && S > (4u << 20)) break;
                if ((S / 4) % (size_t)k) continue;
                bench_case bc = {0};
                bc.op = OPS[oi];
                bc.S = S;
                bc.k = k;
                double work = (double)S * k;
                bc.iters = work < 1e6 ? 200 : work < 64e6 ? 20 : work < 1e9 ? 3 : 1;
                if (sim_machine_run(m, bench_device, &bc) != SIM_OK) {
                    fprintf(stderr, "%s\n", sim_errmsg());
                    return 1;
                }
                double secs = (double)bc.ns / 1e9, bw = (double)bc.moved / secs / 1e9;
                printf("%-18s %4d %10zu %12.1f %14llu %12.2f %8.2f %6d\n", sim_op_name(bc.op), k, S, secs * 1e6,
                       (unsigned long long)bc.sent0, bw, bw / mc, bc.wrong);
                total_wrong += bc.wrong;
                if (k == 8 && S == (64u << 20) && bc.op == SIM_OP_ALL_GATHER) ag8 = bw / mc;
                if (k == 8 && S == (64u << 20) && bc.op == SIM_OP_ALL_TO_ALL) a2a8 = bw / mc;
            }
        }
        sim_machine_free(m);
    }
    printf("\ntarget: 64 MiB over 8 devices >= 0.50 of memcpy bandwidth: all-gather %.2f, all-to-all %.2f%s\n", ag8,
           a2a8, quick ? " (skipped in --quick)" : "");
    printf("wrong values: %d\n", total_wrong);
    return total_wrong ? 1 : 0;
}

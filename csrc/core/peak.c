/* The compute roofline the benchmark sets its rows against: the FP32 FMA
 * peak of the active instruction set on the thread pool, measured where the
 * code runs (a VM's cores run at whatever clock they are given, and a table
 * of nominal figures would not know). Each thread runs the kernels'
 * fma_burn: independent chains of vector FMAs on registers, nothing else. */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "core/core.h"

typedef struct {
    const attnx_kernels *kt;
    int64_t rounds;
    double flops[ATTNX_MAX_THREADS];
    float sink[ATTNX_MAX_THREADS];
} peak_job;

static double seconds_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void burn_item(void *arg, int tid, int64_t i)
{
    (void)tid;
    peak_job *j = arg;
    j->flops[i] = j->kt->fma_burn(j->rounds, &j->sink[i]);
}

double attnx_fma_peak(int num_threads, double seconds)
{
    int nt = num_threads > 0 ? num_threads : attnx_get_num_threads();
    if (nt > ATTNX_MAX_THREADS) nt = ATTNX_MAX_THREADS;
    if (!(seconds > 0.0)) seconds = 0.1;
    peak_job j; /* 3 KB */
    j.kt = attnx_active_kernels();
    /* calibrate on this thread: rounds that take about a third of the time */
    j.rounds = 1 << 12;
    double dt;
    for (;;) {
        const double t0 = seconds_now();
        j.kt->fma_burn(j.rounds, &j.sink[0]);
        dt = seconds_now() - t0;
        if (dt > 1e-3 || j.rounds > ((int64_t)1 << 40)) break;
        j.rounds *= 4;
    }
    j.rounds = (int64_t)((double)j.rounds * (seconds / 3.0) / (dt > 0.0 ? dt : 1e-9)) + 1;
    double best = 0.0; /* the best of three runs: a descheduled thread only lowers one */
    for (int run = 0; run < 3; run++) {
        const double t0 = seconds_now();
        attnx_parallel_items(nt, nt, burn_item, &j);
        const double t = seconds_now() - t0;
        double flops = 0.0;
        for (int i = 0; i < nt; i++) flops += j.flops[i];
        if (t > 0.0 && flops / t > best) best = flops / t;
    }
    return best / 1e9;
}

/* The compute rooflines the benchmark sets its rows against: the peaks of
 * the active kernels' units (FP32 FMAs, bfloat16 dot products, tiles) on the
 * thread pool, measured where the code runs (a VM's cores run at whatever
 * clock they are given, and a table of nominal figures would not know).
 * Each thread runs the unit's burn kernel (kernels.h: fma_burn,
 * bf16dot_burn, amx_burn): independent chains of the unit's instruction on
 * registers (tiles), nothing else. */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "core/core.h"

typedef double (*burn_fn)(int64_t rounds, float *sink);

/* The units, in attnx.h's order: their names and where their kernels sit. */
static const struct {
    const char *name;
    size_t burn; /* offset of the burn kernel in attnx_kernels */
} units[ATTNX_PEAK_UNITS] = {
    [ATTNX_PEAK_FMA] = {"fma", offsetof(attnx_kernels, fma_burn)},
    [ATTNX_PEAK_BF16DOT] = {"bf16dot", offsetof(attnx_kernels, bf16dot_burn)},
    [ATTNX_PEAK_AMX] = {"amx", offsetof(attnx_kernels, amx_burn)},
};

typedef struct {
    burn_fn burn;
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
    j->flops[i] = j->burn(j->rounds, &j->sink[i]);
}

const char *attnx_peak_unit_name(int unit)
{
    return unit >= 0 && unit < ATTNX_PEAK_UNITS ? units[unit].name : NULL;
}

double attnx_peak(int unit, int num_threads, double seconds)
{
    if (unit < 0 || unit >= ATTNX_PEAK_UNITS) return 0.0;
    peak_job j; /* 3 KB */
    j.burn = *(const burn_fn *)((const char *)attnx_active_kernels() + units[unit].burn);
    if (!j.burn) return 0.0;
    int nt = num_threads > 0 ? num_threads : attnx_get_num_threads();
    if (nt > ATTNX_MAX_THREADS) nt = ATTNX_MAX_THREADS;
    if (!(seconds > 0.0)) seconds = 0.1;
    /* calibrate on this thread: rounds that take about a third of the time
     * (from one round: a round of the tile unit's model takes ~0.1 ms) */
    j.rounds = 1;
    double dt;
    for (;;) {
        const double t0 = seconds_now();
        j.burn(j.rounds, &j.sink[0]);
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

#define _POSIX_C_SOURCE 200809L
/* attnx_forward() with no Python: min time over repeated calls.
 *   forward L D threads H causal      (B = 1, Lq = Lk = L, float32)
 * REPS=n overrides the number of calls (default: ~30 GFLOP of work). */
#include "attnx.h"
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <time.h>
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(int argc, char **argv)
{
    int L = argc > 1 ? atoi(argv[1]) : 1024, D = argc > 2 ? atoi(argv[2]) : 64,
        T = argc > 3 ? atoi(argv[3]) : 1, H = argc > 4 ? atoi(argv[4]) : 8;
    int causal = argc > 5 ? atoi(argv[5]) : 0;
    size_t n = (size_t)H * L * D;
    float *q = malloc(4 * n), *k = malloc(4 * n), *v = malloc(4 * n), *o = malloc(4 * n);
    for (size_t i = 0; i < n; i++) {
        q[i] = (float)rand() / RAND_MAX - .5f;
        k[i] = (float)rand() / RAND_MAX - .5f;
        v[i] = (float)rand() / RAND_MAX - .5f;
    }
    const attnx_tensor tq = {q, n, (int64_t)L * D, D}, tk = {k, n, (int64_t)L * D, D},
                       tv = {v, n, (int64_t)L * D, D};
    const attnx_problem p = {.B = 1,
                             .Hq = H,
                             .Hk = H,
                             .Lq = L,
                             .Lk = L,
                             .D = D,
                             .Dv = D,
                             .q = tq,
                             .k = tk,
                             .v = tv,
                             .out = {o, n, (int64_t)L * D, D},
                             .scale = 1.0f / sqrtf(D),
                             .num_threads = T,
                             .causal = causal};
    double best = 1e30, fl = 4.0 * H * L * (double)L * D / (causal ? 2 : 1);
    int reps = (int)(3e10 / fl * 1.0);
    if (getenv("REPS")) reps = atoi(getenv("REPS"));
    if (reps < 5) reps = 5;
    if (reps > 20000) reps = 20000;
    for (int r = 0; r < reps; r++) {
        double t = now();
        attnx_forward(&p);
        t = now() - t;
        if (t < best) best = t;
    }
    printf("L=%d D=%d H=%d T=%d causal=%d: best %.1f us  %.1f GFLOP/s\n", L, D, H, T, causal,
           best * 1e6, fl / best / 1e9);
}

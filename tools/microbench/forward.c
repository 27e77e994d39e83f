#define _POSIX_C_SOURCE 200809L
/* attnx_forward() with no Python: min time over repeated calls.
 *   forward L D threads H causal      (B = 1, Lq = Lk = L, float32)
 * REPS=n overrides the number of calls (default: ~30 GFLOP of work).
 * BF16=1: the values are bfloat16 values, and calls on float32 arrays
 * alternate with calls on bfloat16 ones (q flagged q_bf16, k and v as
 * 16-bit k16, v16): the best of each and their ratio.
 * BWD=1: attnx_backward() instead, on the forward's output and lse and a
 * random upstream gradient (10·L²·D flops a head).
 * AB=1: each call twice, float32 on AMX tiles allowed and not (the core's
 * test hook, run.sh builds with ATTNX_TEST_HOOKS), alternated in this one
 * process: the median of each and the median of their ratios, with the
 * quartiles (the same as ATTNX_BF16_DOTS=none where the split is the only
 * difference, without two processes on a drifting machine). */
#include "attnx.h"
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <time.h>
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
extern int attnx_test_no_split; /* core/plan.c, with ATTNX_TEST_HOOKS */

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* AB=1: reps rounds of the call (p's forward or g's backward) with the split
 * and without it; their medians, and the median ratio with its quartiles. */
static int ab(const attnx_problem *p, const attnx_grad_problem *g, int reps, double fl)
{
    double *t[2] = {malloc(sizeof(double) * reps), malloc(sizeof(double) * reps)};
    double *ratio = malloc(sizeof(double) * reps);
    for (int r = 0; r < reps; r++) {
        for (int off = 0; off < 2; off++) {
            attnx_test_no_split = off;
            const double t0 = now();
            if (g)
                attnx_backward(g);
            else
                attnx_forward(p);
            t[off][r] = now() - t0;
        }
        ratio[r] = t[1][r] / t[0][r];
    }
    attnx_test_no_split = 0;
    qsort(t[0], reps, sizeof(double), by_value);
    qsort(t[1], reps, sizeof(double), by_value);
    qsort(ratio, reps, sizeof(double), by_value);
    const attnx_problem *f = g ? &g->f : p;
    printf("%sL=%lld D=%lld H=%lld T=%d causal=%d, %d rounds: tiles %.1f GFLOP/s, FMAs %.1f "
           "(medians); tiles/FMAs %.3fx [%.3f..%.3f]\n",
           g ? "backward " : "", (long long)f->Lq, (long long)f->D, (long long)f->Hq,
           f->num_threads, (int)f->causal, reps, fl / t[0][reps / 2] / 1e9,
           fl / t[1][reps / 2] / 1e9, ratio[reps / 2], ratio[reps / 4], ratio[3 * reps / 4]);
    free(t[0]), free(t[1]), free(ratio);
    return 0;
}

int main(int argc, char **argv)
{
    int L = argc > 1 ? atoi(argv[1]) : 1024, D = argc > 2 ? atoi(argv[2]) : 64,
        T = argc > 3 ? atoi(argv[3]) : 1, H = argc > 4 ? atoi(argv[4]) : 8;
    int causal = argc > 5 ? atoi(argv[5]) : 0;
    size_t n = (size_t)H * L * D;
    float *q = malloc(4 * n), *k = malloc(4 * n), *v = malloc(4 * n), *o = malloc(4 * n);
    const int bf16 = getenv("BF16") && atoi(getenv("BF16"));
    uint16_t *k16 = malloc(2 * n), *v16 = malloc(2 * n);
    for (size_t i = 0; i < n; i++) {
        q[i] = (float)rand() / RAND_MAX - .5f;
        k[i] = (float)rand() / RAND_MAX - .5f;
        v[i] = (float)rand() / RAND_MAX - .5f;
        if (!bf16) continue;
        float *x[3] = {&q[i], &k[i], &v[i]};
        for (int a = 0; a < 3; a++) { /* truncated to bfloat16 */
            uint32_t u;
            memcpy(&u, x[a], 4);
            u &= 0xffff0000u;
            memcpy(x[a], &u, 4);
        }
        uint32_t u;
        memcpy(&u, &k[i], 4);
        k16[i] = (uint16_t)(u >> 16);
        memcpy(&u, &v[i], 4);
        v16[i] = (uint16_t)(u >> 16);
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
    const int bwd = getenv("BWD") && atoi(getenv("BWD"));
    float *lse = malloc(4 * (size_t)H * L), *dout = malloc(4 * n), *dq = malloc(4 * n),
          *dk = malloc(4 * n), *dv = malloc(4 * n);
    for (size_t i = 0; i < n; i++) dout[i] = (float)rand() / RAND_MAX - .5f;
    attnx_problem pl = p;
    pl.lse = (attnx_out_tensor){lse, (int64_t)H * L, L, 1};
    attnx_forward(&pl);
    const attnx_grad_problem g = {.f = p,
                                  .o = {o, n, (int64_t)L * D, D},
                                  .dout = {dout, n, (int64_t)L * D, D},
                                  .lse = {lse, (int64_t)H * L, L, 1},
                                  .dq = {dq, n, (int64_t)L * D, D},
                                  .dk = {dk, n, (int64_t)L * D, D},
                                  .dv = {dv, n, (int64_t)L * D, D}};
    double best = 1e30, fl = (bwd ? 10.0 : 4.0) * H * L * (double)L * D / (causal ? 2 : 1);
    int reps = (int)(3e10 / fl * 1.0);
    if (getenv("REPS")) reps = atoi(getenv("REPS"));
    if (reps < 5) reps = 5;
    if (reps > 20000) reps = 20000;
    attnx_problem p16 = p;
    p16.k16 = (attnx_half_tensor){k16, n, (int64_t)L * D, D};
    p16.v16 = (attnx_half_tensor){v16, n, (int64_t)L * D, D};
    p16.half_format = ATTNX_HALF_BF16;
    p16.q_bf16 = 1;
    double best16 = 1e30;
    if (getenv("AB") && atoi(getenv("AB"))) return ab(bwd ? NULL : &p, bwd ? &g : NULL, reps, fl);
    for (int r = 0; r < reps; r++) {
        double t = now();
        if (bwd)
            attnx_backward(&g);
        else
            attnx_forward(&p);
        t = now() - t;
        if (t < best) best = t;
        if (!bf16) continue;
        t = now();
        attnx_forward(&p16);
        t = now() - t;
        if (t < best16) best16 = t;
    }
    printf("%sL=%d D=%d H=%d T=%d causal=%d: best %.1f us  %.1f GFLOP/s\n", bwd ? "backward " : "",
           L, D, H, T, causal, best * 1e6, fl / best / 1e9);
    if (bf16)
        printf("  bfloat16 (bf16 dots: %s): best %.1f us  %.1f GFLOP/s  %.2fx float32\n",
               attnx_bf16_dots() ? "yes" : "no", best16 * 1e6, fl / best16 / 1e9, best / best16);
}

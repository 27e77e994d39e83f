#define _GNU_SOURCE
/* attnx_forward() decoding with no Python: one query row per query head,
 * Hq = Hk * G (grouped-query attention with G rows a key/value head), float32
 * keys and values (or int8 with a float32 scale a row: INT8=1; bfloat16:
 * BF16=1) read once a call, under precision "highest" (or "medium": MEDIUM=1).
 * Reports the median and best read speed of K and V (and the scales) over
 * the calls.
 *   decode Hk G Lk D threads   (B = 1, Lq = 1)   REPS=n (default 50), HUGE=1, INT8=1, BF16=1,
 * MEDIUM=1 */
#include "attnx.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
/* n bytes, 2 MiB aligned; HUGE=1 asks for transparent huge pages, as NumPy
 * does for large arrays (madvise) */
static float *alloc(size_t n)
{
    const size_t align = (size_t)2 << 20;
    float *p = aligned_alloc(align, (n + align - 1) / align * align);
    if (p && getenv("HUGE") && atoi(getenv("HUGE"))) madvise(p, n, MADV_HUGEPAGE);
    return p;
}
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
int main(int argc, char **argv)
{
    const int Hk = argc > 1 ? atoi(argv[1]) : 8, G = argc > 2 ? atoi(argv[2]) : 4;
    const int Lk = argc > 3 ? atoi(argv[3]) : 32768, D = argc > 4 ? atoi(argv[4]) : 128;
    const int T = argc > 5 ? atoi(argv[5]) : 1, Hq = Hk * G;
    const size_t nkv = (size_t)Hk * Lk * D, nq = (size_t)Hq * D;
    float *q = alloc(4 * nq), *k = alloc(4 * nkv), *v = alloc(4 * nkv), *o = alloc(4 * nq);
    for (size_t i = 0; i < nq; i++) q[i] = (float)rand() / RAND_MAX - .5f;
    for (size_t i = 0; i < nkv; i++) {
        k[i] = (float)rand() / RAND_MAX - .5f;
        v[i] = (float)rand() / RAND_MAX - .5f;
    }
    attnx_problem p = {.B = 1,
                       .Hq = Hq,
                       .Hk = Hk,
                       .Lq = 1,
                       .Lk = Lk,
                       .D = D,
                       .Dv = D,
                       .q = {q, nq, D, D},
                       .k = {k, nkv, (int64_t)Lk * D, D},
                       .v = {v, nkv, (int64_t)Lk * D, D},
                       .out = {o, nq, D, D},
                       .scale = 1.0f / sqrtf(D),
                       .num_threads = T};
    const int int8 = getenv("INT8") && atoi(getenv("INT8"));
    if (int8) {
        const size_t nrow = (size_t)Hk * Lk;
        int8_t *k8 = (int8_t *)alloc(nkv), *v8 = (int8_t *)alloc(nkv);
        float *ks = alloc(4 * nrow), *vs = alloc(4 * nrow);
        for (size_t i = 0; i < nkv; i++) {
            k8[i] = (int8_t)(rand() % 255 - 127);
            v8[i] = (int8_t)(rand() % 255 - 127);
        }
        for (size_t i = 0; i < nrow; i++) ks[i] = vs[i] = 0.5f / 127;
        p.k8 = (attnx_i8_tensor){k8, nkv, (int64_t)Lk * D, D, ks, nrow, Lk, 1};
        p.v8 = (attnx_i8_tensor){v8, nkv, (int64_t)Lk * D, D, vs, nrow, Lk, 1};
    }
    const int bf16 = !int8 && getenv("BF16") && atoi(getenv("BF16"));
    if (bf16) { /* the float32 values cut to their top halves */
        uint16_t *kb = (uint16_t *)alloc(2 * nkv), *vb = (uint16_t *)alloc(2 * nkv);
        for (size_t i = 0; i < nkv; i++) {
            uint32_t a, b;
            memcpy(&a, k + i, 4);
            memcpy(&b, v + i, 4);
            kb[i] = (uint16_t)(a >> 16);
            vb[i] = (uint16_t)(b >> 16);
        }
        p.half_format = ATTNX_HALF_BF16;
        p.k16 = (attnx_half_tensor){kb, (int64_t)nkv, (int64_t)Lk * D, D};
        p.v16 = (attnx_half_tensor){vb, (int64_t)nkv, (int64_t)Lk * D, D};
    }
    if (getenv("MEDIUM") && atoi(getenv("MEDIUM"))) p.precision = ATTNX_PRECISION_MEDIUM;
    const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 50;
    double *t = malloc(sizeof(double) * (size_t)(reps > 0 ? reps : 1));
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        attnx_forward(&p);
        t[r] = now() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, by_value);
    const double bytes = int8   ? 2.0 * (double)nkv + 8.0 * Hk * Lk
                         : bf16 ? 4.0 * (double)nkv
                                : 8.0 * (double)nkv;
    printf("Hk=%d G=%d Lk=%d D=%d T=%d: median %.1f GB/s, best %.1f GB/s\n", Hk, G, Lk, D, T,
           bytes / t[reps / 2] / 1e9, bytes / t[0] / 1e9);
    return 0;
}

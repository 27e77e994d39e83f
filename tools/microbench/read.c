#define _POSIX_C_SOURCE 200809L
/* Read bandwidth: T threads each sum their share of one buffer of BYTES
 * (float32, 4 independent vector sums), the roofline a decoding call is set
 * against (the bench measures the same with torch's sum over K and V).
 *   read BYTES T          median and best GB/s of 30 rounds
 * Whether reading and computing overlap: CFLAGS="-DFMAS=n" adds n FMAs on
 * every 64-byte line read (into 8 accumulators: throughput, not latency),
 * "-DAHEAD=bytes" a prefetcht1 that far ahead of every line, as decoding's.
 * x86-64 with AVX-512, or AVX2 + FMA (the same sums in 256-bit halves). */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static const float *buf;
static size_t n; /* floats, a multiple of 64 a thread */
static int T;
static volatile float sink;
#ifndef FMAS
#define FMAS 0
#endif
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
__attribute__((target("avx512f"))) static void *sum_share(void *arg)
{
    const size_t id = (size_t)arg, lo = n / T * id, hi = n / T * (id + 1);
    __m512 s[4], c[8];
    const __m512 w = _mm512_set1_ps(0.999f);
    for (int a = 0; a < 4; a++) s[a] = _mm512_setzero_ps();
    for (int a = 0; a < 8; a++) c[a] = _mm512_setzero_ps();
    for (size_t i = lo; i < hi; i += 64) {
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) {
#ifdef AHEAD
            _mm_prefetch((const char *)(buf + i + 16 * a) + AHEAD, _MM_HINT_T1);
#endif
            const __m512 x = _mm512_loadu_ps(buf + i + 16 * a);
            s[a] = _mm512_add_ps(s[a], x);
#pragma GCC unroll 64
            for (int f = 0; f < FMAS; f++) c[f % 8] = _mm512_fmadd_ps(c[f % 8], w, x);
        }
    }
    for (int a = 0; a < 8; a++) s[a % 4] = _mm512_add_ps(s[a % 4], c[a]);
    sink =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
    return NULL;
}
/* the same with AVX2: a 64-byte line in two loads */
__attribute__((target("avx2,fma"))) static void *sum_share256(void *arg)
{
    const size_t id = (size_t)arg, lo = n / T * id, hi = n / T * (id + 1);
    __m256 s[4], c[8];
    const __m256 w = _mm256_set1_ps(0.999f);
    for (int a = 0; a < 4; a++) s[a] = _mm256_setzero_ps();
    for (int a = 0; a < 8; a++) c[a] = _mm256_setzero_ps();
    for (size_t i = lo; i < hi; i += 64) {
#pragma GCC unroll 4
        for (int a = 0; a < 4; a++) {
#ifdef AHEAD
            _mm_prefetch((const char *)(buf + i + 16 * a) + AHEAD, _MM_HINT_T1);
#endif
            const __m256 x = _mm256_add_ps(_mm256_loadu_ps(buf + i + 16 * a),
                                           _mm256_loadu_ps(buf + i + 16 * a + 8));
            s[a] = _mm256_add_ps(s[a], x);
#pragma GCC unroll 64
            for (int f = 0; f < FMAS; f++) c[f % 8] = _mm256_fmadd_ps(c[f % 8], w, x);
        }
    }
    for (int a = 0; a < 8; a++) s[a % 4] = _mm256_add_ps(s[a % 4], c[a]);
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
    sink = o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
    return NULL;
}
static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
int main(int argc, char **argv)
{
    const size_t bytes = argc > 1 ? (size_t)atoll(argv[1]) : (size_t)256 << 20;
    T = argc > 2 ? atoi(argv[2]) : 2;
    if (T < 1 || T > 64) return 2;
    n = bytes / 4 / (64 * (size_t)T) * (64 * (size_t)T);
    float *b = aligned_alloc(64, n * 4); /* n * 4: a multiple of 256 */
    if (!b || n == 0) return 1;
    for (size_t i = 0; i < n; i++) b[i] = 1.0f; /* touched: no page faults timed */
    buf = b;
    __builtin_cpu_init();
    void *(*sum)(void *) = sum_share;
    if (!__builtin_cpu_supports("avx512f")) {
        if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
            fprintf(stderr, "read: this CPU has neither AVX-512 nor AVX2+FMA\n");
            return 3;
        }
        sum = sum_share256;
    }
    double t[30];
    for (int r = 0; r < 30; r++) {
        pthread_t th[64];
        const double t0 = now();
        for (int i = 0; i < T; i++) pthread_create(&th[i], NULL, sum, (void *)(size_t)i);
        for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
        t[r] = now() - t0;
    }
    qsort(t, 30, sizeof t[0], by_value);
    printf("read %zu MiB, %d threads, %d FMAs a line: median %.1f GB/s, best %.1f GB/s\n",
           n * 4 >> 20, T, FMAS, n * 4 / t[15] / 1e9, n * 4 / t[0] / 1e9);
    free(b);
    return 0;
}

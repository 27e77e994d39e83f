/* Peak FP32 FMA throughput of one core: 16 (AVX-512) or 12 (AVX2)
 * independent accumulator chains of fused multiply-adds and nothing else.
 * Run one copy per core at once to see the all-core figure. The AVX-512
 * loop runs only where the CPU has AVX-512 (an AVX2-only CPU would stop on
 * SIGILL), the AVX2 one only where it has AVX2 and FMA. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now()
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
__attribute__((target("avx512f"))) double run512(long n)
{
    __m512 a[16];
    __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps(i);
    double t = now();
    for (long k = 0; k < n; k++) {
#define F(i) a[i] = _mm512_fmadd_ps(a[i], b, c);
        F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
    }
    t = now() - t;
    float s = 0;
    for (int i = 0; i < 16; i++) s += _mm512_reduce_add_ps(a[i]);
    if (s == 1234.5f) printf("x");
    return n * 16.0 * 16 * 2 / t / 1e9;
}
__attribute__((target("avx2,fma"))) double run256(long n)
{
    __m256 a[12];
    __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i);
    double t = now();
    for (long k = 0; k < n; k++) {
#define G(i) a[i] = _mm256_fmadd_ps(a[i], b, c);
        G(0) G(1) G(2) G(3) G(4) G(5) G(6) G(7) G(8) G(9) G(10) G(11)
    }
    t = now() - t;
    float s = 0;
    for (int i = 0; i < 12; i++) {
        float o[8];
        _mm256_storeu_ps(o, a[i]);
        for (int j = 0; j < 8; j++) s += o[j];
    }
    if (s == 1234.5f) printf("x");
    return n * 12.0 * 8 * 2 / t / 1e9;
}
int main()
{
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f");
    const int has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!has256) {
        fprintf(stderr, "fma_peak: this CPU has neither AVX-512 nor AVX2+FMA\n");
        return 3;
    }
    for (int r = 0; r < 3; r++) {
        if (has512) printf("avx512 %.1f ", run512(200000000));
        printf("avx2 %.1f GFLOP/s\n", run256(200000000));
    }
    return 0;
}

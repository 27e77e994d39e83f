/* The decoding tile kernels alone: NQ = argv[2] query rows (a GQA group)
 * against one tile of ATTNX_BK keys, D = Dv = argv[1], keys and values in
 * float32 (argv[3] = 0), float16 (1), bfloat16 (2) or int8 with scales (3):
 * qk_dot, softmax_rows and pv, each timed in TSC cycles (min over many
 * calls), from L1/L2 (the tile is reused), so what shows is the kernels' own
 * cost per key. x86-64 (the kernels' ISA is argv[4], avx512 by default): a
 * tuning tool. */
#include "kernels/kernels.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>
#define NK ATTNX_BK
static float rnd(void) { return (float)rand() / RAND_MAX - 0.5f; }
__attribute__((target("f16c"))) static uint16_t half_of(float x) { return _cvtss_sh(x, 0); }
static uint16_t bf16_of(float x) /* truncated: a benchmark's data */
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}
int main(int argc, char **argv)
{
    const int D = argc > 1 ? atoi(argv[1]) : 128, nq = argc > 2 ? atoi(argv[2]) : 4;
    const int kind = argc > 3 ? atoi(argv[3]) : 0;
    const char *isa = argc > 4 ? argv[4] : "avx512";
    const attnx_kernels *K = attnx_isa_kernels(isa);
    if (!K) {
        fprintf(stderr, "%s is not available here (the kernels' ISA is the 4th argument)\n", isa);
        return 1;
    }
    float *q = aligned_alloc(64, 4 * D * 8), *k = aligned_alloc(64, 4 * NK * D),
          *v = aligned_alloc(64, 4 * NK * D);
    uint16_t *k16 = aligned_alloc(64, 2 * NK * D), *v16 = aligned_alloc(64, 2 * NK * D);
    int8_t *k8 = aligned_alloc(64, NK * D), *v8 = aligned_alloc(64, NK * D);
    float ks[NK], vs[NK];
    for (int j = 0; j < NK; j++) ks[j] = vs[j] = 0.5f / 127;
    float *st = aligned_alloc(64, 4 * NK * 8), *acc = aligned_alloc(64, 4 * 8 * D), m[64], l[64],
          al[64];
    for (int i = 0; i < D * 8; i++) q[i] = rnd();
    for (int i = 0; i < NK * D; i++) {
        k[i] = rnd();
        v[i] = rnd();
        /* half-precision values of the same range as k and v: random bits
         * would make bfloat16 subnormals, whose products take microcode
         * assists (100+ cycles a key on Intel) */
        k16[i] = kind == 2 ? bf16_of(k[i]) : half_of(k[i]);
        v16[i] = kind == 2 ? bf16_of(v[i]) : half_of(v[i]);
        k8[i] = (int8_t)lrintf(k[i] * 254);
        v8[i] = (int8_t)lrintf(v[i] * 254);
    }
    for (int i = 0; i < 8 * D; i++) acc[i] = 0;
    for (int i = 0; i < 64; i++) m[i] = -INFINITY, l[i] = 0;
    double best[3] = {1e30, 1e30, 1e30};
    for (int rep = 0; rep < 20000; rep++) {
        unsigned long long t0 = __rdtsc();
        if (kind == 3)
            K->qk_dot_i8(q, D, nq, k8, D, ks, 1, NK, st, NK);
        else if (kind)
            K->qk_dot_half(kind - 1, q, D, nq, k16, D, NK, st, NK);
        else
            K->qk_dot(q, D, nq, k, D, NK, st, NK);
        unsigned long long t1 = __rdtsc();
        K->softmax_rows(st, NK, nq, NK, m, l, al);
        unsigned long long t2 = __rdtsc();
        if (kind == 3)
            K->pv_i8(st, 1, NK, nq, v8, D, vs, 1, NK, D, al, acc, D);
        else if (kind)
            K->pv_half(kind - 1, st, 1, NK, nq, v16, D, NK, D, al, acc, D);
        else
            K->pv(st, 1, NK, nq, v, D, NK, D, al, acc, D);
        unsigned long long t3 = __rdtsc();
        if (t1 - t0 < best[0]) best[0] = t1 - t0;
        if (t2 - t1 < best[1]) best[1] = t2 - t1;
        if (t3 - t2 < best[2]) best[2] = t3 - t2;
    }
    const double b = kind == 3 ? 2.0 * (D + 4) : (kind ? 2.0 : 4.0) * 2 * D;
    printf("D=%d nq=%d kind=%d  per key (TSC cycles): qk %.1f  softmax %.1f  pv %.1f  total %.1f"
           "  -> %.1f bytes/cycle\n",
           D, nq, kind, best[0] / NK, best[1] / NK, best[2] / NK,
           (best[0] + best[1] + best[2]) / NK, b * NK / (best[0] + best[1] + best[2]));
    return 0;
}

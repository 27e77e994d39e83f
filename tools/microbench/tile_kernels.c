/* The tile kernels alone, on one tile of NQ=64 queries x NK keys with
 * D = Dv = argv[1]: qk, softmax_online and pv, each timed in TSC cycles
 * (min over REPS = 3000 calls, so a noisy neighbour shows up only if it never
 * lets go). NT > 1 rotates over NT key/value tiles, to read them from L2
 * (NT=8 at D=128) or L3 (NT=32). argv[2] = 2 picks the AVX2 table.
 * FLOP/cycle is per TSC cycle (2.3 GHz here); the core runs faster.
 * x86-64 with AVX-512 (or AVX2 with argv[2] = 2) only: a tuning tool. */
#include "kernels/kernels.h"
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>
#define NQ 64
#ifndef NK
#define NK 128
#endif
#ifndef NT
#define NT 1
#endif
#define REPS 3000
static float rnd(void) { return (float)rand() / RAND_MAX - 0.5f; }

/* best = min(best, the TSC cycles stmt takes) */
#define TIME_MIN(best, stmt)                              \
    do {                                                  \
        const unsigned long long t0_ = __rdtsc();         \
        stmt;                                             \
        const double cycles_ = (double)(__rdtsc() - t0_); \
        if (cycles_ < (best)) (best) = cycles_;           \
    } while (0)
int main(int argc, char **argv)
{
    int D = argc > 1 ? atoi(argv[1]) : 64;
    const char *isa = argc > 2 && argv[2][0] == '2' ? "avx2" : "avx512";
    const attnx_kernels *K = attnx_isa_kernels(isa);
    if (!K) {
        fprintf(stderr, "%s is not available here\n", isa);
        return 1;
    }
    float *qt = aligned_alloc(64, 4 * D * NQ), *k = aligned_alloc(64, 4 * NK * D * NT),
          *v = aligned_alloc(64, 4 * NK * D * NT);
    float *st = aligned_alloc(64, 4 * NK * NQ), *acc = aligned_alloc(64, 4 * NQ * D), m[NQ], l[NQ],
          al[NQ];
    for (int i = 0; i < D * NQ; i++) qt[i] = rnd();
    for (int i = 0; i < NK * D * NT; i++) {
        k[i] = rnd();
        v[i] = rnd();
    }
    for (int i = 0; i < NQ * D; i++) acc[i] = 0;
    double best[3] = {1e30, 1e30, 1e30};
    for (int rep = 0; rep < REPS; rep++) {
        TIME_MIN(best[0], K->qk(qt, NQ, NQ, k + (rep % NT) * NK * D, D, NK, D, st));
        for (int i = 0; i < NQ; i++) {
            m[i] = -INFINITY;
            l[i] = 0;
        }
        TIME_MIN(best[1], K->softmax_online(st, NQ, NQ, NK, m, l, al));
        TIME_MIN(best[2], K->pv(st, NQ, 1, NQ, v + (rep % NT) * NK * D, D, NK, D, al, acc, D));
    }
    double fl = 2.0 * NQ * NK * D; /* per GEMM */
    printf("%s D=%d qk %.0f cyc (%.1f flop/cyc)  softmax %.0f cyc (%.2f cyc per 16 scores)  pv "
           "%.0f cyc (%.1f flop/cyc)  total-> %.1f flop/cyc\n",
           isa, D, best[0], fl / best[0], best[1], best[1] / (NQ * NK / 16.0), best[2],
           fl / best[2], 2 * fl / (best[0] + best[1] + best[2]));
    if (K->qk_split) {
        /* float32 on tiles: the queries' split (once an item), the keys'
         * (once a head, or once a tile), and the six tile products */
        const int64_t Dp = (D + 31) / 32 * 32, kpart = (int64_t)NK * Dp;
        uint32_t *qp = aligned_alloc(64, 4 * 3 * (size_t)Dp / 2 * NQ);
        uint16_t *kp = aligned_alloc(64, 2 * 3 * (size_t)kpart);
        double bs[3] = {1e30, 1e30, 1e30};
        for (int rep = 0; rep < REPS; rep++) {
            TIME_MIN(bs[0], K->split_pairs(qt, NQ, NQ, D, Dp, qp, Dp / 2 * NQ));
            TIME_MIN(bs[1], K->split_rows(k + (rep % NT) * NK * D, D, NK, D, kp, kpart, Dp));
            TIME_MIN(bs[2], K->qk_split(qp, NQ, NQ, kp, kpart, NK, Dp, st));
        }
        printf("%s D=%d float32 on tiles: split q %.0f cyc  split k %.0f cyc  qk_split %.0f cyc "
               "(%.1f flop/cyc)  total-> %.1f flop/cyc (%.2fx; keys split a tile: %.2fx)\n",
               isa, D, bs[0], bs[1], bs[2], fl / bs[2], 2 * fl / (bs[2] + best[1] + best[2]),
               (best[0] + best[1] + best[2]) / (bs[2] + best[1] + best[2]),
               (best[0] + best[1] + best[2]) / (bs[1] + bs[2] + best[1] + best[2]));
        if (K->pv_split && D % 16 == 0) {
            /* the values split once a call, transposed: (3, D, ldv) */
            const int64_t ldv = NK + 32, vpart = (int64_t)ATTNX_ROUND16(D) * ldv;
            float *vtf = aligned_alloc(64, 4 * (size_t)D * NK);
            uint16_t *vt = aligned_alloc(64, 2 * 3 * (size_t)vpart);
            float *work = aligned_alloc(64, 4 * ATTNX_PV_BF16_WORK(0));
            float *acct = aligned_alloc(64, 4 * (size_t)D * NQ);
            for (int j = 0; j < NK; j++)
                for (int d = 0; d < D; d++) vtf[d * NK + j] = v[j * D + d];
            attnx_split_rows_scalar(vtf, NK, D, NK, vt, vpart, ldv);
            for (int i = 0; i < NQ * D; i++) acct[i] = 0;
            double bv = 1e30;
            for (int rep = 0; rep < REPS; rep++)
                TIME_MIN(bv, K->pv_split(st, NQ, NQ, vt, ldv, vpart, NK, D, al, acct, work));
            printf("%s D=%d float32 on tiles: pv_split %.0f cyc (%.1f flop/cyc)  total-> %.1f "
                   "flop/cyc (%.2fx)\n",
                   isa, D, bv, fl / bv, 2 * fl / (bs[2] + best[1] + bv),
                   (best[0] + best[1] + best[2]) / (bs[2] + best[1] + bv));
        }
    }
    if (!K->qk_bf16) return 0;
    /* all-bfloat16 inputs: qk_bf16 on the keys in place, and the values'
     * conversion to float32 (half_rows) that pv then reads */
    uint16_t *k16 = malloc(2 * (size_t)NK * D * NT), *v16 = malloc(2 * (size_t)NK * D * NT);
    uint32_t *qt2 = aligned_alloc(64, 4 * ((D + 1) / 2) * NQ);
    float *q = malloc(4 * (size_t)NQ * D);
    for (int i = 0; i < NK * D * NT; i++) {
        k16[i] = (uint16_t)(rand() & 0xbfff); /* exponents below 2^1: finite */
        v16[i] = (uint16_t)(rand() & 0xbfff);
    }
    for (int i = 0; i < NQ * D; i++) q[i] = attnx_bf16_to_float((uint16_t)(rand() & 0xbfff));
    attnx_pack_qt_bf16(q, D, NQ, D, qt2, NQ);
    double bb[2] = {1e30, 1e30};
    for (int rep = 0; rep < REPS; rep++) {
        TIME_MIN(bb[0], K->qk_bf16(qt2, NQ, NQ, k16 + (rep % NT) * NK * D, D, NK, D, 0.125f, st));
        TIME_MIN(bb[1], K->half_rows(ATTNX_HALF_BF16, v16 + (rep % NT) * NK * D, D, NK, D, v));
    }
    printf("%s D=%d bfloat16: qk_bf16 %.0f cyc (%.1f flop/cyc)  V to float32 %.0f cyc  "
           "total-> %.1f flop/cyc (%.2fx float32)\n",
           isa, D, bb[0], fl / bb[0], bb[1], 2 * fl / (bb[0] + bb[1] + best[1] + best[2]),
           (best[0] + best[1] + best[2]) / (bb[0] + bb[1] + best[1] + best[2]));
    if (!K->pv_bf16 || D % 16) return 0;
    /* P·V on tiles (AMX): the probabilities of the softmax above, the values
     * in place, into the transposed accumulator */
    float *work = aligned_alloc(64, 4 * ATTNX_PV_BF16_WORK(D)),
          *acct = aligned_alloc(64, 4 * D * NQ);
    for (int i = 0; i < D * NQ; i++) acct[i] = 0;
    double bp = 1e30;
    for (int rep = 0; rep < REPS; rep++)
        TIME_MIN(bp, K->pv_bf16(st, NQ, NQ, v16 + (rep % NT) * NK * D, D, NK, D, al, acct, work));
    printf("%s D=%d bfloat16: pv_bf16 %.0f cyc (%.1f flop/cyc)  total-> %.1f flop/cyc (%.2fx "
           "float32)\n",
           isa, D, bp, fl / bp, 2 * fl / (bb[0] + best[1] + bp),
           (best[0] + best[1] + best[2]) / (bb[0] + best[1] + bp));
    return 0;
}

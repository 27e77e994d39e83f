/* AVX512_BF16: the scores of bfloat16 queries and keys with vdpbf16ps, which
 * adds two products of bfloat16 pairs to each float32 lane, 32 products a
 * vector and instruction where an FMA does 16. Enabled for this file alone
 * (target pragma); dispatch.c hands out attnx_kernels_avx512_bf16 (avx512.c:
 * the AVX-512 table with qk_bf16 = attnx_qk_bf16_avx512) only when cpuid
 * reports AVX512_BF16 along with AVX-512 F, BW and VL. */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512bf16")
#endif
#include <immintrin.h>

#define BF_W 16 /* float32 lanes (query pairs) a vector */
#define BF_MR 8 /* keys x vectors of queries: 16 accumulators */
#define BF_NV 2

#define BF_INLINE static inline __attribute__((always_inline))

/* Dims 2p and 2p+1 of a key row, as one 32-bit word in every lane. */
BF_INLINE __m512i pair_bcast(const uint16_t *k)
{
    uint32_t w;
    memcpy(&w, k, sizeof w);
    return _mm512_set1_epi32((int)w);
}

/* Register block: MR keys x NV vectors of queries, over the pairs of dims;
 * each step broadcasts one pair of a key row against NV vectors of packed
 * query pairs. */
BF_INLINE void qk_bf16_block(const int MR, const int NV, const uint32_t *qt2, int64_t ldq,
                             const uint16_t *k, int64_t k_sl, int64_t D, float scale, float *st)
{
    __m512 acc[BF_MR][BF_NV];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = D / 2;
    for (int64_t p = 0; p < pairs; p++) {
        if ((p & 15) == 0) /* the next block's keys: short rows defeat the hardware prefetcher */
            for (int r = 0; r < MR; r++) __builtin_prefetch(k + (r + MR) * k_sl + 2 * p, 0, 3);
        __m512i qv[BF_NV];
        for (int c = 0; c < NV; c++) qv[c] = _mm512_loadu_si512(qt2 + p * ldq + c * BF_W);
        for (int r = 0; r < MR; r++) {
            const __m512i kb = pair_bcast(k + r * k_sl + 2 * p);
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qv[c], (__m512bh)kb);
        }
    }
    if (D & 1) { /* the last dim alone: its pair's upper half is 0 in both */
        __m512i qv[BF_NV];
        for (int c = 0; c < NV; c++) qv[c] = _mm512_loadu_si512(qt2 + pairs * ldq + c * BF_W);
        for (int r = 0; r < MR; r++) {
            const __m512i kb = _mm512_set1_epi32((int)k[r * k_sl + D - 1]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qv[c], (__m512bh)kb);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(st + r * ldq + c * BF_W, _mm512_mul_ps(acc[r][c], s));
}

#define BF_CASE(mr, nv)                                                            \
    case (mr) * 8 + (nv):                                                          \
        qk_bf16_block(mr, nv, qt2 + i, ldq, kj, k_sl, D, scale, st + j * ldq + i); \
        break;

// qt2: (ceil(D/2), ldq) pairs  k: (nk, D) bf16 rows k_sl apart  st: (nk, ldq)
void attnx_qk_bf16_avx512(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                          int nk, int64_t D, float scale, float *st)
{
    const int nvec = (nq + BF_W - 1) / BF_W;
    for (int j = 0; j < nk; j += BF_MR) {
        const int mr = nk - j < BF_MR ? nk - j : BF_MR;
        const uint16_t *kj = k + j * k_sl;
        for (int c0 = 0; c0 < nvec; c0 += BF_NV) {
            const int nv = nvec - c0 < BF_NV ? nvec - c0 : BF_NV;
            const int i = c0 * BF_W;
            switch (mr * 8 + nv) {
                // clang-format off
                BF_CASE(1, 1) BF_CASE(1, 2) BF_CASE(2, 1) BF_CASE(2, 2)
                BF_CASE(3, 1) BF_CASE(3, 2) BF_CASE(4, 1) BF_CASE(4, 2)
                BF_CASE(5, 1) BF_CASE(5, 2) BF_CASE(6, 1) BF_CASE(6, 2)
                BF_CASE(7, 1) BF_CASE(7, 2) BF_CASE(8, 1) BF_CASE(8, 2)
                // clang-format on
            }
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#endif

#endif

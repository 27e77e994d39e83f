/* Rounding float32 lanes to bfloat16 pairs in AVX-512 registers (and the
 * rescale of a transposed accumulator), for the
 * files with bfloat16 dot products (avx512_bf16.c, amx.c), each under its
 * own target pragma: include after <immintrin.h>. Integer steps only, so
 * that every CPU (and the emulated build) gives attnx_bf16_round's bits. */
#ifndef ATTNX_BF16_AVX512_H
#define ATTNX_BF16_AVX512_H

/* Each lane of x rounded to bfloat16 in its low 16 bits (the high 16 zero),
 * as attnx_bf16_round: to nearest, ties to even (0x7fff plus the lowest kept
 * bit added, then cut; past the largest finite value: inf); a NaN quiet. */
static inline __m512i bf16_round_avx512(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(
        r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

/* acct[d][i] *= alpha[i] for d < Dv, i < 16 nqv: the first step of P·V into
 * a transposed accumulator (pv_bf16, pv_split, pv_medium). acct: (Dv, ldq) */
static inline void acct_rescale_avx512(const float *alpha, float *acct, int64_t ldq, int64_t Dv,
                                       int nqv)
{
    for (int64_t d = 0; d < Dv; d++)
        for (int c = 0; c < nqv; c++) {
            float *a = acct + d * ldq + c * 16;
            _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(alpha + c * 16), _mm512_loadu_ps(a)));
        }
}

/* The pairs vdpbf16ps and the tiles read: lane i = bf16(even[i]) | bf16(odd[i]) << 16. */
static inline __m512i bf16_pairs_avx512(__m512 even, __m512 odd)
{
    return _mm512_or_si512(bf16_round_avx512(even), _mm512_slli_epi32(bf16_round_avx512(odd), 16));
}

#endif

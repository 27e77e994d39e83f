/* Horizontal sums of AVX-512 registers in one fixed order, for the files
 * under an AVX-512 target (avx512.c's qk_dot, avx512_bf16.c's
 * qk_dot_medium, whose reference in scalar.c spells the order out):
 * include after <immintrin.h>. */
#ifndef ATTNX_HSUM_AVX512_H
#define ATTNX_HSUM_AVX512_H

/* Horizontal sums, every lane sum in one fixed order (the same bits however
 * many sums are taken together): lanes l and l+8 first, then adjacent pairs,
 * then pairs of those, then the two halves. Four vectors a row, four rows. */
static inline __m512 halves_avx512(__m512 a, __m512 b) /* [a0+a2 a1+a3 b0+b2 b1+b3] (128-bit) */
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
static inline __m512 pairs_avx512(__m512 x, __m512 y) /* adjacent lanes: x's, then y's */
{
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
static inline __m512 quads_avx512(__m512 a, __m512 b, __m512 c, __m512 d)
{
    return pairs_avx512(halves_avx512(a, b), halves_avx512(c, d));
}
static inline __m512 chunks_avx512(__m512 x, __m512 y) /* 128-bit chunks 0+1, 2+3 of x, y */
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
/* out[r] = the sum of the lanes of a, b, c, d: the same order with 256-bit
 * halves and hadd, cheaper for one row */
static inline __m256 fold_avx512(__m512 x)
{
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
static inline void hsum4_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float out[4])
{
    const __m256 ab = _mm256_hadd_ps(fold_avx512(a), fold_avx512(b));
    const __m256 abcd = _mm256_hadd_ps(ab, _mm256_hadd_ps(fold_avx512(c), fold_avx512(d)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
/* st[i*ldk + r] = the sum of the lanes of x[i][r], rows i < 3 or 4 and 4 sums r:
 * a third fewer shuffles and half the adds of four hsum4, the same bits (with
 * 3 rows, the fourth's quads are zeros and it is not stored) */
static inline void hsum4x4_avx512(const __m512 x[4][4], const int rows, float *st, int64_t ldk)
{
    const __m512 q3 =
        rows > 3 ? quads_avx512(x[3][0], x[3][1], x[3][2], x[3][3]) : _mm512_setzero_ps();
    const __m512 h01 = pairs_avx512(quads_avx512(x[0][0], x[0][1], x[0][2], x[0][3]),
                                    quads_avx512(x[1][0], x[1][1], x[1][2], x[1][3]));
    const __m512 h23 = pairs_avx512(quads_avx512(x[2][0], x[2][1], x[2][2], x[2][3]), q3);
    /* lanes: [r0a r0c r1a r1c | r0b r0d r1b r1d | r2a r2c r3a r3c | r2b r2d r3b r3d] */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512 s = _mm512_permutexvar_ps(order, chunks_avx512(h01, h23));
    _mm_storeu_ps(st, _mm512_castps512_ps128(s));
    _mm_storeu_ps(st + ldk, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(st + 2 * ldk, _mm512_extractf32x4_ps(s, 2));
    if (rows > 3) _mm_storeu_ps(st + 3 * ldk, _mm512_extractf32x4_ps(s, 3));
}
#endif

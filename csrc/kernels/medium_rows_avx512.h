/* Decoding's rows under precision "medium" in AVX-512 registers, for the
 * files with bfloat16 dot products (avx512_bf16.c, amx.c; their target
 * pragmas include AVX512_BF16): include after <immintrin.h> and
 * bf16_avx512.h. Rows of bfloat16 values are read as they are, 32 a vector;
 * rows of int8 values are widened to float32 (exact) and their top halves
 * taken: the bfloat16 of an int8 value, exact too; rows of float16 values
 * are widened (exact) and rounded to bfloat16 (bf16_words). kind:
 * attnx_medium_rows (kernels.h). */
#ifndef ATTNX_MEDIUM_ROWS_AVX512_H
#define ATTNX_MEDIUM_ROWS_AVX512_H

#include <string.h>

#ifndef ATTNX_AS_BF16                     /* the emulated build (emulate_avx512.h) has its own */
#define ATTNX_AS_BF16(x) ((__m512bh)(x))  /* 32-bit pairs as vdpbf16ps's operand */
#define ATTNX_FROM_BF16(x) ((__m512i)(x)) /* and back */
#endif

#define MR_INLINE static inline __attribute__((always_inline))

static const uint16_t odd_words[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                       23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                       45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
static const uint16_t even_words[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                        22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                        44, 46, 48, 50, 52, 54, 56, 58, 60, 62};

/* 32 float32 values (lo: the first 16, hi: the next) rounded to bfloat16
 * words, in order: vcvtne2ps2bf16, to nearest even, a NaN quiet. Its DAZ
 * (a float32 subnormal becomes 0) never acts on a widened float16, which is
 * never a float32 subnormal, so on these values it gives attnx_bf16_round's
 * bits (the emulated build models the instruction, DAZ included). */
MR_INLINE __m512i bf16_words(__m512 lo, __m512 hi)
{
    return ATTNX_FROM_BF16(_mm512_cvtne2ps_pbh(hi, lo));
}

/* 32 elements of a row at x (kind: attnx_medium_rows) as bfloat16 words, in order. */
MR_INLINE __m512i medium_load(const void *x, const int kind)
{
    if (kind == ATTNX_MEDIUM_BF16) return _mm512_loadu_si512(x);
    if (kind == ATTNX_MEDIUM_F16)
        return bf16_words(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x)),
                          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x + 1)));
    /* 16 values a load, which the compilers fold into its vpmovsxbd (GCC 12 turned
     * one 32-byte load and vextracti32x4 into two loads and the shuffle) */
    const __m128i *b = (const __m128i *)x;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b + 1)));
    return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), _mm512_loadu_si512(odd_words),
                                     _mm512_castps_si512(hi));
}

/* The first n < 32 elements of a row, zero-padded: copied first, so that
 * nothing past the row is read. */
MR_INLINE __m512i medium_load_tail(const void *x, int n, const int kind)
{
    uint16_t t[32] = {0};
    memcpy(t, x, (size_t)n * (kind == ATTNX_MEDIUM_I8 ? 1 : 2));
    return medium_load(t, kind);
}

/* Rows i < nr of the probabilities (times their values' scales: scale_v)
 * rounded to bfloat16 pairs of keys: pp[i*(BK/2) + m] = bf16(p[i][2m]) |
 * bf16(p[i][2m+1]) << 16, 0 past nk. pt: (nr, ldk)  pp: (nr, BK/2); nk <= BK */
static inline void medium_prob_pairs(const float *pt, int64_t ldk, int nr, const float *scale_v,
                                     int64_t s_sl, int nk, uint32_t *pp)
{
    float t[ATTNX_BK];
    for (int i = 0; i < nr; i++) {
        const float *p = pt + i * ldk;
        uint32_t *o = pp + i * (ATTNX_BK / 2);
        if (scale_v) {
            for (int j = 0; j < nk; j++) t[j] = p[j] * scale_v[j * s_sl];
            p = t;
        }
        int j = 0;
        for (; j + 32 <= nk; j += 32) {
            const __m512i r0 = bf16_round_avx512(_mm512_loadu_ps(p + j));
            const __m512i r1 = bf16_round_avx512(_mm512_loadu_ps(p + j + 16));
            _mm512_storeu_si512(o + j / 2,
                                _mm512_permutex2var_epi16(r0, _mm512_loadu_si512(even_words), r1));
        }
        for (; j < nk; j += 2)
            o[j / 2] = attnx_bf16_round(p[j]) |
                       (j + 1 < nk ? (uint32_t)attnx_bf16_round(p[j + 1]) << 16 : 0u);
    }
}

#endif

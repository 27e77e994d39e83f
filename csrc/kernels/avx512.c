/* AVX-512 F kernels: 16 floats a vector, 32 registers, mask registers for
 * partial vectors. Enabled for this file alone (target pragma); dispatch.c
 * calls these only when cpuid and the OS (XCR0) report AVX-512 F. */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(ATTNX_EMULATE_AVX512)
#include "kernels/emulate_avx512.h" /* test builds: SIMDe's portable intrinsics */
#else
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx2,fma,f16c")
#endif
#include <immintrin.h>
#endif

#define W 16
#define VF __m512
#define VMASK __mmask16
#define SUFFIX(name) name##_avx512
#define QK_BF16_TABLE attnx_kernels_avx512_bf16 /* with AVX512_BF16: + qk_bf16 */
#define QK_BF16 attnx_qk_bf16_avx512
#define PV_MEDIUM attnx_pv_medium_avx512
#define BF16DOT_BURN attnx_bf16dot_burn_avx512
#define ROUND_ENTRIES .round_rows = attnx_round_rows_avx512, .round_pairs = attnx_round_pairs_avx512
#define QK_AMX_TABLE attnx_kernels_avx512_amx /* with AMX-BF16: + amx.c's tile kernels */
#define QK_AMX_EMULATED_TABLE attnx_kernels_avx512_amx_emulated /* the same on the model */
#define QK_MR 8 /* 8 keys x 2 vectors: 16 accumulators */
#define QK_NV 2
#define PV_MR 6 /* 6 queries x 4 vectors: 24 accumulators */
#define PV_NV 4

#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, x) _mm512_storeu_ps(p, x)
#define V_SET1(f) _mm512_set1_ps(f)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_ZERO() _mm512_setzero_ps()
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MAX(x, m) _mm512_max_ps(x, m) /* (x > m) ? x : m: a NaN x leaves m */
#define V_SEL_EQ(a, b, t, f) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), f, t)
#define V_SEL_LT(a, b, t, f) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), f, t)
#define V_DIV(a, b) _mm512_div_ps(a, b)
#define V_ANY_NOT_LT(a, b) (_mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ) != 0)
#define V_LOAD_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* bfloat16 to float32: each 16 bits widened and shifted to the top half */
#define V_LOAD_BF16(p)   \
    _mm512_castsi512_ps( \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* 16 int8 values, sign-extended to int32 and converted (exact) */
#define V_LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n)        \
    _mm512_castsi512_ps( \
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define V_SCALE_ZERO_BELOW(y, n, x, lo) \
    _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_NLT_UQ), y, n)
#define V_ZERO_BELOW(y, x, lo) \
    _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_NLT_UQ), y)

#define V_MASK(n) ((__mmask16)((1u << (n)) - 1u))
#define V_HSUM(x) _mm512_reduce_add_ps(x)

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
#define V_HSUM4X4(x, rows, st, ldk) hsum4x4_avx512(x, rows, st, ldk)
#define V_HSUM4(a, b, c, d, out) hsum4_avx512(a, b, c, d, out)

#include "kernels/transpose_avx512.h"
#define V_TRANSPOSE(r) transpose_avx512(r)
/* 16 bytes as floats 0 .. 255 */
#define V_LOAD_BYTES(p) \
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))

/* Bytes have no gather: fetch the aligned dword holding each byte (it never
 * crosses a page, so it is as safe to read as the byte) and shift it out. */
static inline __m512 keep_bytes_avx512(__m512 x, const unsigned char *base, const int32_t *idx,
                                       __m512 fill)
{
    const __m512i vi = _mm512_loadu_si512(idx);
    const __m512i lo = _mm512_and_si512(
        _mm512_add_epi32(vi, _mm512_set1_epi32((int)((uintptr_t)base & 3))), _mm512_set1_epi32(3));
    const __m512i words = _mm512_i32gather_epi32(_mm512_sub_epi32(vi, lo), base, 1);
    const __m512i bytes = _mm512_and_si512(_mm512_srlv_epi32(words, _mm512_slli_epi32(lo, 3)),
                                           _mm512_set1_epi32(0xff));
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(bytes, bytes), fill, x);
}
#define V_KEEP_BYTES(x, base, idx, fill) keep_bytes_avx512(x, base, idx, fill)
#define V_LOAD_M(p, mk) _mm512_maskz_loadu_ps(mk, p)
#define V_STORE_M(p, mk, x) _mm512_mask_storeu_ps(p, mk, x)

/* the register blocks the kernels dispatch to: (rows, vectors) */
// clang-format off
#define QK_CASES                                                                   \
    QK_CASE(1, 1) QK_CASE(1, 2) QK_CASE(2, 1) QK_CASE(2, 2) QK_CASE(3, 1) QK_CASE(3, 2) \
    QK_CASE(4, 1) QK_CASE(4, 2) QK_CASE(5, 1) QK_CASE(5, 2) QK_CASE(6, 1) QK_CASE(6, 2) \
    QK_CASE(7, 1) QK_CASE(7, 2) QK_CASE(8, 1) QK_CASE(8, 2)
#define PV_CASES                                                                   \
    PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(1, 4) PV_CASE(2, 1) PV_CASE(2, 2) \
    PV_CASE(2, 3) PV_CASE(2, 4) PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(3, 3) PV_CASE(3, 4) \
    PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3) PV_CASE(4, 4) PV_CASE(5, 1) PV_CASE(5, 2) \
    PV_CASE(5, 3) PV_CASE(5, 4) PV_CASE(6, 1) PV_CASE(6, 2) PV_CASE(6, 3) PV_CASE(6, 4)
// clang-format on

#include "kernels/kernels_simd.h"

#if defined(__clang__) && !defined(ATTNX_EMULATE_AVX512)
#pragma clang attribute pop
#endif

#endif

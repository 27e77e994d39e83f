/* AVX2 + FMA kernels: 8 floats a vector, 16 registers.
 * The instruction set is enabled for this file alone (target pragma), so the
 * rest of the extension runs on any x86-64; dispatch.c calls these only when
 * cpuid reports AVX2, FMA and F16C. */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

#define W 8
#define VF __m256
#define VMASK __m256i
#define SUFFIX(name) name##_avx2
#define QK_MR 6 /* 6 keys x 2 vectors: 12 accumulators */
#define QK_NV 2
#define PV_MR 4 /* 4 queries x 3 vectors: 12 accumulators */
#define PV_NV 3

#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_IN_REGISTER(x) __asm__("" : "+x"(x)) /* an empty asm that needs x in a register */
#define V_STORE(p, x) _mm256_storeu_ps(p, x)
#define V_SET1(f) _mm256_set1_ps(f)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_ZERO() _mm256_setzero_ps()
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MAX(x, m) _mm256_max_ps(x, m) /* (x > m) ? x : m: a NaN x leaves m */
#define V_SEL_EQ(a, b, t, f) _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_EQ_OQ))
#define V_SEL_LT(a, b, t, f) _mm256_blendv_ps(f, t, _mm256_cmp_ps(a, b, _CMP_LT_OQ))
#define V_DIV(a, b) _mm256_div_ps(a, b)
#define V_ANY_NOT_LT(a, b) (_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NLT_UQ)) != 0)
#define V_LOAD_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* bfloat16 to float32: each 16 bits widened and shifted to the top half */
#define V_LOAD_BF16(p)   \
    _mm256_castsi256_ps( \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
/* 8 int8 values, sign-extended to int32 and converted (exact) */
#define V_LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define V_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n)        \
    _mm256_castsi256_ps( \
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define V_ZERO_BELOW(y, x, lo) _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_NLT_UQ))

static inline __m256i mask_first_avx2(int n)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
#define V_MASK(n) mask_first_avx2(n)

static inline float hsum_avx2(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define V_HSUM(x) hsum_avx2(x)

/* The sums of four vectors at once: out[r] = sum of the lanes of x_r. */
static inline void hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d, float out[4])
{
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#define V_HSUM4(a, b, c, d, out) hsum4_avx2(a, b, c, d, out)

/* r[0..7] = its transpose (8 x 8): pairs interleaved, quadruples, then halves. */
static inline void transpose_avx2(__m256 r[8])
{
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        const __m256 lo = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
        r[i] = lo;
    }
}
#define V_TRANSPOSE(r) transpose_avx2(r)
/* 8 bytes as floats 0 .. 255 */
#define V_LOAD_BYTES(p) \
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

/* Bytes have no gather: fetch the aligned dword holding each byte (it never
 * crosses a page, so it is as safe to read as the byte) and shift it out. */
static inline __m256 keep_bytes_avx2(__m256 x, const unsigned char *base, const int32_t *idx,
                                     __m256 fill)
{
    const __m256i vi = _mm256_loadu_si256((const __m256i *)idx);
    const __m256i lo = _mm256_and_si256(
        _mm256_add_epi32(vi, _mm256_set1_epi32((int)((uintptr_t)base & 3))), _mm256_set1_epi32(3));
    const __m256i words = _mm256_i32gather_epi32((const int *)base, _mm256_sub_epi32(vi, lo), 1);
    const __m256i bytes = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_slli_epi32(lo, 3)),
                                           _mm256_set1_epi32(0xff));
    const __m256i blocked = _mm256_cmpeq_epi32(bytes, _mm256_setzero_si256());
    return _mm256_blendv_ps(x, fill, _mm256_castsi256_ps(blocked));
}
#define V_KEEP_BYTES(x, base, idx, fill) keep_bytes_avx2(x, base, idx, fill)
#define V_LOAD_M(p, mk) _mm256_maskload_ps(p, mk)
#define V_STORE_M(p, mk, x) _mm256_maskstore_ps(p, mk, x)

/* the register blocks the kernels dispatch to: (rows, vectors) */
// clang-format off
#define QK_CASES                                                                   \
    QK_CASE(1, 1) QK_CASE(1, 2) QK_CASE(2, 1) QK_CASE(2, 2) QK_CASE(3, 1) QK_CASE(3, 2) \
    QK_CASE(4, 1) QK_CASE(4, 2) QK_CASE(5, 1) QK_CASE(5, 2) QK_CASE(6, 1) QK_CASE(6, 2)
#define PV_CASES                                                                   \
    PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) \
    PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(3, 3) PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3)
// clang-format on

#include "kernels/kernels_simd.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif

#endif

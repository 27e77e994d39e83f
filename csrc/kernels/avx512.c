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
/* decoding and the backward's products under "medium", kernels.h's ATTNX_MEDIUM_ROWS_KERNELS */
#define MEDIUM_ROWS(s)                                                                    \
    .qk_dot_medium = attnx_qk_dot_medium_##s, .pv_rows_medium = attnx_pv_rows_medium_##s, \
    .ptx_medium = attnx_ptx_medium_##s
#define BF16DOT_BURN attnx_bf16dot_burn_avx512
/* "medium" for inputs that are not bfloat16 (avx512_bf16.c); each table adds its decoding
 * and backward kernels (avx512_bf16.c's with vdpbf16ps, or amx.c's on tiles) */
#define MEDIUM_ENTRIES \
    .round_rows = attnx_round_rows_avx512, .round_pairs = attnx_round_pairs_avx512
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

#include "kernels/hsum_avx512.h" /* hsum4_avx512, hsum4x4_avx512 */
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

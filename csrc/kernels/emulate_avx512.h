/* Test builds only (ATTNX_EMULATE_AVX512 defined: tools/emulate.sh, through
 * tests/c/run.sh's CFLAGS and setup.py's ATTNX_EXTRA_CFLAGS):
 * the AVX-512 kernel files (avx512.c, avx512_bf16.c, amx.c) are compiled
 * against SIMDe's portable AVX-512 intrinsics (the headers of the simde-py
 * package, in the [test] extra) instead of the compiler's, so that their code
 * runs, slowly, on a CPU without AVX-512, and dispatch.c reports AVX-512 and
 * AVX512_BF16 as present (real AMX as absent: its tiles run on the model,
 * tile_model.h, as "amx_emulated"). Never in a build users get: speed means
 * nothing here, only the bits.
 *
 * SIMDe's vdpbf16ps adds each pair's products in its own order, with no
 * flushing; the kernels' contract (kernels.h, qk_bf16) is Intel's: per lane,
 * the odd pair first, one rounding an FMA, bfloat16 subnormals read as 0 and
 * subnormal results flushed. _mm512_dpbf16_ps is that, lane by lane. */
#ifndef ATTNX_EMULATE_AVX512_H
#define ATTNX_EMULATE_AVX512_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors passed without AVX-512 */
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include "kernels/kernels.h" /* attnx_dp_fma: one FMA of a VDPBF16PS lane */

static inline __m512 attnx_emu_dpbf16_ps(__m512 src, __m512i a, __m512i b)
{
    float acc[16];
    uint16_t x[32], y[32];
    _mm512_storeu_ps(acc, src);
    _mm512_storeu_si512(x, a);
    _mm512_storeu_si512(y, b);
    for (int i = 0; i < 16; i++) {
        acc[i] = attnx_dp_fma(x[2 * i + 1], y[2 * i + 1], acc[i]); /* the odd pair first */
        acc[i] = attnx_dp_fma(x[2 * i], y[2 * i], acc[i]);
    }
    return _mm512_loadu_ps(acc);
}

/* Masked loads and stores touch the masked lanes' memory alone, as the
 * instructions do (SIMDe's read and write all 64 bytes: past a row's end). */
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) attnx_emu_maskz_loadu_ps(k, p)
static inline __m512 attnx_emu_maskz_loadu_ps(__mmask16 k, const void *p)
{
    float l[16];
    for (int i = 0; i < 16; i++) l[i] = (k >> i) & 1 ? ((const float *)p)[i] : 0.0f;
    return _mm512_loadu_ps(l);
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, x) attnx_emu_mask_storeu_ps(p, k, x)
static inline void attnx_emu_mask_storeu_ps(void *p, __mmask16 k, __m512 x)
{
    float l[16];
    _mm512_storeu_ps(l, x);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((float *)p)[i] = l[i];
}

/* A fused multiply-add rounds once (SIMDe's, without FMA hardware, twice). */
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) attnx_emu_fmadd_ps(a, b, c)
static inline __m512 attnx_emu_fmadd_ps(__m512 a, __m512 b, __m512 c)
{
    float x[16], y[16], z[16];
    _mm512_storeu_ps(x, a);
    _mm512_storeu_ps(y, b);
    _mm512_storeu_ps(z, c);
    for (int i = 0; i < 16; i++) z[i] = fmaf(x[i], y[i], z[i]);
    return _mm512_loadu_ps(z);
}

/* What this SIMDe lacks, from what it has (the same lanes). */
#ifndef _mm512_cmpeq_epi16_mask
#define _mm512_cmpeq_epi16_mask(a, b) _mm512_cmpeq_epu16_mask(a, b) /* equality has no sign */
#endif
#ifndef _mm512_cmpgt_epu32_mask
#define _mm512_cmpgt_epu32_mask(a, b) ((__mmask16)~_mm512_cmple_epu32_mask(a, b))
#endif
#ifndef _mm512_mask_cmplt_epu32_mask
#define _mm512_mask_cmplt_epu32_mask(k, a, b) \
    ((__mmask16)((k) & ~_mm512_cmpge_epu32_mask(a, b))) /* a < b: not a >= b */
#endif

#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
/* 16 bytes widened to 32-bit lanes, sign-extended (is_signed) or not */
static inline __m512i attnx_emu_cvt8_epi32(__m128i x, int is_signed)
{
    uint8_t b[16];
    int32_t w[16];
    _mm_storeu_si128((__m128i *)b, x);
    for (int i = 0; i < 16; i++) w[i] = is_signed ? (int32_t)(int8_t)b[i] : (int32_t)b[i];
    return _mm512_loadu_si512(w);
}
#ifndef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(x) attnx_emu_cvt8_epi32(x, 1)
#endif
#ifndef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(x) attnx_emu_cvt8_epi32(x, 0)
#endif
#ifndef _mm512_i32gather_epi32
#define _mm512_i32gather_epi32(idx, base, scale) attnx_emu_i32gather_epi32(idx, base, scale)
static inline __m512i attnx_emu_i32gather_epi32(__m512i idx, const void *base, int scale)
{
    int32_t at[16], w[16];
    _mm512_storeu_si512(at, idx);
    for (int i = 0; i < 16; i++) memcpy(&w[i], (const char *)base + (int64_t)at[i] * scale, 4);
    return _mm512_loadu_si512(w);
}
#endif
#ifndef _mm512_cvtepi32_epi16
/* each lane's low 16 bits (vpmovdw truncates) */
#define _mm512_cvtepi32_epi16(x) attnx_emu_cvtepi32_epi16(x)
static inline __m256i attnx_emu_cvtepi32_epi16(__m512i x)
{
    uint32_t w[16];
    uint16_t h[16];
    _mm512_storeu_si512(w, x);
    for (int i = 0; i < 16; i++) h[i] = (uint16_t)w[i];
    return _mm256_loadu_si256((const __m256i *)h);
}
#endif
#ifndef _mm512_reduce_add_ps
/* GCC's order: the 256-bit halves, then the 128-bit ones, then lanes 0+2 and
 * 1+3, then those two */
#define _mm512_reduce_add_ps(x) attnx_emu_reduce_add_ps(x)
static inline float attnx_emu_reduce_add_ps(__m512 x)
{
    float l[16];
    _mm512_storeu_ps(l, x);
    for (int i = 0; i < 8; i++) l[i] = l[i + 8] + l[i];
    for (int i = 0; i < 4; i++) l[i] = l[i + 4] + l[i];
    return (l[0] + l[2]) + (l[1] + l[3]);
}
#endif

/* The kernels hand vdpbf16ps 32-bit pairs (__m512i) as bfloat16 vectors: a
 * cast natively, nothing here (the emulation takes the integer vectors). */
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) attnx_emu_dpbf16_ps(src, a, b)
#define ATTNX_AS_BF16(x) (x)
#define ATTNX_FROM_BF16(x) (x)

/* vcvtne2ps2bf16 as the ISA reference states it, into integer vectors: the
 * low 16 words from b, the high from a; a NaN quiet (its top half, the quiet
 * bit set), a subnormal flushed to a zero of its sign (DAZ), else rounded to
 * nearest even. */
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) attnx_emu_cvtne2ps_pbh(a, b)
static inline __m512i attnx_emu_cvtne2ps_pbh(__m512 a, __m512 b)
{
    float x[32];
    uint16_t w[32];
    _mm512_storeu_ps(x, b);
    _mm512_storeu_ps(x + 16, a);
    for (int i = 0; i < 32; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            w[i] = (uint16_t)((u >> 16) | 0x40u);
        else if ((u & 0x7f800000u) == 0)
            w[i] = (uint16_t)((u >> 16) & 0x8000u);
        else
            w[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return _mm512_loadu_si512(w);
}

#endif

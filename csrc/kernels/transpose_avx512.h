/* A 16 x 16 transpose of float32 lanes in AVX-512 registers, for the files
 * compiled for AVX-512 (avx512.c, amx.c), each under its own target pragma:
 * include after <immintrin.h>. The shuffles move bits and do no arithmetic,
 * so any 32-bit pattern (a pair of 16-bit values) goes through unchanged. */
#ifndef ATTNX_TRANSPOSE_AVX512_H
#define ATTNX_TRANSPOSE_AVX512_H

/* r[0..15] = its transpose (16 x 16): pairs interleaved, then quadruples,
 * then 128-bit quarters across registers, twice. */
static inline void transpose_avx512(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    }
}

#endif

/* AMX (Intel Xeon since Sapphire Rapids): the scores of bfloat16 queries and
 * keys with tile multiplies. One TDPBF16PS adds to a 16 x 16 float32 tile C
 * the products of a 16 x 32 bfloat16 tile A and a 32 x 16 one B: 16384
 * flops an instruction, where vdpbf16ps does 64 and an FMA 32.
 *
 * The layouts fit the scores without packing anything more:
 *   A = 16 keys x 32 dims, rows of the bfloat16 keys read in place (k_sl apart);
 *   B = 16 pairs of dims x 16 queries, rows of qt2 (attnx_pack_qt_bf16's pairs
 *       are the "VNNI" layout B must have: a row a pair of dims, the pair's
 *       two values side by side in each query's 32-bit column);
 *   C = 16 keys x 16 queries, a block of st (nk, ldq) stored in place.
 * Register blocking: 2 key blocks x 2 query blocks in tiles 0-3, the keys in
 * 4-5, the queries in 6-7 (the 8 tiles of palette 1, each 16 rows of 64 bytes).
 *
 * What the tiles do not cover goes to the AVX512_BF16 kernel (every CPU with
 * AMX-BF16 has AVX512_BF16): a head dimension that is not a multiple of 32
 * (a tile row is 32 dims), and the last nk % 16 keys (a tile reads 16 rows).
 *
 * The unit sums the 32 products of an instruction its own way, not FMA by
 * FMA as vdpbf16ps does (measured on a Xeon with AMX: neither order of FMAs
 * matched its bits over 512k random sums, and 1 + 2^-24 + 2^-24 gave
 * 1 + 2^-23, where FMAs in either order give 1), so this kernel matches attnx_qk_bf16_scalar within
 * float32 rounding of the sum, not bit for bit (tests/c/test_kernels.c bounds it). Like vdpbf16ps
 * it reads bfloat16 subnormals as zero and flushes subnormal sums.
 *
 * The tile configuration is per thread, and other code on the thread (a
 * oneDNN matmul under torch) may have its own loaded: the kernel saves it,
 * loads its own, and restores it (or releases the tiles if none was loaded)
 * before it returns. The OS must have granted the process the tile state
 * (dispatch.c asks Linux for it before handing out this table). */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push( \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")
#endif
#include <immintrin.h>

#define TILE 16      /* rows of a tile: keys of A and C, pairs of dims of B */
#define TILE_DIMS 32 /* bfloat16 values in a row of A: 64 bytes */

/* LDTILECFG's 64-byte operand. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes a row, tiles 0-15 */
    uint8_t rows[16];
} amx_config;

/* Palette 1, tiles 0-7 all 16 rows of 64 bytes. */
static const amx_config all_full = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {TILE, TILE, TILE, TILE, TILE, TILE, TILE, TILE},
};

/* st[j*ldq + i] *= scale over a block of 16 keys x 16 queries. */
static inline void scale_block(float *st, int64_t ldq, float scale)
{
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < TILE; j++)
        _mm512_storeu_ps(st + j * ldq, _mm512_mul_ps(s, _mm512_loadu_ps(st + j * ldq)));
}

/* Scores of (16 * nkb) keys x (16 * nqb) queries, nkb, nqb in {1, 2}, over
 * D (a multiple of 32) dims: C[kb][qb] in tile 2 kb + qb.
 * qt2: (D/2, ldq) pairs  k: (16 nkb, D) rows k_sl apart  st: (16 nkb, ldq) */
static void block(int nkb, int nqb, const uint32_t *qt2, int64_t ldq, const uint16_t *k,
                  int64_t k_sl, int64_t D, float scale, float *st)
{
    const int64_t a_stride = k_sl * (int64_t)sizeof *k, b_stride = ldq * (int64_t)sizeof *qt2;
    const int64_t c_stride = ldq * (int64_t)sizeof *st;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d = 0; d < D; d += TILE_DIMS) {
        const uint32_t *b = qt2 + d / 2 * ldq;
        _tile_loadd(4, k + d, a_stride);
        _tile_loadd(6, b, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (nqb == 2) {
            _tile_loadd(7, b + TILE, b_stride);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (nkb == 2) {
            _tile_loadd(5, k + TILE * k_sl + d, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (nqb == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    /* tile t into p, then scaled while its rows are in L1 */
#define STORE_SCALED(t, p)            \
    do {                              \
        _tile_stored(t, p, c_stride); \
        scale_block(p, ldq, scale);   \
    } while (0)
    float *st1 = st + TILE * ldq;
    STORE_SCALED(0, st);
    if (nqb == 2) STORE_SCALED(1, st + TILE);
    if (nkb == 2) STORE_SCALED(2, st1);
    if (nkb == 2 && nqb == 2) STORE_SCALED(3, st1 + TILE);
#undef STORE_SCALED
}

// qt2: (ceil(D/2), ldq) pairs  k: (nk, D) bf16 rows k_sl apart  st: (nk, ldq)
void attnx_qk_bf16_amx(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                       int nk, int64_t D, float scale, float *st)
{
    const int nk_tiles = D % TILE_DIMS ? 0 : nk / TILE * TILE; /* keys the tiles take */
    if (nk_tiles) {
        amx_config saved;
        _tile_storeconfig(&saved);
        _tile_loadconfig(&all_full);
        const int nqv = (nq + TILE - 1) / TILE; /* blocks of 16 queries (qt2 is padded) */
        for (int j = 0; j < nk_tiles; j += 2 * TILE) {
            const int nkb = nk_tiles - j >= 2 * TILE ? 2 : 1;
            for (int c = 0; c < nqv; c += 2)
                block(nkb, nqv - c >= 2 ? 2 : 1, qt2 + c * TILE, ldq, k + j * k_sl, k_sl, D, scale,
                      st + j * ldq + c * TILE);
        }
        if (saved.palette)
            _tile_loadconfig(&saved);
        else
            _tile_release();
    }
    if (nk_tiles < nk)
        attnx_qk_bf16_avx512(qt2, ldq, nq, k + nk_tiles * k_sl, k_sl, nk - nk_tiles, D, scale,
                             st + nk_tiles * ldq);
}

#if defined(__clang__)
#pragma clang attribute pop
#endif

#endif

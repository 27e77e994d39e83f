/* AMX (Intel Xeon since Sapphire Rapids): the scores of bfloat16 queries and
 * keys with tile multiplies (qk_bf16), and P·V over bfloat16 values with P
 * split exactly into bfloat16 parts (pv_bf16, below). One TDPBF16PS adds to a
 * 16 x 16 float32 tile C the products of a 16 x 32 bfloat16 tile A and a
 * 32 x 16 one B: 16384 flops an instruction, where vdpbf16ps does 64 and an
 * FMA 32.
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
 * Under precision "medium" the same blocking takes P·V with P rounded once
 * (pv_medium) and the backward's dV = Pᵀ·dO and dK = dSᵀ·Q (ptx_medium).
 *
 * What the tiles do not cover goes to the AVX512_BF16 kernel (every CPU with
 * AMX-BF16 has AVX512_BF16): a head dimension that is not a multiple of 32
 * (a tile row is 32 dims), and the last nk % 16 keys (a tile reads 16 rows).
 *
 * The unit sums the 32 products of an instruction its own way, not FMA by
 * FMA as vdpbf16ps does (measured on a Xeon with AMX: neither order of FMAs
 * matched its bits over 512k random sums, and 1 + 2^-24 + 2^-24 gave
 * 1 + 2^-23, where FMAs in either order give 1), so this kernel matches
 * attnx_qk_bf16_scalar within float32 rounding of the sum, not bit for bit
 * (tests/c/test_kernels.c bounds it). Like vdpbf16ps it reads bfloat16
 * subnormals as zero and flushes subnormal sums.
 *
 * The tile configuration is per thread, and other code on the thread (a
 * oneDNN matmul under torch) may have its own loaded: the kernel saves it,
 * loads its own, and restores it (or releases the tiles if none was loaded)
 * before it returns. The OS must have granted the process the tile state
 * (dispatch.c asks Linux for it before handing out this table). */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(ATTNX_EMULATE_AVX512)
#include "kernels/emulate_avx512.h"
#elif defined(ATTNX_TILE_MODEL) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))), \
                             apply_to = function)
#elif defined(ATTNX_TILE_MODEL) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#elif defined(__clang__)
#pragma clang attribute push(                                                          \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))), \
    apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")
#endif
#ifndef ATTNX_EMULATE_AVX512
#include <immintrin.h>
#endif

/* amx_emulated.c: the same kernels on the tile unit's model, named
 * *_amx_emulated (the emulated AVX-512 build has no real tiles either). */
#if defined(ATTNX_TILE_MODEL) || defined(ATTNX_EMULATE_AVX512)
#include "kernels/tile_model.h"
#endif
#ifdef ATTNX_TILE_MODEL
#define AMX(name) name##_amx_emulated
#else
#define AMX(name) name##_amx
#endif

#include "kernels/bf16_avx512.h"
#include "kernels/medium_rows_avx512.h"
#include "kernels/transpose_avx512.h"

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

/* Load a kernel's configuration (all_full, or decoding's rows_config);
 * *saved gets the thread's (palette 0 if none was loaded). */
static void tiles_take(amx_config *saved, const amx_config *config)
{
    _tile_storeconfig(saved);
    _tile_loadconfig(config);
}

/* The thread's configuration back, or the tiles released if it had none. */
static void tiles_give_back(const amx_config *saved)
{
    if (saved->palette)
        _tile_loadconfig(saved);
    else
        _tile_release();
}

/* st[j*ldq + i] *= scale over a block of 16 keys x 16 queries. */
static inline void scale_block(float *st, int64_t ldq, float scale)
{
    const __m512 s = _mm512_set1_ps(scale);
    for (int j = 0; j < TILE; j++)
        _mm512_storeu_ps(st + j * ldq, _mm512_mul_ps(s, _mm512_loadu_ps(st + j * ldq)));
}

/* x rounded to nearest at 8 significant bits: Veltkamp's c - (c - x), c = 65537 x. */
static inline __m512 high8(__m512 x)
{
    const __m512 c = _mm512_mul_ps(_mm512_set1_ps(65537.0f), x);
    return _mm512_sub_ps(c, _mm512_sub_ps(c, x));
}

/* The register blocking every kernel here shares: C in tiles 0-3, tile
 * 2r + c holding row block r < nr and column block c < nc (nr, nc in
 * {1, 2}, blocks of 16 rows and 16 float32 columns); A's row blocks in
 * tiles 4-5, B's column blocks in 6-7. */

/* C's tiles from c, rows ld floats apart. */
static inline void c_load(int nr, int nc, const float *c, int64_t ld)
{
    const int64_t stride = ld * (int64_t)sizeof *c;
    _tile_loadd(0, c, stride);
    if (nc == 2) _tile_loadd(1, c + TILE, stride);
    if (nr == 2) _tile_loadd(2, c + TILE * ld, stride);
    if (nr == 2 && nc == 2) _tile_loadd(3, c + TILE * ld + TILE, stride);
}

static inline void c_store(int nr, int nc, float *c, int64_t ld)
{
    const int64_t stride = ld * (int64_t)sizeof *c;
    _tile_stored(0, c, stride);
    if (nc == 2) _tile_stored(1, c + TILE, stride);
    if (nr == 2) _tile_stored(2, c + TILE * ld, stride);
    if (nr == 2 && nc == 2) _tile_stored(3, c + TILE * ld + TILE, stride);
}

static inline void c_zero(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* A's row blocks from a, rows `stride` bytes apart (the second 16 rows on). */
static inline void a_load(int nr, const void *a, int64_t stride)
{
    _tile_loadd(4, a, stride);
    if (nr == 2) _tile_loadd(5, (const char *)a + TILE * stride, stride);
}

/* B's column blocks from b, rows `stride` bytes apart (the second 64 bytes
 * on), and C += A · B. */
static inline void b_multiply(int nr, int nc, const void *b, int64_t stride)
{
    _tile_loadd(6, b, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (nc == 2) {
        _tile_loadd(7, (const char *)b + 64, stride);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (nr == 2) {
        _tile_dpbf16ps(2, 5, 6);
        if (nc == 2) _tile_dpbf16ps(3, 5, 7);
    }
}

/* Scores of (16 * nkb) keys x (16 * nqb) queries, nkb, nqb in {1, 2}, over
 * D (a multiple of 32) dims: C[kb][qb] in tile 2 kb + qb.
 * qt2: (D/2, ldq) pairs  k: (16 nkb, D) rows k_sl apart  st: (16 nkb, ldq) */
static void block(int nkb, int nqb, const uint32_t *qt2, int64_t ldq, const uint16_t *k,
                  int64_t k_sl, int64_t D, float scale, float *st)
{
    const int64_t a_stride = k_sl * (int64_t)sizeof *k, b_stride = ldq * (int64_t)sizeof *qt2;
    const int64_t c_stride = ldq * (int64_t)sizeof *st;
    c_zero();
    for (int64_t d = 0; d < D; d += TILE_DIMS) {
        a_load(nkb, k + d, a_stride);
        b_multiply(nkb, nqb, qt2 + d / 2 * ldq, b_stride);
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
void AMX(attnx_qk_bf16)(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                        int nk, int64_t D, float scale, float *st)
{
    const int nk_tiles = D % TILE_DIMS ? 0 : nk / TILE * TILE; /* keys the tiles take */
    if (nk_tiles) {
        amx_config saved;
        tiles_take(&saved, &all_full);
        const int nqv = (nq + TILE - 1) / TILE; /* blocks of 16 queries (qt2 is padded) */
        for (int j = 0; j < nk_tiles; j += 2 * TILE) {
            const int nkb = nk_tiles - j >= 2 * TILE ? 2 : 1;
            for (int c = 0; c < nqv; c += 2)
                block(nkb, nqv - c >= 2 ? 2 : 1, qt2 + c * TILE, ldq, k + j * k_sl, k_sl, D, scale,
                      st + j * ldq + c * TILE);
        }
        tiles_give_back(&saved);
    }
    if (nk_tiles < nk)
        attnx_qk_bf16_avx512(qt2, ldq, nq, k + nk_tiles * k_sl, k_sl, nk - nk_tiles, D, scale,
                             st + nk_tiles * ldq);
}

/* ---- P·V: pv_bf16 ----------------------------------------------------------
 * The tile product runs with the roles: C = 16 dims x 16 queries of the
 * transposed accumulator acct (Dv, ldq), loaded, summed into and stored back;
 * A = 16 dims x 32 keys of the values transposed (vt, below); B = 16 pairs of
 * keys x 16 queries of one part of P (the VNNI layout: a row a pair of keys,
 * the pair's two parts side by side in each query's 32-bit column). The
 * probabilities are laid out with the queries in the lanes, so B is cut from
 * them with no shuffle; the values need the transpose, once a tile. */

#define PARTS 3                                /* bfloat16 parts of a probability */
#define PAIRS (ATTNX_BK / 2)                   /* pairs of keys a tile, at most */
#define PART_LD (2 * TILE)                     /* queries a row of the parts: 2 tiles */
#define PART_FLOATS ((int64_t)PAIRS * PART_LD) /* one part: (PAIRS, PART_LD) */
_Static_assert(PARTS *PART_FLOATS == ATTNX_PV_BF16_WORK(0),
               "ATTNX_PV_BF16_WORK holds the parts, then the values transposed");

/* split_probs' third way: P rounded to bfloat16 once, one part (pv_medium). */
#define ROUND_ONCE 2

/* The three bfloat16 parts of the probabilities of 16 nqv queries (nqv = 1
 * or 2 tiles), in B's layout:
 *   parts[t][p][i] = part t of pt[2p][i] | part t of pt[2p+1][i] << 16
 * for pairs p < round32(nk) / 2 (keys past nk are 0) and i < 16 nqv. A part is
 * the top 16 bits of what is left of the probability: truncating to them keeps
 * 8 significant bits and the binade, so the difference is exact, and three
 * take all 24 bits. With nearest, the first two parts are rounded to nearest
 * instead (Veltkamp, as split_rows): still exact, and the second and third
 * parts are then half as large (what pv_split's dropped products need). With
 * nearest = ROUND_ONCE, one part: P rounded to nearest even (pv_medium).
 * Two query tiles at a time, so that their parts (24 KiB)
 * stay in L1 while the tiles read them: splitting the whole tile at once
 * wrote 48 KiB, and took twice as long on the Xeon. pt: (nk, ldq)
 * parts: (PARTS, PAIRS, PART_LD) */
static void split_probs(const float *pt, int64_t ldq, int nqv, int nk, int nearest, uint32_t *parts)
{
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const int pairs = (nk + 2 * TILE - 1) / (2 * TILE) * TILE;
    for (int p = 0; p < pairs; p++)
        for (int c = 0; c < nqv; c++) {
            const float *row = pt + 2 * p * ldq + c * TILE;
            __m512 a = 2 * p < nk ? _mm512_loadu_ps(row) : _mm512_setzero_ps();
            __m512 b = 2 * p + 1 < nk ? _mm512_loadu_ps(row + ldq) : _mm512_setzero_ps();
            uint32_t *dst = parts + p * PART_LD + c * TILE;
            if (nearest == ROUND_ONCE) { /* "medium": one part, P rounded */
                _mm512_storeu_si512(dst, bf16_pairs_avx512(a, b));
                continue;
            }
            for (int t = 0; t < PARTS - 1; t++) {
                const __m512i ta = nearest ? _mm512_castps_si512(high8(a))
                                           : _mm512_and_si512(_mm512_castps_si512(a), top);
                const __m512i tb = nearest ? _mm512_castps_si512(high8(b))
                                           : _mm512_and_si512(_mm512_castps_si512(b), top);
                /* ta >> 16 | (tb & top): a part to nearest of a subnormal
                 * may have bits below the top 16 (the unit flushes it anyway) */
                _mm512_storeu_si512(
                    dst + t * PART_FLOATS,
                    _mm512_ternarylogic_epi32(_mm512_srli_epi32(ta, 16), tb, top, 0xf8));
                a = _mm512_sub_ps(a, _mm512_castsi512_ps(ta));
                b = _mm512_sub_ps(b, _mm512_castsi512_ps(tb));
            }
            /* the last part is what is left (its low 16 bits are 0, unless it is
             * subnormal: cleared in b, as the unit flushes it anyway):
             * a >> 16 | (b & top) in one ternary logic op */
            _mm512_storeu_si512(
                dst + (PARTS - 1) * PART_FLOATS,
                _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                          _mm512_castps_si512(b), top, 0xf8));
        }
}

/* Dims d0 .. d0+15 of value row j, or 0 past the last row. */
static inline __m256i dims_of_key(const uint16_t *v, int64_t v_sl, int j, int nk, int64_t d0)
{
    return j < nk ? _mm256_loadu_si256((const __m256i *)(v + j * v_sl + d0))
                  : _mm256_setzero_si256();
}

/* The values transposed, in A's layout: vt[d*BK + j] = v[j][d] for d < Dv,
 * j < nk, and 0 for nk <= j < round32(nk). Two rows of 16 dims interleaved
 * make 16 pairs of keys a 32-bit lane (unpack orders the dims 0-3, 8-11, 4-7,
 * 12-15); 16 such registers transposed are 16 rows of 32 keys. Returns
 * nonzero if a value is inf or NaN. v: (nk, Dv) rows v_sl apart  vt: (Dv, BK) */
static int transpose_values(const uint16_t *v, int64_t v_sl, int nk, int64_t Dv, uint16_t *vt)
{
    static const int dim_of[TILE] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    const __m512i exponent = _mm512_set1_epi16(0x7f80);
    __m512i top = _mm512_setzero_si512(); /* the largest exponent field seen */
    for (int j0 = 0; j0 < nk; j0 += 2 * TILE)
        for (int64_t d0 = 0; d0 < Dv; d0 += TILE) {
            __m512 r[TILE];
            for (int p = 0; p < TILE; p++) {
                const __m256i a = dims_of_key(v, v_sl, j0 + 2 * p, nk, d0);
                const __m256i b = dims_of_key(v, v_sl, j0 + 2 * p + 1, nk, d0);
                const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
                const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                top = _mm512_max_epu16(top, _mm512_and_si512(ab, exponent));
                r[p] = _mm512_castsi512_ps(ab);
            }
            transpose_avx512(r);
            for (int x = 0; x < TILE; x++)
                _mm512_storeu_ps((float *)(vt + (d0 + dim_of[x]) * ATTNX_BK + j0), r[x]);
        }
    return _mm512_cmpeq_epi16_mask(top, exponent) != 0; /* all ones: inf or NaN */
}

/* acct over (16 ndb) dims x (16 nqb) queries (ndb, nqb in {1, 2}) plus
 * `steps` rows of 32 keys of the products of the values' nv parts (1 for
 * bfloat16 values, 3 for float32 ones split) and P's PARTS: with one value
 * part all three of P's, with three the six whose orders reach 2^-16
 * (a + b <= 2, counting from 0), the smaller first. C[db][qb] in tile
 * 2 db + qb, the values' parts in 4-5, P's in 6-7.
 * vt: (nv, 16 ndb, ldv) part b at vt + b·vpart  parts: (PARTS, PAIRS, PART_LD)
 * acct: (16 ndb, ldq) */
static void pv_block(int ndb, int nqb, const uint16_t *vt, int64_t ldv, int64_t vpart, int nv,
                     int np, const uint32_t *parts, int steps, float *acct, int64_t ldq)
{
    const int64_t a_stride = ldv * (int64_t)sizeof *vt;
    const int64_t b_stride = PART_LD * (int64_t)sizeof *parts;
    c_load(ndb, nqb, acct, ldq);
    for (int s = 0; s < steps; s++)
        for (int b = nv - 1; b >= 0; b--) { /* part b of the values, a of P */
            a_load(ndb, vt + b * vpart + s * TILE_DIMS, a_stride);
            for (int a = np - 1 - (nv > 1 ? b : 0); a >= 0; a--)
                b_multiply(ndb, nqb, parts + a * PART_FLOATS + s * TILE * PART_LD, b_stride);
        }
    c_store(ndb, nqb, acct, ldq);
}

/* acct += P · V on tiles for 16 nqv queries, with the values' nv parts
 * (pv_block) and P split per two tiles of queries (split_probs: to nearest
 * with three value parts, as pv_split's dropped products need).
 * pt: (nk, ldq)  vt: (nv, Dv, ldv)  parts: pv_bf16's work  acct: (Dv, ldq) */
static void pv_tiles(const float *pt, int64_t ldq, int nqv, int nk, int64_t Dv, const uint16_t *vt,
                     int64_t ldv, int64_t vpart, int nv, int round_once, uint32_t *parts,
                     float *acct)
{
    if (nk <= 0) return;
    const int steps = (nk + TILE_DIMS - 1) / TILE_DIMS, ndt = (int)(Dv / TILE);
    amx_config saved;
    tiles_take(&saved, &all_full);
    for (int c = 0; c < nqv; c += 2) {
        const int nqb = nqv - c >= 2 ? 2 : 1;
        split_probs(pt + c * TILE, ldq, nqb, nk, round_once ? ROUND_ONCE : nv > 1, parts);
        for (int db = 0; db < ndt; db += 2)
            pv_block(ndt - db >= 2 ? 2 : 1, nqb, vt + db * TILE * ldv, ldv, vpart, nv,
                     round_once ? 1 : PARTS, parts, steps, acct + db * TILE * ldq + c * TILE, ldq);
    }
    tiles_give_back(&saved);
}

/* The tile in FMAs, key by key (a value is inf or NaN): after the rescale,
 * the reference's bits. pt: (nk, ldq)  v: (nk, Dv) rows v_sl apart
 * acct: (Dv, ldq) */
static void pv_fmas(const float *pt, int64_t ldq, int nqv, const uint16_t *v, int64_t v_sl, int nk,
                    int64_t Dv, float *acct)
{
    for (int64_t d = 0; d < Dv; d++)
        for (int c = 0; c < nqv; c++) {
            float *a = acct + d * ldq + c * TILE;
            __m512 acc = _mm512_loadu_ps(a);
            for (int j = 0; j < nk; j++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(pt + j * ldq + c * TILE),
                                      _mm512_set1_ps(attnx_bf16_to_float(v[j * v_sl + d])), acc);
            _mm512_storeu_ps(a, acc);
        }
}

// pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)  work: ATTNX_PV_BF16_WORK(Dv)
void AMX(attnx_pv_bf16)(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                        int nk, int64_t Dv, const float *alpha, float *acct, float *work)
{
    const int nqv = (nq + TILE - 1) / TILE; /* tiles of 16 queries */
    uint32_t *parts = (uint32_t *)work;
    uint16_t *vt = (uint16_t *)(work + PARTS * PART_FLOATS);
    const int special = transpose_values(v, v_sl, nk, Dv, vt);
    if (alpha) acct_rescale_avx512(alpha, acct, ldq, Dv, nqv);
    if (special)
        pv_fmas(pt, ldq, nqv, v, v_sl, nk, Dv, acct);
    else
        pv_tiles(pt, ldq, nqv, nk, Dv, vt, ATTNX_BK, 0, 1, 0, parts, acct);
}

/* pv_bf16 with P rounded to bfloat16 once ("medium"): one tile product a
 * block of values where pv_bf16 takes three; a tile holding an inf or NaN
 * value takes the vdpbf16ps kernel (attnx_pv_medium_scalar's bits).
 * pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)  work: ATTNX_PV_BF16_WORK(Dv) */
void AMX(attnx_pv_medium)(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                          int nk, int64_t Dv, const float *alpha, float *acct, float *work)
{
    const int nqv = (nq + TILE - 1) / TILE;
    uint32_t *parts = (uint32_t *)work;
    uint16_t *vt = (uint16_t *)(work + PARTS * PART_FLOATS);
    if (transpose_values(v, v_sl, nk, Dv, vt)) {
        attnx_pv_medium_avx512(pt, ldq, nq, v, v_sl, nk, Dv, alpha, acct, work);
        return;
    }
    if (alpha) acct_rescale_avx512(alpha, acct, ldq, Dv, nqv);
    pv_tiles(pt, ldq, nqv, nk, Dv, vt, ATTNX_BK, 0, 1, 1, parts, acct);
}

/* ---- float32 on tiles: split_rows, split_pairs, qk_split -------------------
 * Each float32 value is split into three bfloat16 parts (kernels.h, split_rows)
 * so that its products become tile products of parts: the keys as rows of A
 * (split_rows), the queries as B's pairs (split_pairs, from pack_qt's
 * transposed queries). Six of the nine products of parts are summed. */

/* Lanes the split cannot take (scalar.c's off_split): |x| >= 2^100, inf or
 * NaN, or 0 < |x| < 2^-80. */
static inline __mmask16 off_split(__m512 x)
{
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 tiny = _mm512_mask_cmplt_epu32_mask(_mm512_test_epi32_mask(mag, mag), mag,
                                                        _mm512_set1_epi32((127 - 80) << 23));
    return _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32((127 + 100) << 23)) | tiny;
}

/* The top halves of a's and b's 32-bit lanes: 32 bfloat16 values, a's first. */
static inline __m512i top_halves(__m512 a, __m512 b)
{
    const __m512i odd =
        _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(a), odd, _mm512_castps_si512(b));
}

// x: (rows, n) rows x_sl apart  parts: (3, part) rows ldp apart
int AMX(attnx_split_rows)(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *parts,
                          int64_t part, int64_t ldp)
{
    __mmask16 special = 0;
    for (int j = 0; j < ATTNX_ROUND16(rows); j++)
        for (int64_t d = 0; d < n; d += 32) {
            const int64_t left = j < rows ? n - d : 0; /* values of the row from d */
            const __mmask16 ma = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 mb = left >= 32  ? 0xffff
                                 : left > 16 ? (__mmask16)((1u << (left - 16)) - 1)
                                             : 0;
            __m512 a = _mm512_maskz_loadu_ps(ma, x + j * x_sl + d);
            __m512 b = _mm512_maskz_loadu_ps(mb, x + j * x_sl + d + 16);
            special |= off_split(a) | off_split(b);
            uint16_t *out = parts + j * ldp + d;
            for (int t = 0; t < 2; t++) {
                const __m512 ah = high8(a), bh = high8(b);
                _mm512_storeu_si512(out + t * part, top_halves(ah, bh));
                a = _mm512_sub_ps(a, ah);
                b = _mm512_sub_ps(b, bh);
            }
            _mm512_storeu_si512(out + 2 * part, top_halves(a, b));
        }
    return special != 0;
}

// xt: (n, ldx)  parts: (3, part) as (np/2, ldx) pairs
int AMX(attnx_split_pairs)(const float *xt, int64_t ldx, int nx, int64_t n, int64_t np,
                           uint32_t *parts, int64_t part)
{
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    __mmask16 special = 0;
    for (int64_t p = 0; 2 * p < np; p++)
        for (int i = 0; i < nx; i += TILE) {
            __m512 a = 2 * p < n ? _mm512_loadu_ps(xt + 2 * p * ldx + i) : _mm512_setzero_ps();
            __m512 b =
                2 * p + 1 < n ? _mm512_loadu_ps(xt + (2 * p + 1) * ldx + i) : _mm512_setzero_ps();
            special |= off_split(a) | off_split(b);
            uint32_t *out = parts + p * ldx + i;
            for (int t = 0; t < 3; t++) {
                const __m512 ah = t < 2 ? high8(a) : a, bh = t < 2 ? high8(b) : b;
                /* ah >> 16 | (bh & top) in one ternary logic op */
                _mm512_storeu_si512(
                    out + t * part,
                    _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(ah), 16),
                                              _mm512_castps_si512(bh), top, 0xf8));
                a = _mm512_sub_ps(a, ah);
                b = _mm512_sub_ps(b, bh);
            }
        }
    return special != 0;
}

/* Scores of (16 nkb) keys x (16 nqb) queries (nkb, nqb in {1, 2}) over Dp
 * dims: C[kb][qb] in tile 2 kb + qb, the keys' parts in 4-5, the queries'
 * in 6-7. Per 32 dims the six products of parts, the smaller first.
 * qp: (3, Dp/2, ldq)  kp: (3, ., Dp)  st: (16 nkb, ldq) */
static void split_block(int nkb, int nqb, const uint32_t *qp, int64_t ldq, const uint16_t *kp,
                        int64_t kp_part, int64_t Dp, float *st)
{
    const int64_t a_stride = Dp * (int64_t)sizeof *kp, b_stride = ldq * (int64_t)sizeof *qp;
    const int64_t q_part = Dp / 2 * ldq;
    c_zero();
    for (int64_t d = 0; d < Dp; d += TILE_DIMS)
        for (int b = 2; b >= 0; b--) { /* part b of the keys, a of the queries */
            a_load(nkb, kp + b * kp_part + d, a_stride);
            for (int a = 2 - b; a >= 0; a--)
                b_multiply(nkb, nqb, qp + a * q_part + d / 2 * ldq, b_stride);
        }
    c_store(nkb, nqb, st, ldq);
}

// qp: (3, Dp/2, ldq) pairs  kp: (3, ., Dp) rows, part b at kp + b*kp_part  st: (round16(nk), ldq)
void AMX(attnx_qk_split)(const uint32_t *qp, int64_t ldq, int nq, const uint16_t *kp,
                         int64_t kp_part, int nk, int64_t Dp, float *st)
{
    const int nkv = (nk + TILE - 1) / TILE, nqv = (nq + TILE - 1) / TILE;
    amx_config saved;
    tiles_take(&saved, &all_full);
    for (int j = 0; j < nkv; j += 2)
        for (int c = 0; c < nqv; c += 2)
            split_block(nkv - j >= 2 ? 2 : 1, nqv - c >= 2 ? 2 : 1, qp + c * TILE, ldq,
                        kp + j * TILE * Dp, kp_part, Dp, st + j * TILE * ldq + c * TILE);
    tiles_give_back(&saved);
}

/* ---- float32 P·V on tiles: pv_split ----------------------------------------
 * pv_bf16's roles, with the values' three parts transposed once a call
 * (split_values in core/forward.c: vt (3, Dv, ldv), a dim a row, the keys
 * along it) and the probabilities split to nearest: per 32 keys the six
 * products of parts whose orders reach 2^-16, the smaller first. */

// pt: (nk, ldq)  vt: (3, Dv, ldv) parts, part stride vpart  acct: (Dv, ldq)  work:
// ATTNX_PV_BF16_WORK(0)
void AMX(attnx_pv_split)(const float *pt, int64_t ldq, int nq, const uint16_t *vt, int64_t ldv,
                         int64_t vpart, int nk, int64_t Dv, const float *alpha, float *acct,
                         float *work)
{
    const int nqv = (nq + TILE - 1) / TILE; /* tiles of 16 queries */
    if (alpha) acct_rescale_avx512(alpha, acct, ldq, Dv, nqv);
    pv_tiles(pt, ldq, nqv, nk, Dv, vt, ldv, vpart, 3, 0, (uint32_t *)work, acct);
}

/* ---- the backward's ptx under "medium": ptx_medium -------------------------
 * kernels.h's layouts are the tile product's as they are, nothing packed:
 *   A = 16 keys x 32 queries of the rounded tile pp (rows ldp apart);
 *   B = 16 pairs of queries x 16 dims of xp (a word of xp is B's pair);
 *   C = 16 keys x 16 dims, from zero over the queries (the contract's sum),
 *       then added to acc with AVX-512 (its one addition).
 * Register blocking as qk_bf16's: 2 key blocks x 2 dim blocks in tiles 0-3.
 * The last nq % 32 queries come from zero-padded copies of A's columns and
 * B's rows, so nothing of pp past column nq, or of xp past its ceil(nq/2)
 * rows, is read. Keys past a multiple of 16 and dims past a multiple of 16
 * go to the vdpbf16ps kernel, and so does a call whose tile or rows hold an
 * inf or NaN (the reference's bits there, as pv_medium). */

/* Nonzero if one of x's 16-bit values (rows ld apart, n values a row) is
 * inf or NaN: its exponent field (0x7f80 for bfloat16, 0x7c00 for float16)
 * all ones. x: (rows, n) */
static int any_special16(const uint16_t *x, int64_t ld, int rows, int64_t n, uint16_t field)
{
    const __m512i exponent = _mm512_set1_epi16((short)field);
    __m512i top = _mm512_setzero_si512(); /* the largest exponent field seen */
    for (int r = 0; r < rows; r++)
        for (int64_t e = 0; e < n; e += 32) {
            const __mmask32 k = n - e >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - e)) - 1u);
            const __m512i v = _mm512_maskz_loadu_epi16(k, x + r * ld + e);
            top = _mm512_max_epu16(top, _mm512_and_si512(v, exponent));
        }
    return _mm512_cmpeq_epi16_mask(top, exponent) != 0;
}

/* Keys j < 16 nkb, dims e < 16 ndb (nkb, ndb in {1, 2}) of a block: C[kb][db]
 * in tile 2 kb + db from zero over the nq queries, then acc += C.
 * pp: (16 nkb, ldp) bf16  xp: (ceil(nq/2), ldx) pairs  acc: (16 nkb, 16 ndb) rows ldacc apart */
static void ptx_block(int nkb, int ndb, const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp,
                      int64_t ldx, float *acc, int64_t ldacc)
{
    const int full = nq / TILE_DIMS, rest = nq % TILE_DIMS; /* whole rows of A: 32 queries */
    c_zero();
    for (int s = 0; s < full; s++) {
        a_load(nkb, pp + s * TILE_DIMS, ldp * (int64_t)sizeof *pp);
        b_multiply(nkb, ndb, xp + (int64_t)s * TILE * ldx, ldx * (int64_t)sizeof *xp);
    }
    if (rest) { /* queries 32 full .. nq-1: A's columns and B's rows zero past them */
        uint16_t at[2 * TILE][TILE_DIMS];
        uint32_t bt[TILE][2 * TILE];
        const int q0 = full * TILE_DIMS, m0 = full * TILE, pairs = (nq + 1) / 2;
        const __mmask32 k = (__mmask32)((1u << rest) - 1u);
        for (int r = 0; r < TILE * nkb; r++)
            _mm512_storeu_si512(at[r], _mm512_maskz_loadu_epi16(k, pp + r * ldp + q0));
        for (int m = 0; m < TILE; m++)
            for (int c = 0; c < ndb; c++)
                _mm512_storeu_si512(bt[m] + c * TILE,
                                    m0 + m < pairs
                                        ? _mm512_loadu_si512(xp + (m0 + m) * ldx + c * TILE)
                                        : _mm512_setzero_si512());
        a_load(nkb, at, sizeof at[0]);
        b_multiply(nkb, ndb, bt, sizeof bt[0]);
    }
    float c[2 * TILE][2 * TILE];
    c_store(nkb, ndb, &c[0][0], 2 * TILE);
    for (int r = 0; r < TILE * nkb; r++)
        for (int d = 0; d < ndb; d++) {
            float *to = acc + r * ldacc + d * TILE;
            _mm512_storeu_ps(to,
                             _mm512_add_ps(_mm512_loadu_ps(to), _mm512_loadu_ps(c[r] + d * TILE)));
        }
}

// pp: (nk, ldp) bf16  xp: (ceil(nq/2), ldx) pairs  acc: (nk, n) rows ldacc apart
void AMX(attnx_ptx_medium)(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp, int64_t ldx,
                           int nk, int64_t n, float *acc, int64_t ldacc)
{
    const int nk16 = nk / TILE * TILE, pairs = (nq + 1) / 2; /* keys the tiles take */
    const int64_t n16 = n / TILE * TILE;                     /* dims the tiles take */
    if (nq <= 0 || !nk16 || !n16 || any_special16(pp, ldp, nk16, nq, 0x7f80) ||
        any_special16((const uint16_t *)xp, 2 * ldx, pairs, 2 * n16, 0x7f80)) {
        attnx_ptx_medium_avx512(pp, ldp, nq, xp, ldx, nk, n, acc, ldacc);
        return;
    }
    amx_config saved;
    tiles_take(&saved, &all_full);
    for (int j = 0; j < nk16; j += 2 * TILE)
        for (int64_t e = 0; e < n16; e += 2 * TILE)
            ptx_block(nk16 - j >= 2 * TILE ? 2 : 1, n16 - e >= 2 * TILE ? 2 : 1, pp + j * ldp, ldp,
                      nq, xp + e, ldx, acc + j * ldacc + e, ldacc);
    tiles_give_back(&saved);
    if (n16 < n) /* the last dims of the tiles' keys */
        attnx_ptx_medium_avx512(pp, ldp, nq, xp + n16, ldx, nk16, n - n16, acc + n16, ldacc);
    if (nk16 < nk) /* the last keys, every dim */
        attnx_ptx_medium_avx512(pp + nk16 * ldp, ldp, nq, xp, ldx, nk - nk16, n, acc + nk16 * ldacc,
                                ldacc);
}

/* ---- decoding under "medium": qk_dot_medium, pv_rows_medium ---------------
 * A GQA group's few query rows (nq <= 16; dot_max_nq is 8) against a run of
 * the cache, every product of the group one tile product's:
 *   scores: C = 16 keys x 16 queries, A = 16 keys x 32 dims of the keys
 *     (a bfloat16 cache with D % 32 == 0 read in place, else its rows as
 *     medium_load reads them into rows of round32(D)), B = 16 pairs of dims
 *     x 16 queries (qp transposed once a call, queries past nq 0); C's
 *     column i times each key's factor is row i of st;
 *   P·V: C = the nq rows x 16 dims of acc, loaded and stored in place
 *     (rows_config: C and A have nq rows), A = nq rows x 32 keys of P
 *     rounded (medium_prob_pairs, 0 past the keys), B = 16 pairs of keys x
 *     16 dims: two value rows interleaved into pairs, 32 keys x 32 dims at
 *     a time.
 * Keys past a multiple of 16 (scores), fewer than 16 keys (P·V), a head
 * dimension past DEC_DMAX, and a call whose queries, keys or values hold an
 * inf or NaN go to the vdpbf16ps kernels (their bits; within float32
 * rounding of the sums otherwise). */

#define DEC_DMAX 512 /* the largest D the scores' tiles take: A's rows on the stack */

/* Nonzero if a row element of a float16 or bfloat16 cache is inf or NaN (int8: never).
 * x: (rows, n) rows sl apart */
static int any_special_rows(int kind, const void *x, int64_t sl, int rows, int64_t n)
{
    if (kind == ATTNX_MEDIUM_I8 || rows <= 0) return 0;
    return any_special16(x, sl, rows, n, kind == ATTNX_MEDIUM_F16 ? 0x7c00 : 0x7f80);
}

/* All full but C (tiles 0-3) and A (4-5): nq rows, the group's. */
static amx_config rows_config(int nq)
{
    amx_config c = all_full;
    for (int t = 0; t < 6; t++) c.rows[t] = (uint8_t)nq;
    return c;
}

// qp: (nq, ldp) pairs  k: (nk, D) rows k_sl apart  scale_k: (nk) s_sl apart  st: (nq, ldk)
void AMX(attnx_qk_dot_medium)(int kind, const uint32_t *qp, int64_t ldp, int nq, const void *k,
                              int64_t k_sl, const float *scale_k, int64_t s_sl, int nk, int64_t D,
                              float scale, float *st, int64_t ldk)
{
    const int nk16 = nk / TILE * TILE; /* keys the tiles take */
    const int64_t Dp = (D + TILE_DIMS - 1) / TILE_DIMS * TILE_DIMS;
    const int64_t esize = kind == ATTNX_MEDIUM_I8 ? 1 : 2;
    if (!nk16 || nq <= 0 || nq > TILE || Dp > DEC_DMAX ||
        any_special16((const uint16_t *)qp, 2 * ldp, nq, D, 0x7f80) ||
        any_special_rows(kind, k, k_sl, nk16, D)) {
        attnx_qk_dot_medium_avx512(kind, qp, ldp, nq, k, k_sl, scale_k, s_sl, nk, D, scale, st,
                                   ldk);
        return;
    }
    uint32_t bt[DEC_DMAX / 2][TILE]; /* B: pairs of dims x queries */
    for (int64_t p = 0; p < Dp / 2; p++)
        for (int i = 0; i < TILE; i++) bt[p][i] = i < nq ? qp[i * ldp + p] : 0u;
    const int in_place = kind == ATTNX_MEDIUM_BF16 && D % TILE_DIMS == 0;
    uint16_t rows[2 * TILE][DEC_DMAX]; /* A's keys as bfloat16, when not in place */
    amx_config saved;
    tiles_take(&saved, &all_full);
    for (int j = 0; j < nk16; j += 2 * TILE) {
        const int nkb = nk16 - j >= 2 * TILE ? 2 : 1;
        const uint16_t *a = rows[0];
        int64_t a_stride = sizeof rows[0];
        if (in_place) {
            a = (const uint16_t *)k + j * k_sl, a_stride = k_sl * 2;
        } else {
            for (int r = 0; r < TILE * nkb; r++) {
                const char *x = (const char *)k + (j + r) * k_sl * esize;
                for (int64_t c = 0; c < Dp; c += 32)
                    _mm512_storeu_si512(rows[r] + c,
                                        D - c >= 32
                                            ? medium_load(x + c * esize, kind)
                                            : medium_load_tail(x + c * esize, (int)(D - c), kind));
            }
        }
        c_zero();
        for (int64_t d = 0; d < Dp; d += TILE_DIMS) {
            a_load(nkb, a + d, a_stride);
            b_multiply(nkb, 1, bt[d / 2], sizeof bt[0]);
        }
        float c[2 * TILE][TILE];
        c_store(nkb, 1, &c[0][0], TILE);
        for (int r = 0; r < TILE * nkb; r++) {
            const float f = scale_k ? scale * scale_k[(j + r) * s_sl] : scale;
            for (int i = 0; i < nq; i++) st[i * ldk + j + r] = c[r][i] * f;
        }
    }
    tiles_give_back(&saved);
    if (nk16 < nk)
        attnx_qk_dot_medium_avx512(kind, qp, ldp, nq, (const char *)k + nk16 * k_sl * esize, k_sl,
                                   scale_k ? scale_k + nk16 * s_sl : NULL, s_sl, nk - nk16, D,
                                   scale, st + nk16, ldk);
}

/* Words 2t, 2t+1 of pairs_lo: words t of a and b (t < 16); of pairs_hi: words 16 + t. */
static const uint16_t pairs_lo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t pairs_hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                      53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                      27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// pt: (nq, ldk)  v: (nk, Dv) rows v_sl apart  scale_v: (nk) s_sl apart  acc: (nq, ldacc)
void AMX(attnx_pv_rows_medium)(int kind, const float *pt, int64_t ldk, int nq, const void *v,
                               int64_t v_sl, const float *scale_v, int64_t s_sl, int nk, int64_t Dv,
                               const float *alpha, float *acc, int64_t ldacc)
{
    if (nk < TILE || nq <= 0 || nq > TILE || any_special_rows(kind, v, v_sl, nk, Dv)) {
        attnx_pv_rows_medium_avx512(kind, pt, ldk, nq, v, v_sl, scale_v, s_sl, nk, Dv, alpha, acc,
                                    ldacc);
        return;
    }
    const int64_t esize = kind == ATTNX_MEDIUM_I8 ? 1 : 2, row = v_sl * esize;
    if (alpha)
        for (int i = 0; i < nq; i++)
            for (int64_t d = 0; d < Dv; d += 16) {
                float *a = acc + i * ldacc + d;
                _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_set1_ps(alpha[i]), _mm512_loadu_ps(a)));
            }
    const __m512i lo = _mm512_loadu_si512(pairs_lo), hi = _mm512_loadu_si512(pairs_hi);
    uint32_t pp[TILE][ATTNX_BK / 2]; /* A: P's pairs of keys, rows nq */
    uint32_t vb[TILE][2 * TILE];     /* B: pairs of keys x 32 dims */
    const amx_config config = rows_config(nq);
    amx_config saved;
    tiles_take(&saved, &config);
    for (int j = 0; j < nk; j += ATTNX_BK) {
        const int nb = nk - j < ATTNX_BK ? nk - j : ATTNX_BK, steps = (nb + 31) / 32;
        memset(pp, 0, sizeof pp);
        medium_prob_pairs(pt + j, ldk, nq, scale_v ? scale_v + j * s_sl : NULL, s_sl, nb, pp[0]);
        const char *vj = (const char *)v + j * row;
        for (int64_t d0 = 0; d0 < Dv; d0 += 2 * TILE) {
            c_load(1, 2, acc + d0, ldacc);
            for (int s = 0; s < steps; s++) {
                for (int m = 0; m < TILE; m++) {
                    const int k0 = 32 * s + 2 * m; /* keys k0, k0 + 1 of the chunk */
                    const char *x = vj + k0 * row + d0 * esize;
                    const __m512i e = k0 < nb ? medium_load(x, kind) : _mm512_setzero_si512();
                    const __m512i o =
                        k0 + 1 < nb ? medium_load(x + row, kind) : _mm512_setzero_si512();
                    _mm512_storeu_si512(vb[m], _mm512_permutex2var_epi16(e, lo, o));
                    _mm512_storeu_si512(vb[m] + TILE, _mm512_permutex2var_epi16(e, hi, o));
                }
                a_load(1, pp[0] + s * TILE, sizeof pp[0]);
                b_multiply(1, 2, vb, sizeof vb[0]);
            }
            c_store(1, 2, acc + d0, ldacc);
        }
    }
    tiles_give_back(&saved);
}

/* ---- the tiles' peak (kernels.h: amx_burn) ------------------------------------------- */
double AMX(attnx_amx_burn)(int64_t rounds, float *sink)
{
    uint16_t ab[TILE * TILE_DIMS]; /* a tile of A or B: 16 rows of 32 values */
    float c[TILE * TILE];
    for (int e = 0; e < TILE * TILE_DIMS; e++) ab[e] = 0x3b80; /* 2^-8 */
    amx_config saved;
    tiles_take(&saved, &all_full);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t r = 0; r < rounds; r++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, TILE * (int64_t)sizeof *c);
    float s = c[0];
    _tile_stored(3, c, TILE * (int64_t)sizeof *c);
    tiles_give_back(&saved);
    *sink = s + c[0];
    return (double)rounds * 4 * TILE * TILE * TILE_DIMS * 2;
}

#if defined(__clang__) && !defined(ATTNX_EMULATE_AVX512)
#pragma clang attribute pop
#endif

#endif

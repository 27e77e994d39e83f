/* AVX512_BF16: the scores of bfloat16 queries and keys with vdpbf16ps, which
 * adds two products of bfloat16 pairs to each float32 lane, 32 products a
 * vector and instruction where an FMA does 16. Enabled for this file alone
 * (target pragma); dispatch.c hands out attnx_kernels_avx512_bf16 (avx512.c:
 * the AVX-512 table with qk_bf16 = attnx_qk_bf16_avx512) only when cpuid
 * reports AVX512_BF16 along with AVX-512 F, BW and VL. */
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(ATTNX_EMULATE_AVX512)
#include "kernels/emulate_avx512.h" /* test builds: SIMDe's portable intrinsics */
#else
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16"))), \
                             apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512bf16")
#endif
#include <immintrin.h>
#define ATTNX_AS_BF16(x) ((__m512bh)(x)) /* 32-bit pairs as vdpbf16ps's operand */
#endif

#include "kernels/bf16_avx512.h"

#define BF_W 16 /* float32 lanes (query pairs) a vector */
#define BF_MR 8 /* keys x vectors of queries: 16 accumulators */
#define BF_NV 2

#define BF_INLINE static inline __attribute__((always_inline))

/* Dims 2p and 2p+1 of a key row, as one 32-bit word in every lane. */
BF_INLINE __m512i pair_bcast(const uint16_t *k)
{
    uint32_t w;
    memcpy(&w, k, sizeof w);
    return _mm512_set1_epi32((int)w);
}

/* Register block: MR keys x NV vectors of queries, over the pairs of dims;
 * each step broadcasts one pair of a key row against NV vectors of packed
 * query pairs. */
BF_INLINE void qk_bf16_block(const int MR, const int NV, const uint32_t *qt2, int64_t ldq,
                             const uint16_t *k, int64_t k_sl, int64_t D, float scale, float *st)
{
    __m512 acc[BF_MR][BF_NV];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = D / 2;
    for (int64_t p = 0; p < pairs; p++) {
        if ((p & 15) == 0) /* the next block's keys: short rows defeat the hardware prefetcher */
            for (int r = 0; r < MR; r++) __builtin_prefetch(k + (r + MR) * k_sl + 2 * p, 0, 3);
        __m512i qv[BF_NV];
        for (int c = 0; c < NV; c++) qv[c] = _mm512_loadu_si512(qt2 + p * ldq + c * BF_W);
        for (int r = 0; r < MR; r++) {
            const __m512i kb = pair_bcast(k + r * k_sl + 2 * p);
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ATTNX_AS_BF16(qv[c]), ATTNX_AS_BF16(kb));
        }
    }
    if (D & 1) { /* the last dim alone: its pair's upper half is 0 in both */
        __m512i qv[BF_NV];
        for (int c = 0; c < NV; c++) qv[c] = _mm512_loadu_si512(qt2 + pairs * ldq + c * BF_W);
        for (int r = 0; r < MR; r++) {
            const __m512i kb = _mm512_set1_epi32((int)k[r * k_sl + D - 1]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ATTNX_AS_BF16(qv[c]), ATTNX_AS_BF16(kb));
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(st + r * ldq + c * BF_W, _mm512_mul_ps(acc[r][c], s));
}

#define BF_CASE(mr, nv)                                                            \
    case (mr) * 8 + (nv):                                                          \
        qk_bf16_block(mr, nv, qt2 + i, ldq, kj, k_sl, D, scale, st + j * ldq + i); \
        break;

// qt2: (ceil(D/2), ldq) pairs  k: (nk, D) bf16 rows k_sl apart  st: (nk, ldq)
void attnx_qk_bf16_avx512(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                          int nk, int64_t D, float scale, float *st)
{
    const int nvec = (nq + BF_W - 1) / BF_W;
    for (int j = 0; j < nk; j += BF_MR) {
        const int mr = nk - j < BF_MR ? nk - j : BF_MR;
        const uint16_t *kj = k + j * k_sl;
        for (int c0 = 0; c0 < nvec; c0 += BF_NV) {
            const int nv = nvec - c0 < BF_NV ? nvec - c0 : BF_NV;
            const int i = c0 * BF_W;
            switch (mr * 8 + nv) {
                // clang-format off
                BF_CASE(1, 1) BF_CASE(1, 2) BF_CASE(2, 1) BF_CASE(2, 2)
                BF_CASE(3, 1) BF_CASE(3, 2) BF_CASE(4, 1) BF_CASE(4, 2)
                BF_CASE(5, 1) BF_CASE(5, 2) BF_CASE(6, 1) BF_CASE(6, 2)
                BF_CASE(7, 1) BF_CASE(7, 2) BF_CASE(8, 1) BF_CASE(8, 2)
                // clang-format on
            }
        }
    }
}

/* ---- P·V under precision "medium": pv_medium ------------------------------
 * acct[d][i] (a dim a row, the queries in the lanes) takes the products of the
 * probabilities rounded to bfloat16 and the bfloat16 values a pair of keys at
 * a time: the probabilities of keys 2m and 2m+1 for 16 queries are one vector
 * of pairs, and the values v[2m][d] | v[2m+1][d] << 16 one 32-bit word
 * broadcast. Both are laid out once a call, in work:
 *   pp (pairs, 16 nqv) the probabilities' pairs, from its start;
 *   vp (pairs, Dv) the values' pairs, from PM_VALUES floats on
 * (pairs = ceil(nk / 2); a missing odd key is 0 in both). */
#define PM_R 4                              /* dims a register block */
#define PM_NV 4                             /* vectors of queries, at most */
#define PM_VALUES (3 * (ATTNX_BK / 2) * 32) /* where vp starts in work */
_Static_assert(PM_VALUES + ATTNX_BK / 2 * 16 <= ATTNX_PV_BF16_WORK(16), "pv_medium's work fits");
_Static_assert(ATTNX_BK / 2 * ATTNX_BQ <= PM_VALUES, "pp fits before vp");

/* acct rows d0 .. d0+PM_R-1, NV vectors of queries: one vdpbf16ps a pair of
 * keys, dim and vector. pp: (pairs, ldp)  vp: (pairs, Dv) from dim d0
 * acct: (PM_R, ldq) */
BF_INLINE void pv_medium_block(const int NV, const uint32_t *pp, int64_t ldp, const uint32_t *vp,
                               int64_t Dv, int pairs, float *acct, int64_t ldq)
{
    __m512 acc[PM_R][PM_NV];
    for (int r = 0; r < PM_R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_loadu_ps(acct + r * ldq + c * BF_W);
    for (int m = 0; m < pairs; m++) {
        __m512i pv[PM_NV];
        for (int c = 0; c < NV; c++) pv[c] = _mm512_loadu_si512(pp + m * ldp + c * BF_W);
        for (int r = 0; r < PM_R; r++) {
            const __m512i vb = _mm512_set1_epi32((int)vp[m * Dv + r]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ATTNX_AS_BF16(pv[c]), ATTNX_AS_BF16(vb));
        }
    }
    for (int r = 0; r < PM_R; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acct + r * ldq + c * BF_W, acc[r][c]);
}

// pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)  work: ATTNX_PV_BF16_WORK(Dv)
// (nk <= ATTNX_BK, nq <= ATTNX_BQ, Dv % 16 == 0)
void attnx_pv_medium_avx512(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                            int nk, int64_t Dv, const float *alpha, float *acct, float *work)
{
    const int nqv = (nq + BF_W - 1) / BF_W, pairs = (nk + 1) / 2;
    const int64_t ldp = (int64_t)nqv * BF_W;
    uint32_t *pp = (uint32_t *)work, *vp = (uint32_t *)(work + PM_VALUES);
    for (int m = 0; m < pairs; m++) {
        const int odd = 2 * m + 1 < nk;
        for (int c = 0; c < nqv; c++) {
            const float *row = pt + 2 * m * ldq + c * BF_W;
            const __m512 b = odd ? _mm512_loadu_ps(row + ldq) : _mm512_setzero_ps();
            _mm512_storeu_si512(pp + m * ldp + c * BF_W,
                                bf16_pairs_avx512(_mm512_loadu_ps(row), b));
        }
        for (int64_t d = 0; d < Dv; d += 16) {
            const uint16_t *ve = v + 2 * m * v_sl + d;
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)ve));
            const __m512i b =
                odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ve + v_sl)))
                    : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + m * Dv + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
    if (alpha) acct_rescale_avx512(alpha, acct, ldq, Dv, nqv);
    for (int64_t d0 = 0; d0 < Dv; d0 += PM_R)
        for (int c0 = 0; c0 < nqv; c0 += PM_NV) {
            const int nv = nqv - c0 < PM_NV ? nqv - c0 : PM_NV;
            const uint32_t *pc = pp + c0 * BF_W;
            float *ac = acct + d0 * ldq + c0 * BF_W;
            switch (nv) {
            case 1: pv_medium_block(1, pc, ldp, vp + d0, Dv, pairs, ac, ldq); break;
            case 2: pv_medium_block(2, pc, ldp, vp + d0, Dv, pairs, ac, ldq); break;
            case 3: pv_medium_block(3, pc, ldp, vp + d0, Dv, pairs, ac, ldq); break;
            default: pv_medium_block(4, pc, ldp, vp + d0, Dv, pairs, ac, ldq); break;
            }
        }
}

/* ---- precision "medium" for inputs that are not bfloat16 (kernels.h) ------------------- */

// x: (rows, n) rows x_sl apart  dst: (rows, ld)
int attnx_round_rows_avx512(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *dst,
                            int64_t ld)
{
    int over = 0;
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i inf16 = _mm512_set1_epi32(0x7f80), abs16 = _mm512_set1_epi32(0x7fff);
    for (int j = 0; j < rows; j++) {
        const float *r = x + j * x_sl;
        uint16_t *o = dst + j * ld;
        int64_t d = 0;
        for (; d + BF_W <= n; d += BF_W) {
            const __m512 v = _mm512_loadu_ps(r + d);
            const __m512i h = bf16_round_avx512(v);
            const __mmask16 finite = /* |v| < inf, as bits */
                _mm512_cmpgt_epu32_mask(inf, _mm512_and_si512(_mm512_castps_si512(v), abs));
            over |= _mm512_mask_cmpeq_epi32_mask(finite, _mm512_and_si512(h, abs16), inf16) != 0;
            _mm256_storeu_si256((__m256i *)(o + d), _mm512_cvtepi32_epi16(h));
        }
        for (; d < n; d++) { /* the row's tail */
            o[d] = attnx_bf16_round(r[d]);
            over |= attnx_bf16_overflowed(r[d], o[d]);
        }
        for (; d < ld; d++) o[d] = 0;
    }
    return over;
}

// xt: (n, ldx) floats in, (ceil(n/2), ldx) pairs out, in place
void attnx_round_pairs_avx512(float *xt, int64_t ldx, int nx, int64_t n)
{
    const int64_t lanes = ATTNX_ROUND16(nx);
    for (int64_t p = 0; 2 * p < n; p++)
        for (int64_t i = 0; i < lanes; i += BF_W) {
            const __m512 even = _mm512_loadu_ps(xt + 2 * p * ldx + i);
            const __m512 odd =
                2 * p + 1 < n ? _mm512_loadu_ps(xt + (2 * p + 1) * ldx + i) : _mm512_setzero_ps();
            _mm512_storeu_si512(xt + p * ldx + i, bf16_pairs_avx512(even, odd));
        }
}

/* ---- the bfloat16 dot products' peak (kernels.h: bf16dot_burn) ----------------------- */
double attnx_bf16dot_burn_avx512(int64_t rounds, float *sink)
{
    __m512 acc[ATTNX_PEAK_CHAINS];
    const __m512i x = _mm512_set1_epi32(0x3b803b80); /* 2^-8 in both halves */
    for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t r = 0; r < rounds; r++)
        for (int i = 0; i < ATTNX_PEAK_CHAINS; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], ATTNX_AS_BF16(x), ATTNX_AS_BF16(x));
    __m512 s = acc[0];
    for (int i = 1; i < ATTNX_PEAK_CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    float lanes[BF_W];
    _mm512_storeu_ps(lanes, s);
    *sink = lanes[0];
    return (double)rounds * ATTNX_PEAK_CHAINS * BF_W * 4;
}

#if defined(__clang__) && !defined(ATTNX_EMULATE_AVX512)
#pragma clang attribute pop
#endif

#endif

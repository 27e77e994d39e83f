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
#endif

#include "kernels/bf16_avx512.h"
#include "kernels/hsum_avx512.h"
#include "kernels/medium_rows_avx512.h"
#include "kernels/prefetch.h"

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

/* ---- decoding under precision "medium" (kernels.h: qk_dot_medium, pv_rows_medium) ----
 * The rows as medium_rows_avx512.h reads them (medium_load: bfloat16, int8
 * and float16 rows as bfloat16 words; medium_prob_pairs: P rounded). */

/* Keys j .. j+NK-1 (NK 1..4, rows `row` bytes apart) against query rows
 * i .. i+MR-1 (MR 1..4): each chunk of 32 dims of a key is loaded once for
 * all the rows; the sums reduced in hsum16's order (hsum4x4, hsum4), then
 * times each key's factor f. qp: (MR, ldp)  k: NK rows  st: (MR, ldk) */
BF_INLINE void qk_dot_medium_block(const int MR, const int NK, const int kind, const uint32_t *qp,
                                   int64_t ldp, const char *k, int64_t row, int64_t D,
                                   const float *f, float *st, int64_t ldk)
{
    const int64_t full = D / 32, esize = kind == ATTNX_MEDIUM_I8 ? 1 : 2;
    const int tail = (int)(D % 32);
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c <= full; c++) {
        if (c == full && !tail) break;
        __m512i kv[4];
        for (int r = 0; r < NK; r++) {
            const char *x = k + r * row + 32 * c * esize;
            kv[r] = c < full ? medium_load(x, kind) : medium_load_tail(x, tail, kind);
        }
        for (int i = 0; i < MR; i++) {
            const __m512i qv = _mm512_loadu_si512(qp + i * ldp + 16 * c);
            for (int r = 0; r < NK; r++)
                a[i][r] = _mm512_dpbf16_ps(a[i][r], ATTNX_AS_BF16(qv), ATTNX_AS_BF16(kv[r]));
        }
    }
    float sums[4][4];
    if (MR >= 3 && NK == 4)
        hsum4x4_avx512(a, MR, &sums[0][0], 4);
    else
        for (int i = 0; i < MR; i++) hsum4_avx512(a[i][0], a[i][1], a[i][2], a[i][3], sums[i]);
    if (NK == 4) { /* the factors as one vector a row */
        const __m128 fv = _mm_loadu_ps(f);
        for (int i = 0; i < MR; i++)
            _mm_storeu_ps(st + i * ldk, _mm_mul_ps(_mm_loadu_ps(sums[i]), fv));
        return;
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NK; r++) st[i * ldk + r] = sums[i][r] * f[r];
}

#define QM_CASE(mr, nk)                                                                       \
    case (mr) * 8 + (nk):                                                                     \
        qk_dot_medium_block(mr, nk, kind, qp + i * ldp, ldp, kj, row, D, f, st + i * ldk + j, \
                            ldk);                                                             \
        break;

// qp: (nq, ldp) pairs  k: (nk, D) rows k_sl apart  scale_k: (nk) s_sl apart  st: (nq, ldk)
void attnx_qk_dot_medium_avx512(int kind, const uint32_t *qp, int64_t ldp, int nq, const void *k,
                                int64_t k_sl, const float *scale_k, int64_t s_sl, int nk, int64_t D,
                                float scale, float *st, int64_t ldk)
{
    const int64_t row = k_sl * (kind == ATTNX_MEDIUM_I8 ? 1 : 2);
    const int64_t ahead = rows_ahead(row, kind == ATTNX_MEDIUM_I8);
    const int64_t bytes = D * (kind == ATTNX_MEDIUM_I8 ? 1 : 2);
    for (int j = 0; j < nk; j += 4) {
        const int nb = nk - j < 4 ? nk - j : 4;
        const char *kj = (const char *)k + j * row;
        float f[4];
        for (int r = 0; r < 4; r++) {
            prefetch_row(k, (j + ahead + r) * row, bytes);
            f[r] = scale_k && r < nb ? scale * scale_k[(j + r) * s_sl] : scale;
        }
        for (int i = 0; i < nq; i += 4) {
            const int mr = nq - i < 4 ? nq - i : 4;
            switch (mr * 8 + nb) {
                // clang-format off
                QM_CASE(1, 1) QM_CASE(1, 2) QM_CASE(1, 3) QM_CASE(1, 4)
                QM_CASE(2, 1) QM_CASE(2, 2) QM_CASE(2, 3) QM_CASE(2, 4)
                QM_CASE(3, 1) QM_CASE(3, 2) QM_CASE(3, 3) QM_CASE(3, 4)
                QM_CASE(4, 1) QM_CASE(4, 2) QM_CASE(4, 3) QM_CASE(4, 4)
                // clang-format on
            }
        }
    }
}

/* pv_rows_medium: lanes are dims, and a pair of keys is one 32-bit word.
 * vpunpck{l,h}wd of the 32-dim chunks of rows 2m and 2m+1 give the pairs of
 * dims {8g + t} (lo) and {8g + 4 + t} (hi), g, t < 4, in their lanes; the
 * accumulators are kept in that order within a call (to_lo, to_hi on the
 * way in, from_pairs on the way out), so a pair of keys costs two unpacks. */
static const int32_t to_lo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const int32_t to_hi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const int32_t from_pairs[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                       7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                       26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

/* Rows i < MR (1..4) of acc, NC (1, 2) chunks of 32 dims from v's column 0:
 * one vdpbf16ps a pair of keys, row and half chunk.
 * pp: (MR, BK/2)  v: (nk, 32 NC) rows `row` bytes apart  acc: (MR, ldacc) */
BF_INLINE void pv_rows_medium_block(const int MR, const int NC, const int kind, const uint32_t *pp,
                                    const char *v, int64_t row, int nk, const float *alpha,
                                    float *acc, int64_t ldacc, int64_t ahead)
{
    const int64_t esize = kind == ATTNX_MEDIUM_I8 ? 1 : 2;
    __m512 a[4][4];
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < NC; c++) {
            __m512 x0 = _mm512_loadu_ps(acc + i * ldacc + 32 * c);
            __m512 x1 = _mm512_loadu_ps(acc + i * ldacc + 32 * c + 16);
            if (alpha) {
                x0 = _mm512_mul_ps(x0, _mm512_set1_ps(alpha[i]));
                x1 = _mm512_mul_ps(x1, _mm512_set1_ps(alpha[i]));
            }
            a[i][2 * c] = _mm512_permutex2var_ps(x0, _mm512_loadu_si512(to_lo), x1);
            a[i][2 * c + 1] = _mm512_permutex2var_ps(x0, _mm512_loadu_si512(to_hi), x1);
        }
    for (int m = 0; 2 * m < nk; m++) {
        const int odd = 2 * m + 1 < nk;
        prefetch_row(v, (2 * m + ahead) * row, 32 * NC * esize);
        prefetch_row(v, (2 * m + 1 + ahead) * row, 32 * NC * esize);
        __m512i lo[2], hi[2];
        for (int c = 0; c < NC; c++) {
            const char *x = v + 2 * m * row + 32 * c * esize;
            const __m512i e = medium_load(x, kind);
            const __m512i o = odd ? medium_load(x + row, kind) : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(e, o);
            hi[c] = _mm512_unpackhi_epi16(e, o);
        }
        for (int i = 0; i < MR; i++) {
            const __m512i b = _mm512_set1_epi32((int)pp[i * (ATTNX_BK / 2) + m]);
            for (int c = 0; c < NC; c++) {
                a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], ATTNX_AS_BF16(b), ATTNX_AS_BF16(lo[c]));
                a[i][2 * c + 1] =
                    _mm512_dpbf16_ps(a[i][2 * c + 1], ATTNX_AS_BF16(b), ATTNX_AS_BF16(hi[c]));
            }
        }
    }
    const __m512i back0 = _mm512_loadu_si512(from_pairs),
                  back1 = _mm512_loadu_si512(from_pairs + 16);
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < NC; c++) {
            float *to = acc + i * ldacc + 32 * c;
            _mm512_storeu_ps(to, _mm512_permutex2var_ps(a[i][2 * c], back0, a[i][2 * c + 1]));
            _mm512_storeu_ps(to + 16, _mm512_permutex2var_ps(a[i][2 * c], back1, a[i][2 * c + 1]));
        }
}

#define PM_CASE(mr, nc)                                                                            \
    case (mr) * 4 + (nc):                                                                          \
        pv_rows_medium_block(mr, nc, kind, pp, vj + d0 * esize, row, nb, al, acc + i * ldacc + d0, \
                             ldacc, ahead);                                                        \
        break;

// pt: (nq, ldk)  v: (nk, Dv) rows v_sl apart  scale_v: (nk) s_sl apart  acc: (nq, ldacc)
void attnx_pv_rows_medium_avx512(int kind, const float *pt, int64_t ldk, int nq, const void *v,
                                 int64_t v_sl, const float *scale_v, int64_t s_sl, int nk,
                                 int64_t Dv, const float *alpha, float *acc, int64_t ldacc)
{
    const int64_t esize = kind == ATTNX_MEDIUM_I8 ? 1 : 2, row = v_sl * esize;
    const int64_t ahead = rows_ahead(row, kind == ATTNX_MEDIUM_I8);
    uint32_t pp[4 * (ATTNX_BK / 2)];
    for (int i = 0; i < nq; i += 4) {
        const int mr = nq - i < 4 ? nq - i : 4;
        for (int j = 0; j < nk || (j == 0 && alpha); j += ATTNX_BK) { /* no keys: the rescale */
            const int nb = nk - j < ATTNX_BK ? nk - j : ATTNX_BK;
            const float *al = j == 0 && alpha ? alpha + i : NULL;
            const char *vj = (const char *)v + j * row;
            medium_prob_pairs(pt + i * ldk + j, ldk, mr, scale_v ? scale_v + j * s_sl : NULL, s_sl,
                              nb, pp);
            for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
                const int nc = Dv - d0 < 64 ? 1 : 2;
                switch (mr * 4 + nc) {
                    // clang-format off
                    PM_CASE(1, 1) PM_CASE(1, 2) PM_CASE(2, 1) PM_CASE(2, 2)
                    PM_CASE(3, 1) PM_CASE(3, 2) PM_CASE(4, 1) PM_CASE(4, 2)
                    // clang-format on
                }
            }
        }
    }
}

/* ---- the backward's ptx under precision "medium" (kernels.h: ptx_medium) --------------
 * Lanes are the rows' dims; a pair of queries is one 32-bit word, broadcast
 * from the tile's rounded row j (its queries 2m and 2m+1 side by side) and
 * met by the rows' pairs (xp, laid out so by the caller): one vdpbf16ps a
 * pair, key and vector of dims. */
#define PX_MR 4 /* keys x vectors of dims: 16 accumulators */
#define PX_NV 4

/* Keys j < MR (1..4), NV vectors of dims from column 0 (the last one's lanes
 * `last`): the sums from zero over `pairs` pairs, then added to acc.
 * pp: (MR, ldp) bf16  xp: (pairs, ldx) pairs  acc: (MR, 16 NV) rows ldacc apart */
BF_INLINE void ptx_medium_block(const int MR, const int NV, const uint16_t *pp, int64_t ldp,
                                int pairs, const uint32_t *xp, int64_t ldx, __mmask16 last,
                                float *acc, int64_t ldacc)
{
    __m512 s[PX_MR][PX_NV];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) s[r][c] = _mm512_setzero_ps();
    for (int m = 0; m < pairs; m++) {
        __m512i xv[PX_NV];
        for (int c = 0; c < NV; c++) xv[c] = _mm512_loadu_si512(xp + m * ldx + c * BF_W);
        for (int r = 0; r < MR; r++) {
            const __m512i pb = pair_bcast(pp + r * ldp + 2 * m);
            for (int c = 0; c < NV; c++)
                s[r][c] = _mm512_dpbf16_ps(s[r][c], ATTNX_AS_BF16(pb), ATTNX_AS_BF16(xv[c]));
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) {
            float *to = acc + r * ldacc + c * BF_W;
            const __mmask16 k = c == NV - 1 ? last : (__mmask16)0xffff;
            _mm512_mask_storeu_ps(to, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, to), s[r][c]));
        }
}

#define PX_CASE(mr, nv)                                                        \
    case (mr) * 8 + (nv):                                                      \
        ptx_medium_block(mr, nv, pp + j * ldp, ldp, pairs, xp + e0, ldx, last, \
                         acc + j * ldacc + e0, ldacc);                         \
        break;

// pp: (nk, ldp) bf16  xp: (ceil(nq/2), ldx) pairs  acc: (nk, n) rows ldacc apart
void attnx_ptx_medium_avx512(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp,
                             int64_t ldx, int nk, int64_t n, float *acc, int64_t ldacc)
{
    const int pairs = (nq + 1) / 2;
    for (int64_t e0 = 0; e0 < n; e0 += PX_NV * BF_W) { /* the rows' dims stay in L1 over the keys */
        const int64_t width = n - e0 < PX_NV * BF_W ? n - e0 : PX_NV * BF_W;
        const int nv = (int)((width + BF_W - 1) / BF_W), tail = (int)(width - (nv - 1) * BF_W);
        const __mmask16 last = (__mmask16)(tail == BF_W ? 0xffff : (1u << tail) - 1u);
        for (int j = 0; j < nk; j += PX_MR) {
            const int mr = nk - j < PX_MR ? nk - j : PX_MR;
            switch (mr * 8 + nv) {
                // clang-format off
                PX_CASE(1, 1) PX_CASE(1, 2) PX_CASE(1, 3) PX_CASE(1, 4)
                PX_CASE(2, 1) PX_CASE(2, 2) PX_CASE(2, 3) PX_CASE(2, 4)
                PX_CASE(3, 1) PX_CASE(3, 2) PX_CASE(3, 3) PX_CASE(3, 4)
                PX_CASE(4, 1) PX_CASE(4, 2) PX_CASE(4, 3) PX_CASE(4, 4)
                // clang-format on
            }
        }
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

/* SIMD tile kernels, written once against a small set of vector operations.
 *
 * avx2.c, avx512.c and neon.c each define the operations below for their
 * instruction set (W lanes of float) and then include this file, so the
 * variants share one body of code and differ only in vector width and
 * register blocking. Layouts and contracts: see kernels.h; the plain-loop
 * twins in scalar.c are the reference.
 *
 * Required from the includer:
 *   W, VF, VMASK, SUFFIX(name), QK_MR, QK_NV, PV_MR, PV_NV
 *   V_LOAD(p) V_STORE(p,x) V_SET1(f) V_BCAST(p) V_ZERO()
 *   V_FMA(a,b,c) = a*b+c, V_MUL, V_ADD, V_SUB
 *   V_MAX(x, m)  max that returns m when x is NaN
 *   V_MASK(n) V_LOAD_M(p,mk) V_STORE_M(p,mk,x)   first n lanes
 *   V_SEL_EQ(a,b,t,f)  lane-wise (a == b) ? t : f;  V_SEL_LT(a,b,t,f)  (a < b) ? t : f
 *   V_LOAD_HALF(p)  W IEEE halves (uint16_t *) as floats
 *   V_LOAD_BF16(p)  W bfloat16 values;  V_LOAD_I8(p)  W int8 values (int8_t *) as floats
 *   V_DIV(a,b);  V_ANY_NOT_LT(a,b)  nonzero if some lane has !(a < b) (NaN included)
 *   V_ROUND(x)  to nearest integer;  V_POW2(n)  2^n for integral n in [-126, 127]
 *   optional: V_SCALE_ZERO_BELOW(y, n, x, lo)  V_ZERO_BELOW(y * 2^n, x, lo), when
 *             the ISA has a fused form
 *   V_ZERO_BELOW(y, x, lo)  y where !(x < lo) (NaN kept), else 0
 *   V_HSUM(x)  the sum of the lanes, a float
 *   V_KEEP_BYTES(x, base, idx, fill)  x where base[idx[l]] != 0, else fill
 */

#include "kernels/prefetch.h" /* rows_ahead, prefetch_row */

#define ATTNX_INLINE static inline __attribute__((always_inline))

/* V_IN_REGISTER(x): x is kept in a register from here (optional, a no-op by
 * default). GCC folds a vector used by several FMAs into each of them as a
 * memory operand, loading it once per use: in decoding's dot products that
 * is one load per FMA, past the two loads a cycle of AVX2's cores. */
#ifndef V_IN_REGISTER
#define V_IN_REGISTER(x) ((void)0)
#endif

/* exp(x) for x <= 0 or NaN (all the softmax ever passes: scores minus their
 * max), the steps of attnx_expf() in kernels.h, W lanes at a time. Without
 * positive x the upper clamp is not needed: 2^n stays within [2^-126, 1]. */
ATTNX_INLINE VF v_exp(VF x)
{
#ifdef V_SCALE_ZERO_BELOW
    /* No clamp: below LO (where the clamp would act) the result is zeroed
     * below, whatever the steps give there (inf, NaN); above, the same bits. */
    const VF xc = x;
#else
    const VF xc = V_MAX(V_SET1(ATTNX_EXP_LO), x); /* NaN passes through */
#endif
    const VF n = V_ROUND(V_MUL(xc, V_SET1(ATTNX_LOG2E)));
    VF r = V_FMA(n, V_SET1(-ATTNX_LN2_HI), xc);
    r = V_FMA(n, V_SET1(-ATTNX_LN2_LO), r);
    VF y = V_SET1(ATTNX_EXP_P0);
    y = V_FMA(y, r, V_SET1(ATTNX_EXP_P1));
    y = V_FMA(y, r, V_SET1(ATTNX_EXP_P2));
    y = V_FMA(y, r, V_SET1(ATTNX_EXP_P3));
    y = V_FMA(y, r, V_SET1(ATTNX_EXP_P4));
    y = V_FMA(y, r, V_SET1(ATTNX_EXP_P5));
    y = V_FMA(y, V_MUL(r, r), V_ADD(r, V_SET1(1.0f)));
    /* y * 2^n, and exactly 0 below LO (so exp(-inf) = 0) */
#ifdef V_SCALE_ZERO_BELOW
    return V_SCALE_ZERO_BELOW(y, n, x, ATTNX_EXP_LO); /* one instruction and a compare */
#else
    return V_ZERO_BELOW(V_MUL(y, V_POW2(n)), x, ATTNX_EXP_LO);
#endif
}

/* ---- scores: st = K · Qt --------------------------------------------------
 * Register block: MR keys × NV vectors of queries, accumulated over d with a
 * broadcast of k[j][d] against a vector of packed queries qt[d][i..i+W). */
ATTNX_INLINE void qk_block(const int MR, const int NV, const float *qt, int64_t ldq, const float *k,
                           int64_t k_sl, int64_t D, float *st)
{
    VF acc[QK_MR][QK_NV];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
    for (int64_t d = 0; d < D; d++) {
        if ((d & 15) == 0) /* the next block's keys: short rows defeat the hardware prefetcher */
            for (int r = 0; r < MR; r++) __builtin_prefetch(k + (r + MR) * k_sl + d, 0, 3);
        VF qv[QK_NV];
        for (int c = 0; c < NV; c++) qv[c] = V_LOAD(qt + d * ldq + c * W);
        for (int r = 0; r < MR; r++) {
            const VF kb = V_BCAST(k + r * k_sl + d);
            for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(kb, qv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) V_STORE(st + r * ldq + c * W, acc[r][c]);
}

#define QK_CASE(mr, nv) \
    case (mr) * 8 + (nv): qk_block(mr, nv, qt + i, ldq, kj, k_sl, D, st + j * ldq + i); break;

// qt: (D, ldq)  k: (nk, D) rows k_sl apart  st: (nk, ldq)
static void SUFFIX(qk)(const float *qt, int64_t ldq, int nq, const float *k, int64_t k_sl, int nk,
                       int64_t D, float *st)
{
    const int nvec = (nq + W - 1) / W;
    for (int j = 0; j < nk; j += QK_MR) {
        const int mr = nk - j < QK_MR ? nk - j : QK_MR;
        const float *kj = k + j * k_sl;
        for (int c0 = 0; c0 < nvec; c0 += QK_NV) {
            const int nv = nvec - c0 < QK_NV ? nvec - c0 : QK_NV;
            const int i = c0 * W;
            switch (mr * 8 + nv) {
                QK_CASES
            }
        }
    }
}

/* ---- scores for a few queries: dot products along D ----------------------
 * Four keys at a time share each load of the query row; the partial vector
 * of a row that is not a multiple of W is a masked load. Keys in float32, or
 * in 16 bits converted as they are loaded (kind ROW_F16, ROW_BF16: the same
 * float operations on the same values, so the same bits as on converted rows). */

/* What a row of keys or values holds: float32, 16-bit floats of an
 * attnx_half_format (its code + 1), or int8 (the values; the scale of the
 * row is applied by the caller of these loads). */
enum { ROW_F32 = 0, ROW_F16 = 1 + ATTNX_HALF_F16, ROW_BF16 = 1 + ATTNX_HALF_BF16, ROW_I8 };

/* The bytes of an element of a row of that kind. */
ATTNX_INLINE int64_t row_esize(const int kind)
{
    return kind == ROW_F32 ? 4 : kind == ROW_I8 ? 1 : 2;
}

/* The last n < W elements of key row x as a zero-padded vector: a masked
 * load, or the elements converted one by one into the lanes it would give. */
ATTNX_INLINE VF key_tail(const void *x, int n, VMASK mk, const int kind)
{
    if (kind == ROW_F32) return V_LOAD_M((const float *)x, mk);
    float t[W];
    for (int l = 0; l < W; l++)
        t[l] = l >= n           ? 0.0f
               : kind == ROW_I8 ? (float)((const int8_t *)x)[l]
                                : attnx_half16_to_float(kind - 1, ((const uint16_t *)x)[l]);
    return V_LOAD(t);
}

ATTNX_INLINE VF key_load(const void *x, const int kind)
{
    return kind == ROW_F32    ? V_LOAD((const float *)x)
           : kind == ROW_BF16 ? V_LOAD_BF16((const uint16_t *)x)
           : kind == ROW_I8   ? V_LOAD_I8((const int8_t *)x)
                              : V_LOAD_HALF((const uint16_t *)x);
}

/* Element e of key row j: k + (j * k_sl + e) elements of row_esize bytes. */
ATTNX_INLINE const void *key_at(const void *k, int64_t at, const int kind)
{
    return (const char *)k + at * row_esize(kind);
}

/* Keys j0 .. j0+NK-1 (NK 1..4) against query rows i0 .. i0+MR-1 (MR 1..4):
 * each vector of a key is loaded (and converted) once for all the rows, and
 * the four sums of a row are reduced together (V_HSUM4, or all those of 3 or
 * 4 rows at once where the ISA has V_HSUM4X4) into its 4 scores, adjacent in
 * the decoding tile. */
ATTNX_INLINE void qk_dot_block(const int MR, const int NK, const float *q, int64_t D, const void *k,
                               int64_t k_sl, float *st, int64_t ldk, const int kind)
{
    const int64_t dfull = D / W * W;
    const int tail = (int)(D - dfull);
    const VMASK mk = V_MASK(tail);
    VF a[4][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < 4; r++) a[i][r] = V_ZERO();
    for (int64_t d = 0; d < dfull; d += W) {
        VF kv[4];
        for (int r = 0; r < NK; r++) kv[r] = key_load(key_at(k, r * k_sl + d, kind), kind);
        for (int i = 0; i < MR; i++) {
            VF qv = V_LOAD(q + i * D + d);
            V_IN_REGISTER(qv);
            for (int r = 0; r < NK; r++) a[i][r] = V_FMA(qv, kv[r], a[i][r]);
        }
    }
    if (tail) {
        VF kv[4];
        for (int r = 0; r < NK; r++)
            kv[r] = key_tail(key_at(k, r * k_sl + dfull, kind), tail, mk, kind);
        for (int i = 0; i < MR; i++) {
            const VF qv = V_LOAD_M(q + i * D + dfull, mk);
            for (int r = 0; r < NK; r++) a[i][r] = V_FMA(qv, kv[r], a[i][r]);
        }
    }
#ifdef V_HSUM4X4
    if (MR >= 3 && NK == 4) { /* a GQA group's 3 or 4 rows: their sums reduced together */
        V_HSUM4X4(a, MR, st, ldk);
        return;
    }
#endif
    for (int i = 0; i < MR; i++) {
        if (NK == 4) {
            V_HSUM4(a[i][0], a[i][1], a[i][2], a[i][3], st + i * ldk);
            continue;
        }
        float sums[4];
        V_HSUM4(a[i][0], a[i][1], a[i][2], a[i][3], sums);
        for (int r = 0; r < NK; r++) st[i * ldk + r] = sums[r];
    }
}

#define QD_CASE(mr, nk)                                                                        \
    case (mr) * 8 + (nk):                                                                      \
        qk_dot_block(mr, nk, qr + i * D, D, key_at(k, j * k_sl, kind), k_sl, st + i * ldk + j, \
                     ldk, kind);                                                               \
        break;

// qr: (nq, D)  k: (nk, D) rows k_sl apart (float or 16-bit)  st: (nq, ldk)
ATTNX_INLINE void qk_dot_any(const float *qr, int64_t D, int nq, const void *k, int64_t k_sl,
                             int nk, float *st, int64_t ldk, const int kind)
{
    const int64_t esize = row_esize(kind), ahead = rows_ahead(k_sl * esize, kind == ROW_I8);
    /* keys a block: 4, but with 16 vector registers (AVX2) 4 rows x 4 keys of
     * sums, the keys and a query row would spill: there a GQA group of 3 or
     * more rows takes 3 keys (12 sums), int8 2 (its conversion needs
     * registers too). Measured on AMD EPYC Zen 3 (tools/microbench/run.sh
     * tile-decode 128 4 KIND avx2, TSC cycles a key, with V_IN_REGISTER):
     * float32 qk 51 -> 41 (2 keys) -> 37.5 (3); float16 47 -> 35; int8 43 ->
     * 39 (2 keys; 44 with 3). One row keeps 4 keys: 4 chains of FMAs (2 keys:
     * 20 -> 27 cycles). */
    const int kb = W != 8 ? 4 : kind == ROW_I8 ? 2 : nq >= 3 ? 3 : 4;
    for (int j = 0; j < nk; j += kb) {
        for (int r = 0; r < kb; r++) prefetch_row(k, (j + ahead + r) * k_sl * esize, D * esize);
        for (int i = 0; i < nq; i += 4) {
            const int mr = nq - i < 4 ? nq - i : 4, nb = nk - j < kb ? nk - j : kb;
            switch (mr * 8 + nb) {
                // clang-format off
                QD_CASE(1, 1) QD_CASE(1, 2) QD_CASE(1, 3) QD_CASE(1, 4)
                QD_CASE(2, 1) QD_CASE(2, 2) QD_CASE(2, 3) QD_CASE(2, 4)
                QD_CASE(3, 1) QD_CASE(3, 2) QD_CASE(3, 3) QD_CASE(3, 4)
                QD_CASE(4, 1) QD_CASE(4, 2) QD_CASE(4, 3) QD_CASE(4, 4)
                // clang-format on
            }
        }
    }
}

static void SUFFIX(qk_dot)(const float *qr, int64_t D, int nq, const float *k, int64_t k_sl, int nk,
                           float *st, int64_t ldk)
{
    qk_dot_any(qr, D, nq, k, k_sl, nk, st, ldk, 0);
}

static void SUFFIX(qk_dot_half)(int fmt, const float *qr, int64_t D, int nq, const uint16_t *k,
                                int64_t k_sl, int nk, float *st, int64_t ldk)
{
    if (fmt == ATTNX_HALF_BF16)
        qk_dot_any(qr, D, nq, k, k_sl, nk, st, ldk, ROW_BF16);
    else
        qk_dot_any(qr, D, nq, k, k_sl, nk, st, ldk, ROW_F16);
}

// qr: (nq, D)  k: (nk, D) int8, rows k_sl apart  scale: (nk)  st: (nq, ldk)
static void SUFFIX(qk_dot_i8)(const float *qr, int64_t D, int nq, const int8_t *k, int64_t k_sl,
                              const float *scale, int64_t s_sl, int nk, float *st, int64_t ldk)
{
    qk_dot_any(qr, D, nq, k, k_sl, nk, st, ldk, ROW_I8);
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) st[i * ldk + j] *= scale[j * s_sl];
}

/* ---- online softmax, one query per lane ----------------------------------- */
// st: (nk, ldq)  m, l, alpha: (ldq)
static void SUFFIX(softmax_online)(float *st, int64_t ldq, int nq, int nk, float *m, float *l,
                                   float *alpha)
{
    const VF ninf = V_SET1(-INFINITY);
    for (int i = 0; i < nq; i += W) {
        const VF m_old = V_LOAD(m + i);
        /* four running maxima: one chain would wait on max's latency every row */
        VF mx = m_old, mx1 = m_old, mx2 = m_old, mx3 = m_old;
        int j = 0;
        for (; j + 3 < nk; j += 4) {
            mx = V_MAX(V_LOAD(st + j * ldq + i), mx);
            mx1 = V_MAX(V_LOAD(st + (j + 1) * ldq + i), mx1);
            mx2 = V_MAX(V_LOAD(st + (j + 2) * ldq + i), mx2);
            mx3 = V_MAX(V_LOAD(st + (j + 3) * ldq + i), mx3);
        }
        for (; j < nk; j++) mx = V_MAX(V_LOAD(st + j * ldq + i), mx);
        mx = V_MAX(V_MAX(mx1, mx), V_MAX(mx3, mx2));
        const VF msub = V_SEL_EQ(mx, ninf, V_ZERO(), mx);
        const VF a = v_exp(V_SUB(m_old, msub));
        VF sum0 = V_ZERO(), sum1 = V_ZERO();
        for (j = 0; j + 1 < nk; j += 2) {
            const VF p0 = v_exp(V_SUB(V_LOAD(st + j * ldq + i), msub));
            const VF p1 = v_exp(V_SUB(V_LOAD(st + (j + 1) * ldq + i), msub));
            V_STORE(st + j * ldq + i, p0);
            V_STORE(st + (j + 1) * ldq + i, p1);
            sum0 = V_ADD(sum0, p0);
            sum1 = V_ADD(sum1, p1);
        }
        if (j < nk) {
            const VF p0 = v_exp(V_SUB(V_LOAD(st + j * ldq + i), msub));
            V_STORE(st + j * ldq + i, p0);
            sum0 = V_ADD(sum0, p0);
        }
        V_STORE(l + i, V_FMA(V_LOAD(l + i), a, V_ADD(sum0, sum1)));
        V_STORE(m + i, mx);
        V_STORE(alpha + i, a);
    }
}

// st: (nk, ldq)  m, inv_l: (ldq)
static void SUFFIX(softmax_final)(float *st, int64_t ldq, int nq, int nk, const float *m,
                                  const float *inv_l)
{
    for (int i = 0; i < nq; i += W) {
        const VF mi = V_LOAD(m + i);
        const VF msub = V_SEL_EQ(mi, V_SET1(-INFINITY), V_ZERO(), mi);
        const VF il = V_LOAD(inv_l + i);
        for (int j = 0; j < nk; j++)
            V_STORE(st + j * ldq + i, V_MUL(v_exp(V_SUB(V_LOAD(st + j * ldq + i), msub)), il));
    }
}

/* ---- the decoding tile's softmax: keys in the lanes ------------------------
 * For the few rows of decoding (qk_dot's layout, a query's keys contiguous):
 * one exp per W keys, where one lane per query would leave most of a vector
 * idle and take an exp per key. Each row is computed alone, so a row gives
 * the same bits among 1 or 8 rows. The same max, exp and NaN rules as the
 * lanes; the last partial vector is read padded with -inf (exp gives 0). */
ATTNX_INLINE VF row_part(const float *s, int n)
{
    float t[W];
    for (int l = 0; l < W; l++) t[l] = l < n ? s[l] : -INFINITY;
    return V_LOAD(t);
}

ATTNX_INLINE float lanes_max(VF x)
{
    float t[W];
    V_STORE(t, x);
    float mx = t[0];
    for (int l = 1; l < W; l++) mx = t[l] > mx ? t[l] : mx;
    return mx;
}

// st: (nq, ldk)  m, l, alpha: (nq)
static void SUFFIX(softmax_rows)(float *st, int64_t ldk, int nq, int nk, float *m, float *l,
                                 float *alpha)
{
    const int full = nk / W * W, tail = nk - full;
    for (int i = 0; i < nq; i++) {
        float *s = st + i * ldk;
        VF mv = V_SET1(m[i]);
        for (int j = 0; j < full; j += W) mv = V_MAX(V_LOAD(s + j), mv);
        if (tail) mv = V_MAX(row_part(s + full, tail), mv);
        const float mx = lanes_max(mv);
        const VF msub = V_SET1(mx == -INFINITY ? 0.0f : mx);
        float t[W];
        V_STORE(t, v_exp(V_SUB(V_SET1(m[i]), msub)));
        const float a = t[0];
        VF sum = V_ZERO();
        for (int j = 0; j < full; j += W) {
            const VF p = v_exp(V_SUB(V_LOAD(s + j), msub));
            V_STORE(s + j, p);
            sum = V_ADD(sum, p);
        }
        if (tail) {
            const VF p = v_exp(V_SUB(row_part(s + full, tail), msub));
            V_STORE(t, p);
            for (int j = 0; j < tail; j++) s[full + j] = t[j];
            sum = V_ADD(sum, p);
        }
        V_STORE(t, sum);
        float total = 0.0f;
        for (int lane = 0; lane < W; lane++) total += t[lane];
        l[i] = l[i] * a + total;
        m[i] = mx;
        alpha[i] = a;
    }
}

// st: (nq, ldk)  m, inv_l: (nq)
static void SUFFIX(softmax_rows_final)(float *st, int64_t ldk, int nq, int nk, const float *m,
                                       const float *inv_l)
{
    const int full = nk / W * W, tail = nk - full;
    for (int i = 0; i < nq; i++) {
        float *s = st + i * ldk, t[W];
        const VF msub = V_SET1(m[i] == -INFINITY ? 0.0f : m[i]), il = V_SET1(inv_l[i]);
        for (int j = 0; j < full; j += W)
            V_STORE(s + j, V_MUL(v_exp(V_SUB(V_LOAD(s + j), msub)), il));
        if (tail) {
            V_STORE(t, V_MUL(v_exp(V_SUB(row_part(s + full, tail), msub)), il));
            for (int j = 0; j < tail; j++) s[full + j] = t[j];
        }
    }
}

/* ---- masks ------------------------------------------------------------------
 * A mask whose rows hold a query's keys side by side (sk == 1, the usual
 * (.., L, S) array) is read in blocks of W queries x W keys: W mask rows
 * loaded along their keys and transposed in registers (V_TRANSPOSE), so that
 * each vector holds one key for W queries, the tile's layout. The edges of
 * the tile past whole blocks take the scalar loop, and so do other strides
 * (but a mask constant along the queries, sq == 0, is a broadcast per key,
 * and one whose queries are adjacent, sq == 1, as a decoding tile sees a
 * mask's keys, is read with plain loads).
 * Float: one add an element, the same bits as the scalar kernel. Bool: the
 * bytes widened to floats, -inf where a byte is 0. Measured on AMD EPYC Zen
 * 5, one thread, H=8 L=1024 D=64, a random (1, 1, L, L) mask against none
 * (interleaved, medians): float 0.80x (the scalar loop) -> 0.93x; bool 0.77x
 * (bytes gathered down a column) -> 0.95x. */
/* W mask values of one line as a vector: floats, or bytes widened (kind 1) */
ATTNX_INLINE VF mask_load(const void *m, int64_t at, const int boolean)
{
    return boolean ? V_LOAD_BYTES((const unsigned char *)m + at) : V_LOAD((const float *)m + at);
}

/* The tile's vector s with the mask's vector x applied: added, or -inf where 0 */
ATTNX_INLINE VF mask_apply(VF s, VF x, const int boolean)
{
    return boolean ? V_SEL_EQ(x, V_ZERO(), V_SET1(-INFINITY), s) : V_ADD(s, x);
}

/* The scalar kernel on part of the tile: queries i0.., keys j0.. */
ATTNX_INLINE void mask_scalar(float *st, int64_t ldq, int i0, int nq, int j0, int nk, const void *m,
                              int64_t sq, int64_t sk, const int boolean)
{
    if (nq <= 0 || nk <= 0) return;
    const int64_t at = i0 * sq + j0 * sk;
    if (boolean)
        attnx_kernels_scalar.mask_bool(st + j0 * ldq + i0, ldq, nq, nk,
                                       (const unsigned char *)m + at, sq, sk);
    else
        attnx_kernels_scalar.mask_float(st + j0 * ldq + i0, ldq, nq, nk, (const float *)m + at, sq,
                                        sk);
}

/* Both kinds where the mask's queries (sq == 1) or keys (sk == 1) are
 * adjacent; returns 0 for other strides, which the caller takes. */
ATTNX_INLINE int mask_adjacent(float *st, int64_t ldq, int nq, int nk, const void *m, int64_t sq,
                               int64_t sk, const int boolean)
{
    const int nqb = nq / W * W;
    if (sq == 1) { /* queries adjacent (a decoding tile's keys): plain loads */
        for (int j = 0; j < nk; j++)
            for (int i0 = 0; i0 < nqb; i0 += W) {
                float *s = st + j * ldq + i0;
                V_STORE(s, mask_apply(V_LOAD(s), mask_load(m, j * sk + i0, boolean), boolean));
            }
        mask_scalar(st, ldq, nqb, nq - nqb, 0, nk, m, sq, sk, boolean);
        return 1;
    }
    if (sk != 1) return 0;
    const int nkb = nk / W * W; /* keys adjacent: W x W blocks transposed */
    for (int i0 = 0; i0 < nqb; i0 += W)
        for (int j0 = 0; j0 < nkb; j0 += W) {
            VF r[W];
            for (int t = 0; t < W; t++) r[t] = mask_load(m, (i0 + t) * sq + j0, boolean);
            V_TRANSPOSE(r);
            for (int t = 0; t < W; t++) {
                float *s = st + (j0 + t) * ldq + i0;
                V_STORE(s, mask_apply(V_LOAD(s), r[t], boolean));
            }
        }
    mask_scalar(st, ldq, 0, nqb, nkb, nk - nkb, m, sq, sk, boolean); /* keys past the blocks */
    mask_scalar(st, ldq, nqb, nq - nqb, 0, nk, m, sq, sk, boolean);  /* queries past them */
    return 1;
}

// st: (nk, ldq)  m: element (i, j) at m[i*sq + j*sk]
static void SUFFIX(mask_float)(float *st, int64_t ldq, int nq, int nk, const float *m, int64_t sq,
                               int64_t sk)
{
    if (sq == 0) { /* one value per key (a padding mask): broadcast it */
        for (int j = 0; j < nk; j++) {
            const VF mv = V_SET1(m[j * sk]);
            for (int i = 0; i < nq; i += W)
                V_STORE(st + j * ldq + i, V_ADD(V_LOAD(st + j * ldq + i), mv));
        }
        return;
    }
    if (!mask_adjacent(st, ldq, nq, nk, m, sq, sk, 0))
        attnx_kernels_scalar.mask_float(st, ldq, nq, nk, m, sq, sk);
}

// st: (nk, ldq)  m: element (i, j) at m[i*sq + j*sk]
static void SUFFIX(mask_bool)(float *st, int64_t ldq, int nq, int nk, const unsigned char *m,
                              int64_t sq, int64_t sk)
{
    const VF ninf = V_SET1(-INFINITY);
    if (sq == 0) { /* one value per key: block whole rows of the tile */
        for (int j = 0; j < nk; j++)
            if (!m[j * sk])
                for (int i = 0; i < nq; i += W) V_STORE(st + j * ldq + i, ninf);
        return;
    }
    if (mask_adjacent(st, ldq, nq, nk, m, sq, sk, 1)) return;
    for (int i0 = 0; i0 < nq; i0 += W) { /* other strides: bytes gathered down a column */
        int32_t idx[W];
        for (int l = 0; l < W; l++) idx[l] = (int32_t)((i0 + l < nq ? l : 0) * sq);
        const unsigned char *mi = m + i0 * sq;
        for (int j = 0; j < nk; j++) {
            float *s = st + j * ldq + i0;
            V_STORE(s, V_KEEP_BYTES(V_LOAD(s), mi + j * sk, idx, ninf));
        }
    }
}

/* ---- packing the queries ------------------------------------------------------ */
// q: (nq, D) rows q_sl apart  qt: (D, ldq)
/* W x W blocks transposed in registers (V_TRANSPOSE), one multiply per
 * element (the scalar loop's bits). Gathering a vector down a column of q
 * made packing 5% of a forward at L=1024 D=64 on AMD Zen 5 (gathers are slow
 * there); the scalar loop PACK_SCALAR, the blocks PACK_BLOCKS. The packing
 * is O(BQ·D) per item, the products O(BQ·Lk·D). */
static void SUFFIX(pack_qt)(const float *q, int64_t q_sl, int nq, int64_t D, float scale, float *qt,
                            int64_t ldq)
{
    /* whole blocks of W queries x W dims: W rows loaded, transposed in
     * registers, scaled (one multiply an element, as the scalar loop) */
    const int nqb = nq / W * W;
    const int64_t Db = D / W * W;
    const VF s = V_SET1(scale);
    for (int i0 = 0; i0 < nqb; i0 += W)
        for (int64_t d0 = 0; d0 < Db; d0 += W) {
            VF r[W];
            for (int t = 0; t < W; t++) r[t] = V_LOAD(q + (i0 + t) * q_sl + d0);
            V_TRANSPOSE(r);
            for (int t = 0; t < W; t++) V_STORE(qt + (d0 + t) * ldq + i0, V_MUL(s, r[t]));
        }
    /* the rest as the scalar loop: dims past the blocks of the blocked
     * queries, every dim of the others, and the zero padding */
    const int padded = ATTNX_ROUND16(nq);
    for (int64_t d = 0; d < D; d++) {
        float *row = qt + d * ldq;
        for (int i = d < Db ? nqb : 0; i < nq; i++) row[i] = scale * q[i * q_sl + d];
        for (int i = nq; i < padded; i++) row[i] = 0.0f;
    }
}

/* ---- output rows: acc scaled by 1/l, with an inf/NaN check on the way ----- */
// acc: (nq, ldacc)  inv: (nq)  out: (nq, Dv) rows out_sl apart
static int SUFFIX(store_rows)(const float *acc, int64_t ldacc, int nq, int64_t Dv, const float *inv,
                              float *out, int64_t out_sl)
{
    const int64_t dfull = Dv / W * W;
    const VMASK mk = V_MASK((int)(Dv - dfull));
    VF bad = V_ZERO(); /* x * 0 is 0 for finite x, NaN for inf or NaN */
    for (int i = 0; i < nq; i++) {
        const float *a = acc + i * ldacc;
        float *o = out + i * out_sl;
        if (inv[i] == 0.0f) { /* nothing allowed: zeros, whatever acc holds */
            for (int64_t d = 0; d < Dv; d++) o[d] = 0.0f;
            continue;
        }
        const VF s = V_SET1(inv[i]);
        for (int64_t d = 0; d < dfull; d += W) {
            const VF x = V_MUL(V_LOAD(a + d), s);
            V_STORE(o + d, x);
            bad = V_FMA(x, V_ZERO(), bad);
        }
        if (dfull < Dv) {
            const VF x = V_MUL(V_LOAD_M(a + dfull, mk), s);
            V_STORE_M(o + dfull, mk, x);
            bad = V_FMA(x, V_ZERO(), bad); /* masked-off lanes are 0 */
        }
    }
    const float b = V_HSUM(bad);
    return b != b;
}

/* ---- output: acc = alpha * acc + Pᵀ · V -----------------------------------
 * Register block: MR queries × NV vectors of Dv; each step broadcasts
 * p[j][i] and multiplies a vector of the value row v[j]. The last vector of a
 * row may be partial (TAIL lanes, masked loads and stores). Values in float32,
 * or in 16 bits converted as they are loaded (kind, as qk_dot_any:
 * the same bits as on converted rows). ADD (ptx): the products are summed
 * from zero and the sum added to acc at the end, so that acc, which gathers
 * the sums of many calls (dK, dV), takes one rounded term a call. */
ATTNX_INLINE void pv_block(const int MR, const int NV, const int tail, const float *pt,
                           int64_t s_sum, int64_t s_row, const void *v, int64_t v_sl, int nk,
                           const float *alpha, float *acc, int64_t ldacc, const int kind,
                           const int pf, const int add)
{
    const VMASK mk = V_MASK(tail ? tail : W);
    const int64_t esize = row_esize(kind),
                  ahead = pf ? rows_ahead(v_sl * esize, kind == ROW_I8) : 0;
    VF a[PV_MR][PV_NV];
    for (int r = 0; r < MR; r++) {
        const VF s = alpha ? V_SET1(alpha[r]) : V_SET1(1.0f);
        for (int c = 0; c < NV; c++) {
            if (add) {
                a[r][c] = V_ZERO();
                continue;
            }
            const VF x = (tail && c == NV - 1) ? V_LOAD_M(acc + r * ldacc + c * W, mk)
                                               : V_LOAD(acc + r * ldacc + c * W);
            a[r][c] = alpha ? V_MUL(x, s) : x;
        }
    }
    for (int j = 0; j < nk; j++) {
        VF vv[PV_NV];
        if (pf) prefetch_row(v, (j + ahead) * v_sl * esize, NV * W * esize);
        for (int c = 0; c < NV; c++) {
            const void *x = key_at(v, j * v_sl + c * W, kind);
            vv[c] = (tail && c == NV - 1) ? key_tail(x, tail, mk, kind) : key_load(x, kind);
        }
        for (int r = 0; r < MR; r++) {
            const VF p = V_BCAST(pt + j * s_sum + r * s_row);
            for (int c = 0; c < NV; c++) a[r][c] = V_FMA(p, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NV; c++) {
            float *to = acc + r * ldacc + c * W;
            if (tail && c == NV - 1)
                V_STORE_M(to, mk, add ? V_ADD(V_LOAD_M(to, mk), a[r][c]) : a[r][c]);
            else
                V_STORE(to, add ? V_ADD(V_LOAD(to), a[r][c]) : a[r][c]);
        }
}

/* pv: rows r are queries, the sum runs over keys j: element pt[j*ldq + r].
 * ptx: rows r are keys, the sum runs over queries i: element pt[r*ldq + i]. */
#define PV_CASE(mr, nv)                                                                          \
    case (mr) * 8 + (nv):                                                                        \
        if (tail)                                                                                \
            pv_block(mr, nv, tail, pt + i * s_row, s_sum, s_row, key_at(v, d0, kind), v_sl, nk,  \
                     al, ai + d0, ldacc, kind, pf, add);                                         \
        else                                                                                     \
            pv_block(mr, nv, 0, pt + i * s_row, s_sum, s_row, key_at(v, d0, kind), v_sl, nk, al, \
                     ai + d0, ldacc, kind, pf, add);                                             \
        break;

/* acc (nrow, ldacc) [+]= Σ_t pt[t*s_sum + r*s_row] · v[t*v_sl + :] over t < nsum
 * (add: the sum formed from zero, then added; see pv_block) */
ATTNX_INLINE void pv_any(const float *pt, int64_t s_sum, int64_t s_row, int nq, const void *v,
                         int64_t v_sl, int nk, int64_t Dv, const float *alpha, float *acc,
                         int64_t ldacc, const int kind, const int pf, const int add)
{
    const int64_t nvec = (Dv + W - 1) / W;
    /* vectors of values a block: PV_NV, or 2 for converted values with 16
     * vector registers (AVX2): float values can be FMA operands from memory,
     * converted int8 or 16-bit ones take a register each, and PV_NV of them
     * would spill a sum */
    const int nvb = kind != ROW_F32 && W == 8 && PV_NV > 2 ? 2 : PV_NV;
    for (int i = 0; i < nq; i += PV_MR) {
        const int mr = nq - i < PV_MR ? nq - i : PV_MR;
        const float *al = alpha ? alpha + i : NULL;
        float *ai = acc + i * ldacc;
        for (int64_t c0 = 0; c0 < nvec; c0 += nvb) {
            const int nv = nvec - c0 < nvb ? (int)(nvec - c0) : nvb;
            const int64_t d0 = c0 * W;
            const int last = c0 + nv == nvec;
            const int tail = last ? (int)(Dv - (nvec - 1) * W) % W : 0;
            switch (mr * 8 + nv) {
                PV_CASES
            }
        }
    }
}

// pt: element (j, i) at pt[j*s_key + i*s_row]  v: (nk, Dv) rows v_sl apart  acc: (nq, ldacc)
static void SUFFIX(pv)(const float *pt, int64_t s_key, int64_t s_row, int nq, const float *v,
                       int64_t v_sl, int nk, int64_t Dv, const float *alpha, float *acc,
                       int64_t ldacc)
{
    if (s_key == 1) /* a decoding tile: values streamed from memory, prefetched */
        pv_any(pt, 1, s_row, nq, v, v_sl, nk, Dv, alpha, acc, ldacc, ROW_F32, 1, 0);
    else
        pv_any(pt, s_key, s_row, nq, v, v_sl, nk, Dv, alpha, acc, ldacc, ROW_F32, 0, 0);
}

// pt: as pv  v: (nk, Dv) 16-bit, rows v_sl apart  acc: (nq, ldacc)
static void SUFFIX(pv_half)(int fmt, const float *pt, int64_t s_key, int64_t s_row, int nq,
                            const uint16_t *v, int64_t v_sl, int nk, int64_t Dv, const float *alpha,
                            float *acc, int64_t ldacc)
{
    if (fmt == ATTNX_HALF_BF16)
        pv_any(pt, s_key, s_row, nq, v, v_sl, nk, Dv, alpha, acc, ldacc, ROW_BF16, 1, 0);
    else
        pv_any(pt, s_key, s_row, nq, v, v_sl, nk, Dv, alpha, acc, ldacc, ROW_F16, 1, 0);
}

/* pv over int8 values: the probabilities times their values' scales first,
 * into a block of up to PS_ROWS queries x ATTNX_BK keys on the stack (a
 * decoding tile's layout), then pv_any over the int8 rows: the scale costs
 * one multiply a probability, not one a vector of values. */
#define PS_ROWS 8
// pt: as pv  v: (nk, Dv) int8, rows v_sl apart  scale: (nk)  acc: (nq, ldacc)
static void SUFFIX(pv_i8)(const float *pt, int64_t s_key, int64_t s_row, int nq, const int8_t *v,
                          int64_t v_sl, const float *scale, int64_t s_sl, int nk, int64_t Dv,
                          const float *alpha, float *acc, int64_t ldacc)
{
    float ps[PS_ROWS * ATTNX_BK];
    if (nk <= 0) { /* no keys: the rescale alone */
        pv_any(ps, 1, 0, nq, v, v_sl, 0, Dv, alpha, acc, ldacc, ROW_I8, 0, 0);
        return;
    }
    for (int i0 = 0; i0 < nq; i0 += PS_ROWS) {
        const int nr = nq - i0 < PS_ROWS ? nq - i0 : PS_ROWS;
        for (int j0 = 0; j0 < nk; j0 += ATTNX_BK) {
            const int nb = nk - j0 < ATTNX_BK ? nk - j0 : ATTNX_BK;
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < nb; j++)
                    ps[i * ATTNX_BK + j] =
                        pt[(int64_t)(j0 + j) * s_key + (int64_t)(i0 + i) * s_row] *
                        scale[(int64_t)(j0 + j) * s_sl];
            pv_any(ps, 1, ATTNX_BK, nr, v + (int64_t)j0 * v_sl, v_sl, nb, Dv,
                   j0 == 0 && alpha ? alpha + i0 : NULL, acc + (int64_t)i0 * ldacc, ldacc, ROW_I8,
                   1, 0);
        }
    }
}

/* ---- backward: acc (nk rows) += Pᵀ-tile · x, each row's sum over the
 * queries formed in registers from zero and then added ----------------------- */
// pt: (nk, ldq)  x: (nq, n) rows x_sl apart  acc: (nk, n) rows ldacc apart
static void SUFFIX(ptx)(const float *pt, int64_t ldq, int nq, const float *x, int64_t x_sl, int nk,
                        int64_t n, float *acc, int64_t ldacc)
{
    pv_any(pt, 1, ldq, nk, x, x_sl, nq, n, NULL, acc, ldacc, ROW_F32, 0, 1);
}

/* ---- backward: dS = P ∘ (dP − d), one query per lane; exactly 0 where P is 0
 * (a masked key adds nothing, even where dP is inf or NaN) -------------------- */
// pt, dpt: (nk, ldq)  d: (ldq); dS is written over dpt
static void SUFFIX(softmax_bwd)(const float *pt, float *dpt, int64_t ldq, int nq, int nk,
                                const float *d)
{
    for (int i = 0; i < nq; i += W) {
        const VF di = V_LOAD(d + i);
        for (int j = 0; j < nk; j++) {
            const VF p = V_LOAD(pt + j * ldq + i);
            const VF g = V_MUL(p, V_SUB(V_LOAD(dpt + j * ldq + i), di));
            V_STORE(dpt + j * ldq + i, V_SEL_EQ(p, V_ZERO(), V_ZERO(), g));
        }
    }
}

/* ---- softcap and ALiBi: the steps of attnx_tanhf and alibi_scalar ---------- */
ATTNX_INLINE VF v_abs(VF x) { return V_MAX(V_SUB(V_ZERO(), x), x); } /* NaN stays NaN */

ATTNX_INLINE VF v_tanh(VF x)
{
    const VF a = v_abs(x), z = V_MUL(x, x);
    VF y = V_SET1(ATTNX_TANH_P0);
    y = V_ADD(V_MUL(y, z), V_SET1(ATTNX_TANH_P1));
    y = V_ADD(V_MUL(y, z), V_SET1(ATTNX_TANH_P2));
    y = V_ADD(V_MUL(y, z), V_SET1(ATTNX_TANH_P3));
    y = V_ADD(V_MUL(y, z), V_SET1(ATTNX_TANH_P4));
    const VF small = V_ADD(V_MUL(V_MUL(y, z), x), x);
    /* a cap well above the scores (the usual case) leaves every lane in the
     * polynomial's range: the exp and the division are skipped */
    if (!V_ANY_NOT_LT(a, V_SET1(ATTNX_TANH_SMALL))) return small;
    const VF e = v_exp(V_MUL(V_SET1(-2.0f), a));
    const VF one = V_SET1(1.0f);
    const VF r = V_DIV(V_SUB(one, e), V_ADD(one, e));
    const VF large = V_SEL_LT(x, V_ZERO(), V_SUB(V_ZERO(), r), r);
    return V_SEL_LT(a, V_SET1(ATTNX_TANH_SMALL), small, large);
}

// st: (nk, ldq)
static void SUFFIX(softcap)(float *st, int64_t ldq, int nq, int nk, float cap, float inv_cap)
{
    const VF vc = V_SET1(cap), vi = V_SET1(inv_cap);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i += W) {
            float *s = st + j * ldq + i;
            V_STORE(s, V_MUL(vc, v_tanh(V_MUL(V_LOAD(s), vi))));
        }
}

// dst, capped: (nk, ldq)
static void SUFFIX(softcap_bwd)(float *dst, const float *capped, int64_t ldq, int nq, int nk,
                                float inv_cap)
{
    const VF vi = V_SET1(inv_cap), one = V_SET1(1.0f);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i += W) {
            const VF t = V_MUL(V_LOAD(capped + j * ldq + i), vi);
            float *d = dst + j * ldq + i;
            V_STORE(d, V_MUL(V_LOAD(d), V_SUB(one, V_MUL(t, t))));
        }
}

// st: (nk, ldq); c = d(i0) - j0
static void SUFFIX(alibi)(float *st, int64_t ldq, int nq, int nk, float slope, int64_t c)
{
    float lane[W];
    for (int l = 0; l < W; l++) lane[l] = (float)l;
    const VF vl = V_LOAD(lane), vs = V_SET1(slope);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i += W) {
            /* c + i - j + l, exact in float below 2^24 as in the scalar kernel */
            const VF dist = v_abs(V_ADD(vl, V_SET1((float)(c + i - j))));
            float *s = st + j * ldq + i;
            V_STORE(s, V_SUB(V_LOAD(s), V_MUL(vs, dist)));
        }
}

/* ---- 16-bit rows to float32, W at a time (V_LOAD_HALF, V_LOAD_BF16) ------------ */
// src: (rows, n) rows src_sl apart  dst: (rows, n)
static void SUFFIX(half_rows)(int fmt, const uint16_t *src, int64_t src_sl, int rows, int64_t n,
                              float *dst)
{
    for (int j = 0; j < rows; j++) {
        const uint16_t *s = src + j * src_sl;
        float *d = dst + j * n;
        int64_t e = 0;
        if (fmt == ATTNX_HALF_BF16)
            for (; e + W <= n; e += W) V_STORE(d + e, V_LOAD_BF16(s + e));
        else
            for (; e + W <= n; e += W) V_STORE(d + e, V_LOAD_HALF(s + e));
        for (; e < n; e++) d[e] = attnx_half16_to_float(fmt, s[e]);
    }
}

/* ---- int8 rows to their dequantized float32 values, W at a time (V_LOAD_I8) ---- */
// src: (rows, n) int8, rows src_sl apart  scale: (rows)  dst: (rows, n)
static void SUFFIX(i8_rows)(const int8_t *src, int64_t src_sl, const float *scale, int64_t s_sl,
                            int rows, int64_t n, float *dst)
{
    for (int j = 0; j < rows; j++) {
        const int8_t *s = src + j * src_sl;
        const float c = scale[j * s_sl];
        float *d = dst + j * n;
        int64_t e = 0;
        for (; e + W <= n; e += W) V_STORE(d + e, V_MUL(V_SET1(c), V_LOAD_I8(s + e)));
        for (; e < n; e++) d[e] = c * (float)s[e];
    }
}

/* ---- the FMA peak ------------------------------------------------------------ */
static double SUFFIX(fma_burn)(int64_t rounds, float *sink)
{
    VF a[ATTNX_PEAK_CHAINS];
    const VF b = V_SET1(1.0000001f), c = V_SET1(1e-7f);
    for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) a[i] = V_SET1((float)i);
    for (int64_t r = 0; r < rounds; r++)
        for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) a[i] = V_FMA(a[i], b, c);
    VF s = a[0];
    for (int i = 1; i < ATTNX_PEAK_CHAINS; i++) s = V_ADD(s, a[i]);
    float lanes[W];
    V_STORE(lanes, s);
    *sink = lanes[0];
    return (double)rounds * ATTNX_PEAK_CHAINS * W * 2;
}

/* The table, and where the includer names them (QK_BF16_TABLE, QK_BF16,
 * MEDIUM_ROWS(suffix); and QK_AMX_TABLE, QK_AMX_EMULATED_TABLE) the same
 * kernels with a qk_bf16 (and a pv_bf16) too (avx512.c: the kernels are in
 * avx512_bf16.c and amx.c). */
// clang-format off
#define SIMD_ENTRIES                                  \
    .qk = SUFFIX(qk),                                 \
    .qk_dot = SUFFIX(qk_dot),                         \
    .dot_max_nq = W / 2,                              \
    .softmax_online = SUFFIX(softmax_online),         \
    .softmax_final = SUFFIX(softmax_final),           \
    .softmax_rows = SUFFIX(softmax_rows),             \
    .softmax_rows_final = SUFFIX(softmax_rows_final), \
    .mask_float = SUFFIX(mask_float),                 \
    .mask_bool = SUFFIX(mask_bool),                   \
    .pack_qt = SUFFIX(pack_qt),                       \
    .store_rows = SUFFIX(store_rows),                 \
    .pv = SUFFIX(pv),                                 \
    .ptx = SUFFIX(ptx),                               \
    .softmax_bwd = SUFFIX(softmax_bwd),               \
    .softcap = SUFFIX(softcap),                       \
    .softcap_bwd = SUFFIX(softcap_bwd),               \
    .alibi = SUFFIX(alibi),                           \
    .half_rows = SUFFIX(half_rows),                   \
    .qk_dot_half = SUFFIX(qk_dot_half),               \
    .pv_half = SUFFIX(pv_half),                       \
    .i8_rows = SUFFIX(i8_rows),                       \
    .qk_dot_i8 = SUFFIX(qk_dot_i8),                   \
    .pv_i8 = SUFFIX(pv_i8),                           \
    .fma_burn = SUFFIX(fma_burn)
// clang-format on

const attnx_kernels SUFFIX(attnx_kernels) = {SIMD_ENTRIES};
#ifdef QK_BF16_TABLE
const attnx_kernels QK_BF16_TABLE = {
    SIMD_ENTRIES,        .qk_bf16 = QK_BF16,           .pv_medium = PV_MEDIUM, MEDIUM_ENTRIES,
    MEDIUM_ROWS(avx512), .bf16dot_burn = BF16DOT_BURN, .pv_half_tiles = 1};
#endif
#ifdef QK_AMX_TABLE
/* amx.c's kernels, named *_amx, and on the tile unit's model *_amx_emulated */
#define AMX_ENTRIES(s)                                                                          \
    .qk_bf16 = attnx_qk_bf16_##s, .pv_bf16 = attnx_pv_bf16_##s, .qk_split = attnx_qk_split_##s, \
    .pv_split = attnx_pv_split_##s, .split_rows = attnx_split_rows_##s,                         \
    .split_pairs = attnx_split_pairs_##s, .pv_medium = attnx_pv_medium_##s, MEDIUM_ENTRIES,     \
    MEDIUM_ROWS(s), .bf16dot_burn = BF16DOT_BURN, .amx_burn = attnx_amx_burn_##s
const attnx_kernels QK_AMX_TABLE = {SIMD_ENTRIES, AMX_ENTRIES(amx)};
const attnx_kernels QK_AMX_EMULATED_TABLE = {SIMD_ENTRIES, AMX_ENTRIES(amx_emulated)};
#endif

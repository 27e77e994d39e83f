/* Internal: the tile kernels that the drivers (core/forward.c, core/backward.c)
 * call through a table, one table per instruction set, and the list of
 * instruction sets (dispatch.c).
 *
 * The drivers work on one tile of BQ queries against BK keys at a time:
 *
 *   qt  (D, ldq)    packed, pre-scaled queries: qt[d*ldq + i] = scale * q[i][d]
 *   st  (nk, ldq)   scores of the tile, transposed: st[j*ldq + i] = q[i]·k[j]
 *                   (then probabilities, in place)
 *   acc (nq, ldacc) running, unnormalised output rows
 *   m, l, alpha (ldq)  per query: running max, running sum, rescale factor
 *
 * Scores are kept transposed (one query per SIMD lane) so that the row-wise
 * softmax statistics are vertical vector operations with no horizontal
 * reductions. ldq is a multiple of every ISA's vector width; columns past nq
 * hold finite padding and are never read back into results.
 *
 * A new kernel is one member of attnx_kernels with its contract here, its
 * body in scalar.c and kernels_simd.h (a row of each table), and its
 * comparison in tests/c/test_kernels.c.
 */
#ifndef ATTNX_KERNELS_H
#define ATTNX_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attnx.h" /* attnx_half_format */

#ifndef ATTNX_BQ
#define ATTNX_BQ 64 /* queries per tile (ldq); a multiple of every vector width */
#endif
#ifndef ATTNX_BK
#define ATTNX_BK 128 /* keys per tile */
#endif

/* n rounded up to a multiple of 16, a multiple of every ISA's vector width
 * (packed query rows and accumulator rows are padded to it) */
#define ATTNX_ROUND16(n) (((n) + 15) / 16 * 16)

/* What the rows of a "medium" decoding kernel hold (qk_dot_medium,
 * pv_rows_medium): bfloat16 values, int8 values with a scale a row, or
 * float16 values (rounded to bfloat16 as they are read). */
typedef enum { ATTNX_MEDIUM_BF16 = 0, ATTNX_MEDIUM_I8, ATTNX_MEDIUM_F16 } attnx_medium_rows;
/* qk_dot_medium's, pv_rows_medium's and ptx_medium's declarations, of the reference
 * (s = scalar) and of each instruction set's kernels */
#define ATTNX_MEDIUM_ROWS_KERNELS(s)                                                               \
    void attnx_qk_dot_medium_##s(int kind, const uint32_t *qp, int64_t ldp, int nq, const void *k, \
                                 int64_t k_sl, const float *scale_k, int64_t s_sl, int nk,         \
                                 int64_t D, float scale, float *st, int64_t ldk);                  \
    void attnx_pv_rows_medium_##s(int kind, const float *pt, int64_t ldk, int nq, const void *v,   \
                                  int64_t v_sl, const float *scale_v, int64_t s_sl, int nk,        \
                                  int64_t Dv, const float *alpha, float *acc, int64_t ldacc);      \
    void attnx_ptx_medium_##s(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp,         \
                              int64_t ldx, int nk, int64_t n, float *acc, int64_t ldacc);

typedef struct attnx_kernels {
    /* st[j*ldq + i] = sum_d k[j*k_sl + d] * qt[d*ldq + i]
     * qt: (D, ldq)  k: (nk, D) rows k_sl apart  st: (nk, ldq); i < nq (rounded up to a vector) */
    void (*qk)(const float *qt, int64_t ldq, int nq, const float *k, int64_t k_sl, int nk,
               int64_t D, float *st);

    /* The same scores for a few queries (decoding): dot products along D,
     * written as rows, the keys of a query contiguous (the decoding tile):
     * st[i*ldk + j] = sum_d qr[i*D + d] * k[j*k_sl + d]
     * qr: (nq, D) packed, pre-scaled query rows  k: (nk, D) rows k_sl apart  st: (nq, ldk).
     * Used when nq <= dot_max_nq, where qk would waste most lanes of a vector. */
    void (*qk_dot)(const float *qr, int64_t D, int nq, const float *k, int64_t k_sl, int nk,
                   float *st, int64_t ldk);
    int dot_max_nq;

    /* Online softmax over one tile of keys, per query i < nq:
     *   m_new = max(m[i], max_j st[j][i])   (NaN ignored here; it propagates through exp)
     *   alpha[i] = exp(m[i] - m_new'), st[j][i] = exp(st[j][i] - m_new'),
     *   l[i] = l[i]*alpha[i] + sum_j st[j][i],  m[i] = m_new
     * where m_new' = 0 when m_new is -inf (a row with nothing allowed yet sums to 0).
     * st: (nk, ldq)  m, l, alpha: (ldq) */
    void (*softmax_online)(float *st, int64_t ldq, int nq, int nk, float *m, float *l,
                           float *alpha);

    /* Final probabilities once m and l are known (need_weights):
     *   st[j][i] = exp(st[j][i] - m'[i]) * inv_l[i]   st: (nk, ldq)  m, inv_l: (ldq) */
    void (*softmax_final)(float *st, int64_t ldq, int nq, int nk, const float *m,
                          const float *inv_l);

    /* softmax_online and softmax_final on a decoding tile, the keys of a
     * query contiguous (qk_dot's layout): the same steps with st[i*ldk + j]
     * for st[j][i]. st: (nq, ldk)  m, l, alpha, inv_l: (nq) */
    void (*softmax_rows)(float *st, int64_t ldk, int nq, int nk, float *m, float *l, float *alpha);
    void (*softmax_rows_final)(float *st, int64_t ldk, int nq, int nk, const float *m,
                               const float *inv_l);

    /* Masks on a tile of scores; element (i, j) of the mask is m[i*sq + j*sk]
     * (element strides of any sign, 0 = broadcast; |sq| * ldq must fit in int32).
     *   mask_float: st[j][i] += m(i, j)
     *   mask_bool:  st[j][i] = m(i, j) ? st[j][i] : -inf   (nonzero byte = attend) */
    void (*mask_float)(float *st, int64_t ldq, int nq, int nk, const float *m, int64_t sq,
                       int64_t sk);
    void (*mask_bool)(float *st, int64_t ldq, int nq, int nk, const unsigned char *m, int64_t sq,
                      int64_t sk);

    /* Pack an item's queries, pre-scaled and transposed, for qk:
     *   qt[d*ldq + i] = scale * q[i*q_sl + d]  for i < nq
     *   qt[d*ldq + i] = 0                      for nq <= i < nq rounded up to 16
     * q: (nq, D) rows q_sl apart  qt: (D, ldq). */
    void (*pack_qt)(const float *q, int64_t q_sl, int nq, int64_t D, float scale, float *qt,
                    int64_t ldq);

    /* Output rows from the accumulator:
     *   out[i][:] = inv[i] != 0 ? acc[i][:] * inv[i] : 0     (i < nq)
     * acc: (nq, ldacc)  inv: (nq)  out: (nq, Dv) rows out_sl apart.
     * Returns nonzero if any value stored is inf or NaN. */
    int (*store_rows)(const float *acc, int64_t ldacc, int nq, int64_t Dv, const float *inv,
                      float *out, int64_t out_sl);

    /* acc[i][:] = alpha[i] * acc[i][:] + sum_j pt[j*s_key + i*s_row] * v[j*v_sl + :]
     * (alpha NULL: no rescale)  pt: (nk, ldq) as (s_key, s_row) = (ldq, 1), or a decoding
     * tile (nq, ldk) as (1, ldk)  v: (nk, Dv) rows v_sl apart  acc: (nq, ldacc) */
    void (*pv)(const float *pt, int64_t s_key, int64_t s_row, int nq, const float *v, int64_t v_sl,
               int nk, int64_t Dv, const float *alpha, float *acc, int64_t ldacc);

    /* Backward: the tile's transpose times rows of x, summed over the queries:
     *   acc[j][:] += sum_i pt[j*ldq + i] * x[i*x_sl + :]     (j < nk, i < nq)
     * pt: (nk, ldq)  x: (nq, n) rows x_sl apart  acc: (nk, n) rows ldacc apart
     * (dV += Pᵀ dO and dK += dSᵀ Q). The sum over i is formed from zero and
     * then added to acc: acc, which gathers the sums of many query blocks,
     * takes one rounded term a call (backward.c). */
    void (*ptx)(const float *pt, int64_t ldq, int nq, const float *x, int64_t x_sl, int nk,
                int64_t n, float *acc, int64_t ldacc);

    /* Backward through the softmax, per query i (lane) and key j:
     *   dpt[j][i] = pt[j][i] == 0 ? 0 : pt[j][i] * (dpt[j][i] - d[i])
     * pt, dpt: (nk, ldq)  d: (ldq); i < nq rounded up to a vector */
    void (*softmax_bwd)(const float *pt, float *dpt, int64_t ldq, int nq, int nk, const float *d);

    /* Logit soft-capping, in place, i < nq rounded up to a vector:
     *   st[j][i] = cap · tanh(st[j][i] · inv_cap)        (inv_cap = 1 / cap)
     * with tanh as attnx_tanhf below. st: (nk, ldq) */
    void (*softcap)(float *st, int64_t ldq, int nq, int nk, float cap, float inv_cap);

    /* Backward through the softcap: dst[j][i] *= 1 - t², t = capped[j][i] · inv_cap
     * (capped: the scores right after softcap, forward's output of the kernel)
     * dst, capped: (nk, ldq) */
    void (*softcap_bwd)(float *dst, const float *capped, int64_t ldq, int nq, int nk,
                        float inv_cap);

    /* ALiBi: st[j][i] -= slope · |c + i - j|, the distance of key j0 + j from
     * the diagonal d(i0 + i) when c = d(i0) - j0; the distance is converted to
     * float (exact below 2^24) and the product and difference rounded apart,
     * so every ISA gives the same bits. st: (nk, ldq) */
    void (*alibi)(float *st, int64_t ldq, int nq, int nk, float slope, int64_t c);

    /* 16-bit rows to float32 (exact): dst[j*n + d] = src[j*src_sl + d] for
     * j < rows, d < n; fmt: attnx_half_format (IEEE half or bfloat16), for
     * this and the next two kernels.  src: (rows, n) rows src_sl apart  dst: (rows, n) */
    void (*half_rows)(int fmt, const uint16_t *src, int64_t src_sl, int rows, int64_t n,
                      float *dst);

    /* qk_dot for few queries (decoding) over 16-bit keys, converted in
     * registers as they are read: the same results, bit for bit, as qk_dot on
     * the rows converted by half_rows.  k: (nk, D) 16-bit, rows k_sl apart */
    void (*qk_dot_half)(int fmt, const float *qr, int64_t D, int nq, const uint16_t *k,
                        int64_t k_sl, int nk, float *st, int64_t ldk);

    /* pv over 16-bit values, converted in registers as they are read: the
     * same results, bit for bit, as pv on the rows converted by half_rows.
     * For few queries (decoding), and the tiles of the bfloat16 dot path
     * (core/items.c, add_values); prefetches the rows ahead.
     * pt: as pv  v: (nk, Dv) 16-bit, rows v_sl apart */
    void (*pv_half)(int fmt, const float *pt, int64_t s_key, int64_t s_row, int nq,
                    const uint16_t *v, int64_t v_sl, int nk, int64_t Dv, const float *alpha,
                    float *acc, int64_t ldacc);

    /* int8 rows (an int8 KV cache) to their dequantized float32 values, for
     * this and the next two kernels a row's value e standing for
     * scale[j*s_sl] * x[j][e]:
     *   dst[j*n + d] = scale[j*s_sl] * (float)src[j*src_sl + d]   (one rounding)
     * src: (rows, n) int8, rows src_sl apart  scale: (rows) s_sl apart  dst: (rows, n) */
    void (*i8_rows)(const int8_t *src, int64_t src_sl, const float *scale, int64_t s_sl, int rows,
                    int64_t n, float *dst);

    /* qk_dot for few queries (decoding) over int8 keys read in place: the
     * dot products with the exact int8 values, summed as qk_dot sums, then
     * times the key's scale:
     *   st[i*ldk + j] = scale[j*s_sl] * sum_d qr[i*D + d] * (float)k[j*k_sl + d]
     * qr: (nq, D)  k: (nk, D) int8 rows k_sl apart  scale: (nk) s_sl apart  st: (nq, ldk) */
    void (*qk_dot_i8)(const float *qr, int64_t D, int nq, const int8_t *k, int64_t k_sl,
                      const float *scale, int64_t s_sl, int nk, float *st, int64_t ldk);

    /* pv over int8 values read in place (decoding), each probability first
     * multiplied by its value's scale, then one FMA a term in key order:
     *   acc[i][:] = alpha[i] * acc[i][:] + sum_j (pt[j*s_key + i*s_row] * scale[j*s_sl]) * v[j][:]
     * (alpha NULL: no rescale). pt: as pv  v: (nk, Dv) int8 rows v_sl apart
     * scale: (nk) s_sl apart  acc: (nq, ldacc) */
    void (*pv_i8)(const float *pt, int64_t s_key, int64_t s_row, int nq, const int8_t *v,
                  int64_t v_sl, const float *scale, int64_t s_sl, int nk, int64_t Dv,
                  const float *alpha, float *acc, int64_t ldacc);

    /* Scores of bfloat16 queries and keys with bfloat16 dot products
     * (AVX512_BF16's vdpbf16ps), for a block of queries whose values are all
     * bfloat16 (attnx_pack_qt_bf16) against bfloat16 keys read in place; NULL
     * in every table but the one of a CPU that has them. Per query i (lane)
     * and key j, over the pairs of dims p = 0 .. ceil(D/2) - 1 in order, two
     * float32 FMAs a pair, odd dim first (Intel's pseudo-code of VDPBF16PS):
     *   acc = fma(q[i][2p+1], k[j][2p+1], acc);  acc = fma(q[i][2p], k[j][2p], acc)
     * each rounded to nearest even, with bfloat16 subnormal inputs read as
     * zero and subnormal results flushed to zero (whatever MXCSR says; the
     * product of two bfloat16 values is exact in float32); dim D of an odd D
     * is 0 (k[j][D] is never read). Then st[j*ldq + i] = scale * acc.
     * attnx_qk_bf16_scalar below is the reference, bit for bit; AMX's
     * tiles (amx.c) sum each instruction's 32 products their own way, so that
     * kernel matches it within float32 rounding of the sum instead.
     * qt2: (ceil(D/2), ldq) pairs  k: (nk, D) bf16 rows k_sl apart  st: (nk, ldq);
     * i < nq rounded up to a vector */
    void (*qk_bf16)(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                    int nk, int64_t D, float scale, float *st);

    /* P·V of the bfloat16 dot path on AMX tiles, into an accumulator kept
     * transposed (a dim a row, the queries in its lanes), for a tile of
     * probabilities and bfloat16 values (d < Dv, i < nq rounded up to 16):
     *   acct[d][i] = alpha[i] * acct[d][i] + sum_j pt[j][i] * v[j][d]
     * (alpha NULL: no rescale). P is not rounded: each probability is split
     * exactly into three bfloat16 parts, p = p1 + p2 + p3 (the top 8 bits of
     * its 24, of the rest, and the last 8), so the tile products of the parts
     * by the bfloat16 values are exact, summed in float32 the unit's own way:
     * within float32 rounding of the sum of 3·nk terms, with subnormal parts,
     * values and partial sums flushed to zero (parts below 2^-126 are lost:
     * under 2^-125 a probability). A tile holding an inf or NaN value takes FMAs
     * in key order instead (attnx_pv_bf16_scalar's bits), so that 0 · inf is
     * NaN only where the float32 path has it. NULL except with AMX.
     * pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)
     * work: ATTNX_PV_BF16_WORK(Dv) floats, 64-byte aligned; Dv % 16 == 0 */
    void (*pv_bf16)(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl, int nk,
                    int64_t Dv, const float *alpha, float *acct, float *work);

    /* P·V under precision "medium" (attnx.h), for the bfloat16 dot path,
     * as pv_bf16 into the transposed accumulator but with each probability
     * rounded to bfloat16 (to nearest, ties to even) and the products taken
     * as vdpbf16ps takes them, a pair of keys at a time (a missing odd key
     * counts as p = 0, v = 0): attnx_pv_medium_scalar below, bit for bit with
     * vdpbf16ps (AVX512_BF16), within float32 rounding of the sum on AMX's
     * tiles (one tile product a pair of keys where pv_bf16 takes three). A
     * tile holding an inf or NaN value takes the vdpbf16ps kernel there.
     * NULL in every table but those with bfloat16 dot products.
     * pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)
     * work: ATTNX_PV_BF16_WORK(Dv) floats, 64-byte aligned; Dv % 16 == 0 */
    void (*pv_medium)(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl, int nk,
                      int64_t Dv, const float *alpha, float *acct, float *work);

    /* Precision "medium" for inputs that are not bfloat16 (NULL without
     * bfloat16 dot products; references attnx_round_rows_scalar and
     * attnx_round_pairs_scalar, whose bits they give). round_rows: rows of
     * keys or values rounded to bfloat16 (attnx_bf16_round) for qk_bf16 and
     * pv_medium, once a head:
     *   dst[j*ld + d] = bf16(x[j*x_sl + d])  for j < rows, d < n; 0 for n <= d < ld
     * Returns nonzero if a finite value rounded to inf (past bfloat16's
     * largest finite value: the caller keeps float32 for the head).
     * x: (rows, n) rows x_sl apart  dst: (rows, ld), ld >= n
     * round_pairs: pack_qt's transposed queries (at scale 1) rounded in
     * place into qk_bf16's pairs, attnx_pack_qt_bf16_rounded's layout:
     *   word p, lane i = bf16(xt[2p][i]) | bf16(xt[2p+1][i]) << 16
     * at (uint32_t *)xt + p*ldx for 2p < n, i < nx rounded up to 16; row n
     * of an odd n counts as 0 (not read). Row p is written after rows 2p
     * and 2p+1 are read, and pair p/2 < p read row p before: in place.
     * xt: (n, ldx) floats in, (ceil(n/2), ldx) pairs out */
    int (*round_rows)(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *dst, int64_t ld);
    void (*round_pairs)(float *xt, int64_t ldx, int nx, int64_t n);

    /* Decoding under precision "medium" (NULL without bfloat16 dot
     * products): few query rows against a bfloat16, int8 or float16 cache
     * read in place (kind: attnx_medium_rows), with vdpbf16ps; the references
     * attnx_qk_dot_medium_scalar and attnx_pv_rows_medium_scalar, whose bits
     * they give (on AMX's tiles within float32 rounding of their sums, and
     * their bits for a call holding an inf or NaN: amx.c). A key or value
     * of an int8 row is its int8 value, exact in bfloat16, and of a float16
     * row its value rounded to bfloat16 (attnx_bf16_round); scale[j*s_sl]
     * is an int8 row's scale (NULL for the others).
     * qk_dot_medium: the rows' queries rounded to bfloat16 pairs (round_rows
     * into rows of ldp words, 0 past D) against the keys, decoding's tile:
     *   st[i*ldk + j] = hsum16(a) * (scale · s_j)    (s_j = scale[j*s_sl], or 1)
     * where lane l of a takes the pairs p = 16c + l of dims 2p+1, 2p (odd
     * first, as qk_bf16) for c < ceil(D/32), keys 0 past D, from 0, and
     * hsum16 sums the 16 lanes in one fixed order:
     *   g[l] = a[l] + a[l+8];  ((g0 + g1) + (g2 + g3)) + ((g4 + g5) + (g6 + g7))
     * qp: (nq, ldp) pairs, ldp >= 16 ceil(D/32)  k: (nk, D) rows k_sl apart  st: (nq, ldk)
     * pv_rows_medium: P·V of decoding's tile with each probability (times
     * its value's scale for int8, one float32 product) rounded to bfloat16,
     * the products as vdpbf16ps takes pairs of keys (attnx_pv_medium_scalar's
     * steps, rows for lanes), from alpha[i] * acc[i][d] (alpha NULL: no
     * rescale):
     *   acc = dp(bf16(pt[i][2m+1]·s), v[2m+1][d], acc); acc = dp(bf16(pt[i][2m]·s), v[2m][d], acc)
     * pt: (nq, ldk)  v: (nk, Dv) rows v_sl apart  acc: (nq, ldacc); Dv % 32 == 0 */
    void (*qk_dot_medium)(int kind, const uint32_t *qp, int64_t ldp, int nq, const void *k,
                          int64_t k_sl, const float *scale_k, int64_t s_sl, int nk, int64_t D,
                          float scale, float *st, int64_t ldk);
    void (*pv_rows_medium)(int kind, const float *pt, int64_t ldk, int nq, const void *v,
                           int64_t v_sl, const float *scale_v, int64_t s_sl, int nk, int64_t Dv,
                           const float *alpha, float *acc, int64_t ldacc);

    /* The backward's ptx under precision "medium" (NULL without bfloat16
     * dot products; the reference attnx_ptx_medium_scalar, whose bits it
     * gives with vdpbf16ps, and within float32 rounding of the sum on AMX's
     * tiles, which take blocks of 16 keys x 16 dims and leave the rest, and
     * a call holding an inf or NaN, to vdpbf16ps): dV += Pᵀ dO and
     * dK += dSᵀ Q with the tile (P or dS) and the rows (dO or Q) rounded to
     * bfloat16 by the caller (kt->round_rows, and kt->round_pairs on the
     * rows), the products as vdpbf16ps takes pairs of
     * queries (the odd one first), summed from zero, the sum then added:
     *   s = 0;  for m < ceil(nq/2):
     *     s = dp(pp[j][2m+1], x[2m+1][e], s);  s = dp(pp[j][2m], x[2m][e], s)
     *   acc[j][e] += s
     * where xp's word m, lane e is x[2m][e] | x[2m+1][e] << 16 (row nq of
     * an odd nq is 0 in both: pp[j][nq] = 0).
     * pp: (nk, ldp) bf16, ldp even  xp: (ceil(nq/2), ldx) pairs, ldx >= n
     * acc: (nk, n) rows ldacc apart */
    void (*ptx_medium)(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp, int64_t ldx,
                       int nk, int64_t n, float *acc, int64_t ldacc);

    /* Float32 scores on AMX tiles (NULL except with AMX): every float32
     * value x is split exactly into three bfloat16 parts, x = x1 + x2 + x3
     * (split_rows, split_pairs below), and of the nine products of parts
     * the six with a + b <= 4 are summed, per query i (lane) and key j:
     *   st[j*ldq + i] = sum_d sum_{a+b<=4} qa[d][i] · kb[j][d]
     * where qa is part a of qt and kb part b of the keys. The three dropped
     * products (q2·k3, q3·k2, q3·k3) are below 2^-23 |q·k| together: less
     * than one float32 rounding of the product. Each tile product of parts
     * is exact; the unit sums them in float32 its own way (see qk_bf16 on
     * AMX), flushing subnormal parts and sums to zero (parts of |x| below
     * 2^-110 are lost: their absolute size is what a score can lose).
     * qp: (3, Dp/2, ldq) the pairs of split_pairs, part a at qp + a·(Dp/2)·ldq
     * kp: (3, ., Dp) the rows of split_rows, part b at kp + b·kp_part; rows
     *     up to nk rounded up to 16 are read  st: (round16(nk), ldq);
     * Dp % 32 == 0; i < nq rounded up to 16. */
    void (*qk_split)(const uint32_t *qp, int64_t ldq, int nq, const uint16_t *kp, int64_t kp_part,
                     int nk, int64_t Dp, float *st);

    /* Float32 P·V on AMX tiles (NULL except with AMX), as pv_bf16 into the
     * transposed accumulator, for a tile of probabilities and float32 values
     * split into their three parts (split_rows' split) and transposed:
     *   acct[d][i] = alpha[i] * acct[d][i] + sum_j sum_{a+b<=4} pa[j][i] · vb[j][d]
     * (alpha NULL: no rescale), pa part a of pt[j][i] (split as split_rows
     * does), vb part b of value j; the six products as qk_split's, summed
     * the unit's way. Values must be finite, below 2^100 and 0 or at least
     * 2^-80 (the caller checks: split_rows' flag). vt: (3, Dv, ldv) part b at vt + b·vpart,
     * vt[b][d][j] = part b of v[j][d]; keys up to nk rounded up to 32 are
     * read (finite, any value: their probabilities are 0)
     * pt: (nk, ldq)  acct: (Dv, ldq)  work: ATTNX_PV_BF16_WORK(0) floats,
     * 64-byte aligned; Dv % 16 == 0; i < nq rounded up to 16 */
    void (*pv_split)(const float *pt, int64_t ldq, int nq, const uint16_t *vt, int64_t ldv,
                     int64_t vpart, int nk, int64_t Dv, const float *alpha, float *acct,
                     float *work);

    /* The split of qk_split (NULL where it is NULL): x1 is x rounded to
     * nearest at 8 significant bits, x2 the rest x - x1 so rounded, x3 what
     * is left (8 bits at most: a bfloat16 value), by Veltkamp's splitting
     * (c = 65537·x, x1 = c - (c - x): the same bits on every ISA, with no
     * FMA contraction, which C11 mode turns off). |x2| <= 2^-8 |x|,
     * |x3| <= 2^-16 |x|. Rows: parts[a*part + j*ldp + d] = part a+1 of
     * x[j*x_sl + d] for j < rows, d < n; 0 for n <= d < round32(n), and in
     * rows rows .. round16(rows)-1 (columns from round32(n) to ldp are not
     * written). Returns nonzero if any |x| >= 2^100, inf or NaN (65537·x
     * could overflow), or 0 < |x| < 2^-80 (subnormals included: a part, or
     * a product of parts, could fall below bfloat16's and float32's normal
     * range, which the tiles flush to 0, and a result of such values would
     * lose more than float32 rounding); such inputs take the FMA path.
     * x: (rows, n) rows x_sl apart  parts: (3, part), ldp >= round32(n) */
    int (*split_rows)(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *parts,
                      int64_t part, int64_t ldp);

    /* The same split of xt (n, ldx) (pack_qt's transposed rows) as pairs:
     *   parts[a*part + p*ldx + i] = part a+1 of xt[2p][i] | part a+1 of xt[2p+1][i] << 16
     * for 2p < np, i < nx rounded up to 16, where rows n .. np-1 of xt count
     * as 0 (not read). Returns nonzero as split_rows does.
     * xt: (n, ldx)  parts: (3, part), np even */
    int (*split_pairs)(const float *xt, int64_t ldx, int nx, int64_t n, int64_t np, uint32_t *parts,
                       int64_t part);

    /* With qk_bf16, for the tiles that pv_bf16 does not take: 1 if the
     * tiles of the bfloat16 dot path read the 16-bit values in place with
     * pv_half, 0 if they convert them first (half_rows, then pv). Converting
     * in registers costs shuffles a vector of values: on Zen 5 they run
     * beside the FMAs (a tile of 64 queries x 128 keys, Dv=64: 9776 TSC
     * cycles in place against 467 + 9750 with the pass); on an Intel AMX Xeon
     * they are slower, likely because Intel's one shuffle port is also the
     * port of its second FMA (the forward, L=1024 D=64, one thread, before
     * pv_bf16: 1.21-1.25x float32 in place, 1.38-1.40x with the pass). */
    int pv_half_tiles;

    /* The compute roofline: rounds × ATTNX_PEAK_CHAINS independent chains of
     * vector fused multiply-adds on registers, nothing else (attnx_peak).
     * Returns the flops done (2 a lane and FMA); *sink gets a value of the
     * chains, so that the compiler keeps them. */
    double (*fma_burn)(int64_t rounds, float *sink);

    /* The bfloat16 dot products' roofline (NULL without AVX512_BF16): rounds
     * × ATTNX_PEAK_CHAINS independent chains of vdpbf16ps on registers
     * (64 flops an instruction: 2 products a lane, a multiply and an add
     * each). Every bfloat16 half is 2^-8, so a step adds exactly 2^-15 to a
     * lane; chain i starts at i, and *sink gets lane 0 of the chains' sum. */
    double (*bf16dot_burn)(int64_t rounds, float *sink);

    /* The tiles' roofline (NULL without AMX): rounds × 4 TDPBF16PS on the
     * tile kernels' register blocking (C in tiles 0-3, A in 4-5, B in 6-7),
     * 16384 flops each. Every bfloat16 value is 2^-8, so a product adds
     * exactly 2^-11 to each element of C, from 0; *sink gets element 0 of
     * tiles 0 and 3, summed. Saves and restores the thread's tile
     * configuration as the kernels do. */
    double (*amx_burn)(int64_t rounds, float *sink);
} attnx_kernels;

/* Enough independent chains to cover an FMA's latency on both FMA pipes of
 * every core attnx targets (4 cycles × 2 pipes), within AVX2's 16 registers. */
#define ATTNX_PEAK_CHAINS 12

/* One table per instruction set (scalar.c, avx2.c, avx512.c, neon.c); the
 * SIMD ones exist where the compiler targets their architecture.
 * attnx_kernels_avx512_bf16 and attnx_kernels_avx512_amx are the AVX-512
 * table with a qk_bf16 (from avx512_bf16.c, amx.c), the ones dispatch.c
 * hands out for AVX-512 on a CPU with AVX512_BF16, and with AMX-BF16. */
extern const attnx_kernels attnx_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
#define ATTNX_HAVE_X86 1
extern const attnx_kernels attnx_kernels_avx2;
extern const attnx_kernels attnx_kernels_avx512;
extern const attnx_kernels attnx_kernels_avx512_bf16;
extern const attnx_kernels attnx_kernels_avx512_amx;
extern const attnx_kernels attnx_kernels_avx512_amx_emulated;
/* amx.c's kernels, on the tiles (s = amx) and on the tile unit's model
 * (s = amx_emulated: amx_emulated.c, tile_model.h) */
#define ATTNX_AMX_KERNELS(s)                                                                       \
    void attnx_qk_bf16_##s(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k,            \
                           int64_t k_sl, int nk, int64_t D, float scale, float *st);               \
    void attnx_pv_bf16_##s(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,  \
                           int nk, int64_t Dv, const float *alpha, float *acct, float *work);      \
    void attnx_qk_split_##s(const uint32_t *qp, int64_t ldq, int nq, const uint16_t *kp,           \
                            int64_t kp_part, int nk, int64_t Dp, float *st);                       \
    void attnx_pv_split_##s(const float *pt, int64_t ldq, int nq, const uint16_t *vt, int64_t ldv, \
                            int64_t vpart, int nk, int64_t Dv, const float *alpha, float *acct,    \
                            float *work);                                                          \
    int attnx_split_rows_##s(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *parts,   \
                             int64_t part, int64_t ldp);                                           \
    int attnx_split_pairs_##s(const float *xt, int64_t ldx, int nx, int64_t n, int64_t np,         \
                              uint32_t *parts, int64_t part);                                      \
    void attnx_pv_medium_##s(const float *pt, int64_t ldq, int nq, const uint16_t *v,              \
                             int64_t v_sl, int nk, int64_t Dv, const float *alpha, float *acct,    \
                             float *work);                                                         \
    ATTNX_MEDIUM_ROWS_KERNELS(s)                                                                   \
    double attnx_amx_burn_##s(int64_t rounds, float *sink);
ATTNX_AMX_KERNELS(amx)
ATTNX_AMX_KERNELS(amx_emulated)
void attnx_qk_bf16_avx512(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                          int nk, int64_t D, float scale, float *st);
void attnx_pv_medium_avx512(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                            int nk, int64_t Dv, const float *alpha, float *acct, float *work);
double attnx_bf16dot_burn_avx512(int64_t rounds, float *sink);
int attnx_round_rows_avx512(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *dst,
                            int64_t ld);
void attnx_round_pairs_avx512(float *xt, int64_t ldx, int nx, int64_t n);
ATTNX_MEDIUM_ROWS_KERNELS(avx512)
#endif

/* pv_bf16's working memory, in floats: the three parts of P of 32 queries
 * as pairs of keys (3, BK/2, 32) and the values transposed (Dv, BK) in
 * bfloat16. */
#define ATTNX_PV_BF16_WORK(Dv) (3 * (ATTNX_BK / 2) * 32 + (Dv) * (ATTNX_BK / 2))

/* Pack a block of queries for qk_bf16 as pairs of bfloat16 values, one
 * 32-bit word a pair, the even dim in the low half (as the pair lies in a
 * bfloat16 row in memory):
 *   qt2[p*ldq + i] = bf16(q[i][2p]) | bf16(q[i][2p+1]) << 16   for i < nq
 * where bf16(x) is the top 16 bits of x's float32 bits, and 0 for dim D of an
 * odd D and for nq <= i < nq rounded up to 16. Returns 1 if every value read
 * was a bfloat16 value (the low 16 bits of its float32 bits zero), so that
 * the packing lost nothing; 0 otherwise (qt2 then holds truncations: use the
 * float32 path). q: (nq, D) rows q_sl apart  qt2: (ceil(D/2), ldq) */
int attnx_pack_qt_bf16(const float *q, int64_t q_sl, int nq, int64_t D, uint32_t *qt2, int64_t ldq);

/* The reference of qk_bf16 (scalar.c): the steps of its contract in plain C,
 * for tests; not in any table (the scalar table keeps the float32 path). */
void attnx_qk_bf16_scalar(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                          int nk, int64_t D, float scale, float *st);
/* The references of split_rows, split_pairs, qk_split and pv_split
 * (scalar.c), for tests; qk_split's and pv_split's sum the six products
 * in float64 (pv_split's onto alpha[i] * acct[d][i] in float32). */
int attnx_split_rows_scalar(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *parts,
                            int64_t part, int64_t ldp);
int attnx_split_pairs_scalar(const float *xt, int64_t ldx, int nx, int64_t n, int64_t np,
                             uint32_t *parts, int64_t part);
void attnx_qk_split_scalar(const uint32_t *qp, int64_t ldq, int nq, const uint16_t *kp,
                           int64_t kp_part, int nk, int64_t Dp, float *st);
void attnx_pv_split_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *vt, int64_t ldv,
                           int64_t vpart, int nk, int64_t Dv, const float *alpha, float *acct);
/* Precision "medium" (attnx.h: bfloat16 products, float32 sums): the
 * references, in scalar.c, that the kernels with bfloat16 dot products are
 * to match bit for bit (vdpbf16ps) or within float32 rounding of the sum
 * (AMX tiles). attnx_bf16_round: x rounded to bfloat16, to nearest, ties to
 * even (past bfloat16's largest finite value: inf; a NaN stays a NaN of its
 * sign, made quiet). attnx_pack_qt_bf16_rounded: attnx_pack_qt_bf16's
 * layout, each float32 value rounded so (q is packed once, as "medium"
 * rounds Q and K once). attnx_pv_medium_scalar: P·V with each probability
 * rounded to bfloat16, the products as vdpbf16ps takes pairs along the keys
 * (the odd key of a pair first, bfloat16 subnormals read as 0, subnormal
 * results flushed; past the last key of an odd nk, p = v = 0), from
 * alpha[i] * acct[d][i] (alpha NULL: acct[d][i]):
 *   acc = dp(bf16(pt[2m+1][i]), v[2m+1][d], acc); acc = dp(bf16(pt[2m][i]), v[2m][d], acc)
 * pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)
 * q: (nq, D) rows q_sl apart  qt2: (ceil(D/2), ldq) pairs */
uint16_t attnx_bf16_round(float x);
void attnx_pack_qt_bf16_rounded(const float *q, int64_t q_sl, int nq, int64_t D, uint32_t *qt2,
                                int64_t ldq);
void attnx_pv_medium_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                            int nk, int64_t Dv, const float *alpha, float *acct);
int attnx_round_rows_scalar(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *dst,
                            int64_t ld);
void attnx_round_pairs_scalar(float *xt, int64_t ldx, int nx, int64_t n);
ATTNX_MEDIUM_ROWS_KERNELS(scalar)
/* The reference of pv_bf16 (scalar.c), for tests: per d and i, in key
 * order, acc = fmaf(pt[j][i], v[j][d], acc) from alpha[i] * acct[d][i]. */
void attnx_pv_bf16_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                          int nk, int64_t Dv, const float *alpha, float *acct);
#if defined(__aarch64__)
#define ATTNX_HAVE_NEON 1
extern const attnx_kernels attnx_kernels_neon;
#endif

/* A way to compute qk_bf16 on top of an instruction set: its name (as
 * attnx_bf16_dots() reports it and ATTNX_BF16_DOTS asks for it), whether
 * this CPU and OS have it, the instruction set's table with it, and whether
 * its qk_bf16 gives attnx_qk_bf16_scalar's bits (1) or matches it within
 * float32 rounding of the sum (0: AMX); asked_only: used only when
 * ATTNX_BF16_DOTS names it, never as the best (the tile unit's model). */
typedef struct {
    const char *name;
    int (*supported)(void);
    const attnx_kernels *kernels;
    int same_bits;
    int asked_only;
} attnx_dots;

/* An instruction set the core knows (dispatch.c holds the one list, in the
 * order scalar, avx2, avx512, neon): its name, whether this CPU and OS
 * support it, and its kernels (NULL when the build does not target its
 * architecture); and its bfloat16 dot products, best first, ended by a row
 * of NULLs (NULL where it has none). */
typedef struct {
    const char *name;
    int (*supported)(void);
    const attnx_kernels *kernels;
    const attnx_dots *dots;
} attnx_isa;

extern const attnx_isa attnx_isas[];
extern const int attnx_isa_total;

/* The kernels of the named instruction set if this build and CPU can run
 * them, else NULL. */
const attnx_kernels *attnx_isa_kernels(const char *name);

/* The kernel table in use. */
const attnx_kernels *attnx_active_kernels(void);

/* exp(x) for float, the polynomial every kernel uses (Cephes' expf: a degree-6
 * polynomial on [-ln2/2, ln2/2] after range reduction by ln2; within 1 ulp of
 * the correctly rounded exp on [-87.3, 0], checked by tests/c; the kernels
 * never pass a positive x, and x > 88 is clamped to 88). exp(-inf) and
 * anything below -87.33 give exactly 0; NaN gives NaN. The SIMD versions in
 * kernels_simd.h follow the same steps. */
#define ATTNX_EXP_LO (-87.3365478515625f)
#define ATTNX_EXP_HI 88.0f
#define ATTNX_LOG2E 1.44269504088896341f
#define ATTNX_LN2_HI 0.693359375f
#define ATTNX_LN2_LO (-2.12194440e-4f)
#define ATTNX_EXP_P0 1.9875691500e-4f
#define ATTNX_EXP_P1 1.3981999507e-3f
#define ATTNX_EXP_P2 8.3334519073e-3f
#define ATTNX_EXP_P3 4.1665795894e-2f
#define ATTNX_EXP_P4 1.6666665459e-1f
#define ATTNX_EXP_P5 5.0000001201e-1f

static inline float attnx_expf(float x)
{
    if (x != x) return x;
    if (x < ATTNX_EXP_LO) return 0.0f;
    if (x > ATTNX_EXP_HI) x = ATTNX_EXP_HI;
    float n = rintf(x * ATTNX_LOG2E);
    float r = x - n * ATTNX_LN2_HI;
    r = r - n * ATTNX_LN2_LO;
    float y = ATTNX_EXP_P0;
    y = y * r + ATTNX_EXP_P1;
    y = y * r + ATTNX_EXP_P2;
    y = y * r + ATTNX_EXP_P3;
    y = y * r + ATTNX_EXP_P4;
    y = y * r + ATTNX_EXP_P5;
    y = y * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

/* tanh(x) for float, the steps every softcap kernel takes: for |x| < 0.625
 * Cephes' tanhf polynomial, x + x·z·P(z) with z = x²; else
 * sign(x) · (1 - e) / (1 + e) with e = attnx_expf(-2|x|) (|x| > 43.7 gives
 * ±1 exactly). NaN gives NaN. */
#define ATTNX_TANH_SMALL 0.625f
#define ATTNX_TANH_P0 (-5.70498872745e-3f)
#define ATTNX_TANH_P1 2.06390887954e-2f
#define ATTNX_TANH_P2 (-5.37397155531e-2f)
#define ATTNX_TANH_P3 1.33314422036e-1f
#define ATTNX_TANH_P4 (-3.33332819422e-1f)

static inline float attnx_tanhf(float x)
{
    const float a = x < 0.0f ? -x : x;
    if (a < ATTNX_TANH_SMALL) {
        const float z = x * x;
        float y = ATTNX_TANH_P0;
        y = y * z + ATTNX_TANH_P1;
        y = y * z + ATTNX_TANH_P2;
        y = y * z + ATTNX_TANH_P3;
        y = y * z + ATTNX_TANH_P4;
        return y * z * x + x;
    }
    const float e = attnx_expf(-2.0f * a);
    const float r = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -r : r;
}

/* An IEEE binary16 value as float (exact, subnormals, inf and NaN included). */
static inline float attnx_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else {
        float f = (float)m * 0x1p-24f; /* subnormal (or zero): exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A bfloat16 value as float: its 16 bits are the top half of the float's. */
static inline float attnx_bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A bfloat16 value as the bfloat16 dot products read it (vdpbf16ps, the
 * tiles): a subnormal is 0 of its sign. */
static inline float attnx_bf16_daz(uint16_t h)
{
    return attnx_bf16_to_float((h & 0x7f80u) == 0 ? (uint16_t)(h & 0x8000u) : h);
}

/* The least |x| that rounds to a bfloat16 inf: 0x7f7f8000, halfway between
 * bfloat16's largest finite value and inf (the tie goes to inf, even). */
#define ATTNX_BF16_INF_FROM 0x1.ffp127f

/* Whether rounding x to the bfloat16 h took a finite value to inf (round_rows' flag). */
static inline int attnx_bf16_overflowed(float x, uint16_t h)
{
    return (h & 0x7fffu) == 0x7f80u && isfinite(x);
}

/* A float32 result as they write it: a subnormal flushed to 0 of its sign. */
static inline float attnx_ftz(float x) { return fabsf(x) < 0x1p-126f ? copysignf(0.0f, x) : x; }

/* One FMA of vdpbf16ps (the reference's, the emulation's): the product of
 * a and b read as above, added to acc rounded to nearest even, flushed. */
static inline float attnx_dp_fma(uint16_t a, uint16_t b, float acc)
{
    return attnx_ftz(fmaf(attnx_bf16_daz(a), attnx_bf16_daz(b), acc));
}

/* A 16-bit value of format fmt (attnx_half_format) as float. */
static inline float attnx_half16_to_float(int fmt, uint16_t h)
{
    return fmt == ATTNX_HALF_BF16 ? attnx_bf16_to_float(h) : attnx_half_to_float(h);
}

#endif

/* Portable reference kernels: plain loops, the oracle every SIMD variant is
 * tested against (ATTNX_ISA=scalar forces them). Layouts: see kernels.h. */
#include "kernels/kernels.h"

// qt: (D, ldq)  k: (nk, D) rows k_sl apart  st: (nk, ldq)
static void qk_scalar(const float *qt, int64_t ldq, int nq, const float *k, int64_t k_sl, int nk,
                      int64_t D, float *st)
{
    for (int j = 0; j < nk; j++) {
        const float *kj = k + j * k_sl;
        float *sj = st + j * ldq;
        for (int i = 0; i < nq; i++) sj[i] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float kd = kj[d];
            const float *qd = qt + d * ldq;
            for (int i = 0; i < nq; i++) sj[i] += kd * qd[i];
        }
    }
}

// qr: (nq, D)  k: (nk, D) rows k_sl apart  st: (nq, ldk)
static void qk_dot_scalar(const float *qr, int64_t D, int nq, const float *k, int64_t k_sl, int nk,
                          float *st, int64_t ldk)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            float sum = 0.0f;
            for (int64_t d = 0; d < D; d++) sum += qr[i * D + d] * k[j * k_sl + d];
            st[i * ldk + j] = sum;
        }
}

/* Both layouts: score (i, j) at st[j*s_key + i*s_row]. */
static void softmax_online_any(float *st, int64_t s_key, int64_t s_row, int nq, int nk, float *m,
                               float *l, float *alpha)
{
    for (int i = 0; i < nq; i++) {
        float mx = m[i];
        for (int j = 0; j < nk; j++) {
            const float s = st[j * s_key + i * s_row];
            mx = s > mx ? s : mx; /* a NaN score never becomes the max */
        }
        const float msub = mx == -INFINITY ? 0.0f : mx;
        const float a = attnx_expf(m[i] - msub);
        float sum = 0.0f;
        for (int j = 0; j < nk; j++) {
            const float p = attnx_expf(st[j * s_key + i * s_row] - msub);
            st[j * s_key + i * s_row] = p;
            sum += p;
        }
        l[i] = l[i] * a + sum;
        m[i] = mx;
        alpha[i] = a;
    }
}

static void softmax_final_any(float *st, int64_t s_key, int64_t s_row, int nq, int nk,
                              const float *m, const float *inv_l)
{
    for (int i = 0; i < nq; i++) {
        const float msub = m[i] == -INFINITY ? 0.0f : m[i];
        for (int j = 0; j < nk; j++)
            st[j * s_key + i * s_row] = attnx_expf(st[j * s_key + i * s_row] - msub) * inv_l[i];
    }
}

// st: (nk, ldq)  m, l, alpha: (ldq)
static void softmax_online_scalar(float *st, int64_t ldq, int nq, int nk, float *m, float *l,
                                  float *alpha)
{
    softmax_online_any(st, ldq, 1, nq, nk, m, l, alpha);
}

// st: (nk, ldq)  m, inv_l: (ldq)
static void softmax_final_scalar(float *st, int64_t ldq, int nq, int nk, const float *m,
                                 const float *inv_l)
{
    softmax_final_any(st, ldq, 1, nq, nk, m, inv_l);
}

// st: (nq, ldk)  m, l, alpha: (nq)
static void softmax_rows_scalar(float *st, int64_t ldk, int nq, int nk, float *m, float *l,
                                float *alpha)
{
    softmax_online_any(st, 1, ldk, nq, nk, m, l, alpha);
}

// st: (nq, ldk)  m, inv_l: (nq)
static void softmax_rows_final_scalar(float *st, int64_t ldk, int nq, int nk, const float *m,
                                      const float *inv_l)
{
    softmax_final_any(st, 1, ldk, nq, nk, m, inv_l);
}

// st: (nk, ldq)  m: element (i, j) at m[i*sq + j*sk]
static void mask_float_scalar(float *st, int64_t ldq, int nq, int nk, const float *m, int64_t sq,
                              int64_t sk)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) st[j * ldq + i] += m[i * sq + j * sk];
}

// st: (nk, ldq)  m: element (i, j) at m[i*sq + j*sk]
static void mask_bool_scalar(float *st, int64_t ldq, int nq, int nk, const unsigned char *m,
                             int64_t sq, int64_t sk)
{
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            /* a bit select, not a branch: masks are often random */
            uint32_t x;
            memcpy(&x, &st[j * ldq + i], sizeof x);
            const uint32_t keep = 0u - (uint32_t)(m[i * sq + j * sk] != 0);
            x = (x & keep) | (0xff800000u & ~keep); /* -inf where blocked */
            memcpy(&st[j * ldq + i], &x, sizeof x);
        }
}

// q: (nq, D) rows q_sl apart  qt: (D, ldq)
static void pack_qt_scalar(const float *q, int64_t q_sl, int nq, int64_t D, float scale, float *qt,
                           int64_t ldq)
{
    const int padded = ATTNX_ROUND16(nq);
    for (int64_t d = 0; d < D; d++) {
        float *row = qt + d * ldq;
        for (int i = 0; i < nq; i++) row[i] = scale * q[i * q_sl + d];
        for (int i = nq; i < padded; i++) row[i] = 0.0f;
    }
}

/* The float32 bits of x. */
static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

// q: (nq, D) rows q_sl apart  qt2: (ceil(D/2), ldq) pairs
int attnx_pack_qt_bf16(const float *q, int64_t q_sl, int nq, int64_t D, uint32_t *qt2, int64_t ldq)
{
    const int padded = ATTNX_ROUND16(nq);
    uint32_t low = 0; /* the bits a bfloat16 value does not have, of every value read */
    for (int64_t p = 0; 2 * p < D; p++) {
        uint32_t *row = qt2 + p * ldq;
        for (int i = 0; i < nq; i++) {
            const uint32_t even = bits_of(q[i * q_sl + 2 * p]);
            const uint32_t odd = 2 * p + 1 < D ? bits_of(q[i * q_sl + 2 * p + 1]) : 0;
            low |= (even | odd) & 0xffffu;
            row[i] = (even >> 16) | (odd & 0xffff0000u);
        }
        for (int i = nq; i < padded; i++) row[i] = 0;
    }
    return low == 0;
}

// qt2: (ceil(D/2), ldq) pairs  k: (nk, D) bf16 rows k_sl apart  st: (nk, ldq)
void attnx_qk_bf16_scalar(const uint32_t *qt2, int64_t ldq, int nq, const uint16_t *k, int64_t k_sl,
                          int nk, int64_t D, float scale, float *st)
{
    for (int j = 0; j < nk; j++) {
        const uint16_t *kj = k + j * k_sl;
        for (int i = 0; i < nq; i++) {
            float acc = 0.0f;
            for (int64_t p = 0; 2 * p < D; p++) {
                const uint32_t qp = qt2[p * ldq + i];
                const uint16_t k_odd = 2 * p + 1 < D ? kj[2 * p + 1] : 0;
                acc = attnx_dp_fma((uint16_t)(qp >> 16), k_odd, acc); /* the odd dim first */
                acc = attnx_dp_fma((uint16_t)qp, kj[2 * p], acc);
            }
            st[j * ldq + i] = scale * acc;
        }
    }
}

/* ---- float32 on bfloat16 tiles: the split, and qk_split ------------------ */

/* x rounded to nearest at 8 significant bits (Veltkamp: c = 65537·x,
 * c - (c - x)); C11 mode compiles no FMA contraction into it. */
static float high8(float x)
{
    const float c = 65537.0f * x;
    const float d = c - x;
    return c - d;
}

/* The three parts of x, as bfloat16 bits (each part's low 16 bits are 0). */
static void split3(float x, uint16_t part[3])
{
    const float x1 = high8(x), r = x - x1, x2 = high8(r), x3 = r - x2;
    part[0] = (uint16_t)(bits_of(x1) >> 16);
    part[1] = (uint16_t)(bits_of(x2) >> 16);
    part[2] = (uint16_t)(bits_of(x3) >> 16);
}

/* Where the split cannot take x (kernels.h, split_rows): |x| >= 2^100, inf
 * or NaN (65537·x could overflow), or 0 < |x| < 2^-80 (its parts, and their
 * products, could fall below the normal range, which the tiles flush). */
static int off_split(float x)
{
    const uint32_t mag = bits_of(x) & 0x7fffffffu;
    return mag >= (127u + 100u) << 23 || (mag != 0 && mag < (127u - 80u) << 23);
}

// x: (rows, n) rows x_sl apart  parts: (3, part) rows ldp apart
int attnx_split_rows_scalar(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *parts,
                            int64_t part, int64_t ldp)
{
    int special = 0;
    for (int j = 0; j < ATTNX_ROUND16(rows); j++)
        for (int64_t d = 0; d < (n + 31) / 32 * 32; d++) {
            uint16_t t[3] = {0, 0, 0};
            if (j < rows && d < n) {
                special |= off_split(x[j * x_sl + d]);
                split3(x[j * x_sl + d], t);
            }
            for (int a = 0; a < 3; a++) parts[a * part + j * ldp + d] = t[a];
        }
    return special;
}

// xt: (n, ldx)  parts: (3, part) as (np/2, ldx) pairs
int attnx_split_pairs_scalar(const float *xt, int64_t ldx, int nx, int64_t n, int64_t np,
                             uint32_t *parts, int64_t part)
{
    int special = 0;
    for (int64_t p = 0; 2 * p < np; p++)
        for (int i = 0; i < ATTNX_ROUND16(nx); i++) {
            uint16_t even[3] = {0, 0, 0}, odd[3] = {0, 0, 0};
            if (2 * p < n) {
                special |= off_split(xt[2 * p * ldx + i]);
                split3(xt[2 * p * ldx + i], even);
            }
            if (2 * p + 1 < n) {
                special |= off_split(xt[(2 * p + 1) * ldx + i]);
                split3(xt[(2 * p + 1) * ldx + i], odd);
            }
            for (int a = 0; a < 3; a++)
                parts[a * part + p * ldx + i] = even[a] | (uint32_t)odd[a] << 16;
        }
    return special;
}

// qp: (3, Dp/2, ldq) pairs  kp: (3, ., Dp) rows, part b at kp + b*kp_part  st: (nk, ldq)
void attnx_qk_split_scalar(const uint32_t *qp, int64_t ldq, int nq, const uint16_t *kp,
                           int64_t kp_part, int nk, int64_t Dp, float *st)
{
    const int64_t qpart = Dp / 2 * ldq;
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            double acc = 0.0;
            for (int64_t d = 0; d < Dp; d++)
                for (int a = 0; a < 3; a++)
                    for (int b = 0; a + b < 3; b++) {
                        const uint32_t pair = qp[a * qpart + d / 2 * ldq + i];
                        const uint16_t q = (uint16_t)(d % 2 ? pair >> 16 : pair);
                        acc += (double)attnx_bf16_to_float(q) *
                               attnx_bf16_to_float(kp[b * kp_part + j * Dp + d]);
                    }
            st[j * ldq + i] = (float)acc;
        }
}

// pt: (nk, ldq)  vt: (3, Dv, ldv) parts, part b at vt + b*vpart  acct: (Dv, ldq)
void attnx_pv_split_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *vt, int64_t ldv,
                           int64_t vpart, int nk, int64_t Dv, const float *alpha, float *acct)
{
    for (int64_t d = 0; d < Dv; d++)
        for (int i = 0; i < nq; i++) {
            const float start = alpha ? alpha[i] * acct[d * ldq + i] : acct[d * ldq + i];
            double acc = start;
            for (int j = 0; j < nk; j++) {
                uint16_t p[3];
                split3(pt[j * ldq + i], p);
                for (int a = 0; a < 3; a++)
                    for (int b = 0; a + b < 3; b++)
                        acc += (double)attnx_bf16_to_float(p[a]) *
                               attnx_bf16_to_float(vt[b * vpart + d * ldv + j]);
            }
            acct[d * ldq + i] = (float)acc;
        }
}

// pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)
void attnx_pv_bf16_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                          int nk, int64_t Dv, const float *alpha, float *acct)
{
    for (int64_t d = 0; d < Dv; d++)
        for (int i = 0; i < nq; i++) {
            float acc = alpha ? alpha[i] * acct[d * ldq + i] : acct[d * ldq + i];
            for (int j = 0; j < nk; j++)
                acc = fmaf(pt[j * ldq + i], attnx_bf16_to_float(v[j * v_sl + d]), acc);
            acct[d * ldq + i] = acc;
        }
}

/* ---- precision "medium": the references of the bfloat16-dot kernels -------- */

uint16_t attnx_bf16_round(float x)
{
    const uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    /* to nearest, ties to even: add 0x7fff and the lowest kept bit, then cut */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// q: (nq, D) rows q_sl apart  qt2: (ceil(D/2), ldq) pairs
void attnx_pack_qt_bf16_rounded(const float *q, int64_t q_sl, int nq, int64_t D, uint32_t *qt2,
                                int64_t ldq)
{
    const int padded = ATTNX_ROUND16(nq);
    for (int64_t p = 0; 2 * p < D; p++) {
        uint32_t *row = qt2 + p * ldq;
        for (int i = 0; i < nq; i++) {
            const uint32_t even = attnx_bf16_round(q[i * q_sl + 2 * p]);
            const uint32_t odd = 2 * p + 1 < D ? attnx_bf16_round(q[i * q_sl + 2 * p + 1]) : 0u;
            row[i] = even | odd << 16;
        }
        for (int i = nq; i < padded; i++) row[i] = 0;
    }
}

// pt: (nk, ldq)  v: (nk, Dv) bf16 rows v_sl apart  acct: (Dv, ldq)
void attnx_pv_medium_scalar(const float *pt, int64_t ldq, int nq, const uint16_t *v, int64_t v_sl,
                            int nk, int64_t Dv, const float *alpha, float *acct)
{
    for (int64_t d = 0; d < Dv; d++)
        for (int i = 0; i < nq; i++) {
            float acc = alpha ? alpha[i] * acct[d * ldq + i] : acct[d * ldq + i];
            for (int j = 0; j < nk; j += 2) { /* a pair of keys, the odd one first (0 past nk) */
                const uint16_t p_odd = j + 1 < nk ? attnx_bf16_round(pt[(j + 1) * ldq + i]) : 0;
                acc = attnx_dp_fma(p_odd, j + 1 < nk ? v[(j + 1) * v_sl + d] : 0, acc);
                acc = attnx_dp_fma(attnx_bf16_round(pt[j * ldq + i]), v[j * v_sl + d], acc);
            }
            acct[d * ldq + i] = acc;
        }
}

// x: (rows, n) rows x_sl apart  dst: (rows, ld)
int attnx_round_rows_scalar(const float *x, int64_t x_sl, int rows, int64_t n, uint16_t *dst,
                            int64_t ld)
{
    int over = 0;
    for (int j = 0; j < rows; j++)
        for (int64_t d = 0; d < ld; d++) {
            const uint16_t h = d < n ? attnx_bf16_round(x[j * x_sl + d]) : 0;
            over |= d < n && attnx_bf16_overflowed(x[j * x_sl + d], h);
            dst[j * ld + d] = h;
        }
    return over;
}

// xt: (n, ldx) floats in, (ceil(n/2), ldx) pairs out
void attnx_round_pairs_scalar(float *xt, int64_t ldx, int nx, int64_t n)
{
    const int lanes = ATTNX_ROUND16(nx);
    uint32_t *pairs = (uint32_t *)(void *)xt;
    for (int64_t p = 0; 2 * p < n; p++)
        for (int i = 0; i < lanes; i++) {
            const uint32_t even = attnx_bf16_round(xt[2 * p * ldx + i]);
            const uint32_t odd = 2 * p + 1 < n ? attnx_bf16_round(xt[(2 * p + 1) * ldx + i]) : 0u;
            pairs[p * ldx + i] = even | odd << 16;
        }
}

/* Element e of a "medium" decoding row (attnx_medium_rows) in bfloat16:
 * a bfloat16 value as it is, an int8 value exactly, a float16 value rounded. */
static uint16_t medium_elem(int kind, const void *row, int64_t e)
{
    if (kind == ATTNX_MEDIUM_I8) return attnx_bf16_round((float)((const int8_t *)row)[e]);
    const uint16_t h = ((const uint16_t *)row)[e];
    return kind == ATTNX_MEDIUM_F16 ? attnx_bf16_round(attnx_half_to_float(h)) : h;
}

/* The elements of a "medium" decoding row: 1 or 2 bytes. */
static int64_t medium_esize(int kind) { return kind == ATTNX_MEDIUM_I8 ? 1 : 2; }

// qp: (nq, ldp) pairs  k: (nk, D) rows k_sl apart  scale_k: (nk) s_sl apart  st: (nq, ldk)
void attnx_qk_dot_medium_scalar(int kind, const uint32_t *qp, int64_t ldp, int nq, const void *k,
                                int64_t k_sl, const float *scale_k, int64_t s_sl, int nk, int64_t D,
                                float scale, float *st, int64_t ldk)
{
    const int64_t chunks = (D + 31) / 32;
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) {
            const char *kj = (const char *)k + j * k_sl * medium_esize(kind);
            float a[16];
            for (int l = 0; l < 16; l++) {
                a[l] = 0.0f;
                for (int64_t c = 0; c < chunks; c++) { /* pair p: dims 2p+1 then 2p (0 past D) */
                    const int64_t p = 16 * c + l;
                    const uint32_t w = qp[i * ldp + p];
                    const uint16_t odd = 2 * p + 1 < D ? medium_elem(kind, kj, 2 * p + 1) : 0;
                    const uint16_t even = 2 * p < D ? medium_elem(kind, kj, 2 * p) : 0;
                    a[l] = attnx_dp_fma((uint16_t)(w >> 16), odd, a[l]);
                    a[l] = attnx_dp_fma((uint16_t)w, even, a[l]);
                }
            }
            float g[8];
            for (int l = 0; l < 8; l++) g[l] = a[l] + a[l + 8];
            const float sum = ((g[0] + g[1]) + (g[2] + g[3])) + ((g[4] + g[5]) + (g[6] + g[7]));
            st[i * ldk + j] = sum * (scale_k ? scale * scale_k[j * s_sl] : scale);
        }
}

// pt: (nq, ldk)  v: (nk, Dv) rows v_sl apart  scale_v: (nk) s_sl apart  acc: (nq, ldacc)
void attnx_pv_rows_medium_scalar(int kind, const float *pt, int64_t ldk, int nq, const void *v,
                                 int64_t v_sl, const float *scale_v, int64_t s_sl, int nk,
                                 int64_t Dv, const float *alpha, float *acc, int64_t ldacc)
{
    const int64_t row = v_sl * medium_esize(kind);
    for (int i = 0; i < nq; i++)
        for (int64_t d = 0; d < Dv; d++) {
            float a = alpha ? acc[i * ldacc + d] * alpha[i] : acc[i * ldacc + d];
            for (int j = 0; j < nk; j += 2) { /* a pair of keys, the odd one first (0 past nk) */
                uint16_t p[2] = {0, 0}, x[2] = {0, 0};
                for (int t = 0; t < 2 && j + t < nk; t++) {
                    const float pj = pt[i * ldk + j + t];
                    p[t] = attnx_bf16_round(scale_v ? pj * scale_v[(j + t) * s_sl] : pj);
                    x[t] = medium_elem(kind, (const char *)v + (j + t) * row, d);
                }
                a = attnx_dp_fma(p[1], x[1], a);
                a = attnx_dp_fma(p[0], x[0], a);
            }
            acc[i * ldacc + d] = a;
        }
}

// pp: (nk, ldp) bf16  xp: (ceil(nq/2), ldx) pairs  acc: (nk, n) rows ldacc apart
void attnx_ptx_medium_scalar(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp,
                             int64_t ldx, int nk, int64_t n, float *acc, int64_t ldacc)
{
    for (int j = 0; j < nk; j++)
        for (int64_t e = 0; e < n; e++) {
            float s = 0.0f;
            for (int m = 0; 2 * m < nq; m++) { /* a pair of queries, the odd one first */
                const uint32_t w = xp[m * ldx + e];
                s = attnx_dp_fma(pp[j * ldp + 2 * m + 1], (uint16_t)(w >> 16), s);
                s = attnx_dp_fma(pp[j * ldp + 2 * m], (uint16_t)w, s);
            }
            acc[j * ldacc + e] += s;
        }
}

// acc: (nq, ldacc)  inv: (nq)  out: (nq, Dv) rows out_sl apart
static int store_rows_scalar(const float *acc, int64_t ldacc, int nq, int64_t Dv, const float *inv,
                             float *out, int64_t out_sl)
{
    int bad = 0;
    for (int i = 0; i < nq; i++) {
        float *o = out + i * out_sl;
        const float *a = acc + i * ldacc;
        for (int64_t d = 0; d < Dv; d++) {
            o[d] = inv[i] != 0.0f ? a[d] * inv[i] : 0.0f;
            bad |= !isfinite(o[d]);
        }
    }
    return bad;
}

// pt: element (j, i) at pt[j*s_key + i*s_row]  v: (nk, Dv) rows v_sl apart  acc: (nq, ldacc)
static void pv_scalar(const float *pt, int64_t s_key, int64_t s_row, int nq, const float *v,
                      int64_t v_sl, int nk, int64_t Dv, const float *alpha, float *acc,
                      int64_t ldacc)
{
    for (int i = 0; i < nq; i++) {
        float *ai = acc + i * ldacc;
        if (alpha)
            for (int64_t d = 0; d < Dv; d++) ai[d] *= alpha[i];
        for (int j = 0; j < nk; j++) {
            const float p = pt[j * s_key + i * s_row];
            const float *vj = v + j * v_sl;
            for (int64_t d = 0; d < Dv; d++) ai[d] += p * vj[d];
        }
    }
}

// pt: (nk, ldq)  x: (nq, n) rows x_sl apart  acc: (nk, n) rows ldacc apart
static void ptx_scalar(const float *pt, int64_t ldq, int nq, const float *x, int64_t x_sl, int nk,
                       int64_t n, float *acc, int64_t ldacc)
{
    for (int j = 0; j < nk; j++) {
        float *aj = acc + j * ldacc;
        for (int64_t d0 = 0; d0 < n; d0 += 16) { /* 16 dims at a time: sums from zero, then added */
            const int w = n - d0 < 16 ? (int)(n - d0) : 16;
            float sum[16] = {0.0f};
            for (int i = 0; i < nq; i++) {
                const float p = pt[j * ldq + i];
                const float *xi = x + i * x_sl + d0;
                for (int d = 0; d < w; d++) sum[d] += p * xi[d];
            }
            for (int d = 0; d < w; d++) aj[d0 + d] += sum[d];
        }
    }
}

// pt, dpt: (nk, ldq)  d: (ldq)
static void softmax_bwd_scalar(const float *pt, float *dpt, int64_t ldq, int nq, int nk,
                               const float *d)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            const float p = pt[j * ldq + i];
            dpt[j * ldq + i] = p == 0.0f ? 0.0f : p * (dpt[j * ldq + i] - d[i]);
        }
}

// st: (nk, ldq)
static void softcap_scalar(float *st, int64_t ldq, int nq, int nk, float cap, float inv_cap)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) st[j * ldq + i] = cap * attnx_tanhf(st[j * ldq + i] * inv_cap);
}

// dst, capped: (nk, ldq)
static void softcap_bwd_scalar(float *dst, const float *capped, int64_t ldq, int nq, int nk,
                               float inv_cap)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            const float t = capped[j * ldq + i] * inv_cap;
            dst[j * ldq + i] *= 1.0f - t * t;
        }
}

// st: (nk, ldq); c = d(i0) - j0
static void alibi_scalar(float *st, int64_t ldq, int nq, int nk, float slope, int64_t c)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            const int64_t d = c + i - j;
            const float dist = (float)(d < 0 ? -d : d);
            const float bias = slope * dist;
            st[j * ldq + i] -= bias;
        }
}

// src: (rows, n) rows src_sl apart  dst: (rows, n)
static void half_rows_scalar(int fmt, const uint16_t *src, int64_t src_sl, int rows, int64_t n,
                             float *dst)
{
    for (int j = 0; j < rows; j++)
        for (int64_t d = 0; d < n; d++)
            dst[j * n + d] = attnx_half16_to_float(fmt, src[j * src_sl + d]);
}

// qr: (nq, D)  k: (nk, D) 16-bit, rows k_sl apart  st: (nq, ldk)
static void qk_dot_half_scalar(int fmt, const float *qr, int64_t D, int nq, const uint16_t *k,
                               int64_t k_sl, int nk, float *st, int64_t ldk)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            float sum = 0.0f;
            for (int64_t d = 0; d < D; d++)
                sum += qr[i * D + d] * attnx_half16_to_float(fmt, k[j * k_sl + d]);
            st[i * ldk + j] = sum;
        }
}

// pt: element (j, i) at pt[j*s_key + i*s_row]  v: (nk, Dv) 16-bit, rows v_sl apart
// acc: (nq, ldacc)
static void pv_half_scalar(int fmt, const float *pt, int64_t s_key, int64_t s_row, int nq,
                           const uint16_t *v, int64_t v_sl, int nk, int64_t Dv, const float *alpha,
                           float *acc, int64_t ldacc)
{
    for (int i = 0; i < nq; i++) {
        float *ai = acc + i * ldacc;
        if (alpha)
            for (int64_t d = 0; d < Dv; d++) ai[d] *= alpha[i];
        for (int j = 0; j < nk; j++) {
            const float p = pt[j * s_key + i * s_row];
            const uint16_t *vj = v + j * v_sl;
            for (int64_t d = 0; d < Dv; d++) ai[d] += p * attnx_half16_to_float(fmt, vj[d]);
        }
    }
}

// src: (rows, n) int8, rows src_sl apart  scale: (rows)  dst: (rows, n)
static void i8_rows_scalar(const int8_t *src, int64_t src_sl, const float *scale, int64_t s_sl,
                           int rows, int64_t n, float *dst)
{
    for (int j = 0; j < rows; j++)
        for (int64_t d = 0; d < n; d++)
            dst[j * n + d] = scale[j * s_sl] * (float)src[j * src_sl + d];
}

// qr: (nq, D)  k: (nk, D) int8, rows k_sl apart  scale: (nk)  st: (nq, ldk)
static void qk_dot_i8_scalar(const float *qr, int64_t D, int nq, const int8_t *k, int64_t k_sl,
                             const float *scale, int64_t s_sl, int nk, float *st, int64_t ldk)
{
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            float sum = 0.0f;
            for (int64_t d = 0; d < D; d++) sum += qr[i * D + d] * (float)k[j * k_sl + d];
            st[i * ldk + j] = scale[j * s_sl] * sum;
        }
}

// pt: element (j, i) at pt[j*s_key + i*s_row]  v: (nk, Dv) int8, rows v_sl apart
// scale: (nk)  acc: (nq, ldacc)
static void pv_i8_scalar(const float *pt, int64_t s_key, int64_t s_row, int nq, const int8_t *v,
                         int64_t v_sl, const float *scale, int64_t s_sl, int nk, int64_t Dv,
                         const float *alpha, float *acc, int64_t ldacc)
{
    for (int i = 0; i < nq; i++) {
        float *ai = acc + i * ldacc;
        if (alpha)
            for (int64_t d = 0; d < Dv; d++) ai[d] *= alpha[i];
        for (int j = 0; j < nk; j++) {
            const float p = pt[j * s_key + i * s_row] * scale[j * s_sl];
            const int8_t *vj = v + j * v_sl;
            for (int64_t d = 0; d < Dv; d++) ai[d] += p * (float)vj[d];
        }
    }
}

static double fma_burn_scalar(int64_t rounds, float *sink)
{
    float a[ATTNX_PEAK_CHAINS];
    for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) a[i] = (float)i;
    for (int64_t r = 0; r < rounds; r++)
        for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) a[i] = a[i] * 1.0000001f + 1e-7f;
    float s = 0.0f;
    for (int i = 0; i < ATTNX_PEAK_CHAINS; i++) s += a[i];
    *sink = s;
    return (double)rounds * ATTNX_PEAK_CHAINS * 2;
}

const attnx_kernels attnx_kernels_scalar = {
    .qk = qk_scalar,
    .qk_dot = qk_dot_scalar,
    .dot_max_nq = 4,
    .softmax_online = softmax_online_scalar,
    .softmax_final = softmax_final_scalar,
    .softmax_rows = softmax_rows_scalar,
    .softmax_rows_final = softmax_rows_final_scalar,
    .mask_float = mask_float_scalar,
    .mask_bool = mask_bool_scalar,
    .pack_qt = pack_qt_scalar,
    .store_rows = store_rows_scalar,
    .pv = pv_scalar,
    .ptx = ptx_scalar,
    .softmax_bwd = softmax_bwd_scalar,
    .softcap = softcap_scalar,
    .softcap_bwd = softcap_bwd_scalar,
    .alibi = alibi_scalar,
    .half_rows = half_rows_scalar,
    .qk_dot_half = qk_dot_half_scalar,
    .pv_half = pv_half_scalar,
    .i8_rows = i8_rows_scalar,
    .qk_dot_i8 = qk_dot_i8_scalar,
    .pv_i8 = pv_i8_scalar,
    .fma_burn = fma_burn_scalar,
};

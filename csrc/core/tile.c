/* One tile of scores, as both passes compute it: the queries packed once per
 * block, then per tile of BK keys the products, the scale, the causal
 * blocking and the mask. A change of the scores (a softcap, a per-head bias)
 * is one more step of attnx_score_tile. */
#include <math.h>

#include "core/core.h"

/* The SIMD packers and mask kernels gather down a column with int32
 * offsets: a column whose BQ rows lie further apart than that takes the
 * scalar kernels. */
static const attnx_kernels *kernels_for_stride(const attnx_kernels *kt, int64_t stride)
{
    const int64_t reach = (stride < 0 ? -stride : stride) * BQ;
    return reach < INT32_MAX ? kt : &attnx_kernels_scalar;
}

void attnx_pack_rows_t(const attnx_kernels *kt, const float *x, int64_t x_sl, int nq, int64_t n,
                       float scale, float *xt)
{
    kernels_for_stride(kt, x_sl)->pack_qt(x, x_sl, nq, n, scale, xt, BQ);
}

/* Causal: row i sees keys up to i0 + i + offset; the rest of the tile is -inf.
 * Only tiles that cross the diagonal have anything to block. */
static void causal_tile(const attnx_problem *p, int64_t i0, int nq, int64_t j0, int nk, float *st)
{
    const int64_t offset = causal_offset(p);
    if (p->causal == ATTNX_CAUSAL_NONE || j0 + nk - 1 <= i0 + offset) return;
    for (int i = 0; i < nq; i++)
        for (int64_t j = max64(0, i0 + i + offset + 1 - j0); j < nk; j++)
            st[j * BQ + i] = -INFINITY;
}

static void mask_tile(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int nq, int64_t j0,
                      int nk, float *st)
{
    const attnx_mask *m = &r->p->mask;
    if (m->kind == ATTNX_MASK_NONE) return;
    const attnx_kernels *kt = kernels_for_stride(r->kt, m->sq);
    const int64_t at = b * m->sb + h * m->sh + i0 * m->sq + j0 * m->sk;
    if (m->kind == ATTNX_MASK_BOOL)
        kt->mask_bool(st, BQ, nq, nk, (const unsigned char *)m->data + at, m->sq, m->sk);
    else
        kt->mask_float(st, BQ, nq, nk, (const float *)m->data + at, m->sq, m->sk);
}

void attnx_score_tile(const attnx_run *r, const float *qt, int rows, int64_t b, int64_t h,
                      int64_t i0, int nq, int64_t j0, int nk, float *st)
{
    const attnx_problem *p = r->p;
    const float *k = p->k.data + b * p->k.sb + kv_head(p, h) * p->k.sh + j0 * p->k.sl;
    if (rows)
        r->kt->qk_dot(qt, p->D, nq, k, p->k.sl, nk, st, BQ);
    else
        r->kt->qk(qt, BQ, nq, k, p->k.sl, nk, p->D, st);
    if (r->post_scale != 1.0f)
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) st[j * BQ + i] *= r->post_scale;
    causal_tile(p, i0, nq, j0, nk, st);
    mask_tile(r, b, h, i0, nq, j0, nk, st);
}

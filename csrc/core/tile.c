/* One tile of scores, as both passes compute it: the queries packed once per
 * block, then per tile of BK keys the products, the scale, the softcap,
 * ALiBi, the band (causal and window) and the mask. A new change of the
 * scores is one more step of shape_scores. */
#include <math.h>
#include <string.h>

#include "core/core.h"

/* The SIMD bool mask kernel gathers along a vector's lanes with int32
 * offsets (for strides other than adjacent keys): a mask whose `lanes`
 * elements lie further apart than that takes the scalar kernels. */
static const attnx_kernels *kernels_for_stride(const attnx_kernels *kt, int64_t stride,
                                               int64_t lanes)
{
    const int64_t reach = (stride < 0 ? -stride : stride) * lanes;
    return reach < INT32_MAX ? kt : &attnx_kernels_scalar;
}

void attnx_pack_rows_t(const attnx_kernels *kt, const float *x, int64_t x_sl, int nq, int64_t n,
                       float scale, float *xt)
{
    kt->pack_qt(x, x_sl, nq, n, scale, xt, BQ);
}

/* A tile of scores in either layout: score (i, j) at st[j*s_key + i*s_row].
 * The tile kernels put queries in the lanes, (nk, BQ); the decoding tile of
 * qk_dot has a query's keys contiguous, (nq, BK). The steps below are
 * element by element, so on a decoding tile they call the same kernels with
 * the roles of queries and keys exchanged (lanes = keys, lines = queries). */
typedef struct {
    float *st;
    int64_t s_key, s_row;
    int rows; /* the decoding tile */
} tile_view;

static tile_view view_of(float *st, int rows)
{
    return (tile_view){.st = st, .s_key = rows ? 1 : BQ, .s_row = rows ? BK : 1, .rows = rows};
}

/* Causal and the window: row i sees keys [i0 + i + lo, i0 + i + hi] (the
 * head's band); the rest of the tile is -inf. Only tiles that cross an edge
 * of the band have anything to block. */
static void band_tile(const head_bounds *hb, int64_t i0, int nq, int64_t j0, int nk,
                      const tile_view *t)
{
    if (j0 >= i0 + nq - 1 + hb->lo && j0 + nk - 1 <= i0 + hb->hi) return;
    for (int i = 0; i < nq; i++) {
        const int64_t from = clamp64(i0 + i + hb->lo - j0, 0, nk);
        const int64_t to = clamp64(i0 + i + hb->hi + 1 - j0, from, nk);
        float *si = t->st + i * t->s_row;
        for (int64_t j = 0; j < from; j++) si[j * t->s_key] = -INFINITY;
        for (int64_t j = to; j < nk; j++) si[j * t->s_key] = -INFINITY;
    }
}

/* The score steps between the products and the masks: the scale when it is
 * applied late, the softcap (its result copied to capped, if not NULL, for
 * the backward), ALiBi. */
static void shape_scores(const attnx_run *r, const head_bounds *hb, int64_t b, int64_t h,
                         int64_t i0, int nq, int64_t j0, int nk, const tile_view *t, float *capped,
                         int scaled)
{
    const attnx_problem *p = r->p;
    float *st = t->st;
    if (r->post_scale != 1.0f && !scaled)
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) st[j * t->s_key + i * t->s_row] *= r->post_scale;
    /* lanes and lines of the kernels: queries and keys, or the other way round */
    const int64_t ld = t->rows ? BK : BQ;
    const int lanes = t->rows ? nk : nq, lines = t->rows ? nq : nk;
    if (p->softcap > 0.0f) {
        r->kt->softcap(st, ld, lanes, lines, p->softcap, 1.0f / p->softcap);
        if (capped) memcpy(capped, st, sizeof(float) * (size_t)ld * (size_t)lines);
    }
    if (p->alibi.data) { /* |c + i - j| = |-c + j - i| */
        const float slope = p->alibi.data[b * p->alibi.sb + h * p->alibi.sh];
        const int64_t c = i0 + hb->offset - j0;
        r->kt->alibi(st, ld, lanes, lines, slope, t->rows ? -c : c);
    }
}

static void mask_tile(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int nq, int64_t j0,
                      int nk, const tile_view *t)
{
    const attnx_mask *m = &r->p->mask;
    if (m->kind == ATTNX_MASK_NONE) return;
    if (!(attnx_tile_flags(r, b, h, i0, nq, j0, nk) & ATTNX_MAP_DROP)) return; /* keeps all */
    const int64_t at = b * m->sb + h * m->sh + i0 * m->sq + j0 * m->sk;
    const int64_t ld = t->rows ? BK : BQ, s_lane = t->rows ? m->sk : m->sq;
    const int64_t s_line = t->rows ? m->sq : m->sk;
    const int lanes = t->rows ? nk : nq, lines = t->rows ? nq : nk;
    const attnx_kernels *kt = kernels_for_stride(r->kt, s_lane, ld);
    if (m->kind == ATTNX_MASK_BOOL)
        kt->mask_bool(t->st, ld, lanes, lines, (const unsigned char *)m->data + at, s_lane, s_line);
    else
        kt->mask_float(t->st, ld, lanes, lines, (const float *)m->data + at, s_lane, s_line);
}

/* Whether keys and values are stored converted (int8 or 16 bits): their
 * tiles are then converted into the thread's buffers. */
static int converted(const attnx_problem *p) { return p->k8.data || p->k16.data; }

/* Rows j .. j+n-1 of head (b, hk) of an int8 or 16-bit k (v: values), within
 * one page, as float32 into to (n, width). */
static void convert_rows(const attnx_run *r, int values, int64_t b, int64_t hk, int64_t j, int n,
                         int64_t width, float *to)
{
    const attnx_problem *p = r->p;
    if (p->k8.data) {
        const attnx_i8_tensor *t = values ? &p->v8 : &p->k8;
        const float *sc;
        const int8_t *from = i8_row_at(p, t, b, hk, j, &sc);
        r->kt->i8_rows(from, t->sl, sc, t->ssl, n, width, to);
    } else {
        const attnx_half_tensor *t = values ? &p->v16 : &p->k16;
        r->kt->half_rows(p->half_format, t->data + kv_offset(p, t->sb, t->sh, t->sl, b, hk, j),
                         t->sl, n, width, to);
    }
}

/* Rows j0 .. j0+nk-1 of pages, page by page, into buf (nk, width): converted
 * from int8 or 16 bits, or copied. */
static void stage_pages(const attnx_run *r, int values, int64_t b, int64_t hk, int64_t j0, int nk,
                        int64_t width, float *buf)
{
    const attnx_problem *p = r->p;
    for (int64_t j = j0; j < j0 + nk;) {
        const int n = (int)min64(j0 + nk - j, p->pages.size - j % p->pages.size);
        float *to = buf + (j - j0) * width;
        if (converted(p)) {
            convert_rows(r, values, b, hk, j, n, width, to);
        } else {
            const attnx_tensor *t = values ? &p->v : &p->k;
            const float *from = t->data + kv_offset(p, t->sb, t->sh, t->sl, b, hk, j);
            for (int i = 0; i < n; i++)
                memcpy(to + i * width, from + i * t->sl, sizeof(float) * (size_t)width);
        }
        j += n;
    }
}

const float *attnx_kv_rows(const attnx_run *r, int values, int64_t b, int64_t hk, int64_t j0,
                           int nk, float *buf, int64_t *sl)
{
    const attnx_problem *p = r->p;
    const int64_t width = values ? p->Dv : p->D;
    if (!in_one_page(p, j0, nk)) { /* a tile across pages: staged in buf, as gathered keys */
        stage_pages(r, values, b, hk, j0, nk, width, buf);
        *sl = width;
        return buf;
    }
    if (converted(p)) {
        convert_rows(r, values, b, hk, j0, nk, width, buf);
        *sl = width;
        return buf;
    }
    const attnx_tensor *t = values ? &p->v : &p->k;
    *sl = t->sl;
    return t->data + kv_offset(p, t->sb, t->sh, t->sl, b, hk, j0);
}

float attnx_kv_at(const attnx_problem *p, int values, int64_t b, int64_t hk, int64_t j, int64_t d)
{
    if (p->k8.data) {
        const attnx_i8_tensor *t = values ? &p->v8 : &p->k8;
        const float *sc;
        const int8_t *row = i8_row_at(p, t, b, hk, j, &sc);
        return *sc * (float)row[d];
    }
    if (p->k16.data) {
        const attnx_half_tensor *t = values ? &p->v16 : &p->k16;
        return attnx_half16_to_float(p->half_format,
                                     t->data[kv_offset(p, t->sb, t->sh, t->sl, b, hk, j) + d]);
    }
    const attnx_tensor *t = values ? &p->v : &p->k;
    return t->data[kv_offset(p, t->sb, t->sh, t->sl, b, hk, j) + d];
}

void attnx_score_tile(const attnx_run *r, const float *qt, int rows, const float *k, int64_t k_sl,
                      int64_t b, int64_t h, int64_t i0, int nq, int64_t j0, int nk, float *st,
                      float *capped)
{
    const attnx_problem *p = r->p;
    if (rows)
        r->kt->qk_dot(qt, p->D, nq, k, k_sl, nk, st, BK);
    else
        r->kt->qk(qt, BQ, nq, k, k_sl, nk, p->D, st);
    attnx_finish_tile(r, rows, b, h, i0, nq, j0, nk, st, capped, 0);
}

void attnx_finish_tile(const attnx_run *r, int rows, int64_t b, int64_t h, int64_t i0, int nq,
                       int64_t j0, int nk, float *st, float *capped, int scaled)
{
    const head_bounds hb = bounds_of(r->p, b, h);
    const tile_view t = view_of(st, rows);
    shape_scores(r, &hb, b, h, i0, nq, j0, nk, &t, capped, scaled);
    band_tile(&hb, i0, nq, j0, nk, &t);
    mask_tile(r, b, h, i0, nq, j0, nk, &t);
}

float attnx_score_one(const attnx_run *r, int64_t b, int64_t h, int64_t i, int64_t j)
{
    const attnx_problem *p = r->p;
    const head_bounds hb = bounds_of(p, b, h);
    if (j < i + hb.lo || j > i + hb.hi || j >= hb.klen) return -INFINITY;
    const float *q = p->q.data + b * p->q.sb + h * p->q.sh + i * p->q.sl;
    float s = 0.0f;
    for (int64_t d = 0; d < p->D; d++)
        s += r->pre_scale * q[d] * attnx_kv_at(p, 0, b, kv_head(p, h), j, d);
    /* the steps of a tile, on a tile of one score with the scalar kernels */
    const attnx_run one = {.p = p, .kt = &attnx_kernels_scalar, .post_scale = r->post_scale};
    const tile_view t = view_of(&s, 0);
    shape_scores(&one, &hb, b, h, i, 1, j, 1, &t, NULL, 0);
    const attnx_mask *m = &p->mask;
    const int64_t at = b * m->sb + h * m->sh + i * m->sq + j * m->sk;
    if (m->kind == ATTNX_MASK_BOOL && !((const unsigned char *)m->data)[at]) return -INFINITY;
    if (m->kind == ATTNX_MASK_FLOAT) s += ((const float *)m->data)[at];
    return s;
}

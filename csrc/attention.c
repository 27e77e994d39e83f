/* The driver: FlashAttention-style forward over tiles, calling the kernels of
 * the active instruction set through their table (kernels.h).
 *
 * Work is split into items, one per (batch, head, block of BQ queries). For
 * each item the queries are packed once (scaled, transposed), then the keys
 * are visited in tiles of BK: scores, masks, online softmax (running max and
 * sum, rescale), and the weighted sum of values, all in a per-thread scratch
 * of (D + BK + Dv + 3) × BQ floats that stays in cache; the output is
 * normalised once at the end. The Lq×Lk matrix is never built
 * unless the caller asked for the weights, which are then produced by a
 * second pass over the keys with the final max and sum (exact, not rescaled).
 *
 * Causal masks and key lengths shorten the range of keys visited (whole tiles
 * are skipped); only tiles on the diagonal are masked element by element.
 * With too few query blocks to occupy every thread (decoding), the keys are
 * split across threads too and the partial softmaxes merged (split-K).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "kernels.h"
#include "threads.h"

#define BQ ATTNX_BQ
#define BK ATTNX_BK

typedef struct {
    float *qt;     /* (D, BQ) */
    float *st;     /* (BK, BQ) */
    float *acc;    /* (BQ, ldacc) */
    float *m, *l, *alpha; /* (BQ) each */
} scratch;

typedef struct {
    const attnx_problem *p;
    const attnx_kernels *kt;
    int64_t nqb;       /* query blocks per head */
    int64_t nsplit;    /* key ranges per query block (split-K, for decoding) */
    int64_t kchunk;    /* keys per range, a multiple of BK */
    int64_t n_items;   /* B * Hq * nqb * nsplit */
    int64_t ldacc;
    float pre_scale;   /* the scale applied to the packed queries ... */
    float post_scale;  /* ... and to the scores after the product (1 unless |scale| > 1) */
    float *partial;    /* nsplit > 1: per item, m (BQ) | l (BQ) | acc (BQ, ldacc) */
    scratch *scr;      /* one per thread */
    atomic_llong next; /* next item to take */
} job;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* What head (b, h) attends: query rows [0, qlen) and keys [0, klen), and the
 * causal offset (query i sees keys j <= i + offset). The lengths are clamped
 * to [0, L] where they are read: the caller may let another thread write them
 * while the core runs (Python releases the GIL), which may change the numbers
 * but never reaches outside the arrays. */
typedef struct {
    int64_t qlen, klen, offset;
} head_bounds;

static head_bounds bounds_of(const attnx_problem *p, int64_t b, int64_t h)
{
    head_bounds hb;
    hb.qlen = p->query_lengths ? clamp64(p->query_lengths[b * p->ql_sb + h * p->ql_sh], 0, p->Lq) : p->Lq;
    hb.klen = p->key_lengths ? clamp64(p->key_lengths[b * p->kl_sb + h * p->kl_sh], 0, p->Lk) : p->Lk;
    hb.offset = p->causal == ATTNX_CAUSAL_LOWER_RIGHT ? p->Lk - p->Lq : 0;
    return hb;
}

/* Keys [0, kend) that queries [i0, i0 + nq) of a head may see. */
static int64_t keys_end(const attnx_problem *p, const head_bounds *hb, int64_t i0, int64_t nq)
{
    if (p->causal == ATTNX_CAUSAL_NONE) return hb->klen;
    return min64(hb->klen, max64(0, i0 + nq + hb->offset));
}

/* Causal, bool and float masks on one tile of scores.
 * st: (nk, BQ) for queries i0.. i0+nq-1 and keys j0 .. j0+nk-1 of head (b, h). */
static void apply_masks(const job *jb, int64_t b, int64_t h, int64_t i0, int nq,
                        int64_t j0, int nk, int64_t offset, float *st)
{
    const attnx_problem *p = jb->p;
    if (p->causal != ATTNX_CAUSAL_NONE && j0 + nk - 1 > i0 + offset) {
        for (int i = 0; i < nq; i++) {       /* row i sees keys up to i0 + i + offset */
            for (int64_t j = max64(0, i0 + i + offset + 1 - j0); j < nk; j++)
                st[j * BQ + i] = -INFINITY;
        }
    }
    if (p->mask_kind == ATTNX_MASK_NONE) return;
    /* the SIMD mask kernels gather with int32 offsets; huge strides take the scalar path */
    const int64_t reach = (p->mask_sq < 0 ? -p->mask_sq : p->mask_sq) * BQ;
    const attnx_kernels *kt = reach < INT32_MAX ? jb->kt : &attnx_kernels_scalar;
    const int64_t at = b * p->mask_sb + h * p->mask_sh + i0 * p->mask_sq + j0 * p->mask_sk;
    if (p->mask_kind == ATTNX_MASK_BOOL)
        kt->mask_bool(st, BQ, nq, nk, (const unsigned char *)p->mask + at, p->mask_sq, p->mask_sk);
    else
        kt->mask_float(st, BQ, nq, nk, (const float *)p->mask + at, p->mask_sq, p->mask_sk);
}

static int use_dot(const job *jb, int nq) { return nq <= jb->kt->dot_max_nq; }

/* Pack the queries of an item, pre-scaled: for few queries as rows
 * qr (nq, D), else transposed qt (D, BQ), zero-padded to a whole vector. */
static void pack_queries(const job *jb, const scratch *s, const float *q, int nq)
{
    const attnx_problem *p = jb->p;
    if (use_dot(jb, nq)) {
        for (int i = 0; i < nq; i++)
            for (int64_t d = 0; d < p->D; d++) s->qt[i * p->D + d] = jb->pre_scale * q[i * p->q.sl + d];
        return;
    }
    /* the SIMD packers gather down a column with int32 offsets: huge strides go scalar */
    const int64_t reach = (p->q.sl < 0 ? -p->q.sl : p->q.sl) * BQ;
    const attnx_kernels *kt = reach < INT32_MAX ? jb->kt : &attnx_kernels_scalar;
    kt->pack_qt(q, p->q.sl, nq, p->D, jb->pre_scale, s->qt, BQ);
}

/* Scores of one tile, masked: st (nk, BQ) = scale * Q[i0..] · K[j0..]ᵀ (+ masks). */
static void tile_scores(const job *jb, const scratch *s, int64_t b, int64_t h, const float *k,
                        int64_t i0, int nq, int64_t j0, int nk, int64_t offset)
{
    const attnx_problem *p = jb->p;
    if (use_dot(jb, nq))
        jb->kt->qk_dot(s->qt, p->D, nq, k + j0 * p->k.sl, p->k.sl, nk, s->st, BQ);
    else
        jb->kt->qk(s->qt, BQ, nq, k + j0 * p->k.sl, p->k.sl, nk, p->D, s->st);
    if (jb->post_scale != 1.0f)
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) s->st[j * BQ + i] *= jb->post_scale;
    apply_masks(jb, b, h, i0, nq, j0, nk, offset, s->st);
}

/* 1 if none of o[0 .. n) is inf or NaN. (The accumulator block is checked in
 * one pass; its padding columns stay 0.) */
static int row_finite(const float *o, int64_t n)
{
    uint32_t bad = 0;      /* an all-ones exponent is inf or NaN; OR-reduced, so it vectorises */
    for (int64_t d = 0; d < n; d++) {
        uint32_t x;
        memcpy(&x, &o[d], sizeof x);
        bad |= (x & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* An output row that came out inf or NaN although its softmax sum l is finite
 * and non-zero: an inf or NaN value met a zero weight (0 * inf = NaN in the
 * kernels' FMAs), e.g. in a masked or padded key. Recompute it exactly, adding
 * only keys whose weight is non-zero, so that a key that gets no weight never
 * leaks into the result, whatever its value holds. Rare: scalar code.
 * o: (Dv) row i of head (b, h); m, l: the row's final max and sum. */
static void repair_row(const job *jb, int64_t b, int64_t h, int64_t i, float m, float l, float *o)
{
    const attnx_problem *p = jb->p;
    if (!(l > 0.0f && l < INFINITY) || row_finite(o, p->Dv)) return;
    const int64_t hk = h / (p->Hq / p->Hk);
    const head_bounds hb = bounds_of(p, b, h);
    const int64_t kend = keys_end(p, &hb, i, 1);
    const float *q = p->q.data + b * p->q.sb + h * p->q.sh + i * p->q.sl;
    const float msub = m == -INFINITY ? 0.0f : m, inv = 1.0f / l;
    for (int64_t d = 0; d < p->Dv; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < kend; j++) {
        const int64_t mo = b * p->mask_sb + h * p->mask_sh + i * p->mask_sq + j * p->mask_sk;
        if (p->mask_kind == ATTNX_MASK_BOOL && !((const unsigned char *)p->mask)[mo]) continue;
        const float *k = p->k.data + b * p->k.sb + hk * p->k.sh + j * p->k.sl;
        float s = 0.0f;
        for (int64_t d = 0; d < p->D; d++) s += jb->pre_scale * q[d] * k[d];
        s *= jb->post_scale;
        if (p->mask_kind == ATTNX_MASK_FLOAT) s += ((const float *)p->mask)[mo];
        const float w = attnx_expf(s - msub) * inv;
        if (w == 0.0f) continue;
        const float *v = p->v.data + b * p->v.sb + hk * p->v.sh + j * p->v.sl;
        for (int64_t d = 0; d < p->Dv; d++) o[d] += w * v[d];
    }
}

/* The item's output rows from its accumulator: acc / l (normalise = 1) or acc
 * as it is (0: the weights were normalised already); zeros where nothing was
 * allowed (l = 0, and acc may hold 0 * inf = NaN then); rows with inf or NaN
 * recomputed by repair_row. out: (nq, Dv) rows out_sl apart. */
/* log of the softmax sum with the max put back: lse = m' + log(l), -inf when
 * nothing was allowed (l = 0), NaN for a NaN row. */
static float row_lse(float m, float l)
{
    return l == 0.0f ? -INFINITY : (m == -INFINITY ? 0.0f : m) + logf(l);
}

static void write_lse(const attnx_problem *p, int64_t b, int64_t h, int64_t i, float value)
{
    if (p->lse) p->lse[b * p->lse_sb + h * p->lse_sh + i * p->lse_sl] = value;
}

static void write_rows(const job *jb, const scratch *s, int64_t b, int64_t h, int64_t i0, int nq,
                       float *out, int normalise)
{
    const attnx_problem *p = jb->p;
    for (int i = 0; i < nq; i++) write_lse(p, b, h, i0 + i, row_lse(s->m[i], s->l[i]));
    float *inv = s->alpha;          /* free once the last tile is done */
    for (int i = 0; i < nq; i++)
        inv[i] = s->l[i] == 0.0f ? 0.0f : normalise ? 1.0f / s->l[i] : 1.0f;
    if (jb->kt->store_rows(s->acc, jb->ldacc, nq, p->Dv, inv, out, p->out_sl))
        for (int i = 0; i < nq; i++)     /* rare: some value came out inf or NaN */
            repair_row(jb, b, h, i0 + i, s->m[i], s->l[i], out + i * p->out_sl);
}

/* One item's place in the problem: queries i0 .. i0+rows-1 of head (b, h),
 * of which the first nq attend, to keys [0, kend) of key/value head hk. */
typedef struct {
    int64_t b, h, hk, i0, kend, offset;
    int rows, nq;
    float *out;           /* (rows, Dv) rows out_sl apart */
    float *w;             /* (rows, Lk) C-contiguous, or NULL */
    const float *k, *v;   /* the key/value head's first rows */
} item_view;

static item_view view_item(const job *jb, int64_t block)
{
    const attnx_problem *p = jb->p;
    item_view it;
    const int64_t qb = block % jb->nqb, bh = block / jb->nqb;
    it.h = bh % p->Hq;
    it.b = bh / p->Hq;
    it.hk = it.h / (p->Hq / p->Hk);
    it.i0 = qb * BQ;
    it.rows = (int)min64(BQ, p->Lq - it.i0);
    const head_bounds hb = bounds_of(p, it.b, it.h);
    it.nq = (int)max64(0, min64(it.rows, hb.qlen - it.i0));
    it.offset = hb.offset;
    it.kend = keys_end(p, &hb, it.i0, it.nq);
    it.out = p->out + it.b * p->out_sb + it.h * p->out_sh + it.i0 * p->out_sl;
    it.w = p->weights ? p->weights + ((it.b * p->Hq + it.h) * p->Lq + it.i0) * p->Lk : NULL;
    it.k = p->k.data + it.b * p->k.sb + it.hk * p->k.sh;
    it.v = p->v.data + it.b * p->v.sb + it.hk * p->v.sh;
    return it;
}

/* Zero what no tile writes: weights of keys past kend and of rows past nq;
 * output rows past nq (their lse is -inf). */
static void clear_unvisited(const job *jb, const item_view *it)
{
    const attnx_problem *p = jb->p;
    if (it->w)
        for (int i = 0; i < it->rows; i++) {
            const int64_t from = i < it->nq ? it->kend : 0;
            memset(it->w + i * p->Lk + from, 0, sizeof(float) * (size_t)(p->Lk - from));
        }
    for (int i = it->nq; i < it->rows; i++) {
        memset(it->out + i * p->out_sl, 0, sizeof(float) * (size_t)p->Dv);
        write_lse(p, it->b, it->h, it->i0 + i, -INFINITY);
    }
}

static void start_rows(const job *jb, const scratch *s, const item_view *it)
{
    const attnx_problem *p = jb->p;
    pack_queries(jb, s, p->q.data + it->b * p->q.sb + it->h * p->q.sh + it->i0 * p->q.sl, it->nq);
    for (int i = 0; i < BQ; i++) { s->m[i] = -INFINITY; s->l[i] = 0.0f; }
    memset(s->acc, 0, sizeof(float) * (size_t)it->nq * (size_t)jb->ldacc);
}

/* The online softmax over keys [kbeg, kstop): the output rows, or with split-K
 * the partial m | l | acc that merge_partials() combines. */
static void online_item(const job *jb, const scratch *s, const item_view *it, int64_t kbeg,
                        int64_t kstop, float *part)
{
    const attnx_problem *p = jb->p;
    const attnx_kernels *kt = jb->kt;
    const int nq = it->nq;
    start_rows(jb, s, it);
    for (int64_t j0 = kbeg; j0 < kstop; j0 += BK) {
        const int nk = (int)min64(BK, kstop - j0);
        tile_scores(jb, s, it->b, it->h, it->k, it->i0, nq, j0, nk, it->offset);
        kt->softmax_online(s->st, BQ, nq, nk, s->m, s->l, s->alpha);
        kt->pv(s->st, BQ, nq, it->v + j0 * p->v.sl, p->v.sl, nk, p->Dv, s->alpha, s->acc,
               jb->ldacc);
    }
    if (!part) {
        write_rows(jb, s, it->b, it->h, it->i0, nq, it->out, 1);
        return;
    }
    memcpy(part, s->m, sizeof(float) * (size_t)nq);
    memcpy(part + BQ, s->l, sizeof(float) * (size_t)nq);
    memcpy(part + 2 * BQ, s->acc, sizeof(float) * (size_t)nq * (size_t)jb->ldacc);
}

/* need_weights: pass 1 finds each row's max and sum, pass 2 writes the exact
 * probabilities and accumulates the output from them. */
static void weights_item(const job *jb, const scratch *s, const item_view *it)
{
    const attnx_problem *p = jb->p;
    const attnx_kernels *kt = jb->kt;
    const int nq = it->nq;
    start_rows(jb, s, it);
    for (int64_t j0 = 0; j0 < it->kend; j0 += BK) {
        const int nk = (int)min64(BK, it->kend - j0);
        tile_scores(jb, s, it->b, it->h, it->k, it->i0, nq, j0, nk, it->offset);
        kt->softmax_online(s->st, BQ, nq, nk, s->m, s->l, s->alpha);
    }
    float *inv_l = s->alpha;
    for (int i = 0; i < BQ; i++)      /* a NaN sum gives a NaN inverse: it propagates */
        inv_l[i] = (i < nq && s->l[i] != 0.0f) ? 1.0f / s->l[i] : 0.0f;
    for (int64_t j0 = 0; j0 < it->kend; j0 += BK) {
        const int nk = (int)min64(BK, it->kend - j0);
        tile_scores(jb, s, it->b, it->h, it->k, it->i0, nq, j0, nk, it->offset);
        kt->softmax_final(s->st, BQ, nq, nk, s->m, inv_l);
        for (int i = 0; i < nq; i++)         /* transpose: contiguous stores, reads in L1 */
            for (int j = 0; j < nk; j++) it->w[i * p->Lk + j0 + j] = s->st[j * BQ + i];
        kt->pv(s->st, BQ, nq, it->v + j0 * p->v.sl, p->v.sl, nk, p->Dv, NULL, s->acc, jb->ldacc);
    }
    write_rows(jb, s, it->b, it->h, it->i0, nq, it->out, 0);
    for (int i = 0; i < nq; i++)
        if (s->l[i] != s->l[i])            /* a NaN row is NaN throughout, skipped keys too */
            for (int64_t j = 0; j < p->Lk; j++) it->w[i * p->Lk + j] = NAN;
}

// one item: queries i0 .. i0+BQ-1 of head (b, h), against one range of keys
static void run_item(job *jb, scratch *s, int64_t item)
{
    const int64_t split = item % jb->nsplit;
    const item_view it = view_item(jb, item / jb->nsplit);
    if (split == 0) clear_unvisited(jb, &it);
    if (jb->nsplit == 1) {
        if (it.nq == 0) return;
        if (it.w) weights_item(jb, s, &it);
        else online_item(jb, s, &it, 0, it.kend, NULL);
        return;
    }
    /* split-K: this item's range of keys, and where its partial result goes */
    const int64_t kbeg = split * jb->kchunk, kstop = min64(it.kend, kbeg + jb->kchunk);
    float *part = jb->partial + item * (2 * BQ + BQ * jb->ldacc);
    for (int i = 0; i < BQ; i++) { part[i] = -INFINITY; part[BQ + i] = 0.0f; }
    if (it.nq > 0 && kbeg < kstop) online_item(jb, s, &it, kbeg, kstop, part);
}

/* Split-K: combine the nsplit partial softmaxes of each query row,
 *   M = max_s m_s,  f_s = exp(m_s - M'),  out = sum_s f_s acc_s / sum_s f_s l_s
 * (M' = 0 when M = -inf, as in the kernels: nothing allowed gives zeros). */
static void merge_partials(const job *jb)
{
    const attnx_problem *p = jb->p;
    const int64_t stride = 2 * BQ + BQ * jb->ldacc;
    for (int64_t block = 0; block < jb->n_items / jb->nsplit; block++) {
        const int64_t qb = block % jb->nqb, bh = block / jb->nqb;
        const int64_t h = bh % p->Hq, b = bh / p->Hq, i0 = qb * BQ;
        const head_bounds hb = bounds_of(p, b, h);
        const int nq = (int)max64(0, min64(min64(BQ, p->Lq - i0), hb.qlen - i0));
        const float *first = jb->partial + block * jb->nsplit * stride;
        for (int i = 0; i < nq; i++) {
            float M = -INFINITY;
            for (int64_t sp = 0; sp < jb->nsplit; sp++) {
                const float m = first[sp * stride + i];
                M = m > M ? m : M;
            }
            const float msub = M == -INFINITY ? 0.0f : M;
            float l = 0.0f;
            float *o = p->out + b * p->out_sb + h * p->out_sh + (i0 + i) * p->out_sl;
            for (int64_t d = 0; d < p->Dv; d++) o[d] = 0.0f;
            for (int64_t sp = 0; sp < jb->nsplit; sp++) {
                const float *part = first + sp * stride;
                const float f = attnx_expf(part[i] - msub);
                l += f * part[BQ + i];
                const float *acc = part + 2 * BQ + i * jb->ldacc;
                if (part[BQ + i] != 0.0f || part[BQ + i] != part[BQ + i])
                    for (int64_t d = 0; d < p->Dv; d++) o[d] += f * acc[d];
            }
            const float inv = l == 0.0f ? 0.0f : 1.0f / l;
            for (int64_t d = 0; d < p->Dv; d++) o[d] *= inv;
            write_lse(p, b, h, i0 + i, row_lse(M, l));
            repair_row(jb, b, h, i0 + i, M, l, o);
        }
    }
}

static void worker(void *arg, int tid)
{
    job *jb = arg;
    scratch *s = &jb->scr[tid];
    for (;;) {
        const int64_t item = atomic_fetch_add(&jb->next, 1);
        if (item >= jb->n_items) break;
        run_item(jb, s, item);
    }
}

/* ---- validation and set-up ------------------------------------------------ */

static int mul_ok(size_t a, size_t b, size_t *r)
{
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *r = a * b;
    return 1;
}

static attnx_status validate_lengths(const int64_t *len, int64_t sb, int64_t sh, int64_t B,
                                  int64_t H, int64_t limit)
{
    if (!len) return ATTNX_OK;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t x = len[b * sb + h * sh];
            if (x < 0 || x > limit) return ATTNX_ERR_LENGTH;
        }
    return ATTNX_OK;
}

static attnx_status validate(const attnx_problem *p)
{
    if (!p) return ATTNX_ERR_NULL;
    if (p->B < 0 || p->Hq < 0 || p->Hk < 0 || p->Lq < 0 || p->Lk < 0 || p->D < 0 || p->Dv < 0)
        return ATTNX_ERR_SHAPE;
    if (p->Hq > 0 && (p->Hk == 0 || p->Hq % p->Hk != 0)) return ATTNX_ERR_SHAPE;
    if (p->mask_kind < ATTNX_MASK_NONE || p->mask_kind > ATTNX_MASK_FLOAT) return ATTNX_ERR_ARG;
    if (p->causal < ATTNX_CAUSAL_NONE || p->causal > ATTNX_CAUSAL_LOWER_RIGHT) return ATTNX_ERR_ARG;
    if (!isfinite(p->scale)) return ATTNX_ERR_ARG;
    const int empty_out = p->B == 0 || p->Hq == 0 || p->Lq == 0;
    if (!empty_out) {
        if (!p->out && p->Dv > 0) return ATTNX_ERR_NULL;
        if (!p->q.data && p->D > 0) return ATTNX_ERR_NULL;
        if (p->Lk > 0 && ((!p->k.data && p->D > 0) || (!p->v.data && p->Dv > 0))) return ATTNX_ERR_NULL;
        if (p->mask_kind != ATTNX_MASK_NONE && !p->mask && p->Lk > 0) return ATTNX_ERR_NULL;
    }
    attnx_status st = validate_lengths(p->key_lengths, p->kl_sb, p->kl_sh, p->B, p->Hq, p->Lk);
    if (st == ATTNX_OK) st = validate_lengths(p->query_lengths, p->ql_sb, p->ql_sh, p->B, p->Hq, p->Lq);
    if (st != ATTNX_OK) return st;
    size_t n;   /* every element count the core indexes must fit in size_t bytes */
    if (!mul_ok((size_t)p->B, (size_t)p->Hq, &n) || !mul_ok(n, (size_t)p->Lq, &n) ||
        !mul_ok(n, (size_t)(p->Lk > p->Dv ? p->Lk : p->Dv), &n) || !mul_ok(n, sizeof(float), &n))
        return ATTNX_ERR_OVERFLOW;
    return ATTNX_OK;
}

/* The calling thread keeps its scratch buffer between calls (freed when the
 * thread exits), so a stream of small calls does not pay for malloc and the
 * page faults of fresh memory every time. Worker threads allocate theirs. */
static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
typedef struct { float *buf; size_t cap; } cache;

static void cache_free(void *c)
{
    if (c) free(((cache *)c)->buf);
    free(c);
}
static void cache_init(void) { (void)pthread_key_create(&cache_key, cache_free); }

static void *alloc_floats(size_t n);

static float *caller_buffer(size_t n)
{
    pthread_once(&cache_once, cache_init);
    cache *c = pthread_getspecific(cache_key);
    if (!c) {
        if (!(c = calloc(1, sizeof *c))) return NULL;
        if (pthread_setspecific(cache_key, c) != 0) { free(c); return NULL; }
    }
    if (c->cap < n) {
        float *b = alloc_floats(n);
        if (!b) return NULL;
        free(c->buf);
        c->buf = b;
        c->cap = n;
    }
    return c->buf;
}

static void free_scratch(scratch *scr, int n)
{
    for (int t = 1; t < n; t++) free(scr[t].qt);   /* [0] is the caller's cached buffer */
    free(scr);
}

static void *alloc_floats(size_t n)
{
    size_t bytes;
    if (!mul_ok(n, sizeof(float), &bytes) || bytes > SIZE_MAX - 64) return NULL;
    bytes = (bytes + 63) & ~(size_t)63;   /* aligned_alloc wants a multiple of 64 */
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* The threads a call uses: as asked, but one for small problems. */
static int threads_for(const attnx_problem *p, double flops_per_unit, double min_flops)
{
    const int nt = p->num_threads > 0 ? p->num_threads : attnx_get_num_threads();
    const double flops = flops_per_unit * (double)p->B * (double)p->Hq * (double)p->Lq
                         * (double)p->Lk * (double)(p->D > 0 ? p->D : 1);
    return flops < min_flops ? 1 : nt;
}

/* Scores are scale·q·k. The queries are packed pre-scaled, which cannot
 * overflow when |scale| <= 1; a larger scale is applied to the scores instead,
 * so that any scale whose scores fit in float32 works. */
static void split_scale(job *jb, float scale)
{
    jb->pre_scale = fabsf(scale) > 1.0f ? 1.0f : scale;
    jb->post_scale = fabsf(scale) > 1.0f ? scale : 1.0f;
}

/* The forward's plan: items, split-K (when too few query blocks keep every
 * thread busy: decoding, Lq of 1 to a few against long Lk; never for the
 * weights), and the threads that run them. Returns the thread count. */
static int plan_forward(job *jb, int nt)
{
    const attnx_problem *p = jb->p;
    const int64_t blocks = p->B * p->Hq * jb->nqb;
    jb->nsplit = 1;
    jb->kchunk = p->Lk;
    if (nt > 1 && !p->weights && blocks < 4 * (int64_t)nt && p->Lk >= 4 * BK) {
        int64_t want = (4 * (int64_t)nt + blocks - 1) / blocks;    /* ~4 items a thread */
        const int64_t tiles = (p->Lk + BK - 1) / BK;
        if (want > tiles / 2) want = tiles / 2;                    /* >= 2 tiles an item */
        jb->kchunk = (tiles + want - 1) / want * BK;
        jb->nsplit = (p->Lk + jb->kchunk - 1) / jb->kchunk;
    }
    jb->n_items = blocks * jb->nsplit;
    if (nt > jb->n_items) nt = (int)jb->n_items;
    return nt < 1 ? 1 : nt;
}

/* Per thread: qt (D, BQ) | st (BK, BQ) | acc (BQ, ldacc) | m, l, alpha (BQ);
 * thread 0 uses the calling thread's cached buffer. */
static attnx_status alloc_scratch(job *jb, int nt)
{
    const attnx_problem *p = jb->p;
    size_t per;
    if (!mul_ok((size_t)p->D + BK + (size_t)jb->ldacc + 3, BQ, &per)) return ATTNX_ERR_OVERFLOW;
    if (!(jb->scr = calloc((size_t)nt, sizeof(scratch)))) return ATTNX_ERR_NOMEM;
    for (int t = 0; t < nt; t++) {
        float *base = t == 0 ? caller_buffer(per) : alloc_floats(per);
        if (!base) {
            free_scratch(jb->scr, t);
            return ATTNX_ERR_NOMEM;
        }
        scratch *s = &jb->scr[t];
        s->qt = base;
        s->st = s->qt + (size_t)p->D * BQ;
        s->acc = s->st + (size_t)BK * BQ;
        s->m = s->acc + (size_t)jb->ldacc * BQ;
        s->l = s->m + BQ;
        s->alpha = s->l + BQ;
    }
    return ATTNX_OK;
}

attnx_status attnx_forward(const attnx_problem *p)
{
    attnx_status st = validate(p);
    if (st != ATTNX_OK) return st;
    if (p->B == 0 || p->Hq == 0 || p->Lq == 0 || (p->Dv == 0 && !p->weights && !p->lse))
        return ATTNX_OK;

    job jb;
    memset(&jb, 0, sizeof jb);
    jb.p = p;
    jb.kt = attnx_active_kernels();
    jb.nqb = (p->Lq + BQ - 1) / BQ;
    jb.ldacc = ATTNX_ROUND16(p->Dv);
    split_scale(&jb, p->scale);
    atomic_init(&jb.next, 0);
    const int nt = plan_forward(&jb, threads_for(p, 4.0, 2e6));
    if (jb.nsplit > 1) {
        size_t n;
        if (!mul_ok((size_t)jb.n_items, 2 * BQ + BQ * (size_t)jb.ldacc, &n)) return ATTNX_ERR_OVERFLOW;
        if (!(jb.partial = alloc_floats(n))) return ATTNX_ERR_NOMEM;
    }
    if ((st = alloc_scratch(&jb, nt)) != ATTNX_OK) {
        free(jb.partial);
        return st;
    }
    attnx_parallel(nt, worker, &jb);
    if (jb.nsplit > 1) merge_partials(&jb);
    free_scratch(jb.scr, nt);
    free(jb.partial);
    return ATTNX_OK;
}

const char *attnx_strerror(attnx_status status)
{
    switch (status) {
    case ATTNX_OK: return "success";
    case ATTNX_ERR_NULL: return "a required array pointer is NULL";
    case ATTNX_ERR_SHAPE: return "invalid shape: a negative size, or query heads not a multiple of key/value heads";
    case ATTNX_ERR_ARG: return "invalid argument: mask kind or causal mode out of range, or scale not finite";
    case ATTNX_ERR_LENGTH: return "a key or query length lies outside [0, L]";
    case ATTNX_ERR_OVERFLOW: return "the problem is too large: its byte count overflows size_t";
    case ATTNX_ERR_NOMEM: return "out of memory for scratch buffers";
    case ATTNX_ERR_ISA: return "that instruction set is not available on this CPU or build";
    }
    return "unknown error";
}

/* ---- the backward pass ----------------------------------------------------
 * FlashAttention-2's scheme on CPU tiles. With the forward's output O and the
 * log of each row's softmax sum (lse), for an upstream gradient dO, tile by
 * tile (the Lq×Lk matrix is never built):
 *
 *   P  = exp(S − lse)        S = scale·Q Kᵀ + masks, recomputed as the forward does
 *   dV += Pᵀ dO              dP = dO Vᵀ          D = rowsum(dO ∘ O)
 *   dS = P ∘ (dP − D)        (exactly 0 where P is 0)
 *   dQ += scale · dS K       dK += scale · dSᵀ Q        d(mask) = dS
 *
 * Items are (batch, key/value head, range of keys). An item owns the dK and dV
 * rows of its keys (the query heads of a GQA group are added in a fixed
 * order) and the dQ rows of its heads; with several key ranges a head (few
 * heads, many threads), each range writes its own dQ partial and the
 * partials are summed afterwards in range order. No atomics: the same bits
 * on every run with a given thread count. */

typedef struct {
    float *qt;    /* (D, BQ)   queries, pre-scaled, transposed */
    float *dot;   /* (Dv, BQ)  upstream gradient rows, transposed */
    float *st;    /* (BK, BQ)  scores, then P */
    float *dpt;   /* (BK, BQ)  dP, then dS */
    float *dqacc; /* (BQ, ldqa) */
    float *lse;   /* (BQ) the block's lse; +inf in padding lanes (P = 0 there) */
    float *dvec;  /* (BQ) D = rowsum(dO ∘ O) */
    float *ones;  /* (BQ) */
} bscratch;

typedef struct {
    job base;                    /* the forward's view: problem, kernels, scales, nqb */
    const attnx_grad_problem *g;
    int64_t group;               /* query heads per key/value head */
    int64_t nsplit, kchunk, n_items, ldqa;
    float *partial;              /* nsplit > 1: dQ per range, (nsplit, B, Hq, Lq, D) */
    bscratch *scr;
    atomic_llong next;
} bjob;

/* Pack nq rows of x (rows x_sl apart, n wide) transposed into xt (n, BQ), times scale. */
static void pack_rows_t(const attnx_kernels *kt, const float *x, int64_t x_sl, int nq, int64_t n,
                        float scale, float *xt)
{
    const int64_t reach = (x_sl < 0 ? -x_sl : x_sl) * BQ;
    (reach < INT32_MAX ? kt : &attnx_kernels_scalar)->pack_qt(x, x_sl, nq, n, scale, xt, BQ);
}

/* One tile: keys j0 .. j0+nk-1 against the packed block of queries i0 .. i0+nq-1 of head (b, h). */
static void bwd_tile(const bjob *bj, const bscratch *s, int64_t b, int64_t h, int64_t i0, int nq,
                     int64_t j0, int nk)
{
    const job *jb = &bj->base;
    const attnx_problem *p = jb->p;
    const attnx_grad_problem *g = bj->g;
    const attnx_kernels *kt = jb->kt;
    const int64_t hk = h / bj->group;
    const float *k = p->k.data + b * p->k.sb + hk * p->k.sh + j0 * p->k.sl;
    const float *v = p->v.data + b * p->v.sb + hk * p->v.sh + j0 * p->v.sl;
    const float *q = p->q.data + b * p->q.sb + h * p->q.sh + i0 * p->q.sl;
    const float *dout = g->dout.data + b * g->dout.sb + h * g->dout.sh + i0 * g->dout.sl;
    const int64_t offset = p->causal == ATTNX_CAUSAL_LOWER_RIGHT ? p->Lk - p->Lq : 0;

    kt->qk(s->qt, BQ, nq, k, p->k.sl, nk, p->D, s->st);                    /* S */
    if (jb->post_scale != 1.0f)
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) s->st[j * BQ + i] *= jb->post_scale;
    apply_masks(jb, b, h, i0, nq, j0, nk, offset, s->st);
    kt->softmax_final(s->st, BQ, nq, nk, s->lse, s->ones);                  /* P */
    kt->qk(s->dot, BQ, nq, v, p->v.sl, nk, p->Dv, s->dpt);                  /* dP */
    kt->ptx(s->st, BQ, nq, dout, g->dout.sl, nk, p->Dv,                     /* dV += Pᵀ dO */
            g->dv.data + b * g->dv.sb + hk * g->dv.sh + j0 * g->dv.sl, g->dv.sl);
    kt->softmax_bwd(s->st, s->dpt, BQ, nq, nk, s->dvec);                    /* dS */
    kt->ptx(s->dpt, BQ, nq, q, p->q.sl, nk, p->D,                           /* dK += dSᵀ Q */
            g->dk.data + b * g->dk.sb + hk * g->dk.sh + j0 * g->dk.sl, g->dk.sl);
    kt->pv(s->dpt, BQ, nq, k, p->k.sl, nk, p->D, NULL, s->dqacc, bj->ldqa); /* dQ += dS K */
    if (g->dmask) {
        float *dm = g->dmask + ((b * p->Hq + h) * p->Lq + i0) * p->Lk + j0;
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < nk; j++) dm[i * p->Lk + j] = s->dpt[j * BQ + i];
    }
}

/* Queries i0 .. i0+rows-1 of head (b, h) against keys [kbeg, kstop): their
 * contribution to dK and dV, and their dQ rows (scaled) written to dq. */
static void bwd_block(const bjob *bj, const bscratch *s, int64_t b, int64_t h, int64_t i0,
                      int64_t kbeg, int64_t kstop, float *dq, int64_t dq_sl)
{
    const job *jb = &bj->base;
    const attnx_problem *p = jb->p;
    const attnx_grad_problem *g = bj->g;
    const head_bounds hb = bounds_of(p, b, h);
    const int rows = (int)min64(BQ, p->Lq - i0);
    const int nq = (int)max64(0, min64(rows, hb.qlen - i0));
    const int64_t kend = min64(kstop, keys_end(p, &hb, i0, nq));
    for (int i = 0; i < rows; i++) memset(dq + i * dq_sl, 0, sizeof(float) * (size_t)p->D);
    if (nq == 0 || kbeg >= kend) return;

    pack_rows_t(jb->kt, p->q.data + b * p->q.sb + h * p->q.sh + i0 * p->q.sl, p->q.sl, nq, p->D,
                jb->pre_scale, s->qt);
    const float *dout = g->dout.data + b * g->dout.sb + h * g->dout.sh + i0 * g->dout.sl;
    const float *o = g->o.data + b * g->o.sb + h * g->o.sh + i0 * g->o.sl;
    pack_rows_t(jb->kt, dout, g->dout.sl, nq, p->Dv, 1.0f, s->dot);
    for (int i = 0; i < BQ; i++) {
        float d = 0.0f;
        if (i < nq)
            for (int64_t e = 0; e < p->Dv; e++) d += dout[i * g->dout.sl + e] * o[i * g->o.sl + e];
        s->dvec[i] = d;
        s->lse[i] = i < nq ? g->lse[b * g->lse_sb + h * g->lse_sh + (i0 + i) * g->lse_sl] : INFINITY;
    }
    memset(s->dqacc, 0, sizeof(float) * (size_t)nq * (size_t)bj->ldqa);
    for (int64_t j0 = kbeg; j0 < kend; j0 += BK)
        bwd_tile(bj, s, b, h, i0, nq, j0, (int)min64(BK, kend - j0));
    for (int i = 0; i < nq; i++)
        for (int64_t e = 0; e < p->D; e++) dq[i * dq_sl + e] = p->scale * s->dqacc[i * bj->ldqa + e];
}

// one item: the keys [kbeg, kstop) of key/value head (b, hk), against every query of its group
static void bwd_item(bjob *bj, const bscratch *s, int64_t item)
{
    const attnx_problem *p = bj->base.p;
    const attnx_grad_problem *g = bj->g;
    const int64_t split = item % bj->nsplit, bhk = item / bj->nsplit;
    const int64_t hk = bhk % p->Hk, b = bhk / p->Hk;
    const int64_t kbeg = split * bj->kchunk, kstop = min64(p->Lk, kbeg + bj->kchunk);
    float *dk = g->dk.data + b * g->dk.sb + hk * g->dk.sh;
    float *dv = g->dv.data + b * g->dv.sb + hk * g->dv.sh;
    for (int64_t j = kbeg; j < kstop; j++) {
        memset(dk + j * g->dk.sl, 0, sizeof(float) * (size_t)p->D);
        memset(dv + j * g->dv.sl, 0, sizeof(float) * (size_t)p->Dv);
    }
    for (int64_t h = hk * bj->group; h < (hk + 1) * bj->group; h++)
        for (int64_t i0 = 0; i0 < p->Lq; i0 += BQ) {
            if (bj->nsplit == 1)
                bwd_block(bj, s, b, h, i0, kbeg, kstop,
                          g->dq.data + b * g->dq.sb + h * g->dq.sh + i0 * g->dq.sl, g->dq.sl);
            else
                bwd_block(bj, s, b, h, i0, kbeg, kstop,
                          bj->partial + (((split * p->B + b) * p->Hq + h) * p->Lq + i0) * p->D, p->D);
        }
    for (int64_t j = kbeg; j < kstop; j++)
        for (int64_t e = 0; e < p->D; e++) dk[j * g->dk.sl + e] *= p->scale;
}

static void bwd_worker(void *arg, int tid)
{
    bjob *bj = arg;
    for (;;) {
        const int64_t item = atomic_fetch_add(&bj->next, 1);
        if (item >= bj->n_items) break;
        bwd_item(bj, &bj->scr[tid], item);
    }
}

/* dQ from the per-range partials, summed in range order. */
static void bwd_merge_dq(const bjob *bj)
{
    const attnx_problem *p = bj->base.p;
    const attnx_grad_problem *g = bj->g;
    const int64_t per = p->B * p->Hq * p->Lq * p->D;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t i = 0; i < p->Lq; i++) {
                float *dq = g->dq.data + b * g->dq.sb + h * g->dq.sh + i * g->dq.sl;
                const float *src = bj->partial + ((b * p->Hq + h) * p->Lq + i) * p->D;
                for (int64_t e = 0; e < p->D; e++) dq[e] = src[e];
                for (int64_t sp = 1; sp < bj->nsplit; sp++)
                    for (int64_t e = 0; e < p->D; e++) dq[e] += src[sp * per + e];
            }
}

static attnx_status validate_grad(const attnx_grad_problem *g)
{
    if (!g) return ATTNX_ERR_NULL;
    attnx_status st = validate(&g->f);
    if (st != ATTNX_OK) return st;
    const attnx_problem *p = &g->f;
    const int rows = p->B > 0 && p->Hq > 0 && p->Lq > 0;
    if (rows && ((p->Dv > 0 && (!g->o.data || !g->dout.data)) || !g->lse || (p->D > 0 && !g->dq.data)))
        return ATTNX_ERR_NULL;
    if (p->B > 0 && p->Hk > 0 && p->Lk > 0 && ((p->D > 0 && !g->dk.data) || (p->Dv > 0 && !g->dv.data)))
        return ATTNX_ERR_NULL;
    return ATTNX_OK;
}

static void bwd_plan(bjob *bj, int nt)
{
    const attnx_problem *p = bj->base.p;
    const int64_t heads = p->B * p->Hk, tiles = (p->Lk + BK - 1) / BK;
    bj->nsplit = 1;
    bj->kchunk = tiles * BK;
    if (nt > 1 && heads < 2 * (int64_t)nt && tiles > 1) {
        int64_t want = (2 * (int64_t)nt + heads - 1) / heads;
        if (want > tiles) want = tiles;
        bj->kchunk = (tiles + want - 1) / want * BK;
        bj->nsplit = (p->Lk + bj->kchunk - 1) / bj->kchunk;
    }
    if (bj->kchunk == 0) bj->kchunk = BK;
    bj->n_items = heads * bj->nsplit;
}

/* Per thread: qt (D, BQ) | dot (Dv, BQ) | st, dpt (BK, BQ) | dqacc (BQ, ldqa) |
 * lse, dvec, ones (BQ). *bufs receives the nt buffers (freed by the caller). */
static attnx_status alloc_bscratch(bjob *bj, int nt, float ***bufs)
{
    const attnx_problem *p = bj->base.p;
    size_t per;
    if (!mul_ok((size_t)p->D + (size_t)p->Dv + 2 * BK + (size_t)bj->ldqa + 4, BQ, &per))
        return ATTNX_ERR_OVERFLOW;
    bj->scr = calloc((size_t)nt, sizeof(bscratch));
    *bufs = calloc((size_t)nt, sizeof(float *));
    if (!bj->scr || !*bufs) return ATTNX_ERR_NOMEM;
    for (int t = 0; t < nt; t++) {
        float *x = (*bufs)[t] = alloc_floats(per);
        if (!x) return ATTNX_ERR_NOMEM;
        bscratch *s = &bj->scr[t];
        s->qt = x;
        s->dot = s->qt + (size_t)p->D * BQ;
        s->st = s->dot + (size_t)p->Dv * BQ;
        s->dpt = s->st + (size_t)BK * BQ;
        s->dqacc = s->dpt + (size_t)BK * BQ;
        s->lse = s->dqacc + (size_t)bj->ldqa * BQ;
        s->dvec = s->lse + BQ;
        s->ones = s->dvec + BQ;
        for (int i = 0; i < BQ; i++) s->ones[i] = 1.0f;
    }
    return ATTNX_OK;
}

attnx_status attnx_backward(const attnx_grad_problem *g)
{
    attnx_status st = validate_grad(g);
    if (st != ATTNX_OK) return st;
    const attnx_problem *p = &g->f;
    if (p->B == 0 || p->Hk == 0) return ATTNX_OK;

    bjob bj;
    memset(&bj, 0, sizeof bj);
    bj.base.p = p;
    bj.base.kt = attnx_active_kernels();
    bj.base.nqb = (p->Lq + BQ - 1) / BQ;
    split_scale(&bj.base, p->scale);
    bj.g = g;
    bj.group = p->Hq / p->Hk;
    bj.ldqa = ATTNX_ROUND16(p->D);
    atomic_init(&bj.next, 0);

    int nt = threads_for(p, 10.0, 5e6);
    bwd_plan(&bj, nt);
    if (nt > bj.n_items) nt = (int)bj.n_items;
    if (nt < 1) nt = 1;
    if (bj.nsplit > 1) {
        size_t n;
        if (!mul_ok((size_t)bj.nsplit * (size_t)p->B * (size_t)p->Hq, (size_t)p->Lq * (size_t)p->D, &n))
            return ATTNX_ERR_OVERFLOW;
        if (!(bj.partial = alloc_floats(n))) return ATTNX_ERR_NOMEM;
    }
    float **bufs = NULL;
    if ((st = alloc_bscratch(&bj, nt, &bufs)) == ATTNX_OK) {
        attnx_parallel(nt, bwd_worker, &bj);
        if (bj.nsplit > 1) bwd_merge_dq(&bj);
    }
    for (int t = 0; bufs && t < nt; t++) free(bufs[t]);
    free(bufs);
    free(bj.scr);
    free(bj.partial);
    return st;
}

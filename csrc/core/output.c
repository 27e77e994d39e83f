/* The forward's output rows: an item's accumulator normalised into out (and
 * lse), or, with split-K, the items' partial softmaxes merged; rows that came
 * out inf or NaN recomputed exactly. */
#include <math.h>
#include <string.h>

#include "core/core.h"

/* log of the softmax sum with the max put back: lse = m' + log(l), -inf when
 * nothing was allowed (l = 0), NaN for a NaN row. */
static float row_lse(float m, float l)
{
    return l == 0.0f ? -INFINITY : (m == -INFINITY ? 0.0f : m) + logf(l);
}

void attnx_write_lse(const attnx_problem *p, int64_t b, int64_t h, int64_t i, float value)
{
    if (p->lse.data) p->lse.data[b * p->lse.sb + h * p->lse.sh + i * p->lse.sl] = value;
}

/* 1 if none of o[0 .. n) is inf or NaN. */
static int row_finite(const float *o, int64_t n)
{
    uint32_t bad = 0; /* an all-ones exponent is inf or NaN; OR-reduced, so it vectorises */
    for (int64_t d = 0; d < n; d++) {
        uint32_t x;
        memcpy(&x, &o[d], sizeof x);
        bad |= (x & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* A sink logit joins a row's softmax: with its max m, sum l and unnormalised
 * output acc (n floats), m' = max(m, sink), a = exp(m - m'):
 *   l = l·a + exp(sink - m'),  acc = acc·a,  m = m'.
 * A row with nothing allowed (l = 0) keeps its zeros. */
static void fold_sink(float sink, float *m, float *l, float *acc, int64_t n)
{
    if (*l == 0.0f) return;
    const float mn = sink > *m ? sink : *m;
    const float a = attnx_expf(*m - mn);
    *l = *l * a + attnx_expf(sink - mn);
    *m = mn;
    if (a != 1.0f)
        for (int64_t d = 0; d < n; d++) acc[d] *= a;
}

static float sink_of(const attnx_problem *p, int64_t b, int64_t h)
{
    return p->sinks.data[b * p->sinks.sb + h * p->sinks.sh];
}

void attnx_fold_sinks(const fwd_job *jb, const fwd_scratch *s, const item_view *it)
{
    const attnx_problem *p = jb->run.p;
    if (!p->sinks.data) return;
    const float sink = sink_of(p, it->b, it->h);
    for (int i = 0; i < it->nq; i++)
        fold_sink(sink, &s->m[i], &s->l[i], s->acc + i * jb->plan.ldacc, p->Dv);
}

/* An output row that came out inf or NaN although its softmax sum l is finite
 * and non-zero: an inf or NaN value met a zero weight (0 * inf = NaN in the
 * kernels' FMAs), e.g. in a masked or padded key. Recompute it exactly, adding
 * only keys whose weight is non-zero, so that a key that gets no weight never
 * leaks into the result, whatever its value holds. Rare: scalar code.
 * o: (Dv) row i of head (b, h); m, l: the row's final max and sum. */
#ifdef ATTNX_TEST_HOOKS
/* tests/c (built with -DATTNX_TEST_HOOKS): nonzero leaves rows as the kernels
 * wrote them, so that a read of the wrong memory that yields NaN shows in
 * tests with finite inputs instead of being recomputed away */
int attnx_test_no_repair = 0;
#endif

static void repair_row(const attnx_run *r, int64_t b, int64_t h, int64_t i, float m, float l,
                       float *o)
{
#ifdef ATTNX_TEST_HOOKS
    if (attnx_test_no_repair) return;
#endif
    const attnx_problem *p = r->p;
    if (!(l > 0.0f && l < INFINITY) || row_finite(o, p->Dv)) return;
    const head_bounds hb = bounds_of(p, b, h);
    const int64_t kend = keys_end(&hb, i, 1);
    const float msub = m == -INFINITY ? 0.0f : m, inv = 1.0f / l;
    for (int64_t d = 0; d < p->Dv; d++) o[d] = 0.0f;
    for (int64_t j = keys_begin(&hb, i); j < kend; j++) {
        const float s = attnx_score_one(r, b, h, i, j);
        if (s == -INFINITY) continue;
        const float w = attnx_expf(s - msub) * inv;
        if (w == 0.0f) continue;
        for (int64_t d = 0; d < p->Dv; d++) o[d] += w * attnx_kv_at(p, 1, b, kv_head(p, h), j, d);
    }
}

/* The item's output rows from its accumulator: acc / l (normalise = 1) or acc
 * as it is (0: the weights were normalised already); zeros where nothing was
 * allowed (l = 0, and acc may hold 0 * inf = NaN then); rows with inf or NaN
 * recomputed by repair_row. */
void attnx_write_rows(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int normalise)
{
    const attnx_problem *p = jb->run.p;
    for (int i = 0; i < it->nq; i++)
        attnx_write_lse(p, it->b, it->h, it->i0 + i, row_lse(s->m[i], s->l[i]));
    float *inv = s->alpha; /* free once the last tile is done */
    for (int i = 0; i < it->nq; i++)
        inv[i] = s->l[i] == 0.0f ? 0.0f : normalise ? 1.0f / s->l[i] : 1.0f;
    if (!jb->run.kt->store_rows(s->acc, jb->plan.ldacc, it->nq, p->Dv, inv, it->out, p->out.sl))
        return;
    for (int i = 0; i < it->nq; i++) /* rare: some value came out inf or NaN */
        repair_row(&jb->run, it->b, it->h, it->i0 + i, s->m[i], s->l[i], it->out + i * p->out.sl);
}

/* Row i of a block from its nsplit partials (first: the block's first
 * partial, stride floats apart):
 *   M = max_s m_s,  f_s = exp(m_s - M'),  out = sum_s f_s acc_s / sum_s f_s l_s
 * (M' = 0 when M = -inf, as in the kernels: nothing allowed gives zeros). */
static void merge_row(const fwd_job *jb, const float *first, int64_t stride, int64_t b, int64_t h,
                      int64_t i0, int i)
{
    const attnx_problem *p = jb->run.p;
    const int64_t nsplit = jb->plan.nsplit;
    float M = -INFINITY;
    for (int64_t sp = 0; sp < nsplit; sp++) {
        const float m = first[sp * stride + i];
        M = m > M ? m : M;
    }
    const float msub = M == -INFINITY ? 0.0f : M;
    float l = 0.0f;
    float *o = p->out.data + b * p->out.sb + h * p->out.sh + (i0 + i) * p->out.sl;
    for (int64_t d = 0; d < p->Dv; d++) o[d] = 0.0f;
    for (int64_t sp = 0; sp < nsplit; sp++) {
        const float *part = first + sp * stride;
        const float f = attnx_expf(part[i] - msub);
        l += f * part[BQ + i];
        const float *acc = part + 2 * BQ + i * jb->plan.ldacc;
        if (part[BQ + i] != 0.0f || part[BQ + i] != part[BQ + i])
            for (int64_t d = 0; d < p->Dv; d++) o[d] += f * acc[d];
    }
    if (p->sinks.data) fold_sink(sink_of(p, b, h), &M, &l, o, p->Dv);
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    for (int64_t d = 0; d < p->Dv; d++) o[d] *= inv;
    attnx_write_lse(p, b, h, i0 + i, row_lse(M, l));
    repair_row(&jb->run, b, h, i0 + i, M, l, o);
}

void attnx_merge_partials(const fwd_job *jb)
{
    const attnx_problem *p = jb->run.p;
    const int64_t stride = 2 * BQ + BQ * jb->plan.ldacc;
    for (int64_t block = 0; block < jb->plan.n_items / jb->plan.nsplit; block++) {
        const int64_t qb = block % jb->plan.nqb, bh = block / jb->plan.nqb;
        const int64_t h = bh % p->Hq, b = bh / p->Hq, i0 = qb * BQ;
        const head_bounds hb = bounds_of(p, b, h);
        const int nq = rows_attending(&hb, i0, (int)min64(BQ, p->Lq - i0));
        const float *first = jb->partial + block * jb->plan.nsplit * stride;
        for (int i = 0; i < nq; i++) merge_row(jb, first, stride, b, h, i0, i);
    }
}

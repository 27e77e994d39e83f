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

/* ---- long sums (core.h): states in double ---------------------------------- */

size_t attnx_sum_state_size(const fwd_plan *plan)
{
    return (size_t)plan->sum_rows * (2 + (size_t)plan->ldacc);
}

sum_state attnx_sum_state(const fwd_job *jb, double *at)
{
    const int64_t rows = jb->plan.sum_rows;
    const sum_state t = {at, at + rows, at + 2 * rows};
    return t;
}

void attnx_sum_clear(const fwd_job *jb, sum_state t, int nq)
{
    for (int i = 0; i < nq; i++) {
        t.m[i] = -INFINITY;
        t.l[i] = 0.0;
    }
    memset(t.acc, 0, sizeof(double) * (size_t)nq * (size_t)jb->plan.ldacc);
}

/* Row i of t gains a state of max m, sum l and row acc (n values), in the
 * kernels' arithmetic carried in double: m' = max(M, m),
 *   L = L·exp(M - m') + l·exp(m - m'),  ACC = ACC·exp(M - m') + acc·exp(m - m').
 * A state with nothing allowed (l = 0) changes nothing; a NaN one makes the
 * row NaN. FOLD_ROW is written once for float and double states. */
#define FOLD_ROW(T, i, m_, l_, acc_, n)                                            \
    do {                                                                           \
        const double fm_ = (m_), fl_ = (l_), fM_ = (T).m[i];                       \
        if (fl_ == 0.0) break;                                                     \
        const double mx_ = fm_ > fM_ ? fm_ : fM_;                                  \
        const double a_ = exp(fM_ - mx_), f_ = exp(fm_ - mx_);                     \
        double *o_ = (T).acc + (i) * ldacc;                                        \
        const acc_type *x_ = (acc_);                                               \
        (T).l[i] = (T).l[i] * a_ + fl_ * f_;                                       \
        (T).m[i] = mx_;                                                            \
        for (int64_t d = 0; d < (n); d++) o_[d] = o_[d] * a_ + (double)x_[d] * f_; \
    } while (0)

void attnx_sum_fold_f32(const fwd_job *jb, sum_state t, const float *m, const float *l,
                        const float *acc, int nq)
{
    const int64_t ldacc = jb->plan.ldacc, n = jb->run.p->Dv;
    typedef float acc_type;
    for (int i = 0; i < nq; i++) FOLD_ROW(t, i, m[i], l[i], acc + i * ldacc, n);
}

void attnx_sum_fold(const fwd_job *jb, sum_state t, sum_state x, int nq)
{
    const int64_t ldacc = jb->plan.ldacc, n = jb->run.p->Dv;
    typedef double acc_type;
    for (int i = 0; i < nq; i++) FOLD_ROW(t, i, x.m[i], x.l[i], x.acc + i * ldacc, n);
}

void attnx_sum_write_rows(const fwd_job *jb, sum_state t, int64_t b, int64_t h, int64_t i0, int nq)
{
    const attnx_problem *p = jb->run.p;
    for (int i = 0; i < nq; i++) {
        double M = t.m[i], L = t.l[i], *acc = t.acc + i * jb->plan.ldacc;
        if (p->sinks.data && L != 0.0) { /* fold_sink, in double */
            const double sink = sink_of(p, b, h), mn = sink > M ? sink : M, a = exp(M - mn);
            L = L * a + exp(sink - mn);
            M = mn;
            for (int64_t d = 0; d < p->Dv; d++) acc[d] *= a;
        }
        const double inv = L == 0.0 ? 0.0 : 1.0 / L;
        float *o = p->out.data + b * p->out.sb + h * p->out.sh + (i0 + i) * p->out.sl;
        for (int64_t d = 0; d < p->Dv; d++) o[d] = (float)(acc[d] * inv);
        const float lse = L == 0.0 ? -INFINITY : (float)((M == -INFINITY ? 0.0 : M) + log(L));
        attnx_write_lse(p, b, h, i0 + i, lse);
        repair_row(&jb->run, b, h, i0 + i, (float)M, (float)L, o);
    }
}

void attnx_merge_partials(const fwd_job *jb)
{
    const attnx_problem *p = jb->run.p;
    const int64_t nsplit = jb->plan.nsplit, stride = (int64_t)attnx_sum_state_size(&jb->plan);
    for (int64_t block = 0; block < jb->plan.n_items / nsplit; block++) {
        const int64_t qb = block % jb->plan.nqb, bh = block / jb->plan.nqb;
        const int64_t h = bh % p->Hq, b = bh / p->Hq, i0 = qb * BQ;
        const head_bounds hb = bounds_of(p, b, h);
        const int nq = rows_attending(&hb, i0, (int)min64(BQ, p->Lq - i0));
        if (nq == 0) continue;
        /* the ranges' states folded in key order into the first */
        double *first = jb->partial + block * nsplit * stride;
        const sum_state t = attnx_sum_state(jb, first);
        for (int64_t sp = 1; sp < nsplit; sp++)
            attnx_sum_fold(jb, t, attnx_sum_state(jb, first + sp * stride), nq);
        attnx_sum_write_rows(jb, t, b, h, i0, nq);
    }
}

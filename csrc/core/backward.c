/* The backward pass: FlashAttention-2's scheme on CPU tiles. With the
 * forward's output O and the log of each row's softmax sum (lse), for an
 * upstream gradient dO, tile by tile (the Lq×Lk matrix is never built):
 *
 *   P  = exp(S − lse)        S = scale·Q Kᵀ + masks, recomputed as the forward does
 *                            (lse includes the sink, which needs nothing more here)
 *   dV += Pᵀ dO              dP = dO Vᵀ          D = rowsum(dO ∘ O)
 *   dS = P ∘ (dP − D)        (exactly 0 where P is 0)
 *   dQ += scale · dS K       dK += scale · dSᵀ Q        d(mask) = dS
 *   (with a softcap, dS is multiplied by 1 − (S_capped / softcap)² before dQ, dK)
 *
 * Items are (batch, key/value head, range of keys). An item owns the dK and
 * dV rows of its keys (the query heads of a GQA group are added in a fixed
 * order: each block's sum over its queries, and with plan.run, runs of
 * blocks summed apart first, see bwd_item) and the dQ rows of its heads;
 * with several key ranges a head (few heads, many threads), each range
 * writes its own dQ partial and the partials are summed afterwards in range
 * order. No atomics: the same bits on every run with a given thread count.
 * D is summed once a call, before the items (dsum_item). With float32 on AMX
 * tiles (plan.split_dp: S and dP by kt->qk_split), an item takes its keys a
 * slice at a time: the slice's keys and values split into bfloat16 parts,
 * then every query block of the group against them, its dQ rows summed
 * slice by slice.
 *
 * A float mask's gradient is summed along the axes the mask is broadcast
 * over (stride 0 in g->dmask) where dS is computed: no (B, Hq, Lq, Lk) array.
 * Where an element receives several terms, each item sums its terms into a
 * zeroed copy of its own (items of other batches, key/value heads or key
 * ranges have other copies), and the copies are added into the gradient in
 * (batch, key/value head, key range) order; when the copies would take more
 * than MASK_COPIES_FLOATS, dS is recomputed in a pass of its own whose items
 * own disjoint parts of the gradient (mask_pass_item: two of the five
 * products again, 256 KiB a thread), summed and added in the same groups and
 * order. Either way, and however the caller cuts the batch into calls, the
 * same bits. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

/* The copies of the mask's gradient may take this many floats (4 MiB); more,
 * and it gets a pass of its own. */
#define MASK_COPIES_FLOATS ((size_t)1 << 20)
/* Keys per chunk of the own pass's accumulator: (MASK_KEYS, BQ) floats a thread, 256 KiB. */
#define MASK_KEYS 1024

/* How the mask's gradient is accumulated. */
typedef enum { MASK_GRAD_NONE = 0, MASK_GRAD_IN_PASS, MASK_GRAD_OWN_PASS } mask_grad_mode;

typedef struct {
    mask_grad_mode mode;
    int64_t ext[4]; /* the gradient's extents (B, Hq, Lq, Lk, 1 along a summed axis) */
    int64_t by_b, by_hk, by_split; /* which items write separate copies (0/1 each) */
    int64_t ncopies;               /* copies in `copies`, 0 when dS goes to the caller's array */
    size_t size;                   /* floats of one copy: the product of ext */
    float *copies;                 /* (ncopies, ext...) C-contiguous, zeroed, or NULL */
    float *acc;                    /* the own pass: (threads, MASK_KEYS, BQ), or NULL */
} mask_grad_plan;

typedef struct {
    attnx_run run;
    const attnx_grad_problem *g;
    bwd_plan plan;
    float *partial; /* nsplit > 1: dQ per range, (nsplit, B, Hq, Lq, D) */
    bwd_scratch *scr;
    mask_grad_plan mg;
    float *dsum;      /* (B, Hq, Lq) D = rowsum(dO ∘ O), once a call */
    int64_t *kbounds; /* nsplit > 1 with a mask: range s is keys [kbounds[s], kbounds[s+1]),
                         or NULL: s·kchunk on (attnx_balanced_ranges) */
} bwd_job;

/* The rows of a (B, H, L, E) gradient array at (b, h, i). */
static float *at(const attnx_out_tensor *t, int64_t b, int64_t h, int64_t i)
{
    return t->data + b * t->sb + h * t->sh + i * t->sl;
}

static const float *at_in(const attnx_tensor *t, int64_t b, int64_t h, int64_t i)
{
    return t->data + b * t->sb + h * t->sh + i * t->sl;
}

/* dS (nq, nk), transposed in dpt (nk, BQ), added into the mask's gradient
 * dm at (b, h, i0, j0); a stride 0 adds a whole axis into one element. */
static void add_mask_grad(const attnx_mask_grad *dm, const float *dpt, int64_t b, int64_t h,
                          int64_t i0, int nq, int64_t j0, int nk)
{
    float *base = dm->data + b * dm->sb + h * dm->sh + i0 * dm->sq + j0 * dm->sk;
    if (dm->sq == 0) { /* summed over the queries (a padding mask): one sum per key */
        for (int j = 0; j < nk; j++) {
            float sum = 0.0f;
            for (int i = 0; i < nq; i++) sum += dpt[j * BQ + i];
            base[j * dm->sk] += sum;
        }
        return;
    }
    for (int i0 = 0; i0 < nq; i0 += 8) { /* 8 rows at a time: 8 write streams, reads in rows */
        const int n = nq - i0 < 8 ? nq - i0 : 8;
        for (int j = 0; j < nk; j++)
            for (int i = i0; i < i0 + n; i++) base[i * dm->sq + j * dm->sk] += dpt[j * BQ + i];
    }
}

/* Which of a tile's score-like products take kt->qk_split (float32 on AMX
 * tiles, plan.split_dp): S from the block's split queries and the item's
 * split keys, dP from its split upstream gradient and values. Each falls
 * back to the FMAs where the split cannot take a value (|x| >= 2^100, inf,
 * NaN, 0 < |x| < 2^-80): per item for the keys and values, per block for the
 * queries and dO. */
typedef struct {
    int scores, dp;
    int64_t kbeg; /* the slice's first key: row 0 of s->kparts and s->vparts */
    /* a block's, under plan.ptx_medium: dK and dV on kt->ptx_medium, its
     * queries and upstream gradient rounded (0 where one became inf) */
    int dk, dv;
} tile_split;

static const tile_split no_split = {0, 0, 0, 0, 0};

/* dS of a tile into s->dpt (transposed, (BK, BQ)), from the packed block of
 * head (b, h): S, P = exp(S - lse), dP = dO Vᵀ, dS = P ∘ (dP - D). P stays in
 * s->st. */
static void tile_ds(const bwd_job *bj, const bwd_scratch *s, const tile_split *sp, int64_t b,
                    int64_t h, int64_t i0, int nq, int64_t j0, int nk)
{
    const attnx_problem *p = bj->run.p;
    const attnx_kernels *kt = bj->run.kt;
    const int64_t hk = h / bj->plan.group, dp = bj->plan.split_dp, dpv = bj->plan.split_dpv;
    const int64_t rows = bj->plan.kslice + 16, row = j0 - sp->kbeg;
    if (sp->scores && bj->plan.parts == 1) { /* S, rounded ("medium"): scaled by the kernel */
        kt->qk_bf16(s->qparts, BQ, nq, s->kparts + row * dp, dp, nk, p->D, p->scale, s->st);
        attnx_finish_tile(&bj->run, 0, b, h, i0, nq, j0, nk, s->st, s->capped, 1);
    } else if (sp->scores) { /* S */
        kt->qk_split(s->qparts, BQ, nq, s->kparts + row * dp, rows * dp, nk, dp, s->st);
        attnx_finish_tile(&bj->run, 0, b, h, i0, nq, j0, nk, s->st, s->capped, 0);
    } else {
        attnx_score_tile(&bj->run, s->qt, 0, at_in(&p->k, b, hk, j0), p->k.sl, b, h, i0, nq, j0, nk,
                         s->st, s->capped);
    }
    kt->softmax_final(s->st, BQ, nq, nk, s->lse, s->ones); /* P */
    if (sp->dp && bj->plan.parts == 1)                     /* dP, rounded */
        kt->qk_bf16(s->oparts, BQ, nq, s->vparts + row * dpv, dpv, nk, p->Dv, 1.0f, s->dpt);
    else if (sp->dp) /* dP */
        kt->qk_split(s->oparts, BQ, nq, s->vparts + row * dpv, rows * dpv, nk, dpv, s->dpt);
    else
        kt->qk(s->dot, BQ, nq, at_in(&p->v, b, hk, j0), p->v.sl, nk, p->Dv, s->dpt);
}

/* Where a block adds its dK and dV rows: key j's at dk + (j - kbeg)·dk_sl and
 * dv + (j - kbeg)·dv_sl, the gradient's rows or the thread's run sums. */
typedef struct {
    float *dk, *dv;
    int64_t dk_sl, dv_sl, kbeg;
} kv_rows;

/* One tile: keys j0 .. j0+nk-1 against the packed block of queries
 * i0 .. i0+nq-1 of head (b, h); dm: where the mask's gradient goes, or NULL. */
static void bwd_tile(const bwd_job *bj, const bwd_scratch *s, const tile_split *sp,
                     const attnx_mask_grad *dm, const kv_rows *to, int64_t b, int64_t h, int64_t i0,
                     int nq, int64_t j0, int nk)
{
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const attnx_kernels *kt = bj->run.kt;
    const int64_t hk = h / bj->plan.group;
    const float *k = at_in(&p->k, b, hk, j0);
    const float *q = at_in(&p->q, b, h, i0), *dout = at_in(&g->dout, b, h, i0);
    float *dk = to->dk + (j0 - to->kbeg) * to->dk_sl, *dv = to->dv + (j0 - to->kbeg) * to->dv_sl;

    tile_ds(bj, s, sp, b, h, i0, nq, j0, nk); /* P, dP */
    /* dV += Pᵀ dO (P <= 1 rounds to no inf) */
    if (sp->dv && !kt->round_rows(s->st, BQ, nk, nq, s->tbf, BQ))
        kt->ptx_medium(s->tbf, BQ, nq, s->orows, bj->plan.ldva, nk, p->Dv, dv, to->dv_sl);
    else
        kt->ptx(s->st, BQ, nq, dout, g->dout.sl, nk, p->Dv, dv, to->dv_sl);
    kt->softmax_bwd(s->st, s->dpt, BQ, nq, nk, s->dvec); /* dS */
    if (dm) add_mask_grad(dm, s->dpt, b, h, i0, nq, j0, nk);
    if (p->softcap > 0.0f) /* dS through the tanh: × (1 - (capped / softcap)²) */
        kt->softcap_bwd(s->dpt, s->capped, BQ, nq, nk, 1.0f / p->softcap);
    /* dK += dSᵀ Q (a tile whose dS rounds to an inf: the FMAs) */
    if (sp->dk && !kt->round_rows(s->dpt, BQ, nk, nq, s->tbf, BQ))
        kt->ptx_medium(s->tbf, BQ, nq, s->qrows, bj->plan.ldqa, nk, p->D, dk, to->dk_sl);
    else
        kt->ptx(s->dpt, BQ, nq, q, p->q.sl, nk, p->D, dk, to->dk_sl);
    kt->pv(s->dpt, BQ, 1, nq, k, p->k.sl, nk, p->D, NULL, s->dqacc, bj->plan.ldqa); /* dQ += dS K */
}

/* Rows x (nq, n) rounded into ptx_medium's pairs of rows (kernels.h) in
 * place in buf (rows ld floats apart, ld >= n rounded up to 16): copied
 * (read once; 0 past n), then kt->round_pairs. */
static void round_row_pairs(const attnx_kernels *kt, const float *x, int64_t x_sl, int nq,
                            int64_t n, uint32_t *buf, int64_t ld)
{
    float *rows = (float *)(void *)buf;
    for (int i = 0; i < nq; i++) {
        float *r = rows + i * ld;
        memcpy(r, x + i * x_sl, sizeof(float) * (size_t)n);
        memset(r + n, 0, sizeof(float) * (size_t)(ld - n));
    }
    kt->round_pairs(rows, ld, (int)n, nq);
}

/* Under "medium", which of a block's rows hold a value that would round to
 * an inf (attnx_rows_overflow_bf16): its queries (*q_over) or its dO
 * (*dout_over). Where the queries do, its scores keep float32 (as the
 * forward's pack_queries decided, which then took the block's P·V in
 * float32 too, so that O is of the float32 values), and so do its dP and D;
 * where dO does, its dP and D; and the products with such rows (dK's Q,
 * dV's dO) keep the FMAs. bwd_start_block and dsum_item decide alike. */
static void block_overflows(const bwd_job *bj, int64_t b, int64_t h, int64_t i0, int nq,
                            int *q_over, int *dout_over)
{
    const attnx_problem *p = bj->run.p;
    *q_over = attnx_rows_overflow_bf16(at_in(&p->q, b, h, i0), p->q.sl, nq, p->D);
    *dout_over = attnx_rows_overflow_bf16(at_in(&bj->g->dout, b, h, i0), bj->g->dout.sl, nq, p->Dv);
}

/* A block's queries packed, its upstream gradient packed, its lse and D
 * (from bj->dsum); the dQ accumulator zeroed. With *sp's split products,
 * the queries and dO split too (sp's flags cleared where they cannot be);
 * under plan.ptx_medium, both rounded into pairs of rows (sp->dk, sp->dv). */
static void bwd_start_block(const bwd_job *bj, const bwd_scratch *s, tile_split *sp, int64_t b,
                            int64_t h, int64_t i0, int nq)
{
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const attnx_kernels *kt = bj->run.kt;
    const float *dout = at_in(&g->dout, b, h, i0);
    attnx_pack_rows_t(kt, at_in(&p->q, b, h, i0), p->q.sl, nq, p->D, bj->run.pre_scale, s->qt);
    attnx_pack_rows_t(kt, dout, g->dout.sl, nq, p->Dv, 1.0f, s->dot);
    const int64_t dp = bj->plan.split_dp, dpv = bj->plan.split_dpv;
    int q_over = 0, dout_over = 0;
    if (bj->plan.parts == 1) { /* "medium": unscaled, rounded into pairs (kernels.h) */
        block_overflows(bj, b, h, i0, nq, &q_over, &dout_over);
        if (q_over || dout_over) sp->dp = 0;
        if (q_over) sp->scores = 0;
        if (sp->scores) {
            kt->pack_qt(at_in(&p->q, b, h, i0), p->q.sl, nq, p->D, 1.0f, (float *)s->qparts, BQ);
            kt->round_pairs((float *)s->qparts, BQ, nq, p->D);
        }
        if (sp->dp) {
            kt->pack_qt(dout, g->dout.sl, nq, p->Dv, 1.0f, (float *)s->oparts, BQ);
            kt->round_pairs((float *)s->oparts, BQ, nq, p->Dv);
        }
    } else {
        if (sp->scores)
            sp->scores = !kt->split_pairs(s->qt, BQ, nq, p->D, dp, s->qparts, dp / 2 * BQ);
        if (sp->dp) sp->dp = !kt->split_pairs(s->dot, BQ, nq, p->Dv, dpv, s->oparts, dpv / 2 * BQ);
    }
    sp->dk = sp->dv = 0;
    if (bj->plan.ptx_medium) { /* plan.parts 1: the flags above */
        sp->dk = !q_over, sp->dv = !dout_over;
        if (sp->dk)
            round_row_pairs(kt, at_in(&p->q, b, h, i0), p->q.sl, nq, p->D, s->qrows, bj->plan.ldqa);
        if (sp->dv) round_row_pairs(kt, dout, g->dout.sl, nq, p->Dv, s->orows, bj->plan.ldva);
    }
    const float *dsum = bj->dsum + (b * p->Hq + h) * p->Lq + i0;
    for (int i = 0; i < BQ; i++) {
        s->dvec[i] = i < nq ? dsum[i] : 0.0f;
        s->lse[i] =
            i < nq ? g->lse.data[b * g->lse.sb + h * g->lse.sh + (i0 + i) * g->lse.sl] : INFINITY;
    }
    memset(s->dqacc, 0, sizeof(float) * (size_t)nq * (size_t)bj->plan.ldqa);
}

/* dq (nq, D) rows dq_sl apart += scale · the block's dQ sum, which starts again at 0. */
static void add_dq(const bwd_job *bj, const bwd_scratch *s, int nq, float *dq, int64_t dq_sl)
{
    const attnx_problem *p = bj->run.p;
    for (int i = 0; i < nq; i++)
        for (int64_t e = 0; e < p->D; e++)
            dq[i * dq_sl + e] += p->scale * s->dqacc[i * bj->plan.ldqa + e];
    memset(s->dqacc, 0, sizeof(float) * (size_t)nq * (size_t)bj->plan.ldqa);
}

/* Queries i0 .. i0+rows-1 of head (b, h) against keys [kbeg, kstop): their
 * contribution to dK and dV (added into *to's rows, one sum over the block's
 * queries a row: kt->ptx; span [lo, hi) widened to the keys whose rows it
 * adds to), and their dQ rows (scaled) written to dq, or added to it after
 * the first slice of an item's keys. */
static void bwd_block(const bwd_job *bj, const bwd_scratch *s, const tile_split *slice_split,
                      const attnx_mask_grad *dm, const kv_rows *to, int64_t span[2], int64_t b,
                      int64_t h, int64_t i0, int64_t kbeg, int64_t kstop, int first, float *dq,
                      int64_t dq_sl)
{
    const attnx_problem *p = bj->run.p;
    const head_bounds hb = bounds_of(p, b, h);
    const int rows = (int)min64(BQ, p->Lq - i0);
    const int nq = rows_attending(&hb, i0, rows);
    const int64_t kend = min64(kstop, keys_end(&hb, i0, nq));
    const int64_t kfrom = max64(kbeg, keys_begin(&hb, i0));
    if (first)
        for (int i = 0; i < rows; i++) memset(dq + i * dq_sl, 0, sizeof(float) * (size_t)p->D);
    if (nq == 0 || kfrom >= kend) return;
    span[0] = min64(span[0], kfrom);
    span[1] = max64(span[1], kend);
    tile_split sp = *slice_split;
    bwd_start_block(bj, s, &sp, b, h, i0, nq);
    /* long sums (core.h): the tiles' float32 sum of dQ added out into dq
     * every SUM_KEYS keys (at fixed key boundaries), so that it spans no
     * more than a chunk of keys */
    int64_t flush_at = (kfrom / SUM_KEYS + 1) * SUM_KEYS;
    int nk; /* tiles of keys the mask keeps: where it empties them, P = dS = 0 */
    for (int64_t j0 = kfrom; (j0 = attnx_next_tile(&bj->run, b, h, i0, nq, j0, kend, &nk)) < kend;
         j0 += nk) {
        if (j0 >= flush_at) {
            add_dq(bj, s, nq, dq, dq_sl);
            flush_at = (j0 / SUM_KEYS + 1) * SUM_KEYS;
        }
        bwd_tile(bj, s, &sp, dm, to, b, h, i0, nq, j0, nk);
    }
    add_dq(bj, s, nq, dq, dq_sl);
}

/* ---- the mask's gradient ------------------------------------------------------ */

/* Where item (b, hk, split) adds its dS during the main pass: its copy
 * (items that add into the same elements have copies of their own; the copies
 * are added into the caller's array afterwards, in the order of (b, hk, split),
 * which is also the order in which calls over consecutive batches add theirs:
 * the bits do not depend on how the batch is cut into calls), or the caller's
 * array when no element receives more than one term; 0 when the main pass
 * adds none. */
static int mask_grad_target(const bwd_job *bj, int64_t b, int64_t hk, int64_t split,
                            attnx_mask_grad *dm)
{
    const mask_grad_plan *mg = &bj->mg;
    if (mg->mode != MASK_GRAD_IN_PASS) return 0;
    *dm = bj->g->dmask;
    if (!mg->copies) return 1;
    const int64_t c =
        ((mg->by_b ? b : 0) * (mg->by_hk ? bj->run.p->Hk : 1) + (mg->by_hk ? hk : 0)) *
            (mg->by_split ? bj->plan.nsplit : 1) +
        (mg->by_split ? split : 0);
    const int64_t *e = mg->ext; /* a copy is C-contiguous (ext...), 0 along summed axes */
    dm->data = mg->copies + (size_t)c * mg->size;
    dm->sk = bj->g->dmask.sk ? 1 : 0;
    dm->sq = bj->g->dmask.sq ? e[3] : 0;
    dm->sh = bj->g->dmask.sh ? e[2] * e[3] : 0;
    dm->sb = bj->g->dmask.sb ? e[1] * e[2] * e[3] : 0;
    return 1;
}

/* The copies added into the caller's array, in copy order. */
static void mask_grad_merge(const bwd_job *bj)
{
    const mask_grad_plan *mg = &bj->mg;
    const attnx_mask_grad *dm = &bj->g->dmask;
    const int64_t *e = mg->ext;
    size_t r = 0;
    for (int64_t b = 0; b < e[0]; b++)
        for (int64_t h = 0; h < e[1]; h++)
            for (int64_t i = 0; i < e[2]; i++)
                for (int64_t j = 0; j < e[3]; j++, r++) {
                    float *to = dm->data + b * dm->sb + h * dm->sh + i * dm->sq + j * dm->sk;
                    for (int64_t c = 0; c < mg->ncopies; c++)
                        *to += mg->copies[(size_t)c * mg->size + r];
                }
}

/* The mask's own pass, one (b, hk) of an item: the group's heads h0 .. h1-1
 * (those of the item's heads) over the query rows from i_from to i_to and the
 * keys [c0, c1), each tile added into acc with add_mask_grad exactly as the
 * main pass adds it into a copy, so that both ways give the same bits. */
static void mask_pass_group(const bwd_job *bj, const bwd_scratch *s, const attnx_mask_grad *acc,
                            int64_t b, int64_t h0, int64_t h1, int64_t i_from, int64_t i_to,
                            int64_t c0, int64_t c1)
{
    const attnx_problem *p = bj->run.p;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t i0 = i_from; i0 < i_to; i0 += BQ) {
            const head_bounds hb = bounds_of(p, b, h);
            const int nq = rows_attending(&hb, i0, (int)min64(BQ, p->Lq - i0));
            const int64_t j_from = max64(c0, keys_begin(&hb, i0)),
                          j_to = min64(c1, keys_end(&hb, i0, nq));
            if (nq == 0 || j_from >= j_to) continue;
            tile_split none = no_split;
            bwd_start_block(bj, s, &none, b, h, i0, nq);
            int nk; /* dS = 0 where the mask empties the tiles: they add nothing */
            for (int64_t j0 = j_from;
                 (j0 = attnx_next_tile(&bj->run, b, h, i0, nq, j0, j_to, &nk)) < j_to; j0 += nk) {
                tile_ds(bj, s, &none, b, h, i0, nq, j0, nk);
                bj->run.kt->softmax_bwd(s->st, s->dpt, BQ, nq, nk, s->dvec);
                add_mask_grad(acc, s->dpt, 0, 0, i0 - i_from, nq, j0 - c0, nk);
            }
        }
}

/* Item i of the mask's own pass: the items are the gradient's (batch, head,
 * query block) along its axes that are not summed. Per chunk of MASK_KEYS keys
 * and per (b, hk) in order, the group's dS are summed in the thread's zeroed
 * accumulator (BQ rows x MASK_KEYS keys, one row or key where summed; in
 * cache), then added into the caller's array: as the copies of the main pass. */
static void mask_pass_item(void *arg, int tid, int64_t item)
{
    const bwd_job *bj = arg;
    const bwd_scratch *s = &bj->scr[tid];
    const attnx_problem *p = bj->run.p;
    const attnx_mask_grad *dm = &bj->g->dmask;
    const int64_t nqb = dm->sq ? (p->Lq + BQ - 1) / BQ : 1, group = bj->plan.group;
    const int64_t qb = item % nqb, bh = item / nqb, rh = bh % bj->mg.ext[1],
                  rb = bh / bj->mg.ext[1];
    const int64_t b0 = dm->sb ? rb : 0, b1 = dm->sb ? rb + 1 : p->B;
    const int64_t h0 = dm->sh ? rh : 0, h1 = dm->sh ? rh + 1 : p->Hq;
    const int64_t i_from = dm->sq ? qb * BQ : 0, i_to = dm->sq ? min64(p->Lq, i_from + BQ) : p->Lq;
    const int64_t keys = dm->sk ? MASK_KEYS : p->Lk, rows = dm->sq ? i_to - i_from : 1;
    for (int64_t c0 = 0; c0 < p->Lk; c0 += keys) {
        const int64_t c1 = min64(p->Lk, c0 + keys), width = dm->sk ? c1 - c0 : 1;
        const attnx_mask_grad acc = {.data = bj->mg.acc + (size_t)tid * MASK_KEYS * BQ,
                                     .sq = dm->sq ? width : 0,
                                     .sk = dm->sk ? 1 : 0}; /* (rows, width), C-contiguous */
        for (int64_t b = b0; b < b1; b++)
            for (int64_t hk = h0 / group; hk * group < h1; hk++) {
                memset(acc.data, 0, sizeof(float) * (size_t)(rows * width));
                mask_pass_group(bj, s, &acc, b, max64(h0, hk * group), min64(h1, (hk + 1) * group),
                                i_from, i_to, c0, c1);
                float *to = dm->data + b * dm->sb + h0 * dm->sh + i_from * dm->sq + c0 * dm->sk;
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t j = 0; j < width; j++)
                        to[i * dm->sq + j * dm->sk] += acc.data[i * acc.sq + j * acc.sk];
            }
    }
}

/* How the mask's gradient is summed: directly when no element of it receives
 * more than one term; else in the main pass into copies (if they are small),
 * or in a pass of its own. */
static void plan_mask_grad(bwd_job *bj)
{
    const attnx_problem *p = bj->run.p;
    const attnx_mask_grad *dm = &bj->g->dmask;
    mask_grad_plan *mg = &bj->mg;
    memset(mg, 0, sizeof *mg);
    /* no score, no gradient to write (its array may be empty: a fuzz finding,
     * Hq = 0 with a summed head axis had the merge write one element) */
    if (!dm->data || p->B == 0 || p->Hq == 0 || p->Lq == 0 || p->Lk == 0) return;
    const int64_t full[4] = {p->B, p->Hq, p->Lq, p->Lk};
    const int64_t strides[4] = {dm->sb, dm->sh, dm->sq, dm->sk};
    int summed = 0;
    mg->size = 1;
    for (int a = 0; a < 4; a++) {
        mg->ext[a] = strides[a] ? full[a] : 1;
        mg->size *= (size_t)mg->ext[a]; /* no overflow: at most the caller's array */
        summed |= strides[a] == 0 && full[a] > 1;
    }
    mg->mode = MASK_GRAD_IN_PASS;
    if (!summed) return; /* each element one term: added directly */
    mg->by_b = dm->sb == 0 && p->B > 1;
    mg->by_hk = dm->sh == 0 && p->Hk > 1;
    mg->by_split = dm->sk == 0 && bj->plan.nsplit > 1;
    mg->ncopies =
        (mg->by_b ? p->B : 1) * (mg->by_hk ? p->Hk : 1) * (mg->by_split ? bj->plan.nsplit : 1);
    if (mg->size > MASK_COPIES_FLOATS / (size_t)mg->ncopies) mg->mode = MASK_GRAD_OWN_PASS;
}

/* The keys and values [c0, c1) of key/value head (b, hk) split into the
 * thread's parts (rows past c1 zero), or rounded under "medium" (parts 1),
 * and which products may take them. */
static void split_slice(const bwd_job *bj, const bwd_scratch *s, int64_t b, int64_t hk, int64_t c0,
                        int64_t c1, tile_split *sp)
{
    const attnx_problem *p = bj->run.p;
    const attnx_kernels *kt = bj->run.kt;
    const int64_t dp = bj->plan.split_dp, dpv = bj->plan.split_dpv, rows = bj->plan.kslice + 16;
    const int n = (int)(c1 - c0); /* <= kslice */
    if (bj->plan.parts == 1) {    /* "medium": rounded, unless one became inf */
        sp->scores = !kt->round_rows(at_in(&p->k, b, hk, c0), p->k.sl, n, p->D, s->kparts, dp);
        sp->dp = !kt->round_rows(at_in(&p->v, b, hk, c0), p->v.sl, n, p->Dv, s->vparts, dpv);
    } else {
        sp->scores =
            !kt->split_rows(at_in(&p->k, b, hk, c0), p->k.sl, n, p->D, s->kparts, rows * dp, dp);
        sp->dp =
            !kt->split_rows(at_in(&p->v, b, hk, c0), p->v.sl, n, p->Dv, s->vparts, rows * dpv, dpv);
    }
    /* a tile from an unaligned first key (a causal or window band) reads
     * up to 15 rows past the slice's last 16 */
    const int64_t done = bj->plan.parts == 1 ? n : ATTNX_ROUND16(n); /* (split_rows pads) */
    for (int a = 0; a < bj->plan.parts; a++) {
        memset(s->kparts + (a * rows + done) * dp, 0,
               sizeof *s->kparts * (size_t)((rows - done) * dp));
        memset(s->vparts + (a * rows + done) * dpv, 0,
               sizeof *s->vparts * (size_t)((rows - done) * dpv));
    }
}

/* The run sums of the slice from key c0, rows of keys [span[0], span[1])
 * (the others are still zero), added into the gradient's dK and dV rows of
 * key/value head (b, hk), and zeroed for the next run; span emptied. */
static void add_run(const bwd_job *bj, const bwd_scratch *s, int64_t b, int64_t hk, int64_t c0,
                    int64_t span[2])
{
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    for (int64_t j = span[0]; j < span[1]; j++) {
        float *dk = at(&g->dk, b, hk, j), *dv = at(&g->dv, b, hk, j);
        float *rk = s->dkrun + (j - c0) * bj->plan.ldqa, *rv = s->dvrun + (j - c0) * bj->plan.ldva;
        for (int64_t e = 0; e < p->D; e++) {
            dk[e] += rk[e];
            rk[e] = 0.0f;
        }
        for (int64_t e = 0; e < p->Dv; e++) {
            dv[e] += rv[e];
            rv[e] = 0.0f;
        }
    }
    span[0] = INT64_MAX;
    span[1] = INT64_MIN;
}

/* Item i: the keys [kbeg, kstop) of key/value head (b, hk), against every
 * query of its group, a slice of keys at a time. With plan.run, each slice's
 * blocks, in (head, block) order, add their dK and dV rows into the run sums
 * (zeroed), added into the gradient's rows after every plan.run blocks and
 * after the last: a row's sum takes about √blocks terms in the run sums and
 * as many in the gradient, in an order that depends on the problem only. */
static void bwd_item(void *arg, int tid, int64_t item)
{
    const bwd_job *bj = arg;
    const bwd_scratch *s = &bj->scr[tid];
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const int64_t split = item % bj->plan.nsplit, bhk = item / bj->plan.nsplit;
    const int64_t hk = bhk % p->Hk, b = bhk / p->Hk, group = bj->plan.group;
    const int64_t kbeg = bj->kbounds ? bj->kbounds[split] : split * bj->plan.kchunk;
    const int64_t kstop =
        bj->kbounds ? bj->kbounds[split + 1] : min64(p->Lk, kbeg + bj->plan.kchunk);
    const int64_t run = bj->plan.run, blocks = group * ((p->Lq + BQ - 1) / BQ);
    attnx_mask_grad dm;
    const int with_mask = mask_grad_target(bj, b, hk, split, &dm);
    for (int64_t j = kbeg; j < kstop; j++) {
        memset(at(&g->dk, b, hk, j), 0, sizeof(float) * (size_t)p->D);
        memset(at(&g->dv, b, hk, j), 0, sizeof(float) * (size_t)p->Dv);
    }
    /* slices of plan.kslice keys (the run sums' cap bounds it with and
     * without split_dp); at least one, which zeroes dQ (Lk = 0) */
    int64_t c0 = kbeg;
    do {
        const int64_t c1 = min64(kstop, c0 + bj->plan.kslice);
        tile_split sp = {.kbeg = c0};
        if (bj->plan.split_dp && c1 > c0) split_slice(bj, s, b, hk, c0, c1, &sp);
        kv_rows to = {at(&g->dk, b, hk, c0), at(&g->dv, b, hk, c0), g->dk.sl, g->dv.sl, c0};
        if (run) {
            to = (kv_rows){s->dkrun, s->dvrun, bj->plan.ldqa, bj->plan.ldva, c0};
            memset(s->dkrun, 0, sizeof(float) * (size_t)((c1 - c0) * bj->plan.ldqa));
            memset(s->dvrun, 0, sizeof(float) * (size_t)((c1 - c0) * bj->plan.ldva));
        }
        int64_t done = 0;                         /* blocks of the slice */
        int64_t span[2] = {INT64_MAX, INT64_MIN}; /* keys of the run */
        for (int64_t h = hk * group; h < (hk + 1) * group; h++)
            for (int64_t i0 = 0; i0 < p->Lq; i0 += BQ) {
                float *dq =
                    bj->plan.nsplit == 1
                        ? at(&g->dq, b, h, i0)
                        : bj->partial + (((split * p->B + b) * p->Hq + h) * p->Lq + i0) * p->D;
                bwd_block(bj, s, &sp, with_mask ? &dm : NULL, &to, span, b, h, i0, c0, c1,
                          c0 == kbeg, dq, bj->plan.nsplit == 1 ? g->dq.sl : p->D);
                if (run && (++done % run == 0 || done == blocks)) add_run(bj, s, b, hk, c0, span);
            }
        c0 = c1;
    } while (c0 < kstop);
    for (int64_t j = kbeg; j < kstop; j++)
        for (int64_t e = 0; e < p->D; e++) at(&g->dk, b, hk, j)[e] *= p->scale;
}

/* dO's element x as "medium"'s dP = dO Vᵀ reads it (plan.parts 1): rounded
 * to bfloat16 (a block with an element that would round to inf is not
 * rounded: block_overflows). */
static inline float dout_as_rounded(float x) { return attnx_bf16_to_float(attnx_bf16_round(x)); }

/* Item i = b·Hq + h: D = rowsum(dO ∘ O) of each query row of head (b, h),
 * into bj->dsum. Sixteen running sums a row, each over the dims e with the
 * same e % 16, added in order at the end: a loop the compiler may put in
 * vectors (one sum chained through all Dv products took 4 cycles a
 * product, half the time of a D=128 block once the keys came in slices),
 * the same bits either way. Under "medium" (plan.parts 1) dO rounded as dP
 * takes it: dS = P ∘ (dP - D) then stays exact where dP - D is 0 in exact
 * arithmetic (a causal row's first key: P = 1, O = v). In a float64 model
 * of these roundings, over 12 draws of B=1 Hq=4 Hk=2 L=48 D=32 causal, the
 * largest dq and dk errors went from 1.48x and 1.36x torch bfloat16's to
 * 0.97x and 0.99x with it (L=256 D=64 causal: dq 1.29x to 0.99x). A block
 * that keeps float32 for its dP (block_overflows) keeps it here too. */
static void dsum_item(void *arg, int tid, int64_t item)
{
    const bwd_job *bj = arg;
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const int64_t b = item / p->Hq, h = item % p->Hq;
    const head_bounds hb = bounds_of(p, b, h);
    int rounded = 0;
    float row[16];
    for (int64_t i = 0; i < p->Lq; i++) {
        if (i % BQ == 0 && bj->plan.parts == 1) { /* a block as bwd_start_block takes it */
            int q_over, dout_over;
            block_overflows(bj, b, h, i, rows_attending(&hb, i, (int)min64(BQ, p->Lq - i)), &q_over,
                            &dout_over);
            rounded = !q_over && !dout_over;
        }
        const float *dout = at_in(&g->dout, b, h, i), *o = at_in(&g->o, b, h, i);
        float lanes[16] = {0.0f};
        int64_t e = 0;
        for (; e + 16 <= p->Dv; e += 16) {
            for (int l = 0; l < 16; l++)
                row[l] = rounded ? dout_as_rounded(dout[e + l]) : dout[e + l];
            for (int l = 0; l < 16; l++) lanes[l] += row[l] * o[e + l];
        }
        for (int l = 0; e + l < p->Dv; l++)
            lanes[l] += (rounded ? dout_as_rounded(dout[e + l]) : dout[e + l]) * o[e + l];
        float d = 0.0f;
        for (int l = 0; l < 16; l++) d += lanes[l];
        bj->dsum[item * p->Lq + i] = d;
    }
}

/* dQ from the per-range partials, summed in range order. */
static void bwd_merge_dq(const bwd_job *bj)
{
    const attnx_problem *p = bj->run.p;
    const int64_t per = p->B * p->Hq * p->Lq * p->D;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t i = 0; i < p->Lq; i++) {
                float *dq = at(&bj->g->dq, b, h, i);
                const float *src = bj->partial + ((b * p->Hq + h) * p->Lq + i) * p->D;
                for (int64_t e = 0; e < p->D; e++) dq[e] = src[e];
                for (int64_t sp = 1; sp < bj->plan.nsplit; sp++)
                    for (int64_t e = 0; e < p->D; e++) dq[e] += src[sp * per + e];
            }
}

static void free_scratch(bwd_job *bj, int taken)
{
    for (int t = 0; t < taken; t++) attnx_scratch_give_back(t, bj->scr[t].qt);
    free(bj->scr);
    attnx_free_floats(bj->partial);
    attnx_free_floats(bj->mg.copies);
    attnx_free_floats(bj->mg.acc);
    attnx_free_floats(bj->dsum);
}

static attnx_status alloc_scratch(bwd_job *bj)
{
    const int nt = bj->plan.threads;
    if (bj->plan.partial && !(bj->partial = attnx_alloc_floats(bj->plan.partial)))
        return ATTNX_ERR_NOMEM;
    const attnx_problem *p = bj->run.p;
    size_t rows; /* no more than the queries' elements, unless D is 0 */
    if (!mul_ok((size_t)(p->B * p->Hq), (size_t)p->Lq, &rows)) {
        free_scratch(bj, 0);
        return ATTNX_ERR_OVERFLOW;
    }
    if (!(bj->dsum = attnx_alloc_floats(rows))) {
        free_scratch(bj, 0);
        return ATTNX_ERR_NOMEM;
    }
    if (bj->mg.mode == MASK_GRAD_IN_PASS && bj->mg.ncopies > 0) {
        const size_t n = (size_t)bj->mg.ncopies * bj->mg.size; /* <= MASK_COPIES_FLOATS */
        if (!(bj->mg.copies = attnx_alloc_floats(n))) {
            free_scratch(bj, 0);
            return ATTNX_ERR_NOMEM;
        }
        memset(bj->mg.copies, 0, n * sizeof(float));
    }
    if (bj->mg.mode == MASK_GRAD_OWN_PASS &&
        !(bj->mg.acc = attnx_alloc_floats((size_t)nt * MASK_KEYS * BQ))) {
        free_scratch(bj, 0);
        return ATTNX_ERR_NOMEM;
    }
    if (!(bj->scr = calloc((size_t)nt, sizeof(bwd_scratch)))) {
        free_scratch(bj, 0);
        return ATTNX_ERR_NOMEM;
    }
    for (int t = 0; t < nt; t++) {
        float *base = attnx_scratch_take(t, bj->plan.scratch);
        if (!base) {
            free_scratch(bj, t);
            return ATTNX_ERR_NOMEM;
        }
        bj->scr[t] = attnx_bwd_scratch_at(base, bj->run.p, &bj->plan);
    }
    return ATTNX_OK;
}

attnx_status attnx_backward(const attnx_grad_problem *g)
{
    attnx_status st = attnx_check_grad_problem(g, NULL);
    if (st != ATTNX_OK || g->f.B == 0 || g->f.Hk == 0) return st;
    bwd_job bj = {.run = attnx_run_of(&g->f), .g = g};
    if ((st = attnx_plan_backward(&bj.run, g->dmask.data != NULL, &bj.plan)) != ATTNX_OK) return st;
    uint8_t *map = NULL;
    if ((st = attnx_run_map(&bj.run, bj.plan.threads, &map)) != ATTNX_OK) return st;
    bj.kbounds = attnx_balanced_ranges(&bj.run, bj.plan.nsplit, bj.plan.kchunk);
    plan_mask_grad(&bj);
    if ((st = alloc_scratch(&bj)) != ATTNX_OK) {
        free(bj.kbounds);
        free(map);
        return st;
    }
    attnx_parallel_items(bj.plan.threads, g->f.B * g->f.Hq, dsum_item, &bj);
    attnx_parallel_items(bj.plan.threads, bj.plan.n_items, bwd_item, &bj);
    if (bj.plan.nsplit > 1) bwd_merge_dq(&bj);
    if (bj.mg.copies) mask_grad_merge(&bj);
    if (bj.mg.mode == MASK_GRAD_OWN_PASS) {
        const int64_t nqb = g->dmask.sq ? (g->f.Lq + BQ - 1) / BQ : 1;
        attnx_parallel_items(bj.plan.threads, bj.mg.ext[0] * bj.mg.ext[1] * nqb, mask_pass_item,
                             &bj);
    }
    free_scratch(&bj, bj.plan.threads);
    free(bj.kbounds);
    free(map);
    return ATTNX_OK;
}

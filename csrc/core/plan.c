/* The plans of both passes: how many threads, how the work is cut into
 * items (and split-K, when too few items would keep the threads busy), and
 * how much scratch each thread and the partial results need. */
#include <math.h>

#include "core/core.h"

#ifdef ATTNX_TEST_HOOKS
/* tools/microbench (AB=1): nonzero keeps float32 off the tiles, so that one
 * process can alternate both ways */
int attnx_test_no_split = 0;
#endif

/* Float32 on AMX tiles: D rounded up to 32 if the scores of r's problem can
 * take kt->qk_split, where a key tile meets at least min_meet query blocks
 * (of the G heads of a group) to pay for splitting it; else 0. Not for
 * decoding, bfloat16 dot products or a post_scale. */
int64_t attnx_split_dims(const attnx_run *r, int64_t min_meet)
{
#ifdef ATTNX_TEST_HOOKS
    if (attnx_test_no_split) return 0;
#endif
    const attnx_problem *p = r->p;
    const int64_t meet = p->Hk ? p->Hq / p->Hk * ((p->Lq + BQ - 1) / BQ) : 0;
    return r->kt->qk_split && !r->bf16_dots && !p->pages.table && r->post_scale == 1.0f &&
                   p->D > 0 && p->Lq > r->kt->dot_max_nq && meet >= min_meet
               ? (p->D + 31) / 32 * 32
               : 0;
}

attnx_run attnx_run_of(const attnx_problem *p)
{
    const int large = fabsf(p->scale) > 1.0f;
    attnx_run r = {
        .p = p,
        .kt = attnx_active_kernels(),
        .pre_scale = large ? 1.0f : p->scale,
        .post_scale = large ? p->scale : 1.0f,
    };
    /* pages: the FMA kernels, which read a tile's rows in place; the tile
     * paths read whole heads or wider tiles of rows one stride apart */
    r.bf16_dots = r.kt->qk_bf16 && all_bf16(p) && !p->pages.table;
    r.pv_medium =
        r.bf16_dots && p->precision == ATTNX_PRECISION_MEDIUM && r.kt->pv_medium && p->Dv % 16 == 0;
    r.pv_tiles = r.pv_medium || (r.bf16_dots && r.kt->pv_bf16 && p->Dv % 16 == 0);
    /* the forward splits float32 keys and values met by 12 query blocks or
     * more: splitting them costs about a third of one block's tile
     * products, and with two threads the split loses more than with one
     * (L=256: 1.0x on one, likely the other core reading parts from the
     * cache of the core that wrote them). On the Xeon with AMX, 2 threads, H=8 D=64 (the C core,
     * against ATTNX_BF16_DOTS=none): L=256 0.77-0.81x, 384 0.89-0.95x, 512
     * 0.94-0.99x, 768 1.07-1.20x, 1024 1.10-1.12x, 4096 1.07-1.16x */
    r.split_dp = attnx_split_dims(&r, 12);
    r.split_pv = r.split_dp && r.kt->pv_split && p->Dv > 0 && p->Dv % 16 == 0;
    /* "medium" for the rest (float32, float16, int8 K/V): rounding a head's
     * keys and values costs less than one block's products, so every block
     * but decoding's (qk_dot) takes it */
    if (!r.bf16_dots && p->precision == ATTNX_PRECISION_MEDIUM && r.kt->round_rows &&
        r.kt->pv_medium && !p->pages.table && p->D > 0 && p->Dv > 0 && p->Dv % 16 == 0 &&
        p->Lq > r.kt->dot_max_nq) {
        r.split_dp = 0;
        r.split_pv = 0;
        r.round_dk = (p->D + 31) / 32 * 32;
        r.pv_tiles = r.pv_medium = 1;
    }
    /* "medium" rounds every block of such a call, its last short one too */
    r.tiles_only = r.pv_medium && p->Lq > r.kt->dot_max_nq;
    /* "medium" decoding from a bfloat16, float16 or int8 cache (the rows of
     * blocks with few queries: decoding, or any call whose blocks all take
     * qk_dot): the queries' pairs fit in the space of their floats (D >= 2).
     * A float32 cache stays on the FMAs: rounded as it is read, a value past
     * bfloat16's largest would become inf, and only a pass over the cache
     * could tell (the forward's float32 inputs are checked as they are packed) */
    const int cache = p->k8.data || p->k16.data;
    r.dot_medium =
        p->precision == ATTNX_PRECISION_MEDIUM && r.kt->qk_dot_medium && cache && p->D >= 2;
    r.dot_medium_pv = r.dot_medium && p->Dv > 0 && p->Dv % 32 == 0; /* v8, v16 with k8, k16 */
    return r;
}

/* The threads a call uses: as asked, but one for small problems. */
static int threads_for(const attnx_problem *p, double flops_per_unit, double min_flops)
{
    const int nt = p->num_threads > 0 ? p->num_threads : attnx_get_num_threads();
    const double flops = flops_per_unit * (double)p->B * (double)p->Hq * (double)p->Lq *
                         (double)p->Lk * (double)(p->D > 0 ? p->D : 1);
    return flops < min_flops ? 1 : nt;
}

/* No more threads than items, nor than the pool has; at least one. */
static int threads_for_items(int nt, int64_t n_items)
{
    if (nt > n_items) nt = (int)n_items;
    if (nt > ATTNX_MAX_THREADS) nt = ATTNX_MAX_THREADS;
    return nt < 1 ? 1 : nt;
}

/* The forward's key ranges (core.h, long sums): up to SUM_KEYS keys, one range
 * summed in float32; beyond, at most SUM_RANGES ranges of whole chunks, cut
 * by Lk alone. Split-K: when too few query blocks keep every thread busy
 * (decoding: Lq of 1 to a few against long Lk; never for the weights), each
 * range of a block is an item of its own, its state folded with the others'
 * in key order after (the same bits as one item folding them in turn). */
static void split_keys_forward(const attnx_problem *p, int nt, int64_t blocks, fwd_plan *plan)
{
    plan->nsplit = 1;
    plan->kchunk = p->Lk;
    plan->nranges = 1;
    plan->sums = p->Lk > SUM_KEYS;
    plan->sum_rows = min64(BQ, p->Lq);
    plan->partial = 0;
    if (!plan->sums) return;
    const int64_t chunks = (p->Lk + SUM_KEYS - 1) / SUM_KEYS;
    plan->kchunk = (chunks + SUM_RANGES - 1) / SUM_RANGES * SUM_KEYS;
    plan->nranges = (p->Lk + plan->kchunk - 1) / plan->kchunk;
    size_t bytes;
    if (nt <= 1 || p->weights || blocks >= 4 * (int64_t)nt ||
        !mul_ok((size_t)(blocks * plan->nranges), attnx_sum_state_size(plan), &plan->partial) ||
        !mul_ok(plan->partial, sizeof(double), &bytes) || bytes > SUM_PARTIAL_BYTES) {
        plan->partial = 0;
        return;
    }
    plan->nsplit = plan->nranges;
}

attnx_status attnx_plan_forward(const attnx_run *r, fwd_plan *plan)
{
    const attnx_problem *p = r->p;
    const int nt = threads_for(p, 4.0, 2e6);
    plan->nqb = (p->Lq + BQ - 1) / BQ;
    plan->ldacc = ATTNX_ROUND16(p->Dv);
    const int64_t blocks = p->B * p->Hq * plan->nqb;
    split_keys_forward(p, nt, blocks, plan);
    plan->n_items = blocks * plan->nsplit;
    plan->threads = threads_for_items(nt, plan->n_items);
    plan->kp_rows = ATTNX_ROUND16(p->Lk) + 16;
    plan->ldv = (p->Lk + 63) / 64 * 64 + 64;
    plan->split_heads = plan->kparts = plan->vparts = 0;
    if (r->split_dp || r->round_dk) { /* a head's parts, in bfloat16 values: no overflow, Lk
                                       * and D fit memory */
        const size_t kh = r->round_dk ? (size_t)plan->kp_rows * (size_t)r->round_dk
                                      : 3 * (size_t)plan->kp_rows * (size_t)r->split_dp;
        const size_t vh = r->round_dk   ? (size_t)plan->kp_rows * (size_t)p->Dv
                          : r->split_pv ? 3 * (size_t)p->Dv * (size_t)plan->ldv
                                        : 0;
        size_t fit = ATTNX_SPLIT_BYTES / 2 / (kh + vh);
        if (fit > ATTNX_SPLIT_SLOTS) fit = ATTNX_SPLIT_SLOTS;
        if (fit > (size_t)(p->B * p->Hk)) fit = (size_t)(p->B * p->Hk);
        plan->split_heads = (int64_t)(fit < 1 ? 1 : fit);
        if (!mul_ok((size_t)plan->split_heads, kh, &plan->kparts) ||
            !mul_ok((size_t)plan->split_heads, vh, &plan->vparts) ||
            plan->kparts > SIZE_MAX - 1 - plan->vparts)
            return ATTNX_ERR_OVERFLOW;
    }
    return attnx_fwd_scratch_size(p, plan->ldacc, r->split_dp, r->split_pv || r->round_dk,
                                  &plan->scratch);
}

/* Split-K for the backward: items are (batch, key/value head, key range);
 * with fewer heads than 2 a thread, the keys of a head are cut into ranges. */
static void split_keys_backward(const attnx_problem *p, int nt, bwd_plan *plan)
{
    const int64_t heads = p->B * p->Hk, tiles = (p->Lk + BK - 1) / BK;
    plan->nsplit = 1;
    plan->kchunk = tiles * BK;
    if (nt > 1 && heads < 2 * (int64_t)nt && tiles > 1) {
        int64_t want = (2 * (int64_t)nt + heads - 1) / heads;
        if (want > tiles) want = tiles;
        plan->kchunk = (tiles + want - 1) / want * BK;
        plan->nsplit = (p->Lk + plan->kchunk - 1) / plan->kchunk;
    }
    if (plan->kchunk == 0) plan->kchunk = BK;
    plan->n_items = heads * plan->nsplit;
}

attnx_status attnx_plan_backward(const attnx_run *r, int mask_grad, bwd_plan *plan)
{
    const attnx_problem *p = r->p;
    const int nt = threads_for(p, 10.0, 5e6);
    plan->group = p->Hq / p->Hk;
    plan->ldqa = ATTNX_ROUND16(p->D);
    split_keys_backward(p, nt, plan);
    plan->threads = threads_for_items(nt, plan->n_items);
    plan->partial = 0;
    if (plan->nsplit > 1 && !mul_ok((size_t)plan->nsplit * (size_t)p->B * (size_t)p->Hq,
                                    (size_t)p->Lq * (size_t)p->D, &plan->partial))
        return ATTNX_ERR_OVERFLOW;
    /* float32 on tiles for S and dP: an item splits its keys and values a
     * slice of kslice keys at a time, and every query block of its group
     * meets the slice before the next (its dQ rows summed slice by slice):
     * BWD_SLICE_KEYS keys, whose tiles' reads and writes stay in L2. Not with a
     * mask's gradient: its own pass recomputes dS with the FMAs, and both
     * ways must give the same bits. Only where D and Dv round up to 64:
     * against the FMAs on the Xeon with AMX (AB=1 BWD=1 tools/microbench/
     * run.sh forward: both in one process, medians of 16; H=8, one thread
     * unless said):
     *   D=64: L=256 1.05x, 512 (2 threads) 1.07x, 1024 1.02x (2: 1.03x),
     *         2048 (2, causal) 1.04x, 4096 (H=4) 1.04x (2 threads, H=8: 1.03x);
     *   L=1024 D=32: 1.00x; D=96: 0.98x; D=128: 0.98x (L=4096, 2: 1.01x):
     *   there qk_split runs about as fast as the FMAs between the
     *   backward's other kernels, though 1.6x alone (not explained). */
    plan->kslice = plan->kchunk;
    plan->parts = 3;
    plan->split_dp = mask_grad || p->Dv <= 32 || p->Dv > 64 || p->D <= 32 || p->D > 64
                         ? 0
                         : attnx_split_dims(r, BWD_SPLIT_MEET);
    plan->split_dpv = plan->split_dp ? 64 : 0;
    /* "medium": S and dP on the bfloat16 dot products, Q, K, dO and V
     * rounded, where the forward rounds them (round_dk, the same run's
     * conditions: its S, so P consistent with its lse; where the forward
     * stays float32 and the backward rounded, P = exp(S - lse) of rounded
     * S against a float32 lse missed torch bfloat16's error bar by 2.4x
     * (Lk = 3, a GQA group of 3, Lq = 267: its float64 model, 20 trials)).
     * Not with a mask's gradient, whose own pass recomputes dS on the
     * FMAs: both ways must give the same bits (float32 S against the
     * forward's rounded lse: 0.1x the error of the consistent rounding in
     * the same model at L = 256 D = 64) */
    if (!mask_grad && r->round_dk) {
        plan->parts = 1;
        plan->split_dp = (p->D + 31) / 32 * 32;
        plan->split_dpv = (p->Dv + 31) / 32 * 32;
    }
    /* dV = Pᵀ dO and dK = dSᵀ Q on the bfloat16 dot products too, P, dS, dO
     * and Q rounded (as torch's bfloat16 backward takes them): emulated
     * (tools/precision_errors.py, 2026-11-29), dk's and dv's errors 0.87x
     * and 0.63x torch bfloat16's at L=1024 D=64, 1.18x and 1.05x at L=256.
     * dQ = dS K stays on the FMAs (tried on pv_medium, 2026-11-28: 1.19x
     * torch's error on a small causal case; DESIGN.md) */
    plan->ptx_medium = plan->parts == 1 && r->kt->ptx_medium;
    if (plan->split_dp) plan->kslice = min64(plan->kchunk, BWD_SLICE_KEYS);
    /* dK and dV rows sum a term per query block of the group: added one by
     * one into the gradient's rows, their rounding errors grew with the
     * blocks (GQA 8 -> 1, Lq = 4096, Lk = 16, D = 64: 512 terms, dK within
     * 3.4e-4 of float64, torch 2.6e-5). With more than BWD_RUN_MIN blocks,
     * runs of about √blocks blocks are summed apart and the runs' sums added
     * into the rows: √blocks + √blocks terms a sum, not blocks (the same
     * runs whatever the key ranges and slices: the bits do not depend on
     * the threads). A slice's run sums take at most BWD_RUN_FLOATS. */
    const int64_t blocks = plan->group * ((p->Lq + BQ - 1) / BQ);
    plan->ldva = ATTNX_ROUND16(p->Dv);
    plan->run = 0;
    if (blocks > BWD_RUN_MIN && plan->ldqa + plan->ldva > 0) {
        plan->run = (int64_t)sqrt((double)blocks);
        while (plan->run * plan->run < blocks) plan->run++; /* ⌈√blocks⌉ */
        const int64_t keys = (int64_t)(BWD_RUN_FLOATS / (size_t)(plan->ldqa + plan->ldva));
        plan->kslice = min64(plan->kslice, max64(BK, keys / BK * BK));
    }
    return attnx_bwd_scratch_size(p, plan, &plan->scratch);
}

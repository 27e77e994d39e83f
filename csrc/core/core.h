/* Internal to the core: what its files share.
 *
 * The data path of attnx_forward (forward.c):
 *
 *   validate.c   attnx_check_problem: what the core needs to stay in memory
 *   plan.c       the plan: threads, items (B·Hq·query blocks·key ranges),
 *                split-K, scratch sizes
 *   scratch.c    one scratch buffer per thread, and its layout
 *   threads.c    attnx_parallel_items: the persistent pool takes the items
 *   items.c      one item: pack its queries, then per tile of keys
 *   tile.c         scores (qk, scale, causal and mask) ...
 *   kernels/       ... the softmax and the weighted sum of values
 *   output.c     the item's rows out (and lse), or its split-K partial;
 *                the partials merged
 *   errors.c     attnx_strerror, a table
 *
 * attnx_backward (backward.c) reuses the validation, threads, scratch and
 * the tile's scores. Where a variant of attention goes: a change of the
 * scores (softcap, ALiBi) is a step of attnx_score_tile (tile.c), used by
 * both passes; a change of the keys a query sees (sliding window) is
 * head_bounds and keys_end below; a per-head parameter is one member of
 * attnx_problem (attnx.h), checked in validate.c.
 */
#ifndef ATTNX_CORE_H
#define ATTNX_CORE_H

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "attnx.h"
#include "kernels/kernels.h"

#define BQ ATTNX_BQ
#define BK ATTNX_BK

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

/* a * b into *r; 0 if it overflows size_t. */
static inline int mul_ok(size_t a, size_t b, size_t *r)
{
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *r = a * b;
    return 1;
}

/* ---- what a head attends ---------------------------------------------------
 * Query rows [0, qlen) and keys [0, klen) of head (b, h), and the band of
 * keys each query sees: query i sees keys j in [i + lo, i + hi] (causal and
 * the window; ATTNX_FAR on an unbounded side), with offset = d(i) - i, the
 * diagonal's shift (0, or Lk - Lq aligned lower-right). The lengths are
 * clamped to [0, L] where they are read: the caller may let another thread
 * write them while the core runs (Python releases the GIL), which may change
 * the numbers but never reaches outside the arrays. */
#define ATTNX_FAR ((int64_t)1 << 60)

typedef struct {
    int64_t qlen, klen, offset, lo, hi;
} head_bounds;

static inline int64_t length_of(const attnx_lengths *len, int64_t b, int64_t h, int64_t whole)
{
    return len->data ? clamp64(len->data[b * len->sb + h * len->sh], 0, whole) : whole;
}

/* d(i) - i: the diagonal of causal, the window and ALiBi */
static inline int64_t diagonal_offset(const attnx_problem *p)
{
    const int lower_right = p->causal == ATTNX_CAUSAL_NONE ? p->align == ATTNX_ALIGN_LOWER_RIGHT
                                                           : p->causal == ATTNX_CAUSAL_LOWER_RIGHT;
    return lower_right ? p->Lk - p->Lq : 0;
}

/* A side of the window as a distance from the diagonal: FAR when unbounded. */
static inline int64_t window_side(int on, int64_t w)
{
    return on && w >= 0 ? min64(w, ATTNX_FAR) : ATTNX_FAR;
}

static inline head_bounds bounds_of(const attnx_problem *p, int64_t b, int64_t h)
{
    head_bounds hb;
    hb.qlen = length_of(&p->query_lengths, b, h, p->Lq);
    hb.klen = length_of(&p->key_lengths, b, h, p->Lk);
    hb.offset = diagonal_offset(p);
    const int64_t right = window_side(p->window.on, p->window.right);
    hb.lo = hb.offset - window_side(p->window.on, p->window.left);
    hb.hi = hb.offset + (p->causal != ATTNX_CAUSAL_NONE ? 0 : right);
    return hb;
}

/* Keys [keys_begin, keys_end) hold every key that queries [i0, i0 + nq) of
 * a head may see (nq > 0). */
static inline int64_t keys_begin(const head_bounds *hb, int64_t i0)
{
    return clamp64(i0 + hb->lo, 0, hb->klen);
}

static inline int64_t keys_end(const head_bounds *hb, int64_t i0, int64_t nq)
{
    return nq <= 0 ? 0 : clamp64(i0 + nq + hb->hi, 0, hb->klen);
}

/* Whether rows x (rows, n; sl apart) hold a value of magnitude at least
 * ATTNX_BF16_INF_FROM (an inf included), which "medium" would round to an
 * inf: the block keeps float32 for its queries (the forward's
 * pack_queries, the backward's S) or its dO (the backward's dP and D), the
 * forward and the backward deciding alike a block of rows. */
static inline int attnx_rows_overflow_bf16(const float *x, int64_t sl, int rows, int64_t n)
{
    int over = 0;
    for (int i = 0; i < rows; i++)
        for (int64_t e = 0; e < n; e++) over |= fabsf(x[i * sl + e]) >= ATTNX_BF16_INF_FROM;
    return over;
}

/* The key/value head that query head h reads (grouped-query attention). */
static inline int64_t kv_head(const attnx_problem *p, int64_t h) { return h / (p->Hq / p->Hk); }

/* Rows [0, n) of query block i0 that attend: past the head's qlen give zeros. */
static inline int rows_attending(const head_bounds *hb, int64_t i0, int rows)
{
    return (int)max64(0, min64(rows, hb->qlen - i0));
}

/* ---- keys and values: arrays, or pages ---------------------------------------
 * The element offset of row j of key/value head (b, hk) in an array of
 * strides (sb, sh, sl): (B, Hk, Lk, .) as it is, or a pool of pages
 * (p->pages, attnx.h), whose table entries are clamped where read. */
static inline int64_t kv_offset(const attnx_problem *p, int64_t sb, int64_t sh, int64_t sl,
                                int64_t b, int64_t hk, int64_t j)
{
    const attnx_pages *pg = &p->pages;
    if (!pg->table) return b * sb + hk * sh + j * sl;
    const int64_t page = clamp64(pg->table[b * pg->sb + j / pg->size], 0, pg->num_pages - 1);
    return page * sb + hk * sh + (j % pg->size) * sl;
}

/* Whether keys j0 .. j0+nk-1 lie in one page (always, without pages): their
 * rows are then one stride apart, and kernels may read them in place. */
static inline int in_one_page(const attnx_problem *p, int64_t j0, int64_t nk)
{
    return !p->pages.table || j0 % p->pages.size + nk <= p->pages.size;
}

/* Row j of head (b, hk) of an int8 tensor (k8 or v8), and in *scale its
 * scale's address (the next rows' scales ssl apart, within one page). */
static inline const int8_t *i8_row_at(const attnx_problem *p, const attnx_i8_tensor *t, int64_t b,
                                      int64_t hk, int64_t j, const float **scale)
{
    *scale = t->scale + kv_offset(p, t->ssb, t->ssh, t->ssl, b, hk, j);
    return t->data + kv_offset(p, t->sb, t->sh, t->sl, b, hk, j);
}

/* q, k and v all bfloat16 values: the bfloat16 dot path may take the
 * problem (plan.c), and the scratch has room for pv_bf16 (scratch.c). */
static inline int all_bf16(const attnx_problem *p)
{
    return p->q_bf16 && p->k16.data && p->half_format == ATTNX_HALF_BF16;
}

/* ---- a run: the problem, its kernels, and how the scale is applied ---------
 * Scores are scale·q·k. The queries are packed pre-scaled, which cannot
 * overflow when |scale| <= 1; a larger scale is applied to the scores
 * instead (post_scale), so that any scale whose scores fit in float32 works.
 * bf16_dots: blocks of queries that are all bfloat16 may take kt->qk_bf16
 * against the bfloat16 keys (q_bf16, bfloat16 K/V, and the kernel); they are
 * packed unscaled as bfloat16 pairs, and the kernel scales the sums by the
 * whole scale (1/√D is no bfloat16 value: pre-scaling would round q). With
 * pv_tiles those blocks also take kt->pv_bf16 for P·V, into an accumulator
 * kept transposed (fwd_scratch.acct); under precision "medium", kt->pv_medium
 * (pv_medium: P rounded to bfloat16, a dot product a pair of keys).
 * split_dp: the scores of float32 queries and keys take kt->qk_split (AMX),
 * the keys split once a call into bfloat16 parts (forward.c), the queries
 * once an item; only where a key tile meets enough queries to pay for the
 * split (plan.c), and with no post_scale. split_pv: P·V of those items
 * takes kt->pv_split into acct, over the values split and transposed once
 * a call too. round_dk: under precision "medium", blocks of queries that
 * are not all bfloat16 take the bfloat16 dot path too (qk_bf16, pv_medium):
 * the keys and values rounded to bfloat16 once a call (kt->round_rows, in
 * split_dp's slots and pipeline, one part each), the queries once an item
 * (pack_qt, then kt->round_pairs). dot_medium: under precision "medium",
 * decoding's few rows (qk_dot's layout) against a bfloat16 or int8 cache
 * read in place: the rows rounded to bfloat16 pairs once an item
 * (kt->round_rows), the scores by kt->qk_dot_medium and, with
 * dot_medium_pv, P·V by kt->pv_rows_medium (P rounded). */
typedef struct {
    const attnx_problem *p;
    const attnx_kernels *kt;
    float pre_scale, post_scale;
    int bf16_dots;
    int pv_tiles;     /* bf16_dots and kt->pv_bf16, Dv % 16 == 0: their blocks' P·V on tiles */
    int pv_medium;    /* and precision "medium": kt->pv_medium instead (P rounded to bfloat16) */
    int64_t split_dp; /* float32 on tiles (kt->qk_split): D rounded up to 32; else 0 */
    int split_pv;     /* and P·V on tiles too (kt->pv_split, Dv % 16 == 0) */
    int64_t round_dk; /* "medium", K and V rounded a head: D rounded up to 32, their rows; else 0 */
    int tiles_only;   /* every block on the tiled kernels, a few rows too (not qk_dot): "medium"
                       * with more query rows than qk_dot takes, so that every block rounds */
    int dot_medium;   /* "medium" decoding's scores from a bfloat16 or int8 cache: qk_dot_medium */
    int dot_medium_pv; /* and its P·V (Dv % 32 == 0): pv_rows_medium */
    /* the mask's block map (blockmap.c), or NULL: block (b, h, qb, kb) at
     * map[b*map_sb + h*map_sh + qb*map_sq + kb], strides 0 where broadcast */
    const uint8_t *map;
    int64_t map_sb, map_sh, map_sq;
} attnx_run;

attnx_run attnx_run_of(const attnx_problem *p); /* plan.c */

/* ---- block maps of masks (blockmap.c) --------------------------------------- */

/* Blocks along an axis of n entries, per_block a block; 1 when the axis is
 * broadcast (stride 0) or empty. */
int64_t attnx_map_extent(int64_t stride, int64_t n, int64_t per_block);

/* r->map for r's problem: the problem's own map where its extents fit, else
 * one classified now into *owned (the caller frees it); NULL without a mask. */
attnx_status attnx_run_map(attnx_run *r, int num_threads, uint8_t **owned);

/* The next tile of keys that queries [i0, i0 + nq) of head (b, h) meet from
 * key j0 on, below kstop: its first key (kstop when none is left) and *nk,
 * at most BK keys, trimmed to blocks of the map that keep (the whole range,
 * BK at a time, without a map). */
int64_t attnx_next_tile(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int64_t nq,
                        int64_t j0, int64_t kstop, int *nk);

/* Key ranges for n items of a head (split-K), [bounds[s], bounds[s + 1]):
 * whole tiles, cut so that each holds about the same number of blocks the map
 * keeps (the threads follow the work, not the square). NULL (keep the even
 * cut of `chunk` keys, a multiple of BK) without a map, when the even cut is
 * within 25% of balanced, or out of memory; else the caller frees it. */
int64_t *attnx_balanced_ranges(const attnx_run *r, int64_t n, int64_t chunk);

/* The OR of the map's flags over queries [i0, i0 + nq) and keys [j0, j0 + nk)
 * of head (b, h): no ATTNX_MAP_KEEP, the tile is all masked (skip it); no
 * ATTNX_MAP_DROP, the mask changes nothing there. Both flags without a map. */
int attnx_tile_flags(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t j0,
                     int64_t nk);

/* Rows j0 .. j0+nk-1 of key/value head (b, hk) of the keys (values = 0) or the
 * values (1), as float32 rows *sl floats apart: the array itself, or, for
 * half-precision K/V and for rows of several pages, converted or copied into
 * buf (nk, width) (tile.c). */
const float *attnx_kv_rows(const attnx_run *r, int values, int64_t b, int64_t hk, int64_t j0,
                           int nk, float *buf, int64_t *sl);

/* Element d of key (values = 0) or value (1) row j of key/value head (b, hk). */
float attnx_kv_at(const attnx_problem *p, int values, int64_t b, int64_t hk, int64_t j, int64_t d);

/* ---- plans (plan.c) -------------------------------------------------------- */

/* Long sums. A forward over more than SUM_KEYS keys sums each row's softmax
 * in chunks: keys [c·SUM_KEYS, (c+1)·SUM_KEYS), whatever the item's range,
 * each chunk's float32 state (max, sum, output row) folded into a double
 * state as it ends, so that no float32 running sum spans more than SUM_KEYS
 * keys (2^25 keys summed in one float32 sum stop growing at 2^24). The
 * chunks are grouped into at most SUM_RANGES ranges of whole chunks (cut by
 * the keys alone, or by a mask's kept work: never by the threads); a range's
 * chunks fold into the range's state, and the ranges' states into the row's,
 * in key order. Split-K computes the ranges on different threads and folds
 * their states in the same order (output.c): the bits are the same at every
 * thread count. */
#define SUM_KEYS 1024
#define SUM_RANGES 64
/* Split-K's partial states take at most this many bytes (else one item a block) */
#define SUM_PARTIAL_BYTES ((size_t)256 << 20)

typedef struct {
    int threads;
    int64_t nqb;     /* query blocks per head */
    int64_t nsplit;  /* key ranges per query block computed apart (split-K, for decoding) */
    int64_t kchunk;  /* keys per range, a multiple of BK (of SUM_KEYS with sums) */
    int64_t n_items; /* B * Hq * nqb * nsplit */
    int64_t ldacc;   /* accumulator rows: Dv rounded up to a whole vector */
    size_t scratch;  /* floats per thread (attnx_fwd_scratch_at) */
    /* long sums (Lk > SUM_KEYS): nranges ranges of kchunk keys (or kbounds),
     * each row's state in double (sum_rows: its rows); else 0 and float32
     * throughout, one range */
    int sums;
    int64_t nranges;
    int64_t sum_rows; /* min(BQ, Lq): the rows of a block's states */
    size_t partial;   /* doubles of the split-K partials (sum states), 0 when nsplit is 1 */
    /* with split_dp (or round_dk): the parts of split_heads key/value heads
     * (b·Hk + hk) are kept at once, head bh's in slot bh % split_heads, at
     * most ATTNX_SPLIT_SLOTS and ATTNX_SPLIT_BYTES (or one head's); with
     * round_dk one part each: the keys rounded (kp_rows, round_dk), the
     * values rounded (kp_rows, Dv) */
    int64_t split_heads;
    int64_t kp_rows; /* rows of a head's key parts, round16(Lk) + 16 */
    size_t kparts;   /* bfloat16 values of the slots' key parts */
    int64_t ldv;     /* with split_pv: keys a row of a head's value parts, round64(Lk) + 64 */
    size_t vparts;   /* with split_pv: bfloat16 values of the slots' value parts */
} fwd_plan;

/* The most memory the parts of the heads kept at once take, unless one
 * head's take more: 16 MiB (L=1024 D=64 would fit 20 heads; L=16384 D=64:
 * one, 12 MiB); and at most 3 heads: the one being split, the one whose
 * items run, and a spare, so that a split seldom waits for the last items
 * of the head whose slot it takes. */
#define ATTNX_SPLIT_BYTES ((size_t)16 << 20)
#define ATTNX_SPLIT_SLOTS 3

typedef struct {
    int threads;
    int64_t group;   /* query heads per key/value head */
    int64_t nsplit;  /* key ranges per key/value head */
    int64_t kchunk;  /* keys per range, a multiple of BK */
    int64_t n_items; /* B * Hk * nsplit */
    int64_t ldqa;    /* dQ accumulator rows: D rounded up to a whole vector */
    size_t scratch;  /* floats per thread (attnx_bwd_scratch_at) */
    size_t partial;  /* floats of the per-range dQ partials, 0 when nsplit is 1 */
    /* float32 on tiles (AMX) for S = Q Kᵀ and dP = dO Vᵀ: 64 and 64 (D and Dv
     * of 33 to 64, plan.c), or 0; parts 3 (kt->qk_split over the split parts).
     * Under precision "medium" with bfloat16 dot products: D and Dv rounded
     * up to 32, parts 1 (kt->qk_bf16 over Q, K, dO and V rounded to bfloat16,
     * as the forward rounds them: the same S, so the forward's P) */
    int64_t split_dp, split_dpv;
    int parts;
    /* with parts 1: dV += Pᵀ dO and dK += dSᵀ Q on the bfloat16 dot products
     * too (kt->ptx_medium: P, dS, dO and Q rounded; dQ stays on the FMAs) */
    int ptx_medium;
    /* keys an item takes at a time, a multiple of BK: kchunk, or fewer with
     * split_dp (BWD_SLICE_KEYS) or run sums (BWD_RUN_FLOATS) */
    int64_t kslice;
    /* query blocks a run: an item's blocks (group · query blocks, in the order
     * of (head, block)) add their dK and dV rows into the thread's zeroed run
     * sums, added into the gradient's rows after every run (backward.c); 0:
     * straight into the gradient's rows (no more than BWD_RUN_MIN blocks) */
    int64_t run;
    int64_t ldva; /* with run: dV run rows, Dv rounded up to a whole vector */
} bwd_plan;

/* The backward splits an item's keys and values when each key tile meets
 * at least this many query blocks, this many keys at a time (a multiple of
 * BK: their parts and their K, V, dK and dV rows at D = Dv = 64 take 0.9
 * MiB, and stay in L2). */
#define BWD_SPLIT_MEET 2
#define BWD_SLICE_KEYS 512
/* Run sums when an item has more query blocks than this; their rows take at
 * most this many floats a thread (1 MiB: 2048 keys at D = Dv = 64), or BK
 * keys' rows when those take more. */
#define BWD_RUN_MIN 16
#define BWD_RUN_FLOATS ((size_t)1 << 18)

attnx_status attnx_plan_forward(const attnx_run *r, fwd_plan *plan);
int64_t attnx_split_dims(const attnx_run *r, int64_t min_meet);
attnx_status attnx_plan_backward(const attnx_run *r, int mask_grad, bwd_plan *plan);

/* ---- scratch (scratch.c) ----------------------------------------------------
 * A forward item's working set, per thread; stays in cache:
 *   qt (D, BQ) | st (BK, BQ) | acc (BQ, ldacc) | m, l, alpha (BQ)
 *   | with half-precision K/V: kbuf (BK, D) | vbuf (BK, Dv)
 *   | with bfloat16 Q, K, V: acct (ldacc, BQ) | pv_work (ATTNX_PV_BF16_WORK(ldacc))
 *   | with split_dp: qparts (3, split_dp / 2, BQ)
 *   | with split_pv or round_dk and not bfloat16 Q, K, V (acct, below):
 *     acct | pv_work, as above */
typedef struct {
    float *qt;            /* (D, BQ) packed queries, or (nq, D) rows for qk_dot */
    float *st;            /* (BK, BQ) scores, then probabilities; (nq, BK) when decoding */
    float *acc;           /* (BQ, ldacc) unnormalised output rows */
    float *m, *l, *alpha; /* (BQ) each: running max, sum, rescale factor */
    float *kbuf, *vbuf;   /* a tile of keys and values converted to float32, or NULL */
    float *acct;          /* (ldacc, BQ) the accumulator transposed, for pv_bf16, or NULL */
    float *pv_work;       /* pv_bf16's working memory, or NULL */
    uint32_t *qparts;     /* the queries' parts for qk_split (kt->split_pairs), or NULL */
    double *sums;         /* with long sums: two states (attnx_sum_state), else NULL */
} fwd_scratch;

/* A backward block's working set, per thread:
 *   qt (D, BQ) | dot (Dv, BQ) | st, dpt, capped (BK, BQ) | dqacc (BQ, ldqa) | lse, dvec, ones (BQ)
 *   | with run: dkrun (kslice, ldqa) | dvrun (kslice, ldva)
 *   | with split_dp: qparts (3, split_dp/2, BQ) | oparts (3, split_dpv/2, BQ)
 *                    | kparts (3, kslice + 16, split_dp) | vparts (3, kslice + 16, split_dpv)
 *     with parts 1: qparts (split_dp, BQ) | oparts (split_dpv, BQ) (the rows packed as
 *                    floats, then rounded into pairs in place) | kparts, vparts of 1 part
 *   | with ptx_medium: qrows (BQ, ldqa) | orows (BQ, ldva) | tbf (BK, BQ) bfloat16
 */
typedef struct {
    float *qt;     /* (D, BQ)   queries, pre-scaled, transposed */
    float *dot;    /* (Dv, BQ)  upstream gradient rows, transposed */
    float *st;     /* (BK, BQ)  scores, then P */
    float *dpt;    /* (BK, BQ)  dP, then dS */
    float *capped; /* (BK, BQ)  the scores right after the softcap */
    float *dqacc;  /* (BQ, ldqa) */
    float *lse;    /* (BQ) the block's lse; +inf in padding lanes (P = 0 there) */
    float *dvec;   /* (BQ) D = rowsum(dO ∘ O) */
    float *ones;   /* (BQ) */
    /* with plan.run, else NULL: the run's sums of the dK and dV rows of the
     * item's slice of keys, row j - c0 for key j */
    float *dkrun; /* (kslice, ldqa) */
    float *dvrun; /* (kslice, ldva) */
    /* with split_dp, else NULL: the block's queries and upstream gradient
     * split into bfloat16 pairs (kt->split_pairs), the item's keys and
     * values into rows (kt->split_rows), for kt->qk_split */
    uint32_t *qparts, *oparts;
    uint16_t *kparts, *vparts;
    /* with ptx_medium, else NULL: the block's queries and upstream gradient
     * (as given, unscaled) rounded into ptx_medium's pairs of rows, and a
     * tile (P, then dS) rounded to bfloat16 */
    uint32_t *qrows; /* (BQ, ldqa) floats, rounded in place into (BQ/2, ldqa) pairs */
    uint32_t *orows; /* (BQ, ldva) floats, the same */
    uint16_t *tbf;   /* (BK, BQ) */
} bwd_scratch;

attnx_status attnx_fwd_scratch_size(const attnx_problem *p, int64_t ldacc, int64_t split_dp,
                                    int acct, size_t *floats);
attnx_status attnx_bwd_scratch_size(const attnx_problem *p, const bwd_plan *plan, size_t *floats);
fwd_scratch attnx_fwd_scratch_at(float *base, const attnx_problem *p, int64_t ldacc,
                                 int64_t split_dp, int acct);
bwd_scratch attnx_bwd_scratch_at(float *base, const attnx_problem *p, const bwd_plan *plan);

/* n floats, 64-byte aligned, or NULL (out of memory, or n too large); freed
 * by attnx_free_floats (only: not free(), on Windows). */
float *attnx_alloc_floats(size_t n);
void attnx_free_floats(float *p);

/* Thread tid's scratch buffer of n floats, or NULL: tid 0 (the calling
 * thread) keeps its buffer between calls, so that a stream of small calls does
 * not pay for malloc and the page faults of fresh memory every time. */
float *attnx_scratch_take(int tid, size_t n);

/* A buffer of the calling thread of n floats or more, kept between calls
 * (and freed when the thread exits), one for each use: thread 0's scratch,
 * and the forward's parts of float32 on tiles (at most ATTNX_SPLIT_BYTES but
 * for a single larger head, whose pages a stream of calls would otherwise
 * fault in every call). NULL when out of memory. */
typedef enum { ATTNX_CALLER_SCRATCH, ATTNX_CALLER_PARTS, ATTNX_CALLER_USES } attnx_caller_use;
float *attnx_caller_buffer(attnx_caller_use use, size_t n);
void attnx_scratch_give_back(int tid, float *buf);

/* ---- one tile (tile.c) ------------------------------------------------------ */

/* Pack nq rows of x (rows x_sl apart, n wide) transposed into xt (n, BQ), times
 * scale, zero-padded to a whole vector. */
void attnx_pack_rows_t(const attnx_kernels *kt, const float *x, int64_t x_sl, int nq, int64_t n,
                       float scale, float *xt);

/* Scores of one tile, masked: st (nk, BQ) = scale · Q[i0 ..] · K[j0 ..]ᵀ, then
 * softcap, ALiBi, causal and window, and the mask, for queries i0 .. i0+nq-1
 * of head (b, h) and keys j0 .. j0+nk-1. qt holds the queries packed by
 * attnx_pack_rows_t; or, when rows is set (kt->qk_dot, for few queries), the
 * query rows (nq, D), and st is the decoding tile (nq, BK), a query's keys
 * contiguous. k: the tile's key rows (nk, D), k_sl apart. capped (nk, BQ),
 * when not NULL and the problem has a softcap: the scores right after the
 * softcap (for its backward). */
void attnx_score_tile(const attnx_run *r, const float *qt, int rows, const float *k, int64_t k_sl,
                      int64_t b, int64_t h, int64_t i0, int nq, int64_t j0, int nk, float *st,
                      float *capped);

/* The steps of attnx_score_tile after the products q·k in st, a tile in the
 * layout rows says; scaled: st holds the products times the whole scale
 * already (qk_bf16), else times the pre-scale (post_scale is then applied
 * here). */
void attnx_finish_tile(const attnx_run *r, int rows, int64_t b, int64_t h, int64_t i0, int nq,
                       int64_t j0, int nk, float *st, float *capped, int scaled);

/* The score of query i against key j of head (b, h), every step of
 * attnx_score_tile applied, in scalar code (-inf where it is not allowed). */
float attnx_score_one(const attnx_run *r, int64_t b, int64_t h, int64_t i, int64_t j);

/* ---- the forward's items (items.c, output.c) ---------------------------------- */
typedef struct {
    attnx_run run;
    fwd_plan plan;
    double *partial;  /* nsplit > 1: per item, its range's state (attnx_sum_state) */
    double *sums;     /* with long sums: each thread's two states */
    fwd_scratch *scr; /* one per thread */
    /* with split_dp, in slot x = parts_slot(b, hk): head (b, hk)'s key
     * parts (3, kp_rows, split_dp) at kparts + x·3·kp_rows·split_dp, and
     * kspecial[x]: whether its keys hold a value the split cannot take (its
     * tiles then take qk); with round_dk: its keys rounded (kp_rows,
     * round_dk) at kparts + x·kp_rows·round_dk, kspecial[x] if one rounded
     * to inf (qk then too) */
    uint16_t *kparts;
    unsigned char *kspecial;
    /* with split_pv: slot x's values split and transposed, (3, Dv, ldv) at
     * vparts + x·3·Dv·ldv, and vspecial[x]: whether its values hold a value
     * the split cannot take (P·V then on FMAs); with round_dk: its values
     * rounded (kp_rows, Dv) at vparts + x·kp_rows·Dv, vspecial[x] as kspecial */
    uint16_t *vparts;
    unsigned char *vspecial;
    /* slot x holds head bh's parts once ready[x] is bh + 1; done[x] counts
     * that head's finished items (forward.c, the pipeline) */
    atomic_llong ready[ATTNX_SPLIT_SLOTS], done[ATTNX_SPLIT_SLOTS];
    /* split-K with a mask: range s is keys [kbounds[s], kbounds[s + 1]), cut to
     * equal kept work (attnx_balanced_ranges), or NULL: s·kchunk on */
    int64_t *kbounds;
} fwd_job;

/* The slot of key/value head (b, hk)'s parts. */
static inline int64_t parts_slot(const fwd_job *jb, int64_t b, int64_t hk)
{
    return (b * jb->run.p->Hk + hk) % jb->plan.split_heads;
}

/* One item's place in the problem: queries i0 .. i0+rows-1 of head (b, h),
 * of which the first nq attend, to keys [kbeg, kend) of key/value head hk. */
typedef struct {
    int64_t b, h, hk, i0, kbeg, kend;
    int rows, nq;
    float *out; /* (rows, Dv) rows out.sl apart */
    float *w;   /* (rows, Lk) C-contiguous, or NULL */
} item_view;

item_view attnx_view_item(const fwd_job *jb, int64_t block);
void attnx_clear_unvisited(const fwd_job *jb, const item_view *it);

/* A block's softmax state in double (long sums), rows r of sum_rows:
 *   m (rows) | l (rows) | acc (rows, ldacc)
 * at `at`; m = -inf, l = 0, acc = 0 when nothing was folded in. */
typedef struct {
    double *m, *l, *acc;
} sum_state;

sum_state attnx_sum_state(const fwd_job *jb, double *at);
size_t attnx_sum_state_size(const fwd_plan *plan);
void attnx_sum_clear(const fwd_job *jb, sum_state t, int nq);
/* Fold nq rows of a float32 state (m, l, acc rows ldacc apart) into t. */
void attnx_sum_fold_f32(const fwd_job *jb, sum_state t, const float *m, const float *l,
                        const float *acc, int nq);
/* Fold nq rows of state x into t. */
void attnx_sum_fold(const fwd_job *jb, sum_state t, sum_state x, int nq);
/* Output rows (and lse) i0 .. i0+nq-1 of head (b, h) from state t, the sink
 * folded in first. */
void attnx_sum_write_rows(const fwd_job *jb, sum_state t, int64_t b, int64_t h, int64_t i0, int nq);

/* Range g's keys within [kbeg, kstop): [*from, *to), empty when *from >= *to. */
void attnx_range_keys(const fwd_job *jb, int64_t g, int64_t kbeg, int64_t kstop, int64_t *from,
                      int64_t *to);

/* The online softmax over keys [kbeg, kstop): the output rows, or with part
 * set (split-K, long sums) the range's state that attnx_merge_partials folds. */
void attnx_online_item(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int64_t kbeg,
                       int64_t kstop, double *part);

/* need_weights: the exact probabilities into it->w, and the output rows. */
void attnx_weights_item(const fwd_job *jb, const fwd_scratch *s, const item_view *it);

/* The head's sink logit, if the problem has sinks, joined to each row's m, l
 * and accumulator (before attnx_write_rows, or before the weights' pass 2). */
void attnx_fold_sinks(const fwd_job *jb, const fwd_scratch *s, const item_view *it);

/* Output rows i0 .. i0+nq-1 of head (b, h) from the accumulator in s (and
 * their lse): acc / l when normalise is set, else acc as it is. */
void attnx_write_rows(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int normalise);

/* lse of row i of head (b, h), if the caller asked for it. */
void attnx_write_lse(const attnx_problem *p, int64_t b, int64_t h, int64_t i, float value);

/* Split-K: the partial softmaxes of every block combined into its rows. */
void attnx_merge_partials(const fwd_job *jb);

/* ---- threads (threads.c) ---------------------------------------------------- */

/* Record the threads of this thread's call (attnx_last_threads). */
void attnx_note_threads(int n);

/* Run fn(arg, tid) for tid = 0 .. n-1 concurrently and wait. */
void attnx_parallel(int n, void (*fn)(void *arg, int tid), void *arg);

/* item(arg, tid, i) for every i in [0, n_items), over nt threads that take
 * the next item from a shared counter, in order: an item may wait for one
 * taken before it (attnx_wait_for), which a running thread holds. */
void attnx_parallel_items(int nt, int64_t n_items, void (*item)(void *arg, int tid, int64_t i),
                          void *arg);

/* Wait, spinning and then yielding, until *x reads want (acquire). */
void attnx_wait_for(atomic_llong *x, long long want);

#endif

/* The forward's items. An item is one block of BQ queries of one head (b, h)
 * against one range of keys. Its queries are packed once (scaled,
 * transposed), then the keys are visited in tiles of BK: scores, masks,
 * online softmax (running max and sum, rescale), and the weighted sum of
 * values, all in the thread's scratch, which stays in cache; the output is
 * normalised once at the end (output.c). The Lq×Lk matrix is never built
 * unless the caller asked for the weights, which are then produced by a
 * second pass over the keys with the final max and sum (exact, not rescaled).
 *
 * Causal masks and key lengths shorten the range of keys visited (whole
 * tiles are skipped); only tiles on the diagonal are masked element by
 * element. So does a mask's block map (blockmap.c): a tile it empties is
 * skipped, one it keeps whole is not masked (the weights' passes visit
 * every tile: they write every weight). */
#include <math.h>
#include <string.h>

#include "core/core.h"

item_view attnx_view_item(const fwd_job *jb, int64_t block)
{
    const attnx_problem *p = jb->run.p;
    item_view it;
    const int64_t qb = block % jb->plan.nqb, bh = block / jb->plan.nqb;
    it.h = bh % p->Hq;
    it.b = bh / p->Hq;
    it.hk = kv_head(p, it.h);
    it.i0 = qb * BQ;
    it.rows = (int)min64(BQ, p->Lq - it.i0);
    const head_bounds hb = bounds_of(p, it.b, it.h);
    it.nq = rows_attending(&hb, it.i0, it.rows);
    it.kend = keys_end(&hb, it.i0, it.nq);
    it.kbeg = min64(keys_begin(&hb, it.i0), it.kend);
    it.out = p->out.data + it.b * p->out.sb + it.h * p->out.sh + it.i0 * p->out.sl;
    it.w = p->weights ? p->weights + ((it.b * p->Hq + it.h) * p->Lq + it.i0) * p->Lk : NULL;
    return it;
}

/* Zero what no tile writes: weights of keys outside [kbeg, kend) and of rows
 * past nq; output rows past nq (their lse is -inf). */
void attnx_clear_unvisited(const fwd_job *jb, const item_view *it)
{
    const attnx_problem *p = jb->run.p;
    if (it->w)
        for (int i = 0; i < it->rows; i++) {
            const int64_t from = i < it->nq ? it->kend : 0, upto = i < it->nq ? it->kbeg : 0;
            memset(it->w + i * p->Lk, 0, sizeof(float) * (size_t)upto);
            memset(it->w + i * p->Lk + from, 0, sizeof(float) * (size_t)(p->Lk - from));
        }
    for (int i = it->nq; i < it->rows; i++) {
        memset(it->out + i * p->out.sl, 0, sizeof(float) * (size_t)p->Dv);
        attnx_write_lse(p, it->b, it->h, it->i0 + i, -INFINITY);
    }
}

/* Few queries (decoding) take qk_dot, which reads them as rows (not where
 * every block takes the tiles: a "medium" call's last, short block). */
static int rows_layout(const fwd_job *jb, int nq)
{
    return nq <= jb->run.kt->dot_max_nq && !jb->run.tiles_only;
}

/* The words of a row of "medium" decoding's query pairs: D rounded up to 32, halved. */
static int64_t row_pairs(const attnx_problem *p) { return (p->D + 31) / 32 * 16; }

/* Keys from j up to end that lie in j's page (all of them without pages). */
static int64_t page_run(const attnx_problem *p, int64_t j, int64_t end)
{
    return p->pages.table ? min64(end - j, p->pages.size - j % p->pages.size) : end - j;
}

/* A run of "medium" decoding's cache rows within one page: keys (values)
 * at .. at+n-1 of the item's head, their row stride, their scales (int8:
 * the address and stride; 16-bit rows: NULL) and their kind (attnx_medium_rows). */
typedef struct {
    const void *rows;
    const float *scale;
    int64_t sl, s_sl, n;
    int kind;
} medium_run;

/* The run of the item's key (values = 0) or value (1) cache from row j, up
 * to row end or the end of j's page. */
static medium_run medium_run_at(const attnx_problem *p, const item_view *it, int values, int64_t j,
                                int64_t end)
{
    medium_run r = {NULL, NULL, 0, 0, page_run(p, j, end), ATTNX_MEDIUM_BF16};
    if (p->k8.data) {
        const attnx_i8_tensor *t = values ? &p->v8 : &p->k8;
        r.rows = i8_row_at(p, t, it->b, it->hk, j, &r.scale);
        r.sl = t->sl;
        r.s_sl = t->ssl;
        r.kind = ATTNX_MEDIUM_I8;
        return r;
    }
    const attnx_half_tensor *t = values ? &p->v16 : &p->k16;
    r.rows = t->data + kv_offset(p, t->sb, t->sh, t->sl, it->b, it->hk, j);
    r.sl = t->sl;
    if (p->half_format == ATTNX_HALF_F16) r.kind = ATTNX_MEDIUM_F16;
    return r;
}

/* How an item's queries are packed, and so which kernel takes its scores. */
typedef enum {
    QUERIES_FLOAT,    /* qk (or qk_dot) */
    QUERIES_PAIRS,    /* qk_bf16 */
    QUERIES_SPLIT,    /* qk_split */
    QUERIES_ROW_PAIRS /* qk_dot_medium */
} query_packing;

/* Pack the item's queries: with the bfloat16 dot products (a block of
 * bfloat16 queries against bfloat16 keys, not decoding; or under "medium"
 * any queries, rounded, against the head's rounded keys) as bfloat16 pairs
 * qt2 (ceil(D/2), BQ), unscaled, in s->qt (not where a query would round
 * to an inf: attnx_rows_overflow_bf16); else pre-scaled, for few queries
 * as rows qr (nq, D), else transposed qt (D, BQ), zero-padded to a whole
 * vector, and with split_dp then split into s->qparts too, unless the
 * queries or the head's keys hold a value the split cannot take. */
static query_packing pack_queries(const fwd_job *jb, const fwd_scratch *s, const item_view *it)
{
    const attnx_problem *p = jb->run.p;
    const float *q = p->q.data + it->b * p->q.sb + it->h * p->q.sh + it->i0 * p->q.sl;
    if (!rows_layout(jb, it->nq)) {
        if (jb->run.bf16_dots &&
            attnx_pack_qt_bf16(q, p->q.sl, it->nq, p->D, (uint32_t *)s->qt, BQ))
            return QUERIES_PAIRS;
        if (jb->run.round_dk && !jb->kspecial[parts_slot(jb, it->b, it->hk)] &&
            !attnx_rows_overflow_bf16(q, p->q.sl, it->nq, p->D)) {
            jb->run.kt->pack_qt(q, p->q.sl, it->nq, p->D, 1.0f, s->qt, BQ); /* exact */
            jb->run.kt->round_pairs(s->qt, BQ, it->nq, p->D);
            return QUERIES_PAIRS;
        }
        attnx_pack_rows_t(jb->run.kt, q, p->q.sl, it->nq, p->D, jb->run.pre_scale, s->qt);
        const int64_t dp = jb->run.split_dp;
        if (dp && !jb->kspecial[parts_slot(jb, it->b, it->hk)] &&
            !jb->run.kt->split_pairs(s->qt, BQ, it->nq, p->D, dp, s->qparts, dp / 2 * BQ))
            return QUERIES_SPLIT;
        return QUERIES_FLOAT;
    }
    /* "medium" decoding: unscaled, rounded into rows of pairs (kernels.h), but
     * as floats where a finite value rounds to inf */
    if (jb->run.dot_medium &&
        !jb->run.kt->round_rows(q, p->q.sl, it->nq, p->D, (uint16_t *)s->qt, row_pairs(p) * 2))
        return QUERIES_ROW_PAIRS;
    for (int i = 0; i < it->nq; i++)
        for (int64_t d = 0; d < p->D; d++)
            s->qt[i * p->D + d] = jb->run.pre_scale * q[i * p->q.sl + d];
    return QUERIES_FLOAT;
}

/* Where an item's P·V goes: rows of s->acc (pv, pv_half), or on AMX's
 * tiles into the transposed accumulator s->acct, with pv_bf16 (under
 * "medium" pv_medium, AVX512_BF16's too) over bfloat16 values or pv_split
 * over the head's value parts. */
typedef enum { VALUES_ROWS, VALUES_BF16_TILES, VALUES_SPLIT_TILES } value_path;

/* How an item's tiles are computed: the scores by the queries' packing,
 * P·V by its value path (tiles: not VALUES_ROWS). */
typedef struct {
    query_packing queries;
    value_path values;
    int tiles;
} item_path;

/* The item's float32 state emptied: max -inf, sum 0, accumulator 0 (and acct
 * when the tiles sum into it). */
static void clear_rows(const fwd_job *jb, const fwd_scratch *s, const item_view *it,
                       const item_path *path)
{
    for (int i = 0; i < BQ; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
    }
    /* acc too when the tiles sum into acct: the weights' pass 1 folds the
     * sinks into it before pass 2 recomputes it */
    memset(s->acc, 0, sizeof(float) * (size_t)it->nq * (size_t)jb->plan.ldacc);
    if (path->tiles) memset(s->acct, 0, sizeof(float) * (size_t)jb->run.p->Dv * BQ);
}

static item_path start_rows(const fwd_job *jb, const fwd_scratch *s, const item_view *it)
{
    item_path path;
    path.queries = pack_queries(jb, s, it);
    path.values = VALUES_ROWS;
    if (path.queries == QUERIES_PAIRS && jb->run.pv_tiles &&
        !(jb->run.round_dk && jb->vspecial[parts_slot(jb, it->b, it->hk)]))
        path.values = VALUES_BF16_TILES;
    else if (jb->run.split_pv && !rows_layout(jb, it->nq) &&
             !jb->vspecial[parts_slot(jb, it->b, it->hk)])
        path.values = VALUES_SPLIT_TILES;
    path.tiles = path.values != VALUES_ROWS;
    clear_rows(jb, s, it, &path);
    return path;
}

/* The accumulator in rows (s->acc) once the keys are done: s->acct
 * transposed back when the tiles summed into it (pack_qt's transpose, at
 * scale 1: exact). */
static void finish_values(const fwd_job *jb, const fwd_scratch *s, const item_view *it,
                          const item_path *path)
{
    if (path->tiles)
        jb->run.kt->pack_qt(s->acct, BQ, (int)jb->run.p->Dv, it->nq, 1.0f, s->acc, jb->plan.ldacc);
}

/* Row j0 of the item's key/value head in a 16-bit tensor (not NULL). */
static const uint16_t *half_rows_at(const attnx_problem *p, const attnx_half_tensor *t,
                                    const item_view *it, int64_t j0)
{
    return t->data + kv_offset(p, t->sb, t->sh, t->sl, it->b, it->hk, j0);
}

/* Row j0 of the bfloat16 keys (values = 0) or values (1) of the item's head,
 * and their row stride: the head's rounded rows under "medium" (round_dk),
 * else the bfloat16 tensor's. */
static const uint16_t *bf16_rows_at(const fwd_job *jb, const item_view *it, int values, int64_t j0,
                                    int64_t *sl)
{
    const attnx_problem *p = jb->run.p;
    if (jb->run.round_dk) {
        const int64_t x = parts_slot(jb, it->b, it->hk), rows = jb->plan.kp_rows;
        *sl = values ? p->Dv : jb->run.round_dk;
        return (values ? jb->vparts : jb->kparts) + (x * rows + j0) * *sl;
    }
    const attnx_half_tensor *t = values ? &p->v16 : &p->k16;
    *sl = t->sl;
    return half_rows_at(p, t, it, j0);
}

/* Scores of keys j0 .. j0+nk-1 into s->st, by the queries' packing: pairs
 * (s->qt) for qk_bf16, which reads the bfloat16 keys in place (or the
 * head's rounded keys); split (s->qparts) for qk_split, which reads the
 * head's key parts. */
static void scores(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int64_t j0, int nk,
                   query_packing queries)
{
    const attnx_problem *p = jb->run.p;
    const attnx_half_tensor *k16 = &p->k16;
    if (queries == QUERIES_SPLIT) {
        const int64_t dp = jb->run.split_dp, part = jb->plan.kp_rows * dp;
        const uint16_t *kp = jb->kparts + parts_slot(jb, it->b, it->hk) * 3 * part + j0 * dp;
        jb->run.kt->qk_split(s->qparts, BQ, it->nq, kp, part, nk, dp, s->st);
        attnx_finish_tile(&jb->run, 0, it->b, it->h, it->i0, it->nq, j0, nk, s->st, NULL, 0);
        return;
    }
    if (queries == QUERIES_PAIRS) {
        int64_t k_sl;
        const uint16_t *k = bf16_rows_at(jb, it, 0, j0, &k_sl);
        jb->run.kt->qk_bf16((const uint32_t *)s->qt, BQ, it->nq, k, k_sl, nk, p->D, p->scale,
                            s->st);
        attnx_finish_tile(&jb->run, 0, it->b, it->h, it->i0, it->nq, j0, nk, s->st, NULL, 1);
        return;
    }
    if (queries == QUERIES_ROW_PAIRS) { /* "medium" decoding: a page's keys at a time */
        medium_run r;
        for (int64_t j = j0; j < j0 + nk; j += r.n) {
            r = medium_run_at(p, it, 0, j, j0 + nk);
            jb->run.kt->qk_dot_medium(r.kind, (const uint32_t *)s->qt, row_pairs(p), it->nq, r.rows,
                                      r.sl, r.scale, r.s_sl, (int)r.n, p->D, p->scale,
                                      s->st + (j - j0), BK);
        }
        attnx_finish_tile(&jb->run, 1, it->b, it->h, it->i0, it->nq, j0, nk, s->st, NULL, 1);
        return;
    }
    if (p->k8.data && rows_layout(jb, it->nq) && in_one_page(p, j0, nk)) {
        /* decoding an int8 cache: converted in registers, the scales after the sums */
        const float *sc;
        const int8_t *k = i8_row_at(p, &p->k8, it->b, it->hk, j0, &sc);
        jb->run.kt->qk_dot_i8(s->qt, p->D, it->nq, k, p->k8.sl, sc, p->k8.ssl, nk, s->st, BK);
        attnx_finish_tile(&jb->run, 1, it->b, it->h, it->i0, it->nq, j0, nk, s->st, NULL, 0);
        return;
    }
    if (k16->data && rows_layout(jb, it->nq) && in_one_page(p, j0, nk)) {
        /* decoding a half cache: convert in registers */
        jb->run.kt->qk_dot_half(p->half_format, s->qt, p->D, it->nq, half_rows_at(p, k16, it, j0),
                                k16->sl, nk, s->st, BK);
        attnx_finish_tile(&jb->run, 1, it->b, it->h, it->i0, it->nq, j0, nk, s->st, NULL, 0);
        return;
    }
    int64_t k_sl;
    const float *k = attnx_kv_rows(&jb->run, 0, it->b, it->hk, j0, nk, s->kbuf, &k_sl);
    attnx_score_tile(&jb->run, s->qt, rows_layout(jb, it->nq), k, k_sl, it->b, it->h, it->i0,
                     it->nq, j0, nk, s->st, NULL);
}

/* acc = alpha · acc + P · V over the tile's values (alpha NULL: no rescale).
 * On tiles (path->tiles: AMX) into acct with pv_bf16 or pv_split. 16-bit values are
 * converted in registers as pv_half reads them (the same bits as pv on rows
 * converted by half_rows) when decoding, and on the bfloat16 dot path where
 * the kernels say so (pv_half_tiles: vdpbf16ps on Zen). AVX2's float16
 * conversion in registers is slower: other tiles keep the pass. */
static void add_values(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int64_t j0,
                       int nk, const float *alpha, const item_path *path)
{
    const attnx_problem *p = jb->run.p;
    if (path->values == VALUES_SPLIT_TILES) {
        const int64_t ldv = jb->plan.ldv, part = p->Dv * ldv;
        const uint16_t *vt = jb->vparts + parts_slot(jb, it->b, it->hk) * 3 * part + j0;
        jb->run.kt->pv_split(s->st, BQ, it->nq, vt, ldv, part, nk, p->Dv, alpha, s->acct,
                             s->pv_work);
        return;
    }
    if (path->values == VALUES_BF16_TILES) {
        int64_t v_sl;
        const uint16_t *v = bf16_rows_at(jb, it, 1, j0, &v_sl);
        (jb->run.pv_medium ? jb->run.kt->pv_medium : jb->run.kt->pv_bf16)(
            s->st, BQ, it->nq, v, v_sl, nk, p->Dv, alpha, s->acct, s->pv_work);
        return;
    }
    const int rows = rows_layout(jb, it->nq);
    const int64_t s_key = rows ? 1 : BQ, s_row = rows ? BK : 1; /* the tile's layout */
    if (rows && jb->run.dot_medium_pv) { /* "medium" decoding: a page's values at a time */
        medium_run r;
        for (int64_t j = j0; j < j0 + nk; j += r.n) {
            r = medium_run_at(p, it, 1, j, j0 + nk);
            jb->run.kt->pv_rows_medium(r.kind, s->st + (j - j0), BK, it->nq, r.rows, r.sl, r.scale,
                                       r.s_sl, (int)r.n, p->Dv, j == j0 ? alpha : NULL, s->acc,
                                       jb->plan.ldacc);
        }
        return;
    }
    if (p->v8.data && rows && in_one_page(p, j0, nk)) {
        const float *sc;
        const int8_t *v = i8_row_at(p, &p->v8, it->b, it->hk, j0, &sc);
        jb->run.kt->pv_i8(s->st, s_key, s_row, it->nq, v, p->v8.sl, sc, p->v8.ssl, nk, p->Dv, alpha,
                          s->acc, jb->plan.ldacc);
        return;
    }
    if (p->v16.data && (rows || (jb->run.bf16_dots && jb->run.kt->pv_half_tiles)) &&
        in_one_page(p, j0, nk)) {
        const attnx_half_tensor *v = &p->v16;
        jb->run.kt->pv_half(p->half_format, s->st, s_key, s_row, it->nq, half_rows_at(p, v, it, j0),
                            v->sl, nk, p->Dv, alpha, s->acc, jb->plan.ldacc);
        return;
    }
    int64_t v_sl;
    const float *v = attnx_kv_rows(&jb->run, 1, it->b, it->hk, j0, nk, s->vbuf, &v_sl);
    jb->run.kt->pv(s->st, s_key, s_row, it->nq, v, v_sl, nk, jb->run.p->Dv, alpha, s->acc,
                   jb->plan.ldacc);
}

/* The online softmax of a tile, in its layout. */
static void softmax_tile(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int nk)
{
    if (rows_layout(jb, it->nq))
        jb->run.kt->softmax_rows(s->st, BK, it->nq, nk, s->m, s->l, s->alpha);
    else
        jb->run.kt->softmax_online(s->st, BQ, it->nq, nk, s->m, s->l, s->alpha);
}

/* The end of key j's chunk of long sums (core.h), or kstop if sooner. */
static int64_t chunk_end(const fwd_job *jb, int64_t j, int64_t kstop)
{
    return jb->plan.sums ? min64(kstop, (j / SUM_KEYS + 1) * SUM_KEYS) : kstop;
}

/* The online softmax over keys [kbeg, kstop) into the float32 state of s
 * (emptied first unless fresh: start_rows has just emptied it). */
static void online_keys(const fwd_job *jb, const fwd_scratch *s, const item_view *it,
                        const item_path *path, int64_t kbeg, int64_t kstop, int fresh)
{
    if (!fresh) clear_rows(jb, s, it, path);
    /* tiles of keys the mask keeps: what it empties adds nothing to the rows */
    int nk;
    for (int64_t j0 = kbeg;
         (j0 = attnx_next_tile(&jb->run, it->b, it->h, it->i0, it->nq, j0, kstop, &nk)) < kstop;
         j0 += nk) {
        scores(jb, s, it, j0, nk, path->queries);
        softmax_tile(jb, s, it, nk);
        add_values(jb, s, it, j0, nk, s->alpha, path);
    }
    finish_values(jb, s, it, path);
}

/* Long sums: keys [kbeg, kstop) of one range, chunk by chunk, each chunk's
 * float32 state folded into r (emptied first). */
static void range_state(const fwd_job *jb, const fwd_scratch *s, const item_view *it,
                        const item_path *path, int64_t kbeg, int64_t kstop, sum_state r)
{
    attnx_sum_clear(jb, r, it->nq);
    for (int64_t c0 = kbeg, c1; c0 < kstop; c0 = c1) {
        c1 = chunk_end(jb, c0, kstop);
        online_keys(jb, s, it, path, c0, c1, 0);
        attnx_sum_fold_f32(jb, r, s->m, s->l, s->acc, it->nq);
    }
}

/* Range g's keys: [kbounds[g], kbounds[g + 1]) or g·kchunk on, within [kbeg, kstop). */
void attnx_range_keys(const fwd_job *jb, int64_t g, int64_t kbeg, int64_t kstop, int64_t *from,
                      int64_t *to)
{
    const int64_t *kb = jb->kbounds;
    *from = max64(kbeg, kb ? kb[g] : g * jb->plan.kchunk);
    *to = min64(kstop, kb ? kb[g + 1] : (g + 1) * jb->plan.kchunk);
}

void attnx_online_item(const fwd_job *jb, const fwd_scratch *s, const item_view *it, int64_t kbeg,
                       int64_t kstop, double *part)
{
    const item_path path = start_rows(jb, s, it);
    if (part) { /* split-K: one range's state */
        range_state(jb, s, it, &path, kbeg, kstop, attnx_sum_state(jb, part));
        return;
    }
    if (!jb->plan.sums) { /* one float32 sum */
        online_keys(jb, s, it, &path, kbeg, kstop, 1);
        attnx_fold_sinks(jb, s, it);
        attnx_write_rows(jb, s, it, 1);
        return;
    }
    /* every range in turn, folded into the first in key order, as
     * attnx_merge_partials folds split-K's (the same bits) */
    const sum_state t = attnx_sum_state(jb, s->sums);
    const sum_state r = attnx_sum_state(jb, s->sums + attnx_sum_state_size(&jb->plan));
    for (int64_t g = 0; g < jb->plan.nranges; g++) {
        int64_t from, to;
        attnx_range_keys(jb, g, kbeg, kstop, &from, &to);
        if (g == 0)
            range_state(jb, s, it, &path, from, to, t);
        else if (from < to) {
            range_state(jb, s, it, &path, from, to, r);
            attnx_sum_fold(jb, t, r, it->nq);
        }
    }
    attnx_sum_write_rows(jb, t, it->b, it->h, it->i0, it->nq);
}

/* need_weights, pass 1: each row's max and sum; s->alpha becomes 1 / sum.
 * With long sums, each chunk's max and sum folded into a double state
 * (attnx_sum_fold_f32; the accumulator, zeros here, unused). Returns start_rows' answer, for
 * pass 2. */
static item_path weights_stats(const fwd_job *jb, const fwd_scratch *s, const item_view *it)
{
    const item_path path = start_rows(jb, s, it);
    const sum_state t = attnx_sum_state(jb, s->sums);
    if (jb->plan.sums) attnx_sum_clear(jb, t, it->nq);
    for (int64_t c0 = it->kbeg, c1; c0 < it->kend; c0 = c1) {
        c1 = chunk_end(jb, c0, it->kend);
        if (c0 > it->kbeg) clear_rows(jb, s, it, &path); /* start_rows emptied it first */
        for (int64_t j0 = c0; j0 < c1; j0 += BK) {
            const int nk = (int)min64(BK, c1 - j0);
            scores(jb, s, it, j0, nk, path.queries);
            softmax_tile(jb, s, it, nk);
        }
        if (!jb->plan.sums) break;                             /* one chunk */
        attnx_sum_fold_f32(jb, t, s->m, s->l, s->acc, it->nq); /* acc: zeros, unused */
    }
    if (jb->plan.sums)
        for (int i = 0; i < it->nq; i++) { /* the max is a score: exact in float32 */
            s->m[i] = (float)t.m[i];
            s->l[i] = (float)t.l[i];
        }
    attnx_fold_sinks(jb, s, it);
    for (int i = 0; i < BQ; i++) /* a NaN sum gives a NaN inverse: it propagates */
        s->alpha[i] = (i < it->nq && s->l[i] != 0.0f) ? 1.0f / s->l[i] : 0.0f;
    return path;
}

/* need_weights, pass 2: the exact probabilities, written out and summed
 * into the output rows (with long sums, a chunk's sum added to a double
 * row, then the rows rounded back into s->acc). */
void attnx_weights_item(const fwd_job *jb, const fwd_scratch *s, const item_view *it)
{
    const attnx_problem *p = jb->run.p;
    const attnx_kernels *kt = jb->run.kt;
    const int nq = it->nq;
    const int64_t ldacc = jb->plan.ldacc;
    const item_path path = weights_stats(jb, s, it);
    double *sum = s->sums; /* (nq, ldacc) with long sums */
    if (jb->plan.sums) memset(sum, 0, sizeof(double) * (size_t)nq * (size_t)ldacc);
    for (int64_t c0 = it->kbeg, c1; c0 < it->kend; c0 = c1) {
        c1 = chunk_end(jb, c0, it->kend);
        if (c0 > it->kbeg) { /* long sums: the accumulator starts again */
            memset(s->acc, 0, sizeof(float) * (size_t)nq * (size_t)ldacc);
            if (path.tiles) memset(s->acct, 0, sizeof(float) * (size_t)p->Dv * BQ);
        }
        for (int64_t j0 = c0; j0 < c1; j0 += BK) {
            const int nk = (int)min64(BK, c1 - j0);
            scores(jb, s, it, j0, nk, path.queries);
            if (rows_layout(jb, nq)) {
                kt->softmax_rows_final(s->st, BK, nq, nk, s->m, s->alpha);
                for (int i = 0; i < nq; i++)
                    memcpy(it->w + i * p->Lk + j0, s->st + i * BK, sizeof(float) * (size_t)nk);
            } else {
                kt->softmax_final(s->st, BQ, nq, nk, s->m, s->alpha);
                for (int i = 0; i < nq; i++) /* transpose: contiguous stores, reads in L1 */
                    for (int j = 0; j < nk; j++) it->w[i * p->Lk + j0 + j] = s->st[j * BQ + i];
            }
            add_values(jb, s, it, j0, nk, NULL, &path);
        }
        finish_values(jb, s, it, &path);
        if (jb->plan.sums)
            for (int i = 0; i < nq; i++)
                for (int64_t d = 0; d < p->Dv; d++) sum[i * ldacc + d] += s->acc[i * ldacc + d];
    }
    if (jb->plan.sums)
        for (int i = 0; i < nq; i++)
            for (int64_t d = 0; d < p->Dv; d++) s->acc[i * ldacc + d] = (float)sum[i * ldacc + d];
    attnx_write_rows(jb, s, it, 0);
    for (int i = 0; i < nq; i++)
        if (s->l[i] != s->l[i]) /* a NaN row is NaN throughout, skipped keys too */
            for (int64_t j = 0; j < p->Lk; j++) it->w[i * p->Lk + j] = NAN;
}

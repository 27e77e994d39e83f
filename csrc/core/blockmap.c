/* Block maps of masks: which tiles of a mask keep nothing, drop nothing, or
 * both, so that the passes skip the first (no products, no softmax, no reads
 * of K or V) and apply no mask to the second.
 *
 * A map covers the mask (B, Hq, Lq, Lk) in blocks of ATTNX_MAP_ROWS query
 * rows by ATTNX_MAP_KEYS keys, one byte a block, the OR of its entries'
 * flags:
 *   ATTNX_MAP_KEEP  some entry keeps its key   (bool: nonzero; float: not -inf)
 *   ATTNX_MAP_DROP  some entry changes a score (bool: zero;    float: not 0)
 * A tile is empty when no block it meets keeps, full when none drops. Axes a
 * mask is broadcast along (stride 0) have one block: a mask shared by heads
 * (or batch, or queries) is read once. Reading is the one pass over the
 * mask's bytes, row by row, each block's scan stopping once it holds both
 * flags; it allocates nothing of Lq×Lk.
 *
 * The map only removes work the mask makes void: an empty tile's scores
 * would all be -inf (its rows' sums gain exactly 0), a full tile's mask
 * leaves every score as it is. A float mask's -inf added to an inf or NaN
 * score is NaN, which reaches its row: with float masks the map is used only
 * when every query and key is finite (float32 arrays, checked once a call),
 * so the results are those of the whole square in every case. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

/* The flags of n entries of a bool mask, `sk` bytes apart. */
static int flags_bool(const unsigned char *x, int64_t sk, int64_t n)
{
    unsigned any = 0, all = 1;
    if (sk == 1)
        for (int64_t j = 0; j < n; j++) { /* vectorised by the compiler */
            any |= x[j];
            all &= x[j] != 0;
        }
    else
        for (int64_t j = 0; j < n; j++) {
            any |= x[j * sk];
            all &= x[j * sk] != 0;
        }
    return (any ? ATTNX_MAP_KEEP : 0) | (all ? 0 : ATTNX_MAP_DROP);
}

/* The flags of n entries of a float mask, `sk` floats apart. */
static int flags_float(const float *x, int64_t sk, int64_t n)
{
    int keep = 0, drop = 0;
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j * sk];
        keep |= !(v == -INFINITY);
        drop |= !(v == 0.0f);
    }
    return (keep ? ATTNX_MAP_KEEP : 0) | (drop ? ATTNX_MAP_DROP : 0);
}

int64_t attnx_map_extent(int64_t stride, int64_t n, int64_t per_block)
{
    return stride == 0 || n == 0 ? 1 : (n + per_block - 1) / per_block;
}

/* One row of blocks of the map: query rows [i0, i0 + rows) of the mask at
 * `at` (element offset of (b, h, i0, 0)) into out (nkb). */
static void classify_rows(const attnx_mask *m, int64_t at, int64_t rows, int64_t Lk, uint8_t *out)
{
    const int64_t nkb = attnx_map_extent(1, Lk, ATTNX_MAP_KEYS);
    memset(out, 0, (size_t)nkb);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t kb = 0; kb < nkb; kb++) {
            if (out[kb] == (ATTNX_MAP_KEEP | ATTNX_MAP_DROP)) continue;
            const int64_t j0 = kb * ATTNX_MAP_KEYS, n = min64(ATTNX_MAP_KEYS, Lk - j0);
            const int64_t e = at + i * m->sq + j0 * m->sk;
            out[kb] |= (uint8_t)(m->kind == ATTNX_MASK_BOOL
                                     ? flags_bool((const unsigned char *)m->data + e, m->sk, n)
                                     : flags_float((const float *)m->data + e, m->sk, n));
        }
}

typedef struct {
    const attnx_mask *m;
    int64_t Lq, Lk, nh, nq, nkb;
    uint8_t *out;
} classify_job;

static void classify_item(void *arg, int tid, int64_t item)
{
    (void)tid;
    const classify_job *cj = arg;
    const attnx_mask *m = cj->m;
    const int64_t qb = item % cj->nq, h = item / cj->nq % cj->nh, b = item / cj->nq / cj->nh;
    const int64_t i0 = qb * ATTNX_MAP_ROWS;
    const int64_t rows = m->sq == 0 ? min64(1, cj->Lq) : min64(ATTNX_MAP_ROWS, cj->Lq - i0);
    classify_rows(m, b * m->sb + h * m->sh + i0 * m->sq, rows, cj->Lk, cj->out + item * cj->nkb);
}

void attnx_map_dims(const attnx_mask *m, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                    int64_t dims[4])
{
    dims[0] = m->sb ? B : 1;
    dims[1] = m->sh ? H : 1;
    dims[2] = attnx_map_extent(m->sq, Lq, ATTNX_MAP_ROWS);
    dims[3] = attnx_map_extent(1, Lk, ATTNX_MAP_KEYS);
}

void attnx_classify_mask(const attnx_mask *m, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                         uint8_t *out, int num_threads)
{
    int64_t d[4];
    attnx_map_dims(m, B, H, Lq, Lk, d);
    if (B == 0 || H == 0 || Lq == 0 || Lk == 0) {
        memset(out, 0, (size_t)(d[0] * d[1] * d[2] * d[3]));
        return;
    }
    classify_job cj = {.m = m, .Lq = Lq, .Lk = Lk, .nh = d[1], .nq = d[2], .nkb = d[3], .out = out};
    const int64_t items = d[0] * d[1] * d[2];
    int nt = num_threads > 0 ? num_threads : attnx_get_num_threads();
    /* a thread a few MiB of mask at least */
    const double bytes = (double)items * ATTNX_MAP_ROWS * (double)Lk;
    if (bytes < 4e6 * nt) nt = (int)(bytes / 4e6) + 1;
    if (nt > items) nt = (int)items;
    attnx_parallel_items(nt < 1 ? 1 : nt, items, classify_item, &cj);
}

/* Whether every query and key is finite (float32 queries and keys in
 * arrays only; 0 for the others): x * 0 is NaN exactly for inf and NaN. */
static int rows_finite(const attnx_tensor *t, int64_t B, int64_t H, int64_t L, int64_t D)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t l = 0; l < L; l++) {
                const float *x = t->data + b * t->sb + h * t->sh + l * t->sl;
                float z = 0.0f;
                for (int64_t e = 0; e < D; e++) z += x[e] * 0.0f;
                if (z != 0.0f) return 0;
            }
    return 1;
}

static int inputs_finite(const attnx_problem *p)
{
    if (p->k16.data || p->k8.data || p->pages.table) return 0;
    return rows_finite(&p->q, p->B, p->Hq, p->Lq, p->D) &&
           rows_finite(&p->k, p->B, p->Hk, p->Lk, p->D);
}

attnx_status attnx_run_map(attnx_run *r, int num_threads, uint8_t **owned)
{
    const attnx_problem *p = r->p;
    *owned = NULL;
    r->map = NULL;
    if (p->mask.kind == ATTNX_MASK_NONE || p->Lq == 0 || p->Lk == 0) return ATTNX_OK;
    /* a float mask's -inf added to a score that is inf or NaN gives NaN, which
     * reaches its row: with such inputs every tile is computed and masked */
    if (p->mask.kind == ATTNX_MASK_FLOAT && !inputs_finite(p)) return ATTNX_OK;
    int64_t d[4];
    attnx_map_dims(&p->mask, p->B, p->Hq, p->Lq, p->Lk, d);
    const attnx_block_map *given = &p->mask_map;
    if (given->data && given->nb == d[0] && given->nh == d[1] && given->nq == d[2] &&
        given->nkb == d[3]) {
        r->map = given->data;
        r->map_sb = d[0] > 1 ? given->sb : 0;
        r->map_sh = d[1] > 1 ? given->sh : 0;
        r->map_sq = d[2] > 1 ? given->sq : 0;
        return ATTNX_OK;
    }
    size_t n;
    if (!mul_ok((size_t)(d[0] * d[1]), (size_t)(d[2] * d[3]), &n)) return ATTNX_ERR_OVERFLOW;
    uint8_t *map = malloc(n ? n : 1);
    if (!map) return ATTNX_ERR_NOMEM;
    attnx_classify_mask(&p->mask, p->B, p->Hq, p->Lq, p->Lk, map, num_threads);
    r->map = map;
    r->map_sq = d[2] > 1 ? d[3] : 0;
    r->map_sh = d[1] > 1 ? d[2] * d[3] : 0;
    r->map_sb = d[0] > 1 ? d[1] * d[2] * d[3] : 0;
    *owned = map;
    return ATTNX_OK;
}

/* The OR of the map's flags over the query blocks that rows [i0, i0 + nq)
 * of head (b, h) meet, in key block kb. */
static int block_flags(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t kb)
{
    const uint8_t *at = r->map + b * r->map_sb + h * r->map_sh + kb;
    const int64_t q0 = r->map_sq ? i0 / ATTNX_MAP_ROWS : 0;
    const int64_t q1 = r->map_sq ? (i0 + nq - 1) / ATTNX_MAP_ROWS : 0;
    int flags = 0;
    for (int64_t qb = q0; qb <= q1; qb++) flags |= at[qb * r->map_sq];
    return flags;
}

int64_t attnx_next_tile(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int64_t nq,
                        int64_t j0, int64_t kstop, int *nk)
{
    if (!r->map || j0 >= kstop) {
        *nk = (int)min64(BK, kstop - j0);
        return j0;
    }
    int64_t kb = j0 / ATTNX_MAP_KEYS; /* the first block at or after j0 that keeps */
    while (kb * ATTNX_MAP_KEYS < kstop && !(block_flags(r, b, h, i0, nq, kb) & ATTNX_MAP_KEEP))
        kb++;
    if (kb * ATTNX_MAP_KEYS >= kstop) {
        *nk = 0;
        return kstop;
    }
    const int64_t from = max64(j0, kb * ATTNX_MAP_KEYS);
    const int64_t stop = min64(kstop, from + BK);
    int64_t end = from; /* the end of the last block that keeps, up to stop */
    for (int64_t c = kb; c * ATTNX_MAP_KEYS < stop; c++)
        if (block_flags(r, b, h, i0, nq, c) & ATTNX_MAP_KEEP)
            end = min64(stop, (c + 1) * ATTNX_MAP_KEYS);
    *nk = (int)(end - from);
    return from;
}

int64_t *attnx_balanced_ranges(const attnx_run *r, int64_t n, int64_t chunk)
{
    const attnx_problem *p = r->p;
    if (!r->map || n < 2 || p->Lk == 0) return NULL;
    const int64_t tiles = (p->Lk + BK - 1) / BK, per = BK / ATTNX_MAP_KEYS;
    const int64_t nkb = attnx_map_extent(1, p->Lk, ATTNX_MAP_KEYS);
    const int64_t nb = r->map_sb ? p->B : 1, nh = r->map_sh ? p->Hq : 1;
    const int64_t nq = r->map_sq ? (p->Lq + ATTNX_MAP_ROWS - 1) / ATTNX_MAP_ROWS : 1;
    int64_t *w = calloc((size_t)tiles + 1, sizeof *w);
    int64_t *bounds = malloc(sizeof *bounds * (size_t)(n + 1));
    if (!w || !bounds) {
        free(w);
        free(bounds);
        return NULL; /* the even cut, which needs no memory */
    }
    for (int64_t b = 0; b < nb; b++) /* each tile's kept blocks, over every row of the map */
        for (int64_t h = 0; h < nh; h++)
            for (int64_t qb = 0; qb < nq; qb++) {
                const uint8_t *row = r->map + b * r->map_sb + h * r->map_sh + qb * r->map_sq;
                for (int64_t kb = 0; kb < nkb; kb++) w[kb / per] += row[kb] & ATTNX_MAP_KEEP;
            }
    int64_t total = 0, worst = 0;
    for (int64_t t = 0; t < tiles; t++) total += w[t];
    for (int64_t s = 0; s < n; s++) { /* the even cut's heaviest range */
        int64_t sum = 0;
        for (int64_t t = s * chunk / BK; t < min64(tiles, (s + 1) * chunk / BK); t++) sum += w[t];
        worst = max64(worst, sum);
    }
    if (total == 0 || 4 * worst * n <= 5 * total) { /* within 25% of even: keep it */
        free(w);
        free(bounds);
        return NULL;
    }
    int64_t t = 0, cum = 0;
    bounds[0] = 0;
    for (int64_t s = 1; s < n; s++) { /* range s - 1 ends once it holds its share */
        while (t < tiles && (cum + w[t]) * n <= s * total) cum += w[t++];
        if (t < tiles && cum * n < s * total && 2 * (cum + w[t]) * n - 2 * s * total < w[t] * n)
            cum += w[t++]; /* the tile that crosses the share goes where it is closer to it */
        bounds[s] = min64(p->Lk, t * BK);
    }
    bounds[n] = p->Lk;
    free(w);
    return bounds;
}

int attnx_tile_flags(const attnx_run *r, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t j0,
                     int64_t nk)
{
    if (!r->map) return ATTNX_MAP_KEEP | ATTNX_MAP_DROP;
    if (nq <= 0 || nk <= 0) return 0;
    int flags = 0;
    for (int64_t kb = j0 / ATTNX_MAP_KEYS; kb <= (j0 + nk - 1) / ATTNX_MAP_KEYS; kb++)
        flags |= block_flags(r, b, h, i0, nq, kb);
    return flags;
}

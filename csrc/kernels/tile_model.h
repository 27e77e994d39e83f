/* A portable C model of the AMX tile unit, for amx.c compiled as
 * amx_emulated.c (ATTNX_TILE_MODEL; and for amx.c itself in the emulated
 * AVX-512 test build, emulate_avx512.h): the tile intrinsics amx.c uses
 * become functions on a per-thread copy of the unit's state, so that the AMX
 * kernels run on any CPU with AVX-512 (dispatch.c: ATTNX_BF16_DOTS=amx_emulated,
 * never chosen unasked). For tests: every tile product is a loop of scalar FMAs.
 *
 * The model, as Intel's ISA reference states the instructions:
 *   LDTILECFG   the 64-byte configuration (palette, then colsb[16] bytes a
 *               row and rows[16] a tile); loading one zeroes the tiles;
 *   STTILECFG   the configuration in use, or 64 zero bytes if none is;
 *   TILERELEASE back to the initial state (no configuration, tiles zero);
 *   TILELOADD   rows[t] rows of colsb[t] bytes, `stride` bytes apart; the
 *               rest of the tile zero;  TILESTORED  the same rows back;
 *   TILEZERO    the tile zero;
 *   TDPBF16PS   C (M x N float32) += A (M x K pairs) · B (K pairs x N), with
 *               M = rows[c], N = colsb[c] / 4, K = colsb[a] / 4: per element
 *               two float32 sums from zero, of the even halves' products and
 *               of the odd halves', over k in order, each step an FMA rounded
 *               to nearest even with bfloat16 subnormals read as 0 and a
 *               subnormal result flushed to 0; then C + (even + odd), each
 *               rounded and flushed the same way (the ISA reference's temp1
 *               of two lanes an element, summed into the destination at the
 *               end; this order gives 1 + 2^-24 + 2^-24 = 1 + 2^-23, as a
 *               Xeon did, where one FMA after another from C gives 1).
 * The real unit's order of sums within an instruction is its own (amx.c): the
 * kernels' tests bound their results within float32 rounding of the sum, for
 * the unit and for this model alike. */
#ifndef ATTNX_TILE_MODEL_H
#define ATTNX_TILE_MODEL_H

#include <stdint.h>
#include <string.h>

#include "kernels/kernels.h" /* attnx_dp_fma, attnx_ftz */

#define TM_TILES 8
#define TM_ROWS 16
#define TM_COLSB 64

typedef struct {
    unsigned char cfg[64]; /* LDTILECFG's operand; palette (byte 0) 0: none loaded */
    unsigned char data[TM_TILES][TM_ROWS][TM_COLSB];
} tm_unit;

static _Thread_local tm_unit tm_state;

static inline int tm_rows(int t) { return tm_state.cfg[48 + t]; }
static inline int tm_colsb(int t)
{
    return tm_state.cfg[16 + 2 * t] | tm_state.cfg[17 + 2 * t] << 8;
}

static inline void tm_loadconfig(const void *cfg)
{
    memcpy(tm_state.cfg, cfg, sizeof tm_state.cfg);
    memset(tm_state.data, 0, sizeof tm_state.data);
}

static inline void tm_storeconfig(void *cfg) { memcpy(cfg, tm_state.cfg, sizeof tm_state.cfg); }

static inline void tm_release(void) { memset(&tm_state, 0, sizeof tm_state); }

static inline void tm_zero(int t) { memset(tm_state.data[t], 0, sizeof tm_state.data[t]); }

static inline void tm_loadd(int t, const void *base, int64_t stride)
{
    tm_zero(t);
    for (int r = 0; r < tm_rows(t); r++)
        memcpy(tm_state.data[t][r], (const char *)base + r * stride, (size_t)tm_colsb(t));
}

static inline void tm_stored(int t, void *base, int64_t stride)
{
    for (int r = 0; r < tm_rows(t); r++)
        memcpy((char *)base + r * stride, tm_state.data[t][r], (size_t)tm_colsb(t));
}

static inline void tm_dpbf16ps(int c, int a, int b)
{
    const int M = tm_rows(c), N = tm_colsb(c) / 4, K = tm_colsb(a) / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float even = 0.0f, odd = 0.0f;
            for (int k = 0; k < K; k++) {
                uint16_t x[2], y[2];
                memcpy(x, &tm_state.data[a][m][4 * k], sizeof x);
                memcpy(y, &tm_state.data[b][k][4 * n], sizeof y);
                even = attnx_dp_fma(x[0], y[0], even); /* kernels.h: read, round, flush */
                odd = attnx_dp_fma(x[1], y[1], odd);
            }
            float acc;
            memcpy(&acc, &tm_state.data[c][m][4 * n], sizeof acc);
            acc = attnx_ftz(acc + attnx_ftz(even + odd));
            memcpy(&tm_state.data[c][m][4 * n], &acc, sizeof acc);
        }
}

/* amx.c's intrinsics, on the model (the compiler's, if its header defined
 * them, are put aside). */
#undef _tile_loadconfig
#undef _tile_storeconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) tm_loadconfig(cfg)
#define _tile_storeconfig(cfg) tm_storeconfig(cfg)
#define _tile_release() tm_release()
#define _tile_zero(t) tm_zero(t)
#define _tile_loadd(t, base, stride) tm_loadd(t, base, stride)
#define _tile_stored(t, base, stride) tm_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) tm_dpbf16ps(c, a, b)

#endif

/* How the decoding kernels read ahead of the rows they stream (kernels_simd.h's
 * and avx512_bf16.c's): one list of distances for every instruction set. */
#ifndef ATTNX_PREFETCH_H
#define ATTNX_PREFETCH_H

#include <stdint.h>

#include "kernels/kernels.h" /* ATTNX_BK */

/* Decoding streams each key and value row from memory once: ask for the
 * row AHEAD_BYTES further on while a row is used, every 64-byte line of it,
 * so that enough lines are in flight to read at the memory's bandwidth while
 * the rows in hand are computed on. Measured on AMD EPYC Zen 5, one thread,
 * H=8 Lk=32768 D=128 (A/B runs interleaved, medians): no prefetch float32
 * 24 GB/s, float16 17; every other line (the neighbour left to the hardware)
 * 27 and 18; every line 34 and 30. 8 KiB ahead beat 2, 4 and 16 KiB over
 * float32/float16 with and without GQA; there prefetcht0/t1/t2 and
 * prefetchnta were alike. On an Intel Xeon (AMX, 2 vCPUs), prefetchnta, which
 * fills L1 alone and so is limited by its few fill buffers, read half as
 * fast as the others (tools/microbench/run.sh decode, float32, 2 threads:
 * H=32 Lk=8192 D=128 10.5 GB/s against 21.2-21.7; GQA 8 x 4 rows Lk=32768
 * 9.2 against 19.2-19.6), so the rows go to L2 (prefetcht1, locality 2).
 * The address may lie past the array (the next tile's rows, or nothing): a
 * prefetch never faults, and it is computed as an integer, so no pointer
 * outside the array is formed. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
/* int8 rows are a quarter of float32's bytes for the same arithmetic, so
 * AHEAD_BYTES of them are four times as many rows, yet too few: decoding an
 * int8 cache is as much compute as reading (GQA on AVX2), and Q·Kᵀ and P·V
 * take turns a tile at a time, each stream idle while the other runs. A
 * whole tile ahead, each phase asks for the next tile of its own stream.
 * Measured on AMD EPYC Zen 3, 2 threads, D=128 (tools/microbench/run.sh
 * decode with INT8=1, 8 rounds interleaved, medians): H=32 Lk=8192 64 rows
 * ahead (8 KiB) 13.3 GB/s, 128 rows 15.5; GQA 8 x 4 rows Lk=32768 9.4 and
 * 9.9; 256 rows 9.5. */
#ifndef AHEAD_ROWS_I8
#define AHEAD_ROWS_I8 ATTNX_BK
#endif
/* Rows ahead: those of row_bytes that make AHEAD_BYTES, at least 4; int8,
 * AHEAD_ROWS_I8. */
static inline __attribute__((always_inline)) int64_t rows_ahead(int64_t row_bytes, const int i8)
{
    if (i8) return AHEAD_ROWS_I8;
    const int64_t n = AHEAD_BYTES / (row_bytes > 0 ? row_bytes : 1);
    return n < 4 ? 4 : n;
}

static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t at,
                                                               int64_t bytes)
{
    const uintptr_t row = (uintptr_t)base + (uintptr_t)at;
    for (int64_t o = 0; o < bytes; o += 64)
        __builtin_prefetch((const void *)(row + o), 0, PREFETCH_LOCALITY);
}

#endif

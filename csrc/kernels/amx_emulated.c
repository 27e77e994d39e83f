/* amx.c's kernels on the portable model of the tile unit (tile_model.h),
 * named *_amx_emulated: the table dispatch.c hands out for
 * ATTNX_BF16_DOTS=amx_emulated on a CPU with AVX512_BF16, so that the AMX
 * code runs, and is tested, where there are no tiles. Never picked unasked. */
#define ATTNX_TILE_MODEL 1
#include "kernels/amx.c"

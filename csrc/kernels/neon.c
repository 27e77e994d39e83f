/* NEON kernels for aarch64: 4 floats a vector, 32 registers. NEON is part of
 * the aarch64 baseline, so no target flag is needed; dispatch.c picks these
 * on aarch64 unless ATTNX_ISA=scalar. */
#include "kernels/kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

#define W 4
#define VF float32x4_t
#define VMASK int /* NEON has no masked loads: a partial vector is copied through a buffer */
#define SUFFIX(name) name##_neon
#define QK_MR 8 /* 8 keys x 2 vectors: 16 accumulators */
#define QK_NV 2
#define PV_MR 6 /* 6 queries x 3 vectors: 18 accumulators */
#define PV_NV 3

#define V_LOAD(p) vld1q_f32(p)
#define V_STORE(p, x) vst1q_f32(p, x)
#define V_SET1(f) vdupq_n_f32(f)
#define V_BCAST(p) vld1q_dup_f32(p)
#define V_ZERO() vdupq_n_f32(0.0f)
#define V_FMA(a, b, c) vfmaq_f32(c, a, b)
#define V_MUL(a, b) vmulq_f32(a, b)
#define V_ADD(a, b) vaddq_f32(a, b)
#define V_SUB(a, b) vsubq_f32(a, b)
#define V_MAX(x, m) vbslq_f32(vcgtq_f32(x, m), x, m) /* (x > m) ? x : m: a NaN x leaves m */
#define V_SEL_EQ(a, b, t, f) vbslq_f32(vceqq_f32(a, b), t, f)
#define V_SEL_LT(a, b, t, f) vbslq_f32(vcltq_f32(a, b), t, f)
#define V_DIV(a, b) vdivq_f32(a, b)
#define V_ANY_NOT_LT(a, b) (vminvq_u32(vcltq_f32(a, b)) == 0)
#define V_LOAD_HALF(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))
/* bfloat16 to float32: each 16 bits widened and shifted to the top half */
#define V_LOAD_BF16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))
/* 4 int8 values, widened twice and converted (exact); the 4 bytes read as one word */
static inline float32x4_t load_i8_neon(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
#define V_LOAD_I8(p) load_i8_neon(p)
#define V_ROUND(x) vrndnq_f32(x)
#define V_POW2(n) \
    vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23))
#define V_ZERO_BELOW(y, x, lo) \
    vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), vcltq_f32(x, vdupq_n_f32(lo))))
#define V_HSUM(x) vaddvq_f32(x)
/* The sums of four vectors at once: out[r] = sum of the lanes of x_r. */
#define V_HSUM4(a, b, c, d, out) vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)))

/* r[0..3] = its transpose (4 x 4) */
static inline void transpose_neon(float32x4_t r[4])
{
    const float32x4x2_t a = vtrnq_f32(r[0], r[1]), b = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1]));
}
#define V_TRANSPOSE(r) transpose_neon(r)
/* 4 bytes as floats 0 .. 255 */
static inline float32x4_t load_bytes_neon(const unsigned char *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    const uint16x8_t h = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(h)));
}
#define V_LOAD_BYTES(p) load_bytes_neon(p)

static inline float32x4_t load_first_neon(const float *p, int n)
{
    float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < n; i++) tmp[i] = p[i];
    return vld1q_f32(tmp);
}
static inline void store_first_neon(float *p, int n, float32x4_t x)
{
    float tmp[4];
    vst1q_f32(tmp, x);
    for (int i = 0; i < n; i++) p[i] = tmp[i];
}
static inline float32x4_t keep_bytes_neon(float32x4_t x, const unsigned char *base,
                                          const int32_t *idx, float32x4_t fill)
{
    const uint32_t keep[4] = {base[idx[0]] ? ~0u : 0u, base[idx[1]] ? ~0u : 0u,
                              base[idx[2]] ? ~0u : 0u, base[idx[3]] ? ~0u : 0u};
    return vbslq_f32(vld1q_u32(keep), x, fill);
}
#define V_KEEP_BYTES(x, base, idx, fill) keep_bytes_neon(x, base, idx, fill)
#define V_MASK(n) (n)
#define V_LOAD_M(p, n) load_first_neon(p, n)
#define V_STORE_M(p, n, x) store_first_neon(p, n, x)

/* the register blocks the kernels dispatch to: (rows, vectors) */
// clang-format off
#define QK_CASES                                                                   \
    QK_CASE(1, 1) QK_CASE(1, 2) QK_CASE(2, 1) QK_CASE(2, 2) QK_CASE(3, 1) QK_CASE(3, 2) \
    QK_CASE(4, 1) QK_CASE(4, 2) QK_CASE(5, 1) QK_CASE(5, 2) QK_CASE(6, 1) QK_CASE(6, 2) \
    QK_CASE(7, 1) QK_CASE(7, 2) QK_CASE(8, 1) QK_CASE(8, 2)
#define PV_CASES                                                                   \
    PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) \
    PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(3, 3) PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3) \
    PV_CASE(5, 1) PV_CASE(5, 2) PV_CASE(5, 3) PV_CASE(6, 1) PV_CASE(6, 2) PV_CASE(6, 3)
// clang-format on

#include "kernels/kernels_simd.h"

#endif

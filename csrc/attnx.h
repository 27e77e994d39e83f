/* attnx: masked multi-head scaled dot-product attention on float32 arrays.
 *
 *   out = softmax(scale * Q Kᵀ + mask) V
 *
 * The C core knows nothing of Python: one problem struct of pointers and
 * element strides goes in, an error code comes out. A caller (the glue in
 * python/, or a plain C test) fills the struct and calls attnx_forward().
 *
 * Shapes, in elements; every array's last axis is contiguous (stride 1):
 *   q       (B, Hq, Lq, D)
 *   k       (B, Hk, Lk, D)      Hq a multiple of Hk (grouped-query attention)
 *   v       (B, Hk, Lk, Dv)
 *   out     (B, Hq, Lq, Dv)
 *   weights (B, Hq, Lq, Lk)     optional, C-contiguous
 *   mask    (B, Hq, Lq, Lk)     optional, any strides (0 = broadcast), bool or float
 *   key_lengths, query_lengths  (B, Hq) int64, optional, any strides
 */
#ifndef ATTNX_H
#define ATTNX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ATTNX_OK = 0,
    ATTNX_ERR_NULL,     /* a required pointer is NULL */
    ATTNX_ERR_SHAPE,    /* a negative size, or Hq not a multiple of Hk */
    ATTNX_ERR_ARG,      /* an enum out of range, a scale or softcap not finite */
    ATTNX_ERR_LENGTH,   /* a key or query length outside [0, L] */
    ATTNX_ERR_OVERFLOW, /* a size whose byte count does not fit in size_t */
    ATTNX_ERR_NOMEM,    /* scratch memory could not be allocated */
    ATTNX_ERR_ISA,      /* the requested instruction set is not available */
    ATTNX_ERR_PAGE      /* a page table entry outside the pool, or pages of no rows */
} attnx_status;

typedef enum { ATTNX_MASK_NONE = 0, ATTNX_MASK_BOOL, ATTNX_MASK_FLOAT } attnx_mask_kind;

typedef enum {
    ATTNX_CAUSAL_NONE = 0,
    ATTNX_CAUSAL_UPPER_LEFT, /* query i sees keys j <= i (PyTorch's is_causal) */
    ATTNX_CAUSAL_LOWER_RIGHT /* query i sees keys j <= i + Lk - Lq (decoding) */
} attnx_causal;

/* A read-only float32 array of up to 4 axes (b, h, l, e): element (b, h, l, e)
 * at data[b*sb + h*sh + l*sl + e]; the last axis is contiguous. */
typedef struct {
    const float *data;
    int64_t sb, sh, sl;
} attnx_tensor;

/* A read-only array of 16-bit floats, IEEE binary16 (half) or bfloat16 (the
 * problem's half_format), laid out as attnx_tensor. */
typedef struct {
    const uint16_t *data;
    int64_t sb, sh, sl;
} attnx_half_tensor;

/* The same, written by the core. */
typedef struct {
    float *data;
    int64_t sb, sh, sl;
} attnx_out_tensor;

/* A mask over the scores (B, Hq, Lq, Lk): element (b, h, i, j) at
 * data[b*sb + h*sh + i*sq + j*sk], strides of any sign (0 = broadcast).
 * kind: attnx_mask_kind; a bool mask is 1 byte an element, nonzero = attend;
 * a float mask is added to the scores. */
typedef struct {
    int kind;
    const void *data;
    int64_t sb, sh, sq, sk;
} attnx_mask;

/* A block map of a mask (see attnx_classify_mask): one byte a block of
 * ATTNX_MAP_ROWS query rows by ATTNX_MAP_KEYS keys, the OR of its entries'
 * flags, ATTNX_MAP_KEEP (an entry keeps its key) and ATTNX_MAP_DROP (an
 * entry changes its score: a bool mask's zero, a float mask's nonzero).
 * Extents (nb, nh, nq, nkb) as attnx_map_dims gives them (1 along an axis the
 * mask is broadcast along); block (b, h, qb, kb) at data[b*sb + h*sh + qb*sq
 * + kb]. */
#define ATTNX_MAP_ROWS 64
#define ATTNX_MAP_KEYS 32
#define ATTNX_MAP_KEEP 1
#define ATTNX_MAP_DROP 2
typedef struct {
    const uint8_t *data;
    int64_t nb, nh, nq, nkb;
    int64_t sb, sh, sq;
} attnx_block_map;

/* Per-head lengths (B, Hq) int64: element (b, h) at data[b*sb + h*sh];
 * data NULL = the whole axis. */
typedef struct {
    const int64_t *data;
    int64_t sb, sh;
} attnx_lengths;

/* A float per head (B, Hq): element (b, h) at data[b*sb + h*sh]; data NULL =
 * not given (ALiBi slopes, sink logits). */
typedef struct {
    const float *data;
    int64_t sb, sh;
} attnx_head_values;

/* The gradient of a float mask, written by the backward: d(scores) element
 * (b, h, i, j) of (B, Hq, Lq, Lk) is added to data[b*sb + h*sh + i*sq + j*sk].
 * A stride of 0 sums that axis: a mask broadcast over batch, heads, queries
 * or keys gets its gradient in its own shape, with no (B, Hq, Lq, Lk) array.
 * Nonzero strides must address distinct elements. */
typedef struct {
    float *data;
    int64_t sb, sh, sq, sk;
} attnx_mask_grad;

/* A band around each query's diagonal d(i) (i, or i + Lk - Lq when aligned
 * lower-right): key j is allowed only if d(i) - left <= j <= d(i) + right.
 * on = 0: no band; a negative left or right: that side is unbounded. */
typedef struct {
    int on;
    int64_t left, right;
} attnx_window;

/* Keys and values in pages (a paged KV cache, read in place), or table NULL.
 * k and v (or k16 and v16) then describe the pool: their sb is the stride of
 * a page, sl of a row in a page, sh of a head. Key/value row j of head
 * (b, hk) is row j % size of page table[b * sb + j / size]. The first
 * ceil(Lk / size) entries of each of the B table rows must be in
 * [0, num_pages) (ATTNX_ERR_PAGE otherwise; checked before anything is
 * written); they are also clamped to it where read, so a table another
 * thread changes meanwhile changes numbers, never addresses. Forward only. */
typedef struct {
    const int32_t *table;
    int64_t sb;        /* the stride of a table row, in entries */
    int64_t size;      /* rows a page, >= 1 */
    int64_t num_pages; /* pages in the pool */
} attnx_pages;

/* A read-only array of int8 values with a float32 scale a row (an int8 KV
 * cache): element (b, h, l, e) stands for scale[b*ssb + h*ssh + l*ssl] *
 * data[b*sb + h*sh + l*sl + e], the product rounded to float32 (the
 * "dequantized" value); strides in elements, the last axis contiguous. */
typedef struct {
    const int8_t *data;
    int64_t sb, sh, sl;
    const float *scale;
    int64_t ssb, ssh, ssl;
} attnx_i8_tensor;

/* The format of 16-bit keys and values: IEEE binary16, or bfloat16 (the top
 * half of a float32: sign, 8 exponent bits, 7 mantissa bits). */
typedef enum { ATTNX_HALF_F16 = 0, ATTNX_HALF_BF16 } attnx_half_format;

/* Where the diagonal d(i) of the band and of ALiBi lies when causal is
 * ATTNX_CAUSAL_NONE (with a causal mode, the mode's alignment is used). */
typedef enum { ATTNX_ALIGN_UPPER_LEFT = 0, ATTNX_ALIGN_LOWER_RIGHT } attnx_align;

/* How exact the products Q·Kᵀ and P·V must be (the caller's choice; the
 * softmax, its max and sums, lse and every accumulation are float32 always):
 *   ATTNX_PRECISION_HIGHEST  each product exact to float32 (the default)
 *   ATTNX_PRECISION_MEDIUM   products of bfloat16 roundings of the inputs
 *                            and of P allowed, as torch's bfloat16 SDPA and
 *                            torch.set_float32_matmul_precision("medium")
 * MEDIUM is a permission, not a demand: a kernel without bfloat16 dot
 * products computes it as HIGHEST. In this version every kernel does: the
 * bfloat16 kernels that use it (AMX, AVX512_BF16) are to come. */
typedef enum { ATTNX_PRECISION_HIGHEST = 0, ATTNX_PRECISION_MEDIUM } attnx_precision;

/* The scores, in this order (zero-initialised members are plain attention):
 *   s = scale · q·k
 *   softcap > 0:  s = softcap · tanh(s / softcap)
 *   alibi:        s -= slope[b, h] · |d(i) - j|
 *   causal, window, lengths, a bool mask: disallowed keys get -inf;
 *   a float mask is added
 *   sinks:        the softmax's denominator gains exp(sink[b, h]); a row with no
 *                 allowed key still gives zeros (and lse -inf). */
typedef struct {
    int64_t B, Hq, Hk, Lq, Lk, D, Dv;
    attnx_tensor q, k, v;        /* (B, Hq, Lq, D), (B, Hk, Lk, D), (B, Hk, Lk, Dv) */
    attnx_out_tensor out;        /* (B, Hq, Lq, Dv) */
    float *weights;              /* (B, Hq, Lq, Lk) C-contiguous, or NULL */
    attnx_out_tensor lse;        /* (B, Hq, Lq) or data NULL: log of each row's softmax sum */
    attnx_mask mask;             /* kind ATTNX_MASK_NONE: no mask */
    int causal;                  /* attnx_causal */
    attnx_lengths key_lengths;   /* keys [0, key_lengths[b, h]) are attended */
    attnx_lengths query_lengths; /* query rows past query_lengths[b, h] give zeros */
    float scale;
    int num_threads;         /* <= 0: attnx_get_num_threads() */
    attnx_window window;     /* a sliding window (Mistral, Gemma) */
    int align;               /* attnx_align, for the window and ALiBi without causal */
    float softcap;           /* > 0: logit soft-capping (Gemma 2); 0: none */
    attnx_head_values alibi; /* (B, Hq) ALiBi slopes (BLOOM, MPT), or data NULL */
    attnx_head_values sinks; /* (B, Hq) attention-sink logits (gpt-oss), or data NULL */
    /* Keys and values in 16 bits (a float16 or bfloat16 KV cache), forward
     * only: when k16.data is set, k16 and v16 are read and k, v are not used;
     * half_format (attnx_half_format) says which format both hold. A few
     * query rows (decoding) convert them in registers; larger blocks convert
     * them tile by tile to float32 in scratch. Accumulation is float32. */
    attnx_half_tensor k16, v16;
    int half_format;
    /* Nonzero: every value of q is a bfloat16 value (the low 16 bits of its
     * float32 bits are zero), as when q was bfloat16 before the caller
     * widened it. With bfloat16 keys and values (k16, half_format
     * ATTNX_HALF_BF16) on a CPU with AVX512_BF16 (attnx_bf16_dots()), blocks
     * of more than a few query rows then compute Q·Kᵀ with bfloat16 dot
     * products: float32 sums of exact products, in another order, with
     * subnormal inputs and sums flushed to zero, the scale applied to the
     * sums (docs/DESIGN.md, "bfloat16 dot products"); with AMX-BF16, P·V
     * too, on P split exactly into three bfloat16 parts (not rounded).
     * Checked, not trusted: a block of queries holding another value takes
     * the float32 path. */
    int q_bf16;
    int precision;     /* attnx_precision */
    attnx_pages pages; /* table NULL: k, v (k16, v16, k8, v8) are (B, Hk, Lk, .) arrays */
    /* Keys and values in int8 with a float32 scale a row (an int8 KV cache),
     * forward only: when k8.data is set, k8 and v8 are read (k, v, k16, v16
     * are not). Scores are scale_j · (q · k8_j), summed in float32 over the
     * exact int8 values; P·V sums (p_ij · vscale_j) · v8_j. A few query rows
     * (decoding) read them in place; larger blocks convert tile by tile to
     * the dequantized float32 values (scale · int8, rounded) in scratch. With
     * pages, the scales lie in pages too: (num_pages, size) rows of ssb, ssl. */
    attnx_i8_tensor k8, v8;
    /* The mask's block map, computed once for a mask used many times
     * (attnx_classify_mask), or data NULL: each call classifies the mask
     * itself (one pass over its bytes). Either way, tiles whose blocks keep
     * nothing are skipped and tiles whose blocks drop nothing are not masked.
     * Used only where its extents are the mask's in this problem (else the
     * call classifies); its bytes are trusted to describe the mask. */
    attnx_block_map mask_map;
} attnx_problem;

/* Forward attention. Never reads outside the arrays described; writes only
 * out, weights and lse. Returns ATTNX_OK or an error code (nothing written then).
 * lse[b,h,i] = max_j s_ij + log(sum_j exp(s_ij - max_j s_ij)) over the allowed
 * scores s of row i: -inf for a row with no allowed key (or past query_lengths). */
attnx_status attnx_forward(const attnx_problem *p);

/* n independent forward problems (each as attnx_forward takes it), spread
 * over num_threads threads (<= 0: attnx_get_num_threads()): a problem of at
 * least ATTNX_BATCH_ALONE_FLOPS (4·Hq·Lq·Lk·D) runs alone on every thread, as
 * attnx_forward runs it; the others (decoding rows, short sequences) run one
 * a thread at a time, each on one thread, so that a batch of many small
 * problems costs no wake-up of the pool each. Returns the first error (the
 * problems that ran have written their outputs), or ATTNX_OK. */
#define ATTNX_BATCH_ALONE_FLOPS 3.2e7
attnx_status attnx_forward_batch(const attnx_problem *problems, int64_t n, int num_threads);

/* The extents (nb, nh, nq, nkb) of the block map of mask m over the scores
 * (B, H, Lq, Lk): B or 1 (m->sb == 0), H or 1, ceil(Lq / ATTNX_MAP_ROWS) or 1
 * (m->sq == 0, or Lq == 0), ceil(Lk / ATTNX_MAP_KEYS) (1 when Lk == 0). */
void attnx_map_dims(const attnx_mask *m, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                    int64_t dims[4]);

/* The block map of mask m (kind bool or float) over the scores (B, H, Lq, Lk)
 * into out, C-contiguous of attnx_map_dims' extents: one pass over the
 * mask's bytes on num_threads threads (<= 0: attnx_get_num_threads()). */
void attnx_classify_mask(const attnx_mask *m, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                         uint8_t *out, int num_threads);

/* The check attnx_forward makes before it runs: ATTNX_OK, or the error code
 * it would return with *field (when field is not NULL) naming the member of
 * the problem at fault: "Hk", "causal", "scale", "mask.kind", "q.data",
 * "key_lengths", "size" (a byte count overflows), ... (NULL when valid). */
attnx_status attnx_check_problem(const attnx_problem *p, const char **field);

/* The backward pass of attnx_forward for an upstream gradient dout:
 *   f      the forward problem (q, k, v, mask, lengths, causal, scale; its out,
 *          weights and lse are not used)
 *   o      (B, Hq, Lq, Dv) the forward's output      dout (B, Hq, Lq, Dv)
 *   lse    (B, Hq, Lq) the forward's lse
 *   dq     (B, Hq, Lq, D)   dk (B, Hk, Lk, D)   dv (B, Hk, Lk, Dv): written whole
 *   dmask  the gradient of a float mask, or data NULL: d(scores) of the allowed
 *          entries added in, summed along every axis whose stride is 0 (the
 *          axes a broadcast mask repeats); the caller zeroes it (entries never
 *          visited stay 0)
 * The gradient of the sinks, -sum_i exp(sink - lse_i) · rowsum(dout ∘ o)_i,
 * needs no pass over the keys: the caller computes it from o, dout and lse.
 * Deterministic: the same bits on every run with the same thread count. */
typedef struct {
    attnx_problem f;
    attnx_tensor o, dout;
    attnx_tensor lse;
    attnx_out_tensor dq, dk, dv;
    attnx_mask_grad dmask;
} attnx_grad_problem;

/* As attnx_check_problem, for the backward: *field names the member of g at
 * fault ("dq.data", "lse.data", or "f.<member>" for the forward problem). */
attnx_status attnx_check_grad_problem(const attnx_grad_problem *g, const char **field);

attnx_status attnx_backward(const attnx_grad_problem *g);

const char *attnx_strerror(attnx_status status);

/* A 64-bit fingerprint of nbytes bytes at data, chained from seed (hash a
 * non-contiguous array piece by piece, each piece's result the next one's
 * seed). Not cryptographic: the Python package uses it to notice arrays
 * modified in place between a forward and its vjp. */
uint64_t attnx_fingerprint(uint64_t seed, const void *data, size_t nbytes);

/* Another 64-bit fingerprint of nbytes contiguous bytes, computed on the
 * thread pool in fixed chunks (the same value whatever the thread count). */
uint64_t attnx_fingerprint_parallel(const void *data, size_t nbytes);

/* Instruction sets: chosen once from cpuid, overridable by the environment
 * variable ATTNX_ISA=scalar|avx2|avx512|neon or attnx_set_isa(). */
const char *attnx_isa_name(void);          /* the one in use */
int attnx_isa_available(const char *name); /* 1 if compiled in and supported by the CPU */
attnx_status attnx_set_isa(const char *name);

/* The bfloat16 dot products the kernels in use have for Q·Kᵀ, which
 * forwards with q_bf16 and bfloat16 keys and values use: "amx" (AVX-512 on a
 * CPU with AMX-BF16, the process granted the tiles), "avx512_bf16" (AVX-512
 * on a CPU with AVX512_BF16), or NULL for none. Picked once per instruction
 * set: the best the CPU has, unless the environment variable
 * ATTNX_BF16_DOTS=amx|avx512_bf16|none asks for another it has. */
const char *attnx_bf16_dots(void);

/* Every instruction set the core knows, in order: name_at(0 .. count-1). */
int attnx_isa_count(void);
const char *attnx_isa_name_at(int i); /* NULL outside [0, count) */

#define ATTNX_MAX_THREADS 256 /* more threads than this are not used */

int attnx_get_num_threads(void);
void attnx_set_num_threads(int n); /* n <= 0: the default */

/* The threads the calling thread's last forward ran on (its plan's count,
 * 0 before any): the forward's bits do not depend on it, so tests read
 * which count a call took here. */
int attnx_last_threads(void);

/* Registers the pool's fork() handlers; call once when the library loads, so
 * that a fork child knows it is one (idempotent, thread-safe). */
void attnx_threads_init(void);

/* on = 1: the calls of threads inside attnx_on_team(1) run on the team of an
 * OpenMP runtime already loaded in this process (libgomp or Intel's libiomp,
 * e.g. torch's), whose workers are still spinning after that library's own
 * parallel work, instead of on attnx's pool; the first found under the
 * directory `under` (NULL: no preference), else the first loaded. on = 0: on
 * the pool again. Returns the runtime's file when its team is used from now
 * on, NULL otherwise (none is loaded, on = 0, or this process is a fork()
 * child of one that had attnx loaded: there, always the pool). Once found, a
 * runtime is kept. */
const char *attnx_use_openmp(int on, const char *under);

/* Whether the calling thread's calls may run on that team (1) or only on the
 * pool (0, the default); returns the previous setting. Only calls that stand
 * in for the team's own library's work (attnx.torch's) should: a process in
 * which the team never started forks safely, one whose team ran does not. */
int attnx_on_team(int on);

/* The compute rooflines the benchmark reports its rows against, one a unit:
 * the FP32 FMAs of the active instruction set (ATTNX_PEAK_FMA, "fma"), its
 * bfloat16 dot products (ATTNX_PEAK_BF16DOT, "bf16dot": vdpbf16ps) and its
 * tiles (ATTNX_PEAK_AMX, "amx": TDPBF16PS). attnx_peak: the unit's peak on
 * num_threads threads of the pool (<= 0: attnx_get_num_threads()), in
 * GFLOP/s: register-only chains, the best of three runs of about
 * seconds / 3 each; 0.0 where the kernels in use lack the unit, or for a
 * unit outside [0, ATTNX_PEAK_UNITS). attnx_peak_unit_name: the unit's
 * name, NULL outside that range. */
enum { ATTNX_PEAK_FMA, ATTNX_PEAK_BF16DOT, ATTNX_PEAK_AMX, ATTNX_PEAK_UNITS };
const char *attnx_peak_unit_name(int unit);
double attnx_peak(int unit, int num_threads, double seconds);

#ifdef __cplusplus
}
#endif
#endif

/* CPython + NumPy glue for the attnx core: the only file that sees Python.
 *
 * forward() and backward() check what only they can see of each array they
 * are handed (type, dtype, ndim, shapes against each other, strides,
 * alignment, writeability), fill one problem struct of pointers and element
 * strides, and release the GIL while the core runs. What the core checks
 * itself (heads that do not divide, the causal code, a scale that is not
 * finite, lengths out of range, sizes that overflow) comes back as its error
 * code and the member at fault, and is raised here as an exception naming
 * the argument. They are private: attnx/_functional.py and attnx/_grad.py
 * normalise the public arguments and call them with (B, H, L, E) views.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include <string.h>

#include "attnx.h"
#include "kernels/kernels.h"

/* ---- checking one array ------------------------------------------------------ */

static int check_type(PyObject *obj, const char *name, const char *or_none)
{
    if (PyArray_Check(obj)) return 1;
    PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray%s, not %.200s", name, or_none,
                 Py_TYPE(obj)->tp_name);
    return 0;
}

static int check_dtype(PyArrayObject *a, const char *name, int typenum)
{
    if (PyArray_TYPE(a) == typenum && PyArray_ISNOTSWAPPED(a)) return 1;
    PyArray_Descr *want = PyArray_DescrFromType(typenum);
    PyErr_Format(PyExc_TypeError, "%s must have dtype %S in native byte order, not %S", name,
                 (PyObject *)want, (PyObject *)PyArray_DESCR(a));
    Py_XDECREF(want);
    return 0;
}

/* 4-D with the expected sizes (expect[i] < 0: any size). */
static int check_shape(PyArrayObject *a, const char *name, const npy_intp expect[4])
{
    if (PyArray_NDIM(a) != 4) {
        PyErr_Format(PyExc_ValueError, "%s must be 4-D, got %d-D", name, PyArray_NDIM(a));
        return 0;
    }
    const npy_intp *shape = PyArray_SHAPE(a);
    for (int i = 0; i < 4; i++) {
        if (expect[i] >= 0 && shape[i] != expect[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s has shape (%zd, %zd, %zd, %zd), expected axis %d of size %zd", name,
                         shape[0], shape[1], shape[2], shape[3], i, expect[i]);
            return 0;
        }
    }
    return 1;
}

/* Whole-element strides, a contiguous last axis, aligned data. */
static int check_strides(PyArrayObject *a, const char *name)
{
    const npy_intp item = PyArray_ITEMSIZE(a), *strides = PyArray_STRIDES(a);
    for (int i = 0; i < 4; i++) {
        if (strides[i] % item != 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s stride %zd of axis %d is not a multiple of its item size", name,
                         strides[i], i);
            return 0;
        }
    }
    if (PyArray_DIM(a, 3) > 1 && strides[3] != item) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be contiguous along its last axis (stride %zd bytes)", name,
                     strides[3]);
        return 0;
    }
    if (!PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s data is not aligned", name);
        return 0;
    }
    return 1;
}

enum { READ = 0, WRITE = 1, WRITE_C_CONTIGUOUS = 2 };

/* A 4-D float32 operand the core reads (READ) or writes. An empty array is
 * never touched: any strides will do. Returns 0 with an exception set. */
static int check_array(PyObject *obj, const char *name, const npy_intp expect[4], int access)
{
    if (!check_type(obj, name, "")) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!check_dtype(a, name, NPY_FLOAT32) || !check_shape(a, name, expect)) return 0;
    if (PyArray_SIZE(a) != 0 && !check_strides(a, name)) return 0;
    if (access != READ && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
        return 0;
    }
    if (access == WRITE_C_CONTIGUOUS && PyArray_SIZE(a) != 0 && !PyArray_IS_C_CONTIGUOUS(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous", name);
        return 0;
    }
    return 1;
}

static int64_t estride(PyObject *a, int axis)
{
    PyArrayObject *x = (PyArrayObject *)a;
    return (int64_t)(PyArray_STRIDE(x, axis) / PyArray_ITEMSIZE(x));
}

static npy_intp dim(PyObject *a, int axis) { return PyArray_DIM((PyArrayObject *)a, axis); }

/* ---- filling the problem -------------------------------------------------------- */

/* A checked array as the core reads it: data and element strides. */
static attnx_tensor tensor_of(PyObject *a)
{
    return (attnx_tensor){.data = PyArray_DATA((PyArrayObject *)a),
                          .sb = estride(a, 0),
                          .sh = estride(a, 1),
                          .sl = estride(a, 2)};
}

static int fill_in(attnx_tensor *t, PyObject *a, const char *name, const npy_intp shape[4])
{
    if (!check_array(a, name, shape, READ)) return 0;
    *t = tensor_of(a);
    return 1;
}

static int fill_out(attnx_out_tensor *t, PyObject *a, const char *name, const npy_intp shape[4])
{
    if (!check_array(a, name, shape, WRITE)) return 0;
    *t = (attnx_out_tensor){.data = PyArray_DATA((PyArrayObject *)a),
                            .sb = estride(a, 0),
                            .sh = estride(a, 1),
                            .sl = estride(a, 2)};
    return 1;
}

/* A float16 operand the core reads (keys and values of a half-precision cache). */
static int fill_in_half(attnx_half_tensor *t, PyObject *a, const char *name,
                        const npy_intp shape[4], int format)
{
    if (!check_type(a, name, "")) return 0;
    PyArrayObject *x = (PyArrayObject *)a;
    if (!check_dtype(x, name, format == ATTNX_HALF_BF16 ? NPY_UINT16 : NPY_FLOAT16) ||
        !check_shape(x, name, shape))
        return 0;
    if (PyArray_SIZE(x) != 0 && !check_strides(x, name)) return 0;
    *t = (attnx_half_tensor){
        .data = PyArray_DATA(x), .sb = estride(a, 0), .sh = estride(a, 1), .sl = estride(a, 2)};
    return 1;
}

/* An int8 operand with its scales, the tuple (x, scale): x int8 of the given
 * shape, scale float32 (B, H, L, 1), x[b, h, l, :] standing for
 * scale[b, h, l, 0] * x[b, h, l, :] (an int8 KV cache). */
static int fill_in_i8(attnx_i8_tensor *t, PyObject *pair, const char *name, const npy_intp shape[4])
{
    if (PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "%s must be an array, or a tuple (int8 values, scales)",
                     name);
        return 0;
    }
    PyObject *x = PyTuple_GET_ITEM(pair, 0), *sc = PyTuple_GET_ITEM(pair, 1);
    if (!check_type(x, name, "") || !check_dtype((PyArrayObject *)x, name, NPY_INT8) ||
        !check_shape((PyArrayObject *)x, name, shape))
        return 0;
    const npy_intp sshape[4] = {dim(x, 0), dim(x, 1), dim(x, 2), 1};
    char sname[32];
    snprintf(sname, sizeof sname, "%s's scales", name);
    if (!check_array(sc, sname, sshape, READ)) return 0;
    PyArrayObject *xa = (PyArrayObject *)x;
    if (PyArray_SIZE(xa) != 0 && !check_strides(xa, name)) return 0;
    *t = (attnx_i8_tensor){.data = PyArray_DATA(xa),
                           .sb = estride(x, 0),
                           .sh = estride(x, 1),
                           .sl = estride(x, 2),
                           .scale = PyArray_DATA((PyArrayObject *)sc),
                           .ssb = estride(sc, 0),
                           .ssh = estride(sc, 1),
                           .ssl = estride(sc, 2)};
    return 1;
}

/* An empty int8 cache (arrays of no elements may have NULL data): any
 * non-NULL pointer marks the problem's keys and values as int8. */
static void mark_int8(attnx_problem *p)
{
    static const int8_t none8 = 0;
    static const float none_scale = 0.0f;
    if (!p->k8.data) p->k8.data = &none8;
    if (!p->v8.data) p->v8.data = &none8;
    if (!p->k8.scale) p->k8.scale = &none_scale;
    if (!p->v8.scale) p->v8.scale = &none_scale;
}

/* 16-bit keys and values: float16, or uint16 holding bfloat16 bits (NumPy has no
 * bfloat16 of its own; attnx/_args.py passes ml_dtypes' bfloat16 as a uint16 view). */
static int half_format_of(PyObject *a)
{
    if (!PyArray_Check(a)) return -1;
    const int type = PyArray_TYPE((PyArrayObject *)a);
    return type == NPY_FLOAT16 ? ATTNX_HALF_F16 : type == NPY_UINT16 ? ATTNX_HALF_BF16 : -1;
}

/* q, k, v: their shapes give the problem's sizes. k and v both float16, or
 * both uint16 (bfloat16 bits): a 16-bit cache, read as such (forward only). */
static int fill_qkv(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v)
{
    const npy_intp any[4] = {-1, -1, -1, -1};
    if (!fill_in(&p->q, q, "q", any)) return 0;
    p->B = dim(q, 0), p->Hq = dim(q, 1), p->Lq = dim(q, 2), p->D = dim(q, 3);
    const npy_intp kshape[4] = {p->B, -1, -1, p->D};
    if (PyTuple_Check(k) || PyTuple_Check(v)) { /* int8 values and scales, both */
        if (!PyTuple_Check(k) || !PyTuple_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "k and v must both be (int8 values, scales) tuples");
            return 0;
        }
        if (!fill_in_i8(&p->k8, k, "k", kshape)) return 0;
        p->Hk = dim(PyTuple_GET_ITEM(k, 0), 1), p->Lk = dim(PyTuple_GET_ITEM(k, 0), 2);
        const npy_intp vshape[4] = {p->B, p->Hk, p->Lk, -1};
        if (!fill_in_i8(&p->v8, v, "v", vshape)) return 0;
        p->Dv = dim(PyTuple_GET_ITEM(v, 0), 3);
        mark_int8(p);
        return 1;
    }
    const int format = half_format_of(k), half = format >= 0 && format == half_format_of(v);
    p->half_format = half ? format : ATTNX_HALF_F16;
    if (!(half ? fill_in_half(&p->k16, k, "k", kshape, format) : fill_in(&p->k, k, "k", kshape)))
        return 0;
    p->Hk = dim(k, 1), p->Lk = dim(k, 2);
    const npy_intp vshape[4] = {p->B, p->Hk, p->Lk, -1};
    if (!(half ? fill_in_half(&p->v16, v, "v", vshape, format) : fill_in(&p->v, v, "v", vshape)))
        return 0;
    p->Dv = dim(v, 3);
    if (half && !p->k16.data) { /* an empty cache: any non-NULL marks it half */
        static const uint16_t none = 0;
        p->k16.data = &none;
    }
    return 1;
}

/* A bool or float32 mask (B, Hq, Lq, Lk), broadcast along any axis (stride
 * 0), the last included. */
static int fill_mask(attnx_problem *p, PyObject *obj)
{
    if (obj == Py_None) return 1;
    if (!check_type(obj, "mask", " or None")) return 0;
    PyArrayObject *m = (PyArrayObject *)obj;
    const int type = PyArray_TYPE(m);
    if ((type != NPY_BOOL && type != NPY_FLOAT32) || !PyArray_ISNOTSWAPPED(m)) {
        PyErr_Format(PyExc_TypeError,
                     "mask must have dtype bool or float32 (native byte order), not %S",
                     (PyObject *)PyArray_DESCR(m));
        return 0;
    }
    const npy_intp full[4] = {p->B, p->Hq, p->Lq, p->Lk};
    if (!check_shape(m, "mask", full)) return 0;
    for (int i = 0; i < 4; i++) {
        if (PyArray_STRIDE(m, i) % PyArray_ITEMSIZE(m)) {
            PyErr_SetString(PyExc_ValueError, "mask strides must be whole elements");
            return 0;
        }
    }
    if (!PyArray_ISALIGNED(m)) {
        PyErr_SetString(PyExc_ValueError, "mask data is not aligned");
        return 0;
    }
    p->mask = (attnx_mask){.kind = type == NPY_BOOL ? ATTNX_MASK_BOOL : ATTNX_MASK_FLOAT,
                           .data = PyArray_DATA(m),
                           .sb = estride(obj, 0),
                           .sh = estride(obj, 1),
                           .sq = estride(obj, 2),
                           .sk = estride(obj, 3)};
    return 1;
}

/* A per-head array (B, Hq) of the given type (int64 lengths, float32 slopes
 * and sinks), any whole-element strides: its data and element strides, or
 * data NULL for None. */
static int fill_per_head(PyObject *obj, const char *name, int type, npy_intp B, npy_intp H,
                         const void **data, int64_t *sb, int64_t *sh)
{
    *data = NULL;
    if (obj == Py_None) return 1;
    if (!check_type(obj, name, " or None")) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != type || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype %s (native byte order), not %S", name,
                     type == NPY_INT64 ? "int64" : "float32", (PyObject *)PyArray_DESCR(a));
        return 0;
    }
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 0) != B || PyArray_DIM(a, 1) != H) {
        PyErr_Format(PyExc_ValueError, "%s must have shape (%zd, %zd)", name, B, H);
        return 0;
    }
    const npy_intp size = PyArray_ITEMSIZE(a);
    if (PyArray_STRIDE(a, 0) % size || PyArray_STRIDE(a, 1) % size || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned with whole-element strides", name);
        return 0;
    }
    *data = PyArray_DATA(a);
    *sb = estride(obj, 0);
    *sh = estride(obj, 1);
    return 1;
}

static int fill_lengths(attnx_lengths *len, PyObject *obj, const char *name, npy_intp B, npy_intp H)
{
    const void *data;
    if (!fill_per_head(obj, name, NPY_INT64, B, H, &data, &len->sb, &len->sh)) return 0;
    len->data = data;
    return 1;
}

static int fill_head_values(attnx_head_values *hv, PyObject *obj, const char *name, npy_intp B,
                            npy_intp H)
{
    const void *data;
    if (!fill_per_head(obj, name, NPY_FLOAT32, B, H, &data, &hv->sb, &hv->sh)) return 0;
    hv->data = data;
    return 1;
}

/* The variants of the scores: None, or the tuple
 * (window_on, left, right, align, softcap, alibi_slopes, sinks, precision). */
static int fill_variant(attnx_problem *p, PyObject *variant)
{
    if (variant == Py_None) return 1;
    long long left, right;
    int on, align, precision;
    double softcap;
    PyObject *alibi, *sinks;
    if (!PyArg_ParseTuple(variant, "iLLidOOi:variant", &on, &left, &right, &align, &softcap, &alibi,
                          &sinks, &precision))
        return 0;
    p->window = (attnx_window){.on = on, .left = left, .right = right};
    p->align = align;
    p->precision = precision;
    p->softcap = (float)softcap;
    return fill_head_values(&p->alibi, alibi, "alibi_slopes", p->B, p->Hq) &&
           fill_head_values(&p->sinks, sinks, "sinks", p->B, p->Hq);
}

/* What both passes read: q, k, v, mask, lengths, causal, scale. The causal
 * code and the scale go in as given; the core checks them. */
static int fill_problem(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v, PyObject *mask,
                        PyObject *kl, PyObject *ql, int causal, double scale, PyObject *variant)
{
    memset(p, 0, sizeof *p);
    if (!fill_qkv(p, q, k, v) || !fill_mask(p, mask) ||
        !fill_lengths(&p->key_lengths, kl, "key_lengths", p->B, p->Hq) ||
        !fill_lengths(&p->query_lengths, ql, "query_lengths", p->B, p->Hq) ||
        !fill_variant(p, variant))
        return 0;
    p->causal = causal;
    p->scale = (float)scale;
    return 1;
}

/* ---- the core's refusals as exceptions ---------------------------------------- */

/* field: the member of the problem the core names (attnx_check_problem). */
static PyObject *raise_refusal(attnx_status st, const char *field, const attnx_problem *p,
                               PyObject *scale_obj)
{
    if (st == ATTNX_ERR_NOMEM)
        return PyErr_Format(PyExc_MemoryError, "attnx: %s", attnx_strerror(st));
    if (!field) return PyErr_Format(PyExc_ValueError, "attnx: %s", attnx_strerror(st));
    if (strcmp(field, "Hk") == 0)
        return PyErr_Format(PyExc_ValueError,
                            "query heads (q's axis 1: %lld) must be a multiple of key/value "
                            "heads (k's axis 1: %lld)",
                            (long long)p->Hq, (long long)p->Hk);
    if (strcmp(field, "causal") == 0)
        return PyErr_Format(PyExc_ValueError,
                            "causal must be CAUSAL_NONE, CAUSAL_UPPER_LEFT or CAUSAL_LOWER_RIGHT "
                            "(%d, %d, %d), not %d",
                            ATTNX_CAUSAL_NONE, ATTNX_CAUSAL_UPPER_LEFT, ATTNX_CAUSAL_LOWER_RIGHT,
                            p->causal);
    if (strcmp(field, "scale") == 0)
        return PyErr_Format(PyExc_ValueError, "scale must be finite in float32, got %R", scale_obj);
    if (strcmp(field, "precision") == 0)
        return PyErr_Format(PyExc_ValueError,
                            "precision must be PRECISION_HIGHEST or PRECISION_MEDIUM (%d, %d), "
                            "not %d",
                            ATTNX_PRECISION_HIGHEST, ATTNX_PRECISION_MEDIUM, p->precision);
    if (strcmp(field, "softcap") == 0)
        return PyErr_Format(PyExc_ValueError,
                            "softcap must be finite and > 0 in float32, with a finite "
                            "reciprocal (0: none)");
    if (st == ATTNX_ERR_LENGTH) {
        const int keys = strcmp(field, "key_lengths") == 0;
        return PyErr_Format(PyExc_ValueError, "%s: a length lies outside [0, %s] = [0, %lld]",
                            field, keys ? "Lk" : "Lq", (long long)(keys ? p->Lk : p->Lq));
    }
    return PyErr_Format(PyExc_ValueError, "attnx: %s: %s", field, attnx_strerror(st));
}

static PyObject *forward_refused(attnx_status st, const attnx_problem *p, PyObject *scale_obj)
{
    const char *field = NULL;
    if (st != ATTNX_ERR_NOMEM && attnx_check_problem(p, &field) != st) field = NULL;
    return raise_refusal(st, field, p, scale_obj);
}

static PyObject *backward_refused(attnx_status st, const attnx_grad_problem *g, PyObject *scale_obj)
{
    const char *field = NULL;
    if (st != ATTNX_ERR_NOMEM && attnx_check_grad_problem(g, &field) != st) field = NULL;
    return raise_refusal(st, field, &g->f, scale_obj);
}

/* ---- forward ---------------------------------------------------------------------- */

PyDoc_STRVAR(forward_doc,
             "forward(q, k, v, out, weights, mask, key_lengths, query_lengths, causal, scale, "
             "lse=None, variant=None, threads=0, q_bf16=False)\n--\n\n"
             "Private: attention on 4-D float32 views. q (B,Hq,Lq,E), k (B,Hk,Lk,E),\n"
             "v (B,Hk,Lk,Ev), out (B,Hq,Lq,Ev) writeable, weights None or (B,Hq,Lq,Lk)\n"
             "C-contiguous, mask None or bool/float32 (B,Hq,Lq,Lk) with any strides,\n"
             "lengths None or int64 (B,Hq); causal CAUSAL_NONE, CAUSAL_UPPER_LEFT or\n"
             "CAUSAL_LOWER_RIGHT; lse None or (B,Hq,Lq,1) writeable; variant None or\n"
             "(window_on, left, right, align, softcap, alibi_slopes, sinks, precision),\n"
             "alibi_slopes and sinks None or float32 (B,Hq), precision PRECISION_HIGHEST or\n"
             "PRECISION_MEDIUM; threads > 0: this call's thread count (else the\n"
             "process's, set_num_threads); q_bf16: q holds bfloat16 values (the core's\n"
             "attnx_problem.q_bf16: it may then use bfloat16 dot products, bf16_dots()).\n"
             "k and v may be float16 or uint16 (bfloat16 bits), or both (int8 values,\n"
             "float32 scales (.,Hk,Lk,1)) tuples (an int8 cache). Use\n"
             "attnx.scaled_dot_product_attention instead.");

/* out, weights and lse: what the forward writes. */
static int fill_outputs(attnx_problem *p, PyObject *out, PyObject *weights, PyObject *lse)
{
    const npy_intp oshape[4] = {p->B, p->Hq, p->Lq, p->Dv};
    const npy_intp wshape[4] = {p->B, p->Hq, p->Lq, p->Lk};
    const npy_intp lshape[4] = {p->B, p->Hq, p->Lq, 1};
    if (!fill_out(&p->out, out, "out", oshape)) return 0;
    if (weights != Py_None) {
        if (!check_array(weights, "weights", wshape, WRITE_C_CONTIGUOUS)) return 0;
        p->weights = PyArray_DATA((PyArrayObject *)weights);
    }
    return lse == Py_None || fill_out(&p->lse, lse, "lse", lshape);
}

static PyObject *py_forward(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *out, *weights, *mask, *kl, *ql, *lse = Py_None, *variant = Py_None;
    int causal, threads = 0, q_bf16 = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOid|OOip:forward", &q, &k, &v, &out, &weights, &mask, &kl,
                          &ql, &causal, &scale, &lse, &variant, &threads, &q_bf16))
        return NULL;
    attnx_problem p;
    if (!fill_problem(&p, q, k, v, mask, kl, ql, causal, scale, variant) ||
        !fill_outputs(&p, out, weights, lse))
        return NULL;
    p.num_threads = threads > 0 ? threads : 0;
    p.q_bf16 = q_bf16;
    attnx_status st;
    Py_BEGIN_ALLOW_THREADS
        st = attnx_forward(&p);
    Py_END_ALLOW_THREADS
    if (st != ATTNX_OK) return forward_refused(st, &p, PyTuple_GET_ITEM(args, 9));
    Py_RETURN_NONE;
}

/* ---- packed sequences, keys in place or in pages -------------------------------- */

PyDoc_STRVAR(forward_varlen_doc,
             "forward_varlen(q, k, v, out, lse, cu_q, cu_k, table, causal, scale, variant=None, "
             "threads=0, q_bf16=False)\n--\n\n"
             "Private: attention over N packed sequences, sequence i's queries rows\n"
             "cu_q[i] .. cu_q[i+1] of q (1,Hq,Tq,E), out (1,Hq,Tq,Ev) and lse None or\n"
             "(1,Hq,Tq,1), against its cu_k[i+1] - cu_k[i] keys: rows cu_k[i] .. of k and v\n"
             "(1,Hk,Tk,E) and (1,Hk,Tk,Ev) when table is None, else the first rows of its\n"
             "pages table[i] of the pools k (P,Hk,S,E) and v (P,Hk,S,Ev), S rows a page.\n"
             "k and v float32, float16, uint16 (bfloat16 bits), or (int8 values, float32\n"
             "scales (.,Hk,S,1)) tuples. cu_q and cu_k int64\n"
             "(N+1,) C-contiguous, nondecreasing, within Tq (and Tk); table int32 (N, M)\n"
             "C-contiguous, or None. variant as forward()'s, alibi_slopes and sinks (N,Hq).\n"
             "Each sequence is one core problem (causal alignment its own); every one is\n"
             "checked before any is run. Use attnx.varlen_attention instead.");

/* The checked cu_seqlens array: int64 (n + 1,) C-contiguous, nondecreasing
 * from 0, its last entry at most total. */
static const int64_t *cu_of(PyObject *obj, const char *name, npy_intp *n, npy_intp total)
{
    if (!check_type(obj, name, "")) return NULL;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!check_dtype(a, name, NPY_INT64)) return NULL;
    if (PyArray_NDIM(a) != 1 || PyArray_DIM(a, 0) < 1 || !PyArray_IS_C_CONTIGUOUS(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous 1-D array of N+1 >= 1 entries",
                     name);
        return NULL;
    }
    const int64_t *cu = PyArray_DATA(a);
    *n = PyArray_DIM(a, 0) - 1;
    if (cu[0] != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be nondecreasing from 0", name);
        return NULL;
    }
    for (npy_intp i = 0; i < *n; i++)
        if (cu[i + 1] < cu[i]) {
            PyErr_Format(PyExc_ValueError, "%s must be nondecreasing from 0", name);
            return NULL;
        }
    if (cu[*n] > total) {
        PyErr_Format(PyExc_ValueError, "%s ends at %lld, past the %zd rows", name,
                     (long long)cu[*n], total);
        return NULL;
    }
    return cu;
}

/* k or v: float32 or 16-bit (the format of both, or -1: float32), 4-D; or
 * an (int8 values, scales) tuple (fill_in_i8). */
static int fill_kv(attnx_problem *p, int values, PyObject *a, const char *name,
                   const npy_intp shape[4], int format)
{
    if (PyTuple_Check(a)) return fill_in_i8(values ? &p->v8 : &p->k8, a, name, shape);
    if (format >= 0) return fill_in_half(values ? &p->v16 : &p->k16, a, name, shape, format);
    return fill_in(values ? &p->v : &p->k, a, name, shape);
}

/* The problem of sequence i: queries, outputs, keys (rows or pages) and the
 * per-sequence variants moved to it. */
static attnx_problem sequence_problem(const attnx_problem *all, npy_intp i, const int64_t *cu_q,
                                      const int64_t *cu_k, const int32_t *table, npy_intp cols)
{
    attnx_problem p = *all;
    p.B = 1;
    p.Lq = cu_q[i + 1] - cu_q[i];
    p.Lk = cu_k[i + 1] - cu_k[i];
    p.q.data += cu_q[i] * p.q.sl;
    p.out.data += cu_q[i] * p.out.sl;
    if (p.lse.data) p.lse.data += cu_q[i] * p.lse.sl;
    if (table) {
        p.pages.table = table + i * cols;
    } else if (p.k8.data) {
        p.k8.data += cu_k[i] * p.k8.sl, p.k8.scale += cu_k[i] * p.k8.ssl;
        p.v8.data += cu_k[i] * p.v8.sl, p.v8.scale += cu_k[i] * p.v8.ssl;
    } else if (p.k16.data) {
        p.k16.data += cu_k[i] * p.k16.sl;
        p.v16.data += cu_k[i] * p.v16.sl;
    } else {
        p.k.data += cu_k[i] * p.k.sl;
        p.v.data += cu_k[i] * p.v.sl;
    }
    if (p.alibi.data) p.alibi.data += i * p.alibi.sb;
    if (p.sinks.data) p.sinks.data += i * p.sinks.sb;
    return p;
}

/* Sequence i's problem as the core checks it (pools of P pages of S rows, a
 * table of cols columns, or table NULL): 1, or 0 with an exception naming it. */
static int sequence_ok(const attnx_problem *p, npy_intp i, npy_intp P, npy_intp S, npy_intp cols,
                       PyObject *scale_obj)
{
    if (p->pages.table && S > 0 && p->Lk / S + (p->Lk % S != 0) > cols) {
        PyErr_Format(PyExc_ValueError,
                     "block_table: sequence %zd has %lld keys, more than its %zd pages of %zd "
                     "rows hold",
                     i, (long long)p->Lk, cols, S);
        return 0;
    }
    const char *field = NULL;
    const attnx_status st = attnx_check_problem(p, &field);
    if (st == ATTNX_ERR_PAGE && field && strcmp(field, "pages.size") == 0)
        PyErr_Format(PyExc_ValueError, "pages must hold at least one row (k has %zd)", S);
    else if (st == ATTNX_ERR_PAGE)
        PyErr_Format(PyExc_ValueError,
                     "block_table: sequence %zd names a page outside [0, %zd) (the pool holds "
                     "%zd pages of %zd rows)",
                     i, P, P, S);
    else if (st != ATTNX_OK)
        raise_refusal(st, field, p, scale_obj);
    return st == ATTNX_OK;
}

static PyObject *py_forward_varlen(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *out, *lse, *cuq_obj, *cuk_obj, *table_obj, *variant = Py_None;
    int causal, threads = 0, q_bf16 = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOid|Oip:forward_varlen", &q, &k, &v, &out, &lse, &cuq_obj,
                          &cuk_obj, &table_obj, &causal, &scale, &variant, &threads, &q_bf16))
        return NULL;
    attnx_problem all;
    memset(&all, 0, sizeof all);
    const npy_intp any[4] = {-1, -1, -1, -1};
    if (!fill_in(&all.q, q, "q", any)) return NULL;
    all.Hq = dim(q, 1), all.D = dim(q, 3);
    const npy_intp Tq = dim(q, 2);
    const npy_intp one[4] = {1, all.Hq, Tq, -1};
    if (!check_shape((PyArrayObject *)q, "q", one)) return NULL;
    const int format = half_format_of(k), half = format >= 0 && format == half_format_of(v);
    if (PyTuple_Check(k) != PyTuple_Check(v))
        return PyErr_Format(PyExc_TypeError, "k and v must both be (int8 values, scales) tuples");
    const npy_intp kshape[4] = {table_obj == Py_None ? 1 : -1, -1, -1, all.D};
    if (!fill_kv(&all, 0, k, "k", kshape, half ? format : -1)) return NULL;
    PyObject *k_arr = PyTuple_Check(k) ? PyTuple_GET_ITEM(k, 0) : k; /* checked: an array */
    all.Hk = dim(k_arr, 1);
    const npy_intp P = dim(k_arr, 0), S = dim(k_arr, 2);
    const npy_intp vshape[4] = {P, all.Hk, S, -1};
    if (!fill_kv(&all, 1, v, "v", vshape, half ? format : -1)) return NULL;
    all.Dv = dim(PyTuple_Check(v) ? PyTuple_GET_ITEM(v, 0) : v, 3);
    all.half_format = half ? format : ATTNX_HALF_F16;
    if (PyTuple_Check(k)) mark_int8(&all);
    if (half && !all.k16.data) { /* an empty pool: any non-NULL marks it half */
        static const uint16_t none = 0;
        all.k16.data = &none;
    }
    const npy_intp oshape[4] = {1, all.Hq, Tq, all.Dv}, lshape[4] = {1, all.Hq, Tq, 1};
    if (!fill_out(&all.out, out, "out", oshape) ||
        (lse != Py_None && !fill_out(&all.lse, lse, "lse", lshape)))
        return NULL;
    npy_intp n, nk;
    const int64_t *cu_q = cu_of(cuq_obj, "cu_seqlens_q", &n, Tq);
    if (!cu_q) return NULL;
    const int64_t *cu_k = cu_of(cuk_obj, "cu_seqlens_k", &nk, table_obj == Py_None ? S : INT64_MAX);
    if (!cu_k) return NULL;
    if (nk != n)
        return PyErr_Format(PyExc_ValueError, "cu_seqlens_q and cu_seqlens_k differ in length");
    const int32_t *table = NULL;
    npy_intp cols = 0;
    if (table_obj != Py_None) {
        if (!check_type(table_obj, "block_table", " or None")) return NULL;
        PyArrayObject *t = (PyArrayObject *)table_obj;
        if (!check_dtype(t, "block_table", NPY_INT32)) return NULL;
        if (PyArray_NDIM(t) != 2 || PyArray_DIM(t, 0) != n || !PyArray_IS_C_CONTIGUOUS(t))
            return PyErr_Format(PyExc_ValueError,
                                "block_table must be a C-contiguous (%zd, max_blocks) array", n);
        table = PyArray_DATA(t);
        cols = PyArray_DIM(t, 1);
        all.pages = (attnx_pages){.table = table, .sb = 0, .size = S, .num_pages = P};
    }
    all.B = n; /* per-sequence (N, Hq) slopes and sinks */
    if (!fill_variant(&all, variant)) return NULL;
    all.causal = causal;
    all.scale = (float)scale;
    all.num_threads = threads > 0 ? threads : 0;
    all.q_bf16 = q_bf16;
    attnx_problem *problems = PyMem_Malloc(sizeof(attnx_problem) * (size_t)(n > 0 ? n : 1));
    if (!problems) return PyErr_NoMemory();
    npy_intp m = 0;
    for (npy_intp i = 0; i < n; i++) { /* every sequence checked before any runs */
        const attnx_problem p = sequence_problem(&all, i, cu_q, cu_k, table, cols);
        if (!sequence_ok(&p, i, P, S, cols, PyTuple_GET_ITEM(args, 9))) {
            PyMem_Free(problems);
            return NULL;
        }
        if (p.Lq > 0) problems[m++] = p; /* the sequences with queries run */
    }
    attnx_status st;
    Py_BEGIN_ALLOW_THREADS
        st = attnx_forward_batch(problems, m, all.num_threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(problems);
    if (st == ATTNX_ERR_NOMEM)
        return PyErr_Format(PyExc_MemoryError, "attnx: %s", attnx_strerror(st));
    if (st != ATTNX_OK) return PyErr_Format(PyExc_ValueError, "attnx: %s", attnx_strerror(st));
    Py_RETURN_NONE;
}

/* ---- backward ---------------------------------------------------------------------- */

PyDoc_STRVAR(backward_doc,
             "backward(q, k, v, out, dout, lse, dq, dk, dv, dmask, mask, key_lengths, "
             "query_lengths, causal, scale, variant=None, threads=0)\n--\n\n"
             "Private: gradients of forward() on 4-D float32 views. out, dout (B,Hq,Lq,Ev);\n"
             "lse (B,Hq,Lq,1) view; dq (B,Hq,Lq,E), dk (B,Hk,Lk,E), dv (B,Hk,Lk,Ev) writeable;\n"
             "dmask None or a float32 (B,Hq,Lq,Lk) view, zeroed, writeable, whose stride-0\n"
             "axes are summed (a broadcast mask's gradient in its own shape); threads as\n"
             "forward()'s. Use attnx.scaled_dot_product_attention_vjp.");

/* The forward's out and lse, the upstream gradient dout. */
static int fill_saved(attnx_grad_problem *g, PyObject *o, PyObject *dout, PyObject *lse)
{
    const attnx_problem *p = &g->f;
    const npy_intp oshape[4] = {p->B, p->Hq, p->Lq, p->Dv};
    const npy_intp lshape[4] = {p->B, p->Hq, p->Lq, 1};
    return fill_in(&g->o, o, "out", oshape) && fill_in(&g->dout, dout, "dout", oshape) &&
           fill_in(&g->lse, lse, "lse", lshape);
}

/* A float mask's gradient: a float32 (B, Hq, Lq, Lk) writeable view, zeroed,
 * summed along its stride-0 axes. Other strides must not be negative, and
 * must address distinct elements: they are those of a C-contiguous array
 * with the summed axes removed (attnx/_grad.py makes that view). */
static int fill_mask_grad(attnx_grad_problem *g, PyObject *dmask)
{
    if (dmask == Py_None) return 1;
    const attnx_problem *p = &g->f;
    const npy_intp full[4] = {p->B, p->Hq, p->Lq, p->Lk};
    if (!check_type(dmask, "dmask", " or None")) return 0;
    PyArrayObject *a = (PyArrayObject *)dmask;
    if (!check_dtype(a, "dmask", NPY_FLOAT32) || !check_shape(a, "dmask", full)) return 0;
    if (!PyArray_ISWRITEABLE(a) || !PyArray_ISALIGNED(a)) {
        PyErr_SetString(PyExc_ValueError, "dmask must be writeable and aligned");
        return 0;
    }
    npy_intp expect = PyArray_ITEMSIZE(a); /* the stride of the next axis not summed */
    for (int i = 3; i >= 0 && PyArray_SIZE(a) != 0; i--) { /* empty: never written */
        const npy_intp st = PyArray_STRIDE(a, i);
        if (st != 0 && full[i] > 1 && st != expect) {
            PyErr_Format(PyExc_ValueError,
                         "dmask axis %d: stride %zd, expected 0 (summed) or %zd (contiguous)", i,
                         st, expect);
            return 0;
        }
        if (st != 0) expect *= full[i];
    }
    g->dmask = (attnx_mask_grad){.data = PyArray_DATA(a),
                                 .sb = estride(dmask, 0),
                                 .sh = estride(dmask, 1),
                                 .sq = estride(dmask, 2),
                                 .sk = estride(dmask, 3)};
    return 1;
}

/* The gradients the backward writes: dq, dk, dv, and dmask if asked. */
static int fill_grads(attnx_grad_problem *g, PyObject *dq, PyObject *dk, PyObject *dv,
                      PyObject *dmask)
{
    const attnx_problem *p = &g->f;
    const npy_intp qshape[4] = {p->B, p->Hq, p->Lq, p->D}, kshape[4] = {p->B, p->Hk, p->Lk, p->D},
                   vshape[4] = {p->B, p->Hk, p->Lk, p->Dv};
    if (!fill_out(&g->dq, dq, "dq", qshape) || !fill_out(&g->dk, dk, "dk", kshape) ||
        !fill_out(&g->dv, dv, "dv", vshape))
        return 0;
    return fill_mask_grad(g, dmask);
}

static PyObject *py_backward(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *o, *dout, *lse, *dq, *dk, *dv, *dmask, *mask, *kl, *ql;
    PyObject *variant = Py_None;
    int causal, threads = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOid|Oi:backward", &q, &k, &v, &o, &dout, &lse, &dq,
                          &dk, &dv, &dmask, &mask, &kl, &ql, &causal, &scale, &variant, &threads))
        return NULL;
    attnx_grad_problem g;
    memset(&g, 0, sizeof g);
    if (!fill_problem(&g.f, q, k, v, mask, kl, ql, causal, scale, variant) ||
        !fill_saved(&g, o, dout, lse) || !fill_grads(&g, dq, dk, dv, dmask))
        return NULL;
    g.f.num_threads = threads > 0 ? threads : 0;
    attnx_status st;
    Py_BEGIN_ALLOW_THREADS
        st = attnx_backward(&g);
    Py_END_ALLOW_THREADS
    if (st != ATTNX_OK) return backward_refused(st, &g, PyTuple_GET_ITEM(args, 14));
    Py_RETURN_NONE;
}

/* ---- instruction sets and threads ---------------------------------------------------- */

static PyObject *py_bf16_dots(PyObject *self, PyObject *noargs)
{
    const char *name = attnx_bf16_dots();
    if (!name) Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(attnx_isa_name());
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "isa must be a str, not %.200s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if (attnx_set_isa(name) != ATTNX_OK) {
        PyErr_Format(PyExc_ValueError, "instruction set %R is not available here", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Every instruction set the core knows, in order, as a tuple of str. */
static PyObject *isa_names(void)
{
    PyObject *t = PyTuple_New(attnx_isa_count());
    for (int i = 0; t && i < attnx_isa_count(); i++) {
        PyObject *s = PyUnicode_FromString(attnx_isa_name_at(i));
        if (!s) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static PyObject *py_available_isas(PyObject *self, PyObject *noargs)
{
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (int i = 0; i < attnx_isa_count(); i++) {
        const char *name = attnx_isa_name_at(i);
        if (!attnx_isa_available(name)) continue;
        PyObject *s = PyUnicode_FromString(name);
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(s);
    }
    return list;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs)
{
    return PyLong_FromLong(attnx_get_num_threads());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    attnx_set_num_threads(n > 1 << 20 ? 1 << 20 : (n < 0 ? 0 : (int)n));
    Py_RETURN_NONE;
}

static PyObject *py_use_openmp(PyObject *self, PyObject *args)
{
    int on;
    const char *under = NULL;
    if (!PyArg_ParseTuple(args, "p|z:use_openmp", &on, &under)) return NULL;
    const char *name = attnx_use_openmp(on, under);
    if (!name) Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(name);
}

static PyObject *py_on_team(PyObject *self, PyObject *arg)
{
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    return PyBool_FromLong(attnx_on_team(on));
}

/* ---- fingerprints ------------------------------------------------------------------ */

PyDoc_STRVAR(fingerprint_doc,
             "fingerprint(a)\n--\n\n"
             "Private: a 64-bit fingerprint of the bytes of ndarray a, in its memory order\n"
             "(any strides; the GIL released): the same array with other contents gives,\n"
             "but with probability ~2^-64, another value. The vjp functions use it to\n"
             "notice inputs modified in place after the forward.");

static PyObject *py_fingerprint(PyObject *self, PyObject *arg)
{
    if (!check_type(arg, "a", "")) return NULL;
    PyArrayObject *a = (PyArrayObject *)arg;
    uint64_t h = (uint64_t)PyArray_SIZE(a);
    if (PyArray_SIZE(a) == 0) return PyLong_FromUnsignedLongLong(h);
    if (PyArray_IS_C_CONTIGUOUS(a)) { /* the common case: in chunks, on the pool */
        const size_t nbytes = (size_t)PyArray_NBYTES(a);
        const void *data = PyArray_DATA(a);
        Py_BEGIN_ALLOW_THREADS
            h = attnx_fingerprint_parallel(data, nbytes);
        Py_END_ALLOW_THREADS
        return PyLong_FromUnsignedLongLong(h);
    }
    NpyIter *it = NpyIter_New(a, NPY_ITER_READONLY | NPY_ITER_EXTERNAL_LOOP | NPY_ITER_REFS_OK,
                              NPY_KEEPORDER, NPY_NO_CASTING, NULL);
    if (!it) return NULL;
    NpyIter_IterNextFunc *next = NpyIter_GetIterNext(it, NULL);
    if (!next) {
        NpyIter_Deallocate(it);
        return NULL;
    }
    char **data = NpyIter_GetDataPtrArray(it);
    npy_intp *stride = NpyIter_GetInnerStrideArray(it), *count = NpyIter_GetInnerLoopSizePtr(it);
    const npy_intp item = PyArray_ITEMSIZE(a);
    Py_BEGIN_ALLOW_THREADS
        do {
            if (*stride == item) {
                h = attnx_fingerprint(h, data[0], (size_t)(*count * item));
            } else {
                for (npy_intp i = 0; i < *count; i++)
                    h = attnx_fingerprint(h, data[0] + i * *stride, (size_t)item);
            }
        } while (next(it));
    Py_END_ALLOW_THREADS
    NpyIter_Deallocate(it);
    return PyLong_FromUnsignedLongLong(h);
}

/* ---- the FMA peak ------------------------------------------------------------------ */

PyDoc_STRVAR(fma_peak_doc,
             "fma_peak(threads, seconds)\n--\n\n"
             "Private: the FP32 FMA peak of the active instruction set on `threads` threads\n"
             "(0: the default count), GFLOP/s, measured in about `seconds` (the GIL\n"
             "released). The benchmark's compute roofline.");

static PyObject *py_fma_peak(PyObject *self, PyObject *args)
{
    int threads;
    double seconds, gflops;
    if (!PyArg_ParseTuple(args, "id:fma_peak", &threads, &seconds)) return NULL;
    if (!(seconds > 0.0 && seconds <= 60.0)) { /* (PyErr_Format has no %g) */
        char msg[96];
        snprintf(msg, sizeof msg, "fma_peak: seconds must be in (0, 60]; got %g", seconds);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        gflops = attnx_fma_peak(threads, seconds);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(gflops);
}

static PyMethodDef methods[] = {
    {"fingerprint", py_fingerprint, METH_O, fingerprint_doc},
    {"fma_peak", py_fma_peak, METH_VARARGS, fma_peak_doc},
    {"forward", py_forward, METH_VARARGS, forward_doc},
    {"forward_varlen", py_forward_varlen, METH_VARARGS, forward_varlen_doc},
    {"backward", py_backward, METH_VARARGS, backward_doc},
    {"isa", py_isa, METH_NOARGS, "isa()\n--\n\nThe instruction set the kernels use."},
    {"bf16_dots", py_bf16_dots, METH_NOARGS,
     "bf16_dots()\n--\n\nPrivate (tests): the bfloat16 dot products the kernels in use\n"
     "compute Q K^T of all-bfloat16 inputs with: 'amx', 'avx512_bf16' or None."},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(name)\n--\n\nPrivate (tests): use the kernels of one of ISA_NAMES."},
    {"available_isas", py_available_isas, METH_NOARGS,
     "available_isas()\n--\n\nInstruction sets usable on this CPU, in the order of ISA_NAMES."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\nThreads used per call."},
    {"set_num_threads", py_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nThreads used per call; n <= 0 restores the default."},
    {"use_openmp", py_use_openmp, METH_VARARGS,
     "use_openmp(on, under=None)\n--\n\nPrivate (attnx.torch): run the calls' threads on the\n"
     "team of an OpenMP runtime already loaded (torch's libgomp; the first under the\n"
     "directory under if there is one) if on, else on attnx's pool. Returns the\n"
     "runtime's file when its team is used, else None."},
    {"on_team", py_on_team, METH_O,
     "on_team(on)\n--\n\nPrivate (attnx.torch): whether this thread's calls may run on\n"
     "the OpenMP team use_openmp found (True) or only on attnx's pool (False, the\n"
     "default). Returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "attnx._attnx",
    "C core of attnx: masked multi-head scaled dot-product attention.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

/* The core's constants: exp(x) is exactly 0 below EXP_FLUSH_BELOW
 * (kernels.h), so a weight exp(s - max) of a score further than this below
 * its row's maximum is 0 (attnx.reference flushes the same weights); the
 * instruction sets the build knows; the most threads a call uses; the causal
 * codes forward() and backward() take. */
static int add_constants(PyObject *m)
{
    return PyModule_AddObject(m, "EXP_FLUSH_BELOW", PyFloat_FromDouble(ATTNX_EXP_LO)) < 0 ||
                   PyModule_AddObject(m, "ISA_NAMES", isa_names()) < 0 ||
                   PyModule_AddIntConstant(m, "MAX_THREADS", ATTNX_MAX_THREADS) < 0 ||
                   PyModule_AddIntConstant(m, "CAUSAL_NONE", ATTNX_CAUSAL_NONE) < 0 ||
                   PyModule_AddIntConstant(m, "CAUSAL_UPPER_LEFT", ATTNX_CAUSAL_UPPER_LEFT) < 0 ||
                   PyModule_AddIntConstant(m, "CAUSAL_LOWER_RIGHT", ATTNX_CAUSAL_LOWER_RIGHT) < 0 ||
                   PyModule_AddIntConstant(m, "ALIGN_UPPER_LEFT", ATTNX_ALIGN_UPPER_LEFT) < 0 ||
                   PyModule_AddIntConstant(m, "ALIGN_LOWER_RIGHT", ATTNX_ALIGN_LOWER_RIGHT) < 0 ||
                   PyModule_AddIntConstant(m, "PRECISION_HIGHEST", ATTNX_PRECISION_HIGHEST) < 0 ||
                   PyModule_AddIntConstant(m, "PRECISION_MEDIUM", ATTNX_PRECISION_MEDIUM) < 0
               ? -1
               : 0;
}

PyMODINIT_FUNC PyInit__attnx(void)
{
    import_array();
    attnx_threads_init(); /* the fork handlers, before any fork */
    PyObject *m = PyModule_Create(&moduledef);
    if (m && add_constants(m) < 0) Py_CLEAR(m);
    return m;
}

/* The problem both passes read, filled from forward()'s and backward()'s
 * arguments: q, k, v (float32, 16-bit, or int8 with scales), the mask, the
 * lengths, the variants (window, softcap, ALiBi slopes, sinks, precision);
 * and the core's refusals, raised as exceptions naming the argument. */
#define NO_IMPORT_ARRAY
#include "glue.h"

#include <string.h>

/* ---- filling the problem --------------------------------------------------------- */

/* An empty int8 cache (arrays of no elements may have NULL data): any
 * non-NULL pointer marks the problem's keys and values as int8. */
void attnx_py_mark_int8(attnx_problem *p)
{
    static const int8_t none8 = 0;
    static const float none_scale = 0.0f;
    if (!p->k8.data) p->k8.data = &none8;
    if (!p->v8.data) p->v8.data = &none8;
    if (!p->k8.scale) p->k8.scale = &none_scale;
    if (!p->v8.scale) p->v8.scale = &none_scale;
}
/* q, k, v: their shapes give the problem's sizes. k and v both float16, or
 * both uint16 (bfloat16 bits): a 16-bit cache, read as such (forward only). */
static int fill_qkv(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v)
{
    const npy_intp any[4] = {-1, -1, -1, -1};
    if (!attnx_py_fill_in(&p->q, q, "q", any)) return 0;
    p->B = dim(q, 0), p->Hq = dim(q, 1), p->Lq = dim(q, 2), p->D = dim(q, 3);
    const npy_intp kshape[4] = {p->B, -1, -1, p->D};
    if (PyTuple_Check(k) || PyTuple_Check(v)) { /* int8 values and scales, both */
        if (!PyTuple_Check(k) || !PyTuple_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "k and v must both be (int8 values, scales) tuples");
            return 0;
        }
        if (!attnx_py_fill_in_i8(&p->k8, k, "k", kshape)) return 0;
        p->Hk = dim(PyTuple_GET_ITEM(k, 0), 1), p->Lk = dim(PyTuple_GET_ITEM(k, 0), 2);
        const npy_intp vshape[4] = {p->B, p->Hk, p->Lk, -1};
        if (!attnx_py_fill_in_i8(&p->v8, v, "v", vshape)) return 0;
        p->Dv = dim(PyTuple_GET_ITEM(v, 0), 3);
        attnx_py_mark_int8(p);
        return 1;
    }
    const int format = attnx_py_half_format_of(k),
              half = format >= 0 && format == attnx_py_half_format_of(v);
    p->half_format = half ? format : ATTNX_HALF_F16;
    if (!(half ? attnx_py_fill_in_half(&p->k16, k, "k", kshape, format)
               : attnx_py_fill_in(&p->k, k, "k", kshape)))
        return 0;
    p->Hk = dim(k, 1), p->Lk = dim(k, 2);
    const npy_intp vshape[4] = {p->B, p->Hk, p->Lk, -1};
    if (!(half ? attnx_py_fill_in_half(&p->v16, v, "v", vshape, format)
               : attnx_py_fill_in(&p->v, v, "v", vshape)))
        return 0;
    p->Dv = dim(v, 3);
    if (half && !p->k16.data) { /* an empty cache: any non-NULL marks it half */
        static const uint16_t none = 0;
        p->k16.data = &none;
    }
    return 1;
}

/* A bool or float32 mask (B, Hq, Lq, Lk), broadcast along any axis (stride
 * 0), the last included; or a (mask, block map) pair (blockmap.c). */
static int fill_mask(attnx_problem *p, PyObject *obj)
{
    if (obj == Py_None) return 1;
    const npy_intp full[4] = {p->B, p->Hq, p->Lq, p->Lk};
    if (PyTuple_Check(obj)) { /* (mask, its block map): attnx.BlockMask */
        if (PyTuple_GET_SIZE(obj) != 2) {
            PyErr_SetString(PyExc_TypeError, "mask as a tuple must be (mask, block map)");
            return 0;
        }
        return attnx_py_mask_of(&p->mask, PyTuple_GET_ITEM(obj, 0), full) &&
               attnx_py_map_of(&p->mask_map, PyTuple_GET_ITEM(obj, 1), p->B, p->Hq);
    }
    return attnx_py_mask_of(&p->mask, obj, full);
}

/* A per-head array (B, Hq) of the given type (int64 lengths, float32 slopes
 * and sinks), any whole-element strides: its data and element strides, or
 * data NULL for None. */
static int fill_per_head(PyObject *obj, const char *name, int type, npy_intp B, npy_intp H,
                         const void **data, int64_t *sb, int64_t *sh)
{
    *data = NULL;
    if (obj == Py_None) return 1;
    if (!attnx_py_check_type(obj, name, " or None")) return 0;
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
int attnx_py_fill_variant(attnx_problem *p, PyObject *variant)
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
int attnx_py_fill_problem(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v, PyObject *mask,
                          PyObject *kl, PyObject *ql, int causal, double scale, PyObject *variant)
{
    memset(p, 0, sizeof *p);
    if (!fill_qkv(p, q, k, v) || !fill_mask(p, mask) ||
        !fill_lengths(&p->key_lengths, kl, "key_lengths", p->B, p->Hq) ||
        !fill_lengths(&p->query_lengths, ql, "query_lengths", p->B, p->Hq) ||
        !attnx_py_fill_variant(p, variant))
        return 0;
    p->causal = causal;
    p->scale = (float)scale;
    return 1;
}
/* ---- the core's refusals as exceptions ---------------------------------------- */

/* field: the member of the problem the core names (attnx_check_problem). */
PyObject *attnx_py_raise_refusal(attnx_status st, const char *field, const attnx_problem *p,
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

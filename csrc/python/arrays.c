/* One array handed to the glue: its checks (type, dtype, 4-D shape, strides,
 * alignment, writeability), and the operand of the core filled from it
 * (float32 read or written, float16 or bfloat16 read, int8 with its scales). */
#define NO_IMPORT_ARRAY
#include "glue.h"

/* ---- checking one array ------------------------------------------------------ */

int attnx_py_check_type(PyObject *obj, const char *name, const char *or_none)
{
    if (PyArray_Check(obj)) return 1;
    PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray%s, not %.200s", name, or_none,
                 Py_TYPE(obj)->tp_name);
    return 0;
}

int attnx_py_check_dtype(PyArrayObject *a, const char *name, int typenum)
{
    if (PyArray_TYPE(a) == typenum && PyArray_ISNOTSWAPPED(a)) return 1;
    PyArray_Descr *want = PyArray_DescrFromType(typenum);
    PyErr_Format(PyExc_TypeError, "%s must have dtype %S in native byte order, not %S", name,
                 (PyObject *)want, (PyObject *)PyArray_DESCR(a));
    Py_XDECREF(want);
    return 0;
}

/* 4-D with the expected sizes (expect[i] < 0: any size). */
int attnx_py_check_shape(PyArrayObject *a, const char *name, const npy_intp expect[4])
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

/* A 4-D float32 operand the core reads (READ) or writes. An empty array is
 * never touched: any strides will do. Returns 0 with an exception set. */
int attnx_py_check_array(PyObject *obj, const char *name, const npy_intp expect[4], int access)
{
    if (!attnx_py_check_type(obj, name, "")) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!attnx_py_check_dtype(a, name, NPY_FLOAT32) || !attnx_py_check_shape(a, name, expect))
        return 0;
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

/* ---- an operand as the core reads or writes it ----------------------------------- */

/* A checked array as the core reads it: data and element strides. */
static attnx_tensor tensor_of(PyObject *a)
{
    return (attnx_tensor){.data = PyArray_DATA((PyArrayObject *)a),
                          .sb = estride(a, 0),
                          .sh = estride(a, 1),
                          .sl = estride(a, 2)};
}

int attnx_py_fill_in(attnx_tensor *t, PyObject *a, const char *name, const npy_intp shape[4])
{
    if (!attnx_py_check_array(a, name, shape, READ)) return 0;
    *t = tensor_of(a);
    return 1;
}

int attnx_py_fill_out(attnx_out_tensor *t, PyObject *a, const char *name, const npy_intp shape[4])
{
    if (!attnx_py_check_array(a, name, shape, WRITE)) return 0;
    *t = (attnx_out_tensor){.data = PyArray_DATA((PyArrayObject *)a),
                            .sb = estride(a, 0),
                            .sh = estride(a, 1),
                            .sl = estride(a, 2)};
    return 1;
}

/* A float16 operand the core reads (keys and values of a half-precision cache). */
int attnx_py_fill_in_half(attnx_half_tensor *t, PyObject *a, const char *name,
                          const npy_intp shape[4], int format)
{
    if (!attnx_py_check_type(a, name, "")) return 0;
    PyArrayObject *x = (PyArrayObject *)a;
    if (!attnx_py_check_dtype(x, name, format == ATTNX_HALF_BF16 ? NPY_UINT16 : NPY_FLOAT16) ||
        !attnx_py_check_shape(x, name, shape))
        return 0;
    if (PyArray_SIZE(x) != 0 && !check_strides(x, name)) return 0;
    *t = (attnx_half_tensor){
        .data = PyArray_DATA(x), .sb = estride(a, 0), .sh = estride(a, 1), .sl = estride(a, 2)};
    return 1;
}

/* An int8 operand with its scales, the tuple (x, scale): x int8 of the given
 * shape, scale float32 (B, H, L, 1), x[b, h, l, :] standing for
 * scale[b, h, l, 0] * x[b, h, l, :] (an int8 KV cache). */
int attnx_py_fill_in_i8(attnx_i8_tensor *t, PyObject *pair, const char *name,
                        const npy_intp shape[4])
{
    if (PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "%s must be an array, or a tuple (int8 values, scales)",
                     name);
        return 0;
    }
    PyObject *x = PyTuple_GET_ITEM(pair, 0), *sc = PyTuple_GET_ITEM(pair, 1);
    if (!attnx_py_check_type(x, name, "") ||
        !attnx_py_check_dtype((PyArrayObject *)x, name, NPY_INT8) ||
        !attnx_py_check_shape((PyArrayObject *)x, name, shape))
        return 0;
    const npy_intp sshape[4] = {dim(x, 0), dim(x, 1), dim(x, 2), 1};
    char sname[32];
    snprintf(sname, sizeof sname, "%s's scales", name);
    if (!attnx_py_check_array(sc, sname, sshape, READ)) return 0;
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
/* 16-bit keys and values: float16, or uint16 holding bfloat16 bits (NumPy has no
 * bfloat16 of its own; attnx/_args.py passes ml_dtypes' bfloat16 as a uint16 view). */
int attnx_py_half_format_of(PyObject *a)
{
    if (!PyArray_Check(a)) return -1;
    const int type = PyArray_TYPE((PyArrayObject *)a);
    return type == NPY_FLOAT16 ? ATTNX_HALF_F16 : type == NPY_UINT16 ? ATTNX_HALF_BF16 : -1;
}

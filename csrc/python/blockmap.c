/* classify_mask(): a mask's block map (attnx_classify_mask), for
 * attnx.BlockMask, which computes it once and hands it to every call with the
 * mask; and the map's half of fill_mask's (mask, map) pair. */
#define NO_IMPORT_ARRAY
#include "glue.h"

/* A bool or float32 mask, 4-D (B, H, Lq, Lk), any whole-element strides (0 =
 * broadcast), aligned; into *m. */
int attnx_py_mask_of(attnx_mask *m, PyObject *obj, const npy_intp full[4])
{
    if (!attnx_py_check_type(obj, "mask", " or None")) return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    const int type = PyArray_TYPE(a);
    if ((type != NPY_BOOL && type != NPY_FLOAT32) || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError,
                     "mask must have dtype bool or float32 (native byte order), not %S",
                     (PyObject *)PyArray_DESCR(a));
        return 0;
    }
    if (!attnx_py_check_shape(a, "mask", full)) return 0;
    for (int i = 0; i < 4; i++) {
        if (PyArray_STRIDE(a, i) % PyArray_ITEMSIZE(a)) {
            PyErr_SetString(PyExc_ValueError, "mask strides must be whole elements");
            return 0;
        }
    }
    if (!PyArray_ISALIGNED(a)) {
        PyErr_SetString(PyExc_ValueError, "mask data is not aligned");
        return 0;
    }
    *m = (attnx_mask){.kind = type == NPY_BOOL ? ATTNX_MASK_BOOL : ATTNX_MASK_FLOAT,
                      .data = PyArray_DATA(a),
                      .sb = estride(obj, 0),
                      .sh = estride(obj, 1),
                      .sq = estride(obj, 2),
                      .sk = estride(obj, 3)};
    return 1;
}

/* The map of a (mask, map) pair: uint8 (B, H, nq, nkb), broadcast along B and
 * H where the mask is, its last axis contiguous. Its extents along the
 * broadcast axes are 1; the core uses it where the extents are the mask's
 * (attnx_map_dims), and classifies the mask itself otherwise. */
int attnx_py_map_of(attnx_block_map *map, PyObject *obj, npy_intp B, npy_intp H)
{
    if (!attnx_py_check_type(obj, "mask map", "")) return 0;
    const npy_intp want[4] = {B, H, -1, -1};
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!attnx_py_check_dtype(a, "mask map", NPY_UINT8) ||
        !attnx_py_check_shape(a, "mask map", want))
        return 0;
    if (PyArray_DIM(a, 3) > 1 && PyArray_STRIDE(a, 3) != 1) {
        PyErr_SetString(PyExc_ValueError, "mask map: its last axis must be contiguous");
        return 0;
    }
    *map = (attnx_block_map){.data = PyArray_DATA(a),
                             .nb = estride(obj, 0) ? dim(obj, 0) : 1,
                             .nh = estride(obj, 1) ? dim(obj, 1) : 1,
                             .nq = dim(obj, 2),
                             .nkb = dim(obj, 3),
                             .sb = estride(obj, 0),
                             .sh = estride(obj, 1),
                             .sq = estride(obj, 2)};
    return 1;
}

const char attnx_py_classify_mask_doc[] =
    PyDoc_STR("classify_mask(mask, num_threads)\n--\n\n"
              "The block map of a bool or float32 mask (B, H, Lq, Lk) (strides 0 where it is\n"
              "broadcast): uint8 (nb, nh, nq, nkb), 1 along the broadcast axes, one byte a\n"
              "block of ATTNX_MAP_ROWS query rows by ATTNX_MAP_KEYS keys, the OR of\n"
              "MAP_KEEP (an entry keeps its key) and MAP_DROP (an entry changes its score).\n"
              "One pass over the mask's bytes with the GIL released.");

PyObject *attnx_py_classify_mask(PyObject *self, PyObject *args)
{
    PyObject *obj;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:classify_mask", &obj, &threads)) return NULL;
    const npy_intp any[4] = {-1, -1, -1, -1};
    attnx_mask m;
    if (!attnx_py_mask_of(&m, obj, any)) return NULL;
    const npy_intp B = dim(obj, 0), H = dim(obj, 1), Lq = dim(obj, 2), Lk = dim(obj, 3);
    int64_t d[4];
    attnx_map_dims(&m, B, H, Lq, Lk, d);
    npy_intp shape[4] = {(npy_intp)d[0], (npy_intp)d[1], (npy_intp)d[2], (npy_intp)d[3]};
    PyObject *out = PyArray_SimpleNew(4, shape, NPY_UINT8);
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
        attnx_classify_mask(&m, B, H, Lq, Lk, (uint8_t *)PyArray_DATA((PyArrayObject *)out),
                            threads);
    Py_END_ALLOW_THREADS
    return out;
}

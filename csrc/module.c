/* CPython + NumPy glue for the attnx core: the only file that sees Python.
 *
 * forward() checks every array it is handed (type, dtype, ndim, shape,
 * strides, alignment, writeability), fills one attnx_problem of pointers and
 * element strides, releases the GIL while the core runs, and turns the
 * core's error codes into exceptions. It is private: attnx/_functional.py
 * normalises the public arguments and calls it with (B, H, L, E) views.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#include <numpy/arrayobject.h>

#include "attnx.h"
#include "kernels.h"

/* Check one 4-D operand; NULL-safe name for messages. Returns 0 and sets an
 * exception on failure. expect[i] < 0 means "any size". */
static int check_array(PyObject *obj, const char *name, int typenum, const npy_intp expect[4],
                       int writeable, int contiguous)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray, not %.200s", name,
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum || !PyArray_ISNOTSWAPPED(a)) {
        PyArray_Descr *want = PyArray_DescrFromType(typenum);
        PyErr_Format(PyExc_TypeError, "%s must have dtype %S in native byte order, not %S", name,
                     (PyObject *)want, (PyObject *)PyArray_DESCR(a));
        Py_XDECREF(want);
        return 0;
    }
    if (PyArray_NDIM(a) != 4) {
        PyErr_Format(PyExc_ValueError, "%s must be 4-D, got %d-D", name, PyArray_NDIM(a));
        return 0;
    }
    const npy_intp *shape = PyArray_SHAPE(a), *strides = PyArray_STRIDES(a);
    for (int i = 0; i < 4; i++) {
        if (expect[i] >= 0 && shape[i] != expect[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s has shape (%zd, %zd, %zd, %zd), expected axis %d of size %zd", name,
                         shape[0], shape[1], shape[2], shape[3], i, expect[i]);
            return 0;
        }
    }
    if (PyArray_SIZE(a) == 0) {   /* nothing is read or written: any strides will do */
        if (writeable && !PyArray_ISWRITEABLE(a)) {
            PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
            return 0;
        }
        return 1;
    }
    const npy_intp item = PyArray_ITEMSIZE(a);
    for (int i = 0; i < 4; i++) {
        if (strides[i] % item != 0) {
            PyErr_Format(PyExc_ValueError, "%s stride %zd of axis %d is not a multiple of its item size",
                         name, strides[i], i);
            return 0;
        }
    }
    if (shape[3] > 1 && strides[3] != item) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous along its last axis (stride %zd bytes)",
                     name, strides[3]);
        return 0;
    }
    if (!PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s data is not aligned", name);
        return 0;
    }
    if (writeable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
        return 0;
    }
    if (contiguous && !PyArray_IS_C_CONTIGUOUS(a)) {
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

/* Lengths: int64, shape (B, H), any strides. */
static int check_lengths_array(PyObject *obj, const char *name, npy_intp B, npy_intp H)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray or None, not %.200s", name,
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != NPY_INT64 || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype int64 (native byte order), not %S", name,
                     (PyObject *)PyArray_DESCR(a));
        return 0;
    }
    if (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 0) != B || PyArray_DIM(a, 1) != H) {
        PyErr_Format(PyExc_ValueError, "%s must have shape (%zd, %zd)", name, B, H);
        return 0;
    }
    if (PyArray_STRIDE(a, 0) % 8 || PyArray_STRIDE(a, 1) % 8 || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned with whole-element strides", name);
        return 0;
    }
    return 1;
}

static PyObject *raise_status(attnx_status st)
{
    PyObject *exc = st == ATTNX_ERR_NOMEM ? PyExc_MemoryError : PyExc_ValueError;
    PyErr_Format(exc, "attnx: %s", attnx_strerror(st));
    return NULL;
}

PyDoc_STRVAR(forward_doc,
"forward(q, k, v, out, weights, mask, key_lengths, query_lengths, causal, scale)\n--\n\n"
"Private: attention on 4-D float32 views. q (B,Hq,Lq,E), k (B,Hk,Lk,E),\n"
"v (B,Hk,Lk,Ev), out (B,Hq,Lq,Ev) writeable, weights None or (B,Hq,Lq,Lk)\n"
"C-contiguous, mask None or bool/float32 (B,Hq,Lq,Lk) with any strides,\n"
"lengths None or int64 (B,Hq); causal 0 none, 1 upper-left, 2 lower-right.\n"
"Use attnx.scaled_dot_product_attention instead.");

/* A checked 4-D float32 array as the core reads it: data and element strides. */
static attnx_tensor tensor_of(PyObject *a)
{
    attnx_tensor t = {PyArray_DATA((PyArrayObject *)a), estride(a, 0), estride(a, 1), estride(a, 2)};
    return t;
}

/* A bool or float32 mask, 4-D, broadcast along any axis (stride 0), the last included. */
static int fill_mask(attnx_problem *p, PyObject *mask, const npy_intp full[4])
{
    if (!PyArray_Check(mask)) {
        PyErr_Format(PyExc_TypeError, "mask must be a numpy.ndarray or None, not %.200s",
                     Py_TYPE(mask)->tp_name);
        return 0;
    }
    const int mt = PyArray_TYPE((PyArrayObject *)mask);
    if ((mt != NPY_BOOL && mt != NPY_FLOAT32) || !PyArray_ISNOTSWAPPED((PyArrayObject *)mask)) {
        PyErr_Format(PyExc_TypeError, "mask must have dtype bool or float32 (native byte order), not %S",
                     (PyObject *)PyArray_DESCR((PyArrayObject *)mask));
        return 0;
    }
    /* a mask may be broadcast along any axis, the last included */
    PyArrayObject *m = (PyArrayObject *)mask;
    if (PyArray_NDIM(m) != 4) {
        PyErr_Format(PyExc_ValueError, "mask must be 4-D, got %d-D", PyArray_NDIM(m));
        return 0;
    }
    for (int i = 0; i < 4; i++) {
        if (PyArray_DIM(m, i) != full[i]) {
            PyErr_Format(PyExc_ValueError, "mask must have shape (%zd, %zd, %zd, %zd)",
                         full[0], full[1], full[2], full[3]);
            return 0;
        }
        if (PyArray_STRIDE(m, i) % PyArray_ITEMSIZE(m)) {
            PyErr_SetString(PyExc_ValueError, "mask strides must be whole elements");
            return 0;
        }
    }
    if (!PyArray_ISALIGNED(m)) {
        PyErr_SetString(PyExc_ValueError, "mask data is not aligned");
        return 0;
    }
    p->mask_kind = mt == NPY_BOOL ? ATTNX_MASK_BOOL : ATTNX_MASK_FLOAT;
    p->mask = PyArray_DATA(m);
    p->mask_sb = estride(mask, 0); p->mask_sh = estride(mask, 1);
    p->mask_sq = estride(mask, 2); p->mask_sk = estride(mask, 3);
    return 1;
}

/* Check the forward's arrays and fill p (out: writeable when out_writeable). 0 on error. */
static int fill_problem(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v, PyObject *out,
                        int out_writeable, PyObject *weights, PyObject *mask, PyObject *kl,
                        PyObject *ql, int causal, double scale, PyObject *scale_obj)
{

    const npy_intp any4[4] = {-1, -1, -1, -1};
    if (!check_array(q, "q", NPY_FLOAT32, any4, 0, 0)) return 0;
    const npy_intp *qs = PyArray_SHAPE((PyArrayObject *)q);
    const npy_intp B = qs[0], Hq = qs[1], Lq = qs[2], E = qs[3];
    const npy_intp kexp[4] = {B, -1, -1, E};
    if (!check_array(k, "k", NPY_FLOAT32, kexp, 0, 0)) return 0;
    const npy_intp Hk = PyArray_DIM((PyArrayObject *)k, 1), Lk = PyArray_DIM((PyArrayObject *)k, 2);
    const npy_intp vexp[4] = {B, Hk, Lk, -1};
    if (!check_array(v, "v", NPY_FLOAT32, vexp, 0, 0)) return 0;
    const npy_intp Ev = PyArray_DIM((PyArrayObject *)v, 3);
    const npy_intp oexp[4] = {B, Hq, Lq, Ev};
    if (!check_array(out, "out", NPY_FLOAT32, oexp, out_writeable, 0)) return 0;
    const npy_intp full[4] = {B, Hq, Lq, Lk};
    if (weights != Py_None && !check_array(weights, "weights", NPY_FLOAT32, full, 1, 1)) return 0;
    if (Hq > 0 && (Hk == 0 || Hq % Hk != 0)) {
        PyErr_Format(PyExc_ValueError, "query heads (%zd) must be a multiple of key/value heads (%zd)",
                     Hq, Hk);
        return 0;
    }

    attnx_problem pp;
    memset(&pp, 0, sizeof pp);
    pp.B = B; pp.Hq = Hq; pp.Hk = Hk; pp.Lq = Lq; pp.Lk = Lk; pp.D = E; pp.Dv = Ev;
    pp.q = tensor_of(q);
    pp.k = tensor_of(k);
    pp.v = tensor_of(v);
    pp.out = PyArray_DATA((PyArrayObject *)out);
    pp.out_sb = estride(out, 0); pp.out_sh = estride(out, 1); pp.out_sl = estride(out, 2);
    pp.weights = weights == Py_None ? NULL : PyArray_DATA((PyArrayObject *)weights);

    if (mask != Py_None && !fill_mask(&pp, mask, full)) return 0;
    if (kl != Py_None) {
        if (!check_lengths_array(kl, "key_lengths", B, Hq)) return 0;
        pp.key_lengths = PyArray_DATA((PyArrayObject *)kl);
        pp.kl_sb = estride(kl, 0); pp.kl_sh = estride(kl, 1);
    }
    if (ql != Py_None) {
        if (!check_lengths_array(ql, "query_lengths", B, Hq)) return 0;
        pp.query_lengths = PyArray_DATA((PyArrayObject *)ql);
        pp.ql_sb = estride(ql, 0); pp.ql_sh = estride(ql, 1);
    }
    if (causal < ATTNX_CAUSAL_NONE || causal > ATTNX_CAUSAL_LOWER_RIGHT) {
        PyErr_Format(PyExc_ValueError, "causal must be CAUSAL_NONE, CAUSAL_UPPER_LEFT or "
                     "CAUSAL_LOWER_RIGHT (%d, %d, %d), not %d", ATTNX_CAUSAL_NONE,
                     ATTNX_CAUSAL_UPPER_LEFT, ATTNX_CAUSAL_LOWER_RIGHT, causal);
        return 0;
    }
    pp.causal = causal;
    pp.scale = (float)scale;
    if (!isfinite(pp.scale)) {
        PyErr_Format(PyExc_ValueError, "scale must be finite in float32, got %R", scale_obj);
        return 0;
    }

    *p = pp;
    return 1;
}

static int fill_lse(attnx_problem *p, PyObject *lse, int writeable)
{
    const npy_intp want[4] = {p->B, p->Hq, p->Lq, 1};
    if (!check_array(lse, "lse", NPY_FLOAT32, want, writeable, 0)) return 0;
    p->lse = PyArray_DATA((PyArrayObject *)lse);
    p->lse_sb = estride(lse, 0); p->lse_sh = estride(lse, 1); p->lse_sl = estride(lse, 2);
    return 1;
}

static PyObject *py_forward(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *out, *weights, *mask, *kl, *ql, *lse = Py_None;
    int causal;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOid|O:forward", &q, &k, &v, &out, &weights, &mask, &kl,
                          &ql, &causal, &scale, &lse))
        return NULL;
    attnx_problem p;
    if (!fill_problem(&p, q, k, v, out, 1, weights, mask, kl, ql, causal, scale,
                      PyTuple_GET_ITEM(args, 9)))
        return NULL;
    if (lse != Py_None && !fill_lse(&p, lse, 1)) return NULL;
    attnx_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attnx_forward(&p);
    Py_END_ALLOW_THREADS
    if (st != ATTNX_OK) return raise_status(st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(backward_doc,
"backward(q, k, v, out, dout, lse, dq, dk, dv, dmask, mask, key_lengths, query_lengths, causal, scale)\n--\n\n"
"Private: gradients of forward() on 4-D float32 views. out, dout (B,Hq,Lq,Ev);\n"
"lse (B,Hq,Lq,1) view; dq (B,Hq,Lq,E), dk (B,Hk,Lk,E), dv (B,Hk,Lk,Ev) writeable;\n"
"dmask None or (B,Hq,Lq,Lk) C-contiguous, zeroed. Use attnx.scaled_dot_product_attention_vjp.");

static int fill_grad_tensor(attnx_out_tensor *t, PyObject *a, const char *name, const npy_intp shape[4])
{
    if (!check_array(a, name, NPY_FLOAT32, shape, 1, 0)) return 0;
    t->data = PyArray_DATA((PyArrayObject *)a);
    t->sb = estride(a, 0); t->sh = estride(a, 1); t->sl = estride(a, 2);
    return 1;
}

static PyObject *py_backward(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *o, *dout, *lse, *dq, *dk, *dv, *dmask, *mask, *kl, *ql;
    int causal;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOid:backward", &q, &k, &v, &o, &dout, &lse, &dq, &dk,
                          &dv, &dmask, &mask, &kl, &ql, &causal, &scale))
        return NULL;
    attnx_grad_problem g;
    memset(&g, 0, sizeof g);
    if (!fill_problem(&g.f, q, k, v, o, 0, Py_None, mask, kl, ql, causal, scale,
                      PyTuple_GET_ITEM(args, 14)))
        return NULL;
    attnx_problem *p = &g.f;
    const npy_intp oshape[4] = {p->B, p->Hq, p->Lq, p->Dv};
    if (!check_array(dout, "dout", NPY_FLOAT32, oshape, 0, 0) || !fill_lse(p, lse, 0)) return NULL;
    g.o = tensor_of(o);
    g.dout = tensor_of(dout);
    g.lse = p->lse; g.lse_sb = p->lse_sb; g.lse_sh = p->lse_sh; g.lse_sl = p->lse_sl;
    p->lse = NULL;
    /* f.out points at o (validate wants it); the backward never writes it */
    const npy_intp qshape[4] = {p->B, p->Hq, p->Lq, p->D}, kshape[4] = {p->B, p->Hk, p->Lk, p->D},
                   vshape[4] = {p->B, p->Hk, p->Lk, p->Dv}, mshape[4] = {p->B, p->Hq, p->Lq, p->Lk};
    if (!fill_grad_tensor(&g.dq, dq, "dq", qshape) || !fill_grad_tensor(&g.dk, dk, "dk", kshape) ||
        !fill_grad_tensor(&g.dv, dv, "dv", vshape))
        return NULL;
    if (dmask != Py_None) {
        if (!check_array(dmask, "dmask", NPY_FLOAT32, mshape, 1, 1)) return NULL;
        g.dmask = PyArray_DATA((PyArrayObject *)dmask);
    }
    attnx_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attnx_backward(&g);
    Py_END_ALLOW_THREADS
    if (st != ATTNX_OK) return raise_status(st);
    Py_RETURN_NONE;
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
        if (!s) { Py_CLEAR(t); break; }
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
        if (!s || PyList_Append(list, s) < 0) { Py_XDECREF(s); Py_DECREF(list); return NULL; }
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

static PyMethodDef methods[] = {
    {"forward", py_forward, METH_VARARGS, forward_doc},
    {"backward", py_backward, METH_VARARGS, backward_doc},
    {"isa", py_isa, METH_NOARGS, "isa()\n--\n\nThe instruction set the kernels use."},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(name)\n--\n\nPrivate (tests): use 'scalar', 'avx2' or 'avx512' kernels."},
    {"available_isas", py_available_isas, METH_NOARGS,
     "available_isas()\n--\n\nInstruction sets usable on this CPU."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\nThreads used per call."},
    {"set_num_threads", py_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nThreads used per call; n <= 0 restores the default."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "attnx._attnx",
    "C core of attnx: masked multi-head scaled dot-product attention.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__attnx(void)
{
    import_array();
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    /* exp(x) is exactly 0 below this (kernels.h): a weight exp(s - max) of a
     * score further than this below its row's maximum is 0 (attnx.reference
     * flushes the same weights) */
    if (PyModule_AddObject(m, "EXP_FLUSH_BELOW", PyFloat_FromDouble(ATTNX_EXP_LO)) < 0 ||
        PyModule_AddObject(m, "ISA_NAMES", isa_names()) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", ATTNX_MAX_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_NONE", ATTNX_CAUSAL_NONE) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_UPPER_LEFT", ATTNX_CAUSAL_UPPER_LEFT) < 0 ||
        PyModule_AddIntConstant(m, "CAUSAL_LOWER_RIGHT", ATTNX_CAUSAL_LOWER_RIGHT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

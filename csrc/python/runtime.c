/* The small entry points: the instruction sets (in use, available, forced),
 * the threads (count, OpenMP team), fingerprint() (the vjps notice inputs
 * modified in place) and peak() (the benchmark's compute rooflines). */
#define NO_IMPORT_ARRAY
#include "glue.h"

/* ---- instruction sets and threads ---------------------------------------------------- */

PyObject *attnx_py_bf16_dots(PyObject *self, PyObject *noargs)
{
    const char *name = attnx_bf16_dots();
    if (!name) Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

PyObject *attnx_py_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(attnx_isa_name());
}

PyObject *attnx_py_set_isa(PyObject *self, PyObject *arg)
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
PyObject *attnx_py_available_isas(PyObject *self, PyObject *noargs)
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

PyObject *attnx_py_get_num_threads(PyObject *self, PyObject *noargs)
{
    return PyLong_FromLong(attnx_get_num_threads());
}

PyObject *attnx_py_last_threads(PyObject *self, PyObject *noargs)
{
    return PyLong_FromLong(attnx_last_threads());
}

PyObject *attnx_py_set_num_threads(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    attnx_set_num_threads(n > 1 << 20 ? 1 << 20 : (n < 0 ? 0 : (int)n));
    Py_RETURN_NONE;
}

PyObject *attnx_py_use_openmp(PyObject *self, PyObject *args)
{
    int on;
    const char *under = NULL;
    if (!PyArg_ParseTuple(args, "p|z:use_openmp", &on, &under)) return NULL;
    const char *name = attnx_use_openmp(on, under);
    if (!name) Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(name);
}

PyObject *attnx_py_on_team(PyObject *self, PyObject *arg)
{
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    return PyBool_FromLong(attnx_on_team(on));
}

/* ---- fingerprints ------------------------------------------------------------------ */

const char attnx_py_fingerprint_doc[] =
    PyDoc_STR("fingerprint(a)\n--\n\n"
              "Private: a 64-bit fingerprint of the bytes of ndarray a, in its memory order\n"
              "(any strides; the GIL released): the same array with other contents gives,\n"
              "but with probability ~2^-64, another value. The vjp functions use it to\n"
              "notice inputs modified in place after the forward.");

PyObject *attnx_py_fingerprint(PyObject *self, PyObject *arg)
{
    if (!attnx_py_check_type(arg, "a", "")) return NULL;
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

/* ---- the compute rooflines ------------------------------------------------------------ */

const char attnx_py_peak_doc[] =
    PyDoc_STR("peak(unit, threads, seconds)\n--\n\n"
              "Private: the peak of one of PEAK_UNITS ('fma': FP32 FMAs, 'bf16dot':\n"
              "vdpbf16ps, 'amx': AMX tiles) in the kernels in use, on `threads` threads\n"
              "(0: the default count), GFLOP/s, measured in about `seconds` (the GIL\n"
              "released); None where those kernels lack the unit. The benchmark's\n"
              "compute rooflines.");

PyObject *attnx_py_peak(PyObject *self, PyObject *args)
{
    const char *name;
    int threads, unit = 0;
    double seconds, gflops;
    if (!PyArg_ParseTuple(args, "sid:peak", &name, &threads, &seconds)) return NULL;
    while (attnx_peak_unit_name(unit) && strcmp(attnx_peak_unit_name(unit), name) != 0) unit++;
    if (!attnx_peak_unit_name(unit)) {
        char known[64] = "";
        for (int u = 0; attnx_peak_unit_name(u); u++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s'%s'", u ? ", " : "",
                     attnx_peak_unit_name(u));
        PyErr_Format(PyExc_ValueError, "peak: unit must be one of %s; got '%s'", known, name);
        return NULL;
    }
    if (!(seconds > 0.0 && seconds <= 60.0)) { /* (PyErr_Format has no %g) */
        char msg[96];
        snprintf(msg, sizeof msg, "peak: seconds must be in (0, 60]; got %g", seconds);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
        gflops = attnx_peak(unit, threads, seconds);
    Py_END_ALLOW_THREADS
    if (gflops == 0.0) Py_RETURN_NONE;
    return PyFloat_FromDouble(gflops);
}

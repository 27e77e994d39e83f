/* What the CPython + NumPy glue (the .c files of csrc/python) shares: the one
 * header that includes Python.h and NumPy's headers. The core (csrc/core,
 * csrc/kernels) has no Python in it.
 *
 * The glue checks what only it can see of each array it is handed (type,
 * dtype, ndim, shapes against each other, strides, alignment, writeability),
 * fills one problem struct of pointers and element strides, and releases the
 * GIL while the core runs. What the core checks itself (heads that do not
 * divide, the causal code, a scale that is not finite, lengths out of range,
 * sizes that overflow) comes back as its error code and the member at fault,
 * and is raised as an exception naming the argument. The entry points are
 * private: attnx/_functional.py and attnx/_grad.py normalise the public
 * arguments and call them with (B, H, L, E) views.
 *
 *   arrays.c     one array: its checks, and the operand the core reads or writes
 *   problem.c    the problem both passes read (q, k, v, mask, lengths, variants),
 *                and the core's refusals as exceptions
 *   forward.c    forward()
 *   backward.c   backward()
 *   varlen.c     forward_varlen(): packed sequences, keys in place or in pages
 *   blockmap.c   classify_mask(): a mask's block map; a (mask, map) pair
 *   runtime.c    instruction sets, threads, fingerprint(), peak()
 *   module.c     the method table, the constants, PyInit__attnx
 *
 * NumPy's C API is one table of functions, attnx_ARRAY_API, which module.c
 * fills (import_array). Every other glue file defines NO_IMPORT_ARRAY before
 * including this header: it then reads that table instead of defining its own.
 */
#ifndef ATTNX_PYTHON_GLUE_H
#define ATTNX_PYTHON_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_23_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "attnx.h"

/* ---- arrays.c: one array ---------------------------------------------------------- */

/* Each returns 0 (or NULL) with an exception set naming the argument. */
int attnx_py_check_type(PyObject *obj, const char *name, const char *or_none);
int attnx_py_check_dtype(PyArrayObject *a, const char *name, int typenum);
int attnx_py_check_shape(PyArrayObject *a, const char *name, const npy_intp expect[4]);

/* What the core does with an operand attnx_py_check_array checks. */
enum { READ = 0, WRITE = 1, WRITE_C_CONTIGUOUS = 2 };
int attnx_py_check_array(PyObject *obj, const char *name, const npy_intp expect[4], int access);

int attnx_py_fill_in(attnx_tensor *t, PyObject *a, const char *name, const npy_intp shape[4]);
int attnx_py_fill_out(attnx_out_tensor *t, PyObject *a, const char *name, const npy_intp shape[4]);
int attnx_py_fill_in_half(attnx_half_tensor *t, PyObject *a, const char *name,
                          const npy_intp shape[4], int format);
int attnx_py_fill_in_i8(attnx_i8_tensor *t, PyObject *pair, const char *name,
                        const npy_intp shape[4]);
int attnx_py_half_format_of(PyObject *a);

/* A checked array's stride along an axis in elements, and its size along it. */
static inline int64_t estride(PyObject *a, int axis)
{
    PyArrayObject *x = (PyArrayObject *)a;
    return (int64_t)(PyArray_STRIDE(x, axis) / PyArray_ITEMSIZE(x));
}

static inline npy_intp dim(PyObject *a, int axis) { return PyArray_DIM((PyArrayObject *)a, axis); }

/* ---- problem.c: the problem, the refusals ------------------------------------------ */

void attnx_py_mark_int8(attnx_problem *p);
int attnx_py_fill_variant(attnx_problem *p, PyObject *variant);
int attnx_py_fill_problem(attnx_problem *p, PyObject *q, PyObject *k, PyObject *v, PyObject *mask,
                          PyObject *kl, PyObject *ql, int causal, double scale, PyObject *variant);
PyObject *attnx_py_raise_refusal(attnx_status st, const char *field, const attnx_problem *p,
                                 PyObject *scale_obj);

/* ---- blockmap.c: a mask, and its block map ------------------------------------------- */

int attnx_py_mask_of(attnx_mask *m, PyObject *obj, const npy_intp full[4]);
int attnx_py_map_of(attnx_block_map *map, PyObject *obj, npy_intp B, npy_intp H);

/* ---- the entry points, in module.c's method table ----------------------------------- */

PyObject *attnx_py_forward(PyObject *self, PyObject *args);        /* forward.c */
PyObject *attnx_py_backward(PyObject *self, PyObject *args);       /* backward.c */
PyObject *attnx_py_forward_varlen(PyObject *self, PyObject *args); /* varlen.c */
PyObject *attnx_py_classify_mask(PyObject *self, PyObject *args);  /* blockmap.c */
PyObject *attnx_py_isa(PyObject *self, PyObject *noargs);          /* runtime.c, all below */
PyObject *attnx_py_bf16_dots(PyObject *self, PyObject *noargs);
PyObject *attnx_py_set_isa(PyObject *self, PyObject *arg);
PyObject *attnx_py_available_isas(PyObject *self, PyObject *noargs);
PyObject *attnx_py_get_num_threads(PyObject *self, PyObject *noargs);
PyObject *attnx_py_last_threads(PyObject *self, PyObject *noargs);
PyObject *attnx_py_set_num_threads(PyObject *self, PyObject *arg);
PyObject *attnx_py_use_openmp(PyObject *self, PyObject *args);
PyObject *attnx_py_on_team(PyObject *self, PyObject *arg);
PyObject *attnx_py_fingerprint(PyObject *self, PyObject *arg);
PyObject *attnx_py_peak(PyObject *self, PyObject *args);

/* Their docstrings, each next to its function. */
extern const char attnx_py_forward_doc[];
extern const char attnx_py_backward_doc[];
extern const char attnx_py_forward_varlen_doc[];
extern const char attnx_py_classify_mask_doc[];
extern const char attnx_py_fingerprint_doc[];
extern const char attnx_py_peak_doc[];

#endif

/* forward_varlen(): attention over packed sequences (attnx/_paged.py calls
 * it), keys in place or in the pages of a pool (block_table). Each sequence
 * is one core problem; every one is checked before any runs. */
#define NO_IMPORT_ARRAY
#include "glue.h"

#include <string.h>

const char attnx_py_forward_varlen_doc[] =
    PyDoc_STR("forward_varlen(q, k, v, out, lse, cu_q, cu_k, table, causal, scale, variant=None, "
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
    if (!attnx_py_check_type(obj, name, "")) return NULL;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!attnx_py_check_dtype(a, name, NPY_INT64)) return NULL;
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
 * an (int8 values, scales) tuple (attnx_py_fill_in_i8). */
static int fill_kv(attnx_problem *p, int values, PyObject *a, const char *name,
                   const npy_intp shape[4], int format)
{
    if (PyTuple_Check(a)) return attnx_py_fill_in_i8(values ? &p->v8 : &p->k8, a, name, shape);
    if (format >= 0)
        return attnx_py_fill_in_half(values ? &p->v16 : &p->k16, a, name, shape, format);
    return attnx_py_fill_in(values ? &p->v : &p->k, a, name, shape);
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
        attnx_py_raise_refusal(st, field, p, scale_obj);
    return st == ATTNX_OK;
}

PyObject *attnx_py_forward_varlen(PyObject *self, PyObject *args)
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
    if (!attnx_py_fill_in(&all.q, q, "q", any)) return NULL;
    all.Hq = dim(q, 1), all.D = dim(q, 3);
    const npy_intp Tq = dim(q, 2);
    const npy_intp one[4] = {1, all.Hq, Tq, -1};
    if (!attnx_py_check_shape((PyArrayObject *)q, "q", one)) return NULL;
    const int format = attnx_py_half_format_of(k),
              half = format >= 0 && format == attnx_py_half_format_of(v);
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
    if (PyTuple_Check(k)) attnx_py_mark_int8(&all);
    if (half && !all.k16.data) { /* an empty pool: any non-NULL marks it half */
        static const uint16_t none = 0;
        all.k16.data = &none;
    }
    const npy_intp oshape[4] = {1, all.Hq, Tq, all.Dv}, lshape[4] = {1, all.Hq, Tq, 1};
    if (!attnx_py_fill_out(&all.out, out, "out", oshape) ||
        (lse != Py_None && !attnx_py_fill_out(&all.lse, lse, "lse", lshape)))
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
        if (!attnx_py_check_type(table_obj, "block_table", " or None")) return NULL;
        PyArrayObject *t = (PyArrayObject *)table_obj;
        if (!attnx_py_check_dtype(t, "block_table", NPY_INT32)) return NULL;
        if (PyArray_NDIM(t) != 2 || PyArray_DIM(t, 0) != n || !PyArray_IS_C_CONTIGUOUS(t))
            return PyErr_Format(PyExc_ValueError,
                                "block_table must be a C-contiguous (%zd, max_blocks) array", n);
        table = PyArray_DATA(t);
        cols = PyArray_DIM(t, 1);
        all.pages = (attnx_pages){.table = table, .sb = 0, .size = S, .num_pages = P};
    }
    all.B = n; /* per-sequence (N, Hq) slopes and sinks */
    if (!attnx_py_fill_variant(&all, variant)) return NULL;
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

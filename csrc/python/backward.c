/* backward(): the gradients of forward() (attnx/_grad.py calls it), their
 * problem filled, the GIL released while the core runs. */
#define NO_IMPORT_ARRAY
#include "glue.h"

#include <string.h>

const char attnx_py_backward_doc[] =
    PyDoc_STR("backward(q, k, v, out, dout, lse, dq, dk, dv, dmask, mask, key_lengths, "
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
    return attnx_py_fill_in(&g->o, o, "out", oshape) &&
           attnx_py_fill_in(&g->dout, dout, "dout", oshape) &&
           attnx_py_fill_in(&g->lse, lse, "lse", lshape);
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
    if (!attnx_py_check_type(dmask, "dmask", " or None")) return 0;
    PyArrayObject *a = (PyArrayObject *)dmask;
    if (!attnx_py_check_dtype(a, "dmask", NPY_FLOAT32) || !attnx_py_check_shape(a, "dmask", full))
        return 0;
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
    if (!attnx_py_fill_out(&g->dq, dq, "dq", qshape) ||
        !attnx_py_fill_out(&g->dk, dk, "dk", kshape) ||
        !attnx_py_fill_out(&g->dv, dv, "dv", vshape))
        return 0;
    return fill_mask_grad(g, dmask);
}

/* The core refused the problem: an exception naming the argument at fault. */
static PyObject *backward_refused(attnx_status st, const attnx_grad_problem *g, PyObject *scale_obj)
{
    const char *field = NULL;
    if (st != ATTNX_ERR_NOMEM && attnx_check_grad_problem(g, &field) != st) field = NULL;
    return attnx_py_raise_refusal(st, field, &g->f, scale_obj);
}

PyObject *attnx_py_backward(PyObject *self, PyObject *args)
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
    if (!attnx_py_fill_problem(&g.f, q, k, v, mask, kl, ql, causal, scale, variant) ||
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

/* forward(): attention on 4-D views (attnx/_functional.py calls it), its
 * problem filled, the GIL released while the core runs. */
#define NO_IMPORT_ARRAY
#include "glue.h"

const char attnx_py_forward_doc[] =
    PyDoc_STR("forward(q, k, v, out, weights, mask, key_lengths, query_lengths, causal, scale, "
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
    if (!attnx_py_fill_out(&p->out, out, "out", oshape)) return 0;
    if (weights != Py_None) {
        if (!attnx_py_check_array(weights, "weights", wshape, WRITE_C_CONTIGUOUS)) return 0;
        p->weights = PyArray_DATA((PyArrayObject *)weights);
    }
    return lse == Py_None || attnx_py_fill_out(&p->lse, lse, "lse", lshape);
}

/* The core refused the problem: an exception naming the argument at fault. */
static PyObject *forward_refused(attnx_status st, const attnx_problem *p, PyObject *scale_obj)
{
    const char *field = NULL;
    if (st != ATTNX_ERR_NOMEM && attnx_check_problem(p, &field) != st) field = NULL;
    return attnx_py_raise_refusal(st, field, p, scale_obj);
}

PyObject *attnx_py_forward(PyObject *self, PyObject *args)
{
    PyObject *q, *k, *v, *out, *weights, *mask, *kl, *ql, *lse = Py_None, *variant = Py_None;
    int causal, threads = 0, q_bf16 = 0;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOid|OOip:forward", &q, &k, &v, &out, &weights, &mask, &kl,
                          &ql, &causal, &scale, &lse, &variant, &threads, &q_bf16))
        return NULL;
    attnx_problem p;
    if (!attnx_py_fill_problem(&p, q, k, v, mask, kl, ql, causal, scale, variant) ||
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

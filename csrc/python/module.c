/* The extension attnx._attnx: its method table, its constants, and
 * PyInit__attnx, which fills NumPy's C API table (import_array: this is the
 * one glue file without NO_IMPORT_ARRAY) and sets up the core's threads.
 * glue.h says what each glue file holds. */
#include "glue.h"
#include "kernels/kernels.h"

/* Names in the core's order, as a tuple of str: the instruction sets
 * (ISA_NAMES), the units of peak() (PEAK_UNITS). */
static PyObject *names(int count, const char *(*name_at)(int))
{
    PyObject *t = PyTuple_New(count);
    for (int i = 0; t && i < count; i++) {
        PyObject *s = PyUnicode_FromString(name_at(i));
        if (!s) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static PyMethodDef methods[] = {
    {"fingerprint", attnx_py_fingerprint, METH_O, attnx_py_fingerprint_doc},
    {"peak", attnx_py_peak, METH_VARARGS, attnx_py_peak_doc},
    {"forward", attnx_py_forward, METH_VARARGS, attnx_py_forward_doc},
    {"forward_varlen", attnx_py_forward_varlen, METH_VARARGS, attnx_py_forward_varlen_doc},
    {"backward", attnx_py_backward, METH_VARARGS, attnx_py_backward_doc},
    {"classify_mask", attnx_py_classify_mask, METH_VARARGS, attnx_py_classify_mask_doc},
    {"isa", attnx_py_isa, METH_NOARGS, "isa()\n--\n\nThe instruction set the kernels use."},
    {"bf16_dots", attnx_py_bf16_dots, METH_NOARGS,
     "bf16_dots()\n--\n\nPrivate (tests): the bfloat16 dot products the kernels in use\n"
     "compute Q K^T of all-bfloat16 inputs with: 'amx', 'avx512_bf16' or None."},
    {"set_isa", attnx_py_set_isa, METH_O,
     "set_isa(name)\n--\n\nPrivate (tests): use the kernels of one of ISA_NAMES."},
    {"available_isas", attnx_py_available_isas, METH_NOARGS,
     "available_isas()\n--\n\nInstruction sets usable on this CPU, in the order of ISA_NAMES."},
    {"get_num_threads", attnx_py_get_num_threads, METH_NOARGS,
     "get_num_threads()\n--\n\nThreads used per call."},
    {"last_threads", attnx_py_last_threads, METH_NOARGS,
     "last_threads()\n--\n\nPrivate (tests): the threads this thread's last forward ran on."},
    {"set_num_threads", attnx_py_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nThreads used per call; n <= 0 restores the default."},
    {"use_openmp", attnx_py_use_openmp, METH_VARARGS,
     "use_openmp(on, under=None)\n--\n\nPrivate (attnx.torch): run the calls' threads on the\n"
     "team of an OpenMP runtime already loaded (torch's libgomp; the first under the\n"
     "directory under if there is one) if on, else on attnx's pool. Returns the\n"
     "runtime's file when its team is used, else None."},
    {"on_team", attnx_py_on_team, METH_O,
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
 * codes forward() and backward() take; EMULATED_AVX512 1 in the test build
 * whose AVX-512 kernels run on SIMDe (tools/emulate.sh), else 0. */
#ifdef ATTNX_EMULATE_AVX512
#define EMULATED_AVX512 1
#else
#define EMULATED_AVX512 0
#endif
static int add_constants(PyObject *m)
{
    return PyModule_AddObject(m, "EXP_FLUSH_BELOW", PyFloat_FromDouble(ATTNX_EXP_LO)) < 0 ||
                   PyModule_AddObject(m, "ISA_NAMES", names(attnx_isa_count(), attnx_isa_name_at)) <
                       0 ||
                   PyModule_AddObject(m, "PEAK_UNITS",
                                      names(ATTNX_PEAK_UNITS, attnx_peak_unit_name)) < 0 ||
                   PyModule_AddIntConstant(m, "MAX_THREADS", ATTNX_MAX_THREADS) < 0 ||
                   PyModule_AddIntConstant(m, "EMULATED_AVX512", EMULATED_AVX512) < 0 ||
                   PyModule_AddIntConstant(m, "MAP_ROWS", ATTNX_MAP_ROWS) < 0 ||
                   PyModule_AddIntConstant(m, "MAP_KEYS", ATTNX_MAP_KEYS) < 0 ||
                   PyModule_AddIntConstant(m, "MAP_KEEP", ATTNX_MAP_KEEP) < 0 ||
                   PyModule_AddIntConstant(m, "MAP_DROP", ATTNX_MAP_DROP) < 0 ||
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

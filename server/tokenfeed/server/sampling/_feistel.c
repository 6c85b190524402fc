/* The keyed Feistel network of sampling/order.py over a uint64 array, in C: the same rounds
 * (the splitmix64 finalizer as round function, on `half`-bit halves), without numpy's dozen
 * array passes a round. bijection.py's numpy `_feistel_numpy` is its twin and the reference. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_KEYS 64

static inline uint64_t mix64(uint64_t x)
{
    x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)) * UINT64_C(0x94D049BB133111EB);
    return x ^ (x >> 31);
}

/* A C-contiguous uint64 buffer of `n` items (8-byte unsigned format). */
static int uint64s(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                          (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "Q") && strcmp(f, "L"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a uint64 array, not format '%s'", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static inline uint64_t network(uint64_t x, int half, uint64_t mask, const uint64_t *keys,
                               Py_ssize_t nkeys, int inverse)
{
    uint64_t left = x >> half, right = x & mask, t;
    if (!inverse) {
        for (Py_ssize_t k = 0; k < nkeys; k++) {
            t = left ^ (mix64(right ^ keys[k]) & mask);
            left = right;
            right = t;
        }
    } else {
        for (Py_ssize_t k = nkeys - 1; k >= 0; k--) {
            t = right ^ (mix64(left ^ keys[k]) & mask);
            right = left;
            left = t;
        }
    }
    return (left << half) | right;
}

/* The round keys: at most MAX_KEYS ints, each taken modulo 2**64. */
static Py_ssize_t read_keys(PyObject *keys_obj, uint64_t *keys)
{
    PyObject *seq = PySequence_Fast(keys_obj, "keys must be a sequence of ints");
    if (seq == NULL)
        return -1;
    Py_ssize_t nkeys = PySequence_Fast_GET_SIZE(seq);
    if (nkeys > MAX_KEYS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "at most %d keys, got %zd", MAX_KEYS, nkeys);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        keys[i] = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, i));
        if (keys[i] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return nkeys;
}

PyDoc_STRVAR(feistel_doc,
"feistel(x, out, half, keys, inverse)\n\n"
"out[i] = the Feistel network of order.py (one round per key, `half`-bit halves) at x[i], or\n"
"its inverse; x and out are uint64 arrays of one length (they may be the same array).");

static PyObject *feistel(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *x_obj, *out_obj, *keys_obj;
    int half, inverse;
    if (!PyArg_ParseTuple(args, "OOiOp", &x_obj, &out_obj, &half, &keys_obj, &inverse))
        return NULL;
    if (half < 1 || half > 32) {
        PyErr_Format(PyExc_ValueError, "half must be in [1, 32], got %d", half);
        return NULL;
    }
    uint64_t keys[MAX_KEYS];
    Py_ssize_t nkeys = read_keys(keys_obj, keys);
    if (nkeys < 0)
        return NULL;
    Py_buffer x = {0}, out = {0};
    if (uint64s(x_obj, &x, 0, "x") < 0)
        return NULL;
    if (uint64s(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (x.len != out.len) {
        PyErr_Format(PyExc_ValueError, "x and out differ in length (%zd, %zd)", x.len / 8,
                     out.len / 8);
        PyBuffer_Release(&x);
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint64_t *in = x.buf;
    uint64_t *to = out.buf, mask = (half == 32) ? UINT64_C(0xFFFFFFFF) : ((UINT64_C(1) << half) - 1);
    Py_ssize_t n = x.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        to[i] = network(in[i], half, mask, keys, nkeys, inverse);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(permutation_doc,
"permutation(n, half, keys, out)\n\n"
"out[i] (int64, n items) = the network at i, walked on (the network at the value) until it\n"
"falls in [0, n): bijection.py's keyed bijection of [0, n), its domain 2**(2*half) >= n.");

static PyObject *permutation(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *keys_obj, *out_obj;
    Py_ssize_t n;
    int half;
    if (!PyArg_ParseTuple(args, "niOO", &n, &half, &keys_obj, &out_obj))
        return NULL;
    if (half < 1 || half > 31 || n < 1 || (uint64_t)n > (UINT64_C(1) << (2 * half))) {
        PyErr_Format(PyExc_ValueError, "n %zd is not in a domain of 2**%d", n, 2 * half);
        return NULL;
    }
    uint64_t keys[MAX_KEYS];
    Py_ssize_t nkeys = read_keys(keys_obj, keys);
    if (nkeys < 0)
        return NULL;
    Py_buffer out = {0};
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (out.itemsize != 8 || out.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "out must hold %zd int64 items", n);
        PyBuffer_Release(&out);
        return NULL;
    }
    int64_t *to = out.buf;
    uint64_t mask = (UINT64_C(1) << half) - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t y = network((uint64_t)i, half, mask, keys, nkeys, 0);
        while (y >= (uint64_t)n)  /* a bijection of the domain: every walk ends */
            y = network(y, half, mask, keys, nkeys, 0);
        to[i] = (int64_t)y;
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"feistel", feistel, METH_VARARGS, feistel_doc},
    {"permutation", permutation, METH_VARARGS, permutation_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_feistel", "order.py's Feistel network in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__feistel(void)
{
    return PyModule_Create(&module);
}

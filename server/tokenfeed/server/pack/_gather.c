/* Range copies between buffers: the memory moves of serving (a chunk's documents laid out as
 * its row buffer, a batch's rows cut from row buffers) in one call, and, where the caller
 * asks, with the GIL released, so the serving thread runs while a layout thread copies. The
 * numpy twin and the contract are in gather.py; both give the same bytes. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A contiguous int64 array argument as a Py_buffer of `n` items. */
static int int64s(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") && strcmp(f, "l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 array, not format '%s'", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gather_doc,
"gather(dst, dst_at, sources, which, src_at, lengths, itemsize, release_gil)\n\n"
"For each i, copy lengths[i] items from sources[which[i]] at item src_at[i] into dst at item\n"
"dst_at[i]. Every range is checked against its buffer first (ValueError, nothing copied);\n"
"with release_gil the copies run with the GIL released.");

static PyObject *gather(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dst_obj, *dst_at_obj, *sources, *which_obj, *src_at_obj, *len_obj;
    Py_ssize_t itemsize;
    int release_gil;
    if (!PyArg_ParseTuple(args, "OOOOOOnp", &dst_obj, &dst_at_obj, &sources, &which_obj,
                          &src_at_obj, &len_obj, &itemsize, &release_gil))
        return NULL;
    if (itemsize < 1) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be at least 1");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(sources, "sources must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(seq);
    Py_buffer dst = {0}, dst_at = {0}, which = {0}, src_at = {0}, lens = {0};
    Py_buffer *srcs = PyMem_Calloc(nsrc ? nsrc : 1, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (srcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    for (; got < nsrc; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &srcs[got],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    if (int64s(dst_at_obj, &dst_at, "dst_at") < 0)
        goto done;
    if (int64s(which_obj, &which, "which") < 0)
        goto done;
    if (int64s(src_at_obj, &src_at, "src_at") < 0)
        goto done;
    if (int64s(len_obj, &lens, "lengths") < 0)
        goto done;
    Py_ssize_t n = dst_at.len / 8;
    if (which.len / 8 != n || src_at.len / 8 != n || lens.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "dst_at, which, src_at and lengths differ in length "
                     "(%zd, %zd, %zd, %zd)", n, which.len / 8, src_at.len / 8, lens.len / 8);
        goto done;
    }
    const int64_t *to = dst_at.buf, *from = src_at.buf, *len = lens.buf, *k = which.buf;
    int64_t dst_items = dst.len / itemsize;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < 0 || k[i] >= nsrc) {
            PyErr_Format(PyExc_ValueError, "range %zd reads source %lld of %zd", i,
                         (long long)k[i], nsrc);
            goto done;
        }
        int64_t src_items = srcs[k[i]].len / itemsize;
        if (len[i] < 0 || from[i] < 0 || to[i] < 0 || from[i] > src_items - len[i] ||
            to[i] > dst_items - len[i]) {
            PyErr_Format(PyExc_ValueError,
                         "range %zd: %lld items from %lld of a source of %lld to %lld of a "
                         "destination of %lld", i, (long long)len[i], (long long)from[i],
                         (long long)src_items, (long long)to[i], (long long)dst_items);
            goto done;
        }
    }
    char *out = dst.buf;
    PyThreadState *saved = release_gil ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        memmove(out + to[i] * itemsize, (const char *)srcs[k[i]].buf + from[i] * itemsize,
                (size_t)(len[i] * itemsize));
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&srcs[j]);
    PyMem_Free(srcs);
    if (dst.obj)
        PyBuffer_Release(&dst);
    if (dst_at.obj)
        PyBuffer_Release(&dst_at);
    if (which.obj)
        PyBuffer_Release(&which);
    if (src_at.obj)
        PyBuffer_Release(&src_at);
    if (lens.obj)
        PyBuffer_Release(&lens);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather", "Range copies between buffers (gather.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gather(void)
{
    return PyModule_Create(&module);
}

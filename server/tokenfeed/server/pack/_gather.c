/* Range copies between buffers: the memory moves of serving (a chunk's documents laid out as
 * its row buffer, a batch's rows cut from row buffers) in one call, and, where the caller
 * asks, with the GIL released, so the serving thread runs while a layout thread copies. The
 * numpy twin and the contract are in gather.py; both give the same bytes. */

#include "_buffers.h"

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

/* The first index of s[0..n) (ascending) at or past v. */
static Py_ssize_t lower_bound(const int64_t *s, Py_ssize_t n, int64_t v)
{
    Py_ssize_t a = 0, b = n;
    while (a < b) {
        Py_ssize_t m = a + (b - a) / 2;
        if (s[m] < v)
            a = m + 1;
        else
            b = m;
    }
    return a;
}

PyDoc_STRVAR(row_starts_doc,
"row_starts(starts, which, lo, seq_len, splits)\n\n"
"Row r is positions [lo[r], lo[r] + seq_len + 1) of buffer which[r], whose document starts are\n"
"starts[which[r]] (ascending int64). Returns a bytearray of the int64 starts inside the rows,\n"
"row after row, each as a position in its row (1 .. seq_len - 1), and writes the int32 row\n"
"splits into `splits` (rows + 1 items). The GIL is kept throughout.");

static PyObject *row_starts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *sources, *which_obj, *lo_obj, *splits_obj;
    Py_ssize_t seq_len;
    if (!PyArg_ParseTuple(args, "OOOnO", &sources, &which_obj, &lo_obj, &seq_len, &splits_obj))
        return NULL;
    PyObject *seq = PySequence_Fast(sources, "starts must be a sequence of int64 arrays");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(seq);
    Py_buffer which = {0}, lo = {0}, splits = {0};
    Py_buffer *srcs = PyMem_Calloc(nsrc ? nsrc : 1, sizeof(Py_buffer));
    Py_ssize_t *first = NULL, got = 0;
    PyObject *result = NULL;
    if (srcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < nsrc; got++)
        if (int64s(PySequence_Fast_GET_ITEM(seq, got), &srcs[got], "a buffer's starts") < 0)
            goto done;
    if (int64s(which_obj, &which, "which") < 0 || int64s(lo_obj, &lo, "lo") < 0)
        goto done;
    if (PyObject_GetBuffer(splits_obj, &splits,
                           PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        goto done;
    Py_ssize_t rows = which.len / 8;
    if (lo.len / 8 != rows) {
        PyErr_Format(PyExc_ValueError, "which and lo differ in length (%zd, %zd)", rows,
                     lo.len / 8);
        goto done;
    }
    if (splits.itemsize != 4 || splits.len / 4 != rows + 1) {
        PyErr_Format(PyExc_ValueError, "splits must hold %zd int32 items", rows + 1);
        goto done;
    }
    if (seq_len < 1) {
        PyErr_SetString(PyExc_ValueError, "seq_len must be at least 1");
        goto done;
    }
    const int64_t *k = which.buf, *at = lo.buf;
    first = PyMem_Malloc((size_t)(rows ? rows : 1) * 2 * sizeof(Py_ssize_t));
    if (first == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *last = first + rows, total = 0;
    int32_t *split = splits.buf;
    split[0] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (k[r] < 0 || k[r] >= nsrc) {
            PyErr_Format(PyExc_ValueError, "row %zd reads buffer %lld, outside the %zd given", r,
                         (long long)k[r], nsrc);
            goto done;
        }
        const int64_t *s = srcs[k[r]].buf;
        Py_ssize_t n = srcs[k[r]].len / 8;
        first[r] = lower_bound(s, n, at[r] + 1);
        last[r] = lower_bound(s, n, at[r] + seq_len);
        if (last[r] < first[r])  /* seq_len 1: no position inside the row */
            last[r] = first[r];
        total += last[r] - first[r];
        if (total > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "more than 2**31 starts in one call");
            goto done;
        }
        split[r + 1] = (int32_t)total;
    }
    result = PyByteArray_FromStringAndSize(NULL, total * 8);
    if (result == NULL)
        goto done;
    int64_t *out = (int64_t *)PyByteArray_AS_STRING(result);
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int64_t *s = srcs[k[r]].buf;
        for (Py_ssize_t i = first[r]; i < last[r]; i++)
            *out++ = s[i] - at[r];
    }
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&srcs[j]);
    PyMem_Free(srcs);
    PyMem_Free(first);
    if (which.obj)
        PyBuffer_Release(&which);
    if (lo.obj)
        PyBuffer_Release(&lo);
    if (splits.obj)
        PyBuffer_Release(&splits);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"row_starts", row_starts, METH_VARARGS, row_starts_doc},
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

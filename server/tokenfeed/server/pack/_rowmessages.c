/* A group's serialized messages made in one pass each, the rows copied straight from their
 * row buffers into the message, the fingerprint taken over them there: `messages` from each
 * batch's head and tail made by the caller, `batch_messages` from the pieces a stream's
 * messages share and each batch's own fields, written here. The contract and the twin that
 * runs without a C compiler are in rowmessages.py; both make the same bytes. */

#include "_buffers.h"

/* A group's rows: batch b is rows b * per .. (b + 1) * per - 1; row r is row_bytes bytes of
 * source k[r] from its item from[r]. */
typedef struct {
    PyObject *seq;
    Py_buffer *srcs, which, src_at;
    Py_ssize_t nsrc, got, batches, per, itemsize, row_bytes;
    const int64_t *k, *from;
} Rows;

static void rows_close(Rows *g)
{
    for (Py_ssize_t j = 0; j < g->got; j++)
        PyBuffer_Release(&g->srcs[j]);
    PyMem_Free(g->srcs);
    if (g->which.obj)
        PyBuffer_Release(&g->which);
    if (g->src_at.obj)
        PyBuffer_Release(&g->src_at);
    Py_XDECREF(g->seq);
}

/* Opens and checks every row (ValueError naming the first that fails); -1 on an error, and
 * rows_close is called either way. */
static int rows_open(Rows *g, PyObject *sources, PyObject *which, PyObject *src_at,
                     Py_ssize_t batches, Py_ssize_t span, Py_ssize_t itemsize)
{
    memset(g, 0, sizeof(*g));
    if (itemsize < 1 || span < 0) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be at least 1, span >= 0");
        return -1;
    }
    g->seq = PySequence_Fast(sources, "sources must be a sequence of buffers");
    if (g->seq == NULL)
        return -1;
    g->nsrc = PySequence_Fast_GET_SIZE(g->seq);
    g->srcs = PyMem_Calloc(g->nsrc ? g->nsrc : 1, sizeof(Py_buffer));
    if (g->srcs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (; g->got < g->nsrc; g->got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(g->seq, g->got), &g->srcs[g->got],
                               PyBUF_C_CONTIGUOUS) < 0)
            return -1;
    if (int64s(which, &g->which, "which") < 0 || int64s(src_at, &g->src_at, "src_at") < 0)
        return -1;
    Py_ssize_t rows = g->which.len / 8;
    if (g->src_at.len / 8 != rows) {
        PyErr_Format(PyExc_ValueError, "which and src_at differ in length (%zd, %zd)", rows,
                     g->src_at.len / 8);
        return -1;
    }
    if (batches < 1 || rows % batches) {
        PyErr_Format(PyExc_ValueError, "%zd rows are not %zd batches of one shape", rows,
                     batches);
        return -1;
    }
    g->k = g->which.buf;
    g->from = g->src_at.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (g->k[r] < 0 || g->k[r] >= g->nsrc) {
            PyErr_Format(PyExc_ValueError, "row %zd reads source %lld of %zd", r,
                         (long long)g->k[r], g->nsrc);
            return -1;
        }
        int64_t items = g->srcs[g->k[r]].len / itemsize;
        if (g->from[r] < 0 || g->from[r] > items - span) {
            PyErr_Format(PyExc_ValueError, "row %zd: %zd items from %lld of a source of %lld",
                         r, span, (long long)g->from[r], (long long)items);
            return -1;
        }
    }
    g->batches = batches;
    g->per = rows / batches;
    g->itemsize = itemsize;
    g->row_bytes = span * itemsize;
    return 0;
}

typedef struct {
    const char *p;
    Py_ssize_t n;
} Piece;

#define MOST_PIECES 12

/* How a batch's fingerprint is made: by a callback, fingerprint(b, view) with a read-only
 * view of its rows as copied; or here, as hasher(header) updated with the rows, then each of
 * `also` (the batch's starts and row splits), its hexdigest() taken. */
typedef struct {
    PyObject *fingerprint, *hasher, *header;
    Piece also[2];
} Fp;

/* obj.update(a read-only view of n bytes at p), the view released after; -1 on an error. */
static int update(PyObject *obj, PyObject *name, const char *p, Py_ssize_t n)
{
    PyObject *view = PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
    if (view == NULL)
        return -1;
    PyObject *done = PyObject_CallMethodOneArg(obj, name, view);
    /* Released whether or not the update raised; its error is the one kept. */
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *released = PyObject_CallMethod(view, "release", NULL);
    Py_DECREF(view);
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, trace);
    }
    int ok = done != NULL && released != NULL;
    Py_XDECREF(done);
    Py_XDECREF(released);
    return ok ? 0 : -1;
}

static PyObject *s_update, *s_hexdigest;

/* The fingerprint of rows [p, p + n) by `fp`'s hasher: a new str, or NULL. */
static PyObject *hashed(const Fp *fp, const char *p, Py_ssize_t n)
{
    PyObject *h = PyObject_CallOneArg(fp->hasher, fp->header);
    if (h == NULL)
        return NULL;
    int bad = update(h, s_update, p, n) < 0;
    for (int i = 0; i < 2 && !bad; i++)
        bad = update(h, s_update, fp->also[i].p, fp->also[i].n) < 0;
    PyObject *out = bad ? NULL : PyObject_CallMethodNoArgs(h, s_hexdigest);
    Py_DECREF(h);
    return out;
}

/* Batch b's message: the head's pieces, fp_len bytes left for the fingerprint, the tail's
 * pieces, then its rows; the fingerprint (`Fp`: a str of fp_len ASCII characters) fills its
 * place. */
static PyObject *message(const Rows *g, Py_ssize_t b, const Piece *head, int nh,
                         const Piece *tail, int nt, Py_ssize_t fp_len, const Fp *how)
{
    Py_ssize_t before = 0, after = 0;
    for (int i = 0; i < nh; i++)
        before += head[i].n;
    for (int i = 0; i < nt; i++)
        after += tail[i].n;
    Py_ssize_t at = before + fp_len + after, size = g->per * g->row_bytes;
    PyObject *msg = PyBytes_FromStringAndSize(NULL, at + size);
    if (msg == NULL)
        return NULL;
    char *m = PyBytes_AS_STRING(msg), *w = m;
    for (int i = 0; i < nh; w += head[i].n, i++)
        memcpy(w, head[i].p, (size_t)head[i].n);
    w += fp_len;
    for (int i = 0; i < nt; w += tail[i].n, i++)
        memcpy(w, tail[i].p, (size_t)tail[i].n);
    for (Py_ssize_t r = 0; r < g->per; r++) {
        Py_ssize_t row = b * g->per + r;
        const char *src = (const char *)g->srcs[g->k[row]].buf;
        memcpy(m + at + r * g->row_bytes, src + g->from[row] * g->itemsize,
               (size_t)g->row_bytes);
    }
    PyObject *fp = NULL, *view = NULL;
    if (how->fingerprint == NULL) {
        fp = hashed(how, m + at, size);
    } else {
        view = PyMemoryView_FromMemory(m + at, size, PyBUF_READ);
        PyObject *index = view ? PyLong_FromSsize_t(b) : NULL;
        fp = index ? PyObject_CallFunctionObjArgs(how->fingerprint, index, view, NULL) : NULL;
        Py_XDECREF(index);
    }
    if (view != NULL) {
        /* Released whether or not the callback raised; its error is the one kept. */
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyObject *released = PyObject_CallMethod(view, "release", NULL);
        Py_DECREF(view);
        if (released == NULL)
            Py_CLEAR(fp);
        Py_XDECREF(released);
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Restore(type, value, trace);
        }
    }
    Py_ssize_t fl = 0;
    const char *fs = fp != NULL && PyUnicode_Check(fp) && PyUnicode_IS_ASCII(fp)
                         ? PyUnicode_AsUTF8AndSize(fp, &fl) : NULL;
    if (fs == NULL || fl != fp_len) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "batch %zd's fingerprint is not a str of %zd "
                         "characters", b, fp_len);
        Py_XDECREF(fp);
        Py_DECREF(msg);
        return NULL;
    }
    memcpy(m + before, fs, (size_t)fp_len);
    Py_DECREF(fp);
    return msg;
}

/* msg as item b of *out; on its failure (NULL) the list is dropped, which ends the call's loop. */
static void put(PyObject **out, Py_ssize_t b, PyObject *msg)
{
    if (msg == NULL)
        Py_CLEAR(*out);
    else
        PyList_SET_ITEM(*out, b, msg);
}

PyDoc_STRVAR(messages_doc,
"messages(heads, tails, sources, which, src_at, span, itemsize, fp_len, fingerprint)\n\n"
"A group's serialized messages, one bytes object per batch, each made in one pass: batch i is\n"
"heads[i], a fingerprint of fp_len ASCII characters, tails[i], then its rows, row after row:\n"
"row r (rows / len(heads) rows a batch) is span items of sources[which[r]] from item\n"
"src_at[r]. Every row is checked first (ValueError, nothing made). Once batch i's rows are\n"
"copied, fingerprint(i, view) is called with a read-only memoryview of those rows (released\n"
"when the call returns) and its str, of fp_len ASCII characters, fills the fingerprint's\n"
"place: no message leaves this call before it is whole. The GIL is kept.");

static PyObject *messages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *heads, *tails, *sources, *which, *src_at, *fingerprint;
    Py_ssize_t span, itemsize, fp_len;
    if (!PyArg_ParseTuple(args, "O!O!OOOnnnO", &PyList_Type, &heads, &PyList_Type, &tails,
                          &sources, &which, &src_at, &span, &itemsize, &fp_len, &fingerprint))
        return NULL;
    if (fp_len < 0 || !PyCallable_Check(fingerprint)) {
        PyErr_SetString(PyExc_ValueError, "fp_len must be >= 0, fingerprint callable");
        return NULL;
    }
    Py_ssize_t batches = PyList_GET_SIZE(heads);
    if (PyList_GET_SIZE(tails) != batches) {
        PyErr_Format(PyExc_ValueError, "%zd heads for %zd tails", batches,
                     PyList_GET_SIZE(tails));
        return NULL;
    }
    for (Py_ssize_t b = 0; b < batches; b++)
        if (!PyBytes_Check(PyList_GET_ITEM(heads, b)) ||
            !PyBytes_Check(PyList_GET_ITEM(tails, b))) {
            PyErr_Format(PyExc_TypeError, "batch %zd's head and tail must be bytes", b);
            return NULL;
        }
    Rows g;
    PyObject *out = NULL;
    if (rows_open(&g, sources, which, src_at, batches, span, itemsize) < 0)
        goto done;
    out = PyList_New(batches);
    for (Py_ssize_t b = 0; out != NULL && b < batches; b++) {
        PyObject *h = PyList_GET_ITEM(heads, b), *t = PyList_GET_ITEM(tails, b);
        Piece head = {PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h)};
        Piece tail = {PyBytes_AS_STRING(t), PyBytes_GET_SIZE(t)};
        Fp how = {fingerprint, NULL, NULL, {{NULL, 0}, {NULL, 0}}};
        put(&out, b, message(&g, b, &head, 1, &tail, 1, fp_len, &how));
    }
done:
    rows_close(&g);
    return out;
}

/* v as a protobuf varint (a negative int64 as its 10-byte two's complement) into out. */
static Py_ssize_t varint(char *out, int64_t v)
{
    uint64_t u = (uint64_t)v;
    Py_ssize_t n = 0;
    for (; u > 0x7F; u >>= 7)
        out[n++] = (char)((u & 0x7F) | 0x80);
    out[n++] = (char)u;
    return n;
}

PyDoc_STRVAR(batch_messages_doc,
"batch_messages(parts, tags, steps, epochs, starts, start_at, splits, splits_each, sources,\n"
"               which, src_at, span, itemsize, fp_len, hasher, header)\n\n"
"`messages` with each batch's head and tail written here. parts: four bytes (a, b, c, d);\n"
"tags: four one-byte field keys (t0 .. t3). Batch i's head is a, the varint field t0 of\n"
"steps[i] (left out where 0), b; its tail the varint field t1 of epochs[i] (left out where 0),\n"
"c, the length-delimited field t2 of starts[start_at[i]:start_at[i + 1]] and t3 of\n"
"splits[i * splits_each:(i + 1) * splits_each] (each left out where empty), d. len(steps)\n"
"batches; start_at holds len(steps) + 1 ascending byte offsets. Batch i's fingerprint is made\n"
"here: hasher(header), updated with its rows as copied, its starts, then its row splits (each a\n"
"read-only memoryview, released after), and its hexdigest(), a str of fp_len ASCII characters.");

static PyObject *batch_messages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts, *tags, *steps_obj, *epochs_obj, *starts_obj, *start_at_obj, *splits_obj;
    PyObject *sources, *which, *src_at, *hasher, *header;
    Py_ssize_t splits_each, span, itemsize, fp_len;
    if (!PyArg_ParseTuple(args, "O!SOOOOOnOOOnnnOS", &PyTuple_Type, &parts, &tags, &steps_obj,
                          &epochs_obj, &starts_obj, &start_at_obj, &splits_obj, &splits_each,
                          &sources, &which, &src_at, &span, &itemsize, &fp_len, &hasher,
                          &header))
        return NULL;
    if (fp_len < 0 || splits_each < 0 || !PyCallable_Check(hasher)) {
        PyErr_SetString(PyExc_ValueError, "fp_len and splits_each must be >= 0, hasher callable");
        return NULL;
    }
    if (PyTuple_GET_SIZE(parts) != 4 || PyBytes_GET_SIZE(tags) != 4) {
        PyErr_SetString(PyExc_ValueError, "parts must be 4 bytes objects, tags 4 bytes");
        return NULL;
    }
    Piece part[4];
    for (int i = 0; i < 4; i++) {
        PyObject *p = PyTuple_GET_ITEM(parts, i);
        if (!PyBytes_Check(p)) {
            PyErr_Format(PyExc_TypeError, "part %d must be bytes", i);
            return NULL;
        }
        part[i] = (Piece){PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p)};
    }
    const char *tag = PyBytes_AS_STRING(tags);
    Rows g = {0};
    Py_buffer steps = {0}, epochs = {0}, starts = {0}, start_at = {0}, splits = {0};
    PyObject *out = NULL;
    if (int64s(steps_obj, &steps, "steps") < 0 || int64s(epochs_obj, &epochs, "epochs") < 0 ||
        int64s(start_at_obj, &start_at, "start_at") < 0 ||
        PyObject_GetBuffer(starts_obj, &starts, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(splits_obj, &splits, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t batches = steps.len / 8;
    const int64_t *step = steps.buf, *epoch = epochs.buf, *cut = start_at.buf;
    if (epochs.len / 8 != batches || start_at.len / 8 != batches + 1) {
        PyErr_Format(PyExc_ValueError, "%zd steps, %zd epochs and %zd start offsets: want "
                     "one epoch a step and one offset more", batches, epochs.len / 8,
                     start_at.len / 8);
        goto done;
    }
    for (Py_ssize_t b = 0; b < batches; b++)
        if (cut[b] < 0 || cut[b + 1] < cut[b] || cut[b + 1] > starts.len) {
            PyErr_Format(PyExc_ValueError, "batch %zd's starts [%lld, %lld) are not inside "
                         "the %zd bytes given", b, (long long)cut[b], (long long)cut[b + 1],
                         starts.len);
            goto done;
        }
    if (splits_each * batches > splits.len) {
        PyErr_Format(PyExc_ValueError, "%zd batches of %zd bytes of row splits: %zd given",
                     batches, splits_each, splits.len);
        goto done;
    }
    if (rows_open(&g, sources, which, src_at, batches, span, itemsize) < 0)
        goto done;
    out = PyList_New(batches);
    for (Py_ssize_t b = 0; out != NULL && b < batches; b++) {
        char v[4][10];
        Piece head[MOST_PIECES], tail[MOST_PIECES];
        int nh = 0, nt = 0;
        head[nh++] = part[0];
        if (step[b]) {
            head[nh++] = (Piece){tag, 1};
            head[nh++] = (Piece){v[0], varint(v[0], step[b])};
        }
        head[nh++] = part[1];
        if (epoch[b]) {
            tail[nt++] = (Piece){tag + 1, 1};
            tail[nt++] = (Piece){v[1], varint(v[1], epoch[b])};
        }
        tail[nt++] = part[2];
        Py_ssize_t n = (Py_ssize_t)(cut[b + 1] - cut[b]);
        if (n) {
            tail[nt++] = (Piece){tag + 2, 1};
            tail[nt++] = (Piece){v[2], varint(v[2], n)};
            tail[nt++] = (Piece){(const char *)starts.buf + cut[b], n};
        }
        if (splits_each) {
            tail[nt++] = (Piece){tag + 3, 1};
            tail[nt++] = (Piece){v[3], varint(v[3], splits_each)};
            tail[nt++] = (Piece){(const char *)splits.buf + b * splits_each, splits_each};
        }
        tail[nt++] = part[3];
        Fp how = {NULL, hasher, header,
                  {{(const char *)starts.buf + cut[b], n},
                   {(const char *)splits.buf + b * splits_each, splits_each}}};
        put(&out, b, message(&g, b, head, nh, tail, nt, fp_len, &how));
    }
done:
    rows_close(&g);
    PyBuffer_Release(&steps);
    PyBuffer_Release(&epochs);
    PyBuffer_Release(&start_at);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&splits);
    return out;
}

static PyMethodDef methods[] = {
    {"messages", messages, METH_VARARGS, messages_doc},
    {"batch_messages", batch_messages, METH_VARARGS, batch_messages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rowmessages", "A group's messages made in C (rowmessages.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowmessages(void)
{
    s_update = PyUnicode_InternFromString("update");
    s_hexdigest = PyUnicode_InternFromString("hexdigest");
    if (s_update == NULL || s_hexdigest == NULL)
        return NULL;
    return PyModule_Create(&module);
}

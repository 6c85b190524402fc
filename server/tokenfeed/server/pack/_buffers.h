/* Buffer arguments shared by the server's C extensions (_gather.c, _rowmessages.c). */

#ifndef TOKENFEED_BUFFERS_H
#define TOKENFEED_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A contiguous int64 array argument as a Py_buffer of `view->len / 8` items. */
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

#endif

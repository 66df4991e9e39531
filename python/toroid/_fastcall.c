/* toroid._fastcall: the blocking all-reduce and broadcast of the Python binding (on numpy
 * buffers and on addresses), called without ctypes (issue 36: a 4 KiB all-reduce through ctypes costs ~5 us of argument conversion and
 * Python-level checks on top of the library's ~3 us).
 *
 * A CPython extension on the stable ABI of Python 3.11 (Py_LIMITED_API: the buffer protocol
 * entered it in 3.11), built by setup.py where a C compiler and Python's headers exist; where it
 * is absent the binding calls the same functions through ctypes (python/toroid/_lib.py).
 *
 * It does not link to libtoroid.so: _lib.py hands it the addresses of the functions in the
 * library it loaded (bind), so both paths reach the one library instance, whichever file
 * TOROID_LIBRARY names, and the width in bytes of each toroid_datatype, so that the element
 * count passed to the library is derived here from the buffer's own length.
 *
 * Private: the binding calls it. A call that cannot take this path (a buffer that is not
 * C-contiguous, a read-only output, an element size that does not match the type, an unbound
 * module) returns NOT_TAKEN, with no exception set, and the binding takes its general path,
 * which gives the usual errors. The GIL is released while the library runs, as ctypes does. */

#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>

/* The library's signatures (include/toroid.h): the enums are C ints, the result too. */
typedef int (*all_reduce_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int op);
typedef int (*broadcast_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int root);

#define NOT_TAKEN (-1)
#define MAX_TYPES 64

static all_reduce_fn all_reduce_ptr;
static broadcast_fn broadcast_ptr;
static unsigned char widths[MAX_TYPES]; /* bytes per element of toroid_datatype i; 0: unknown */

/* bind(all_reduce_address, broadcast_address, widths: bytes) */
static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bind(all_reduce, broadcast, widths)");
        return NULL;
    }
    void *ar = PyLong_AsVoidPtr(args[0]);
    void *bc = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred())
        return NULL;
    char *w;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(args[2], &w, &n) < 0)
        return NULL;
    if (ar == NULL || bc == NULL || n <= 0 || n > MAX_TYPES) {
        PyErr_SetString(PyExc_ValueError, "bind: null function or bad widths");
        return NULL;
    }
    memset(widths, 0, sizeof widths);
    memcpy(widths, w, (size_t)n);
    all_reduce_ptr = (all_reduce_fn)ar;
    broadcast_ptr = (broadcast_fn)bc;
    Py_RETURN_NONE;
}

/* The element width of a toroid_datatype code, or 0. */
static size_t width_of(long dtype) {
    return dtype >= 0 && dtype < MAX_TYPES ? widths[dtype] : 0;
}

/* A C-contiguous view of obj (writable if asked) whose items are `width` bytes; 0 if obj cannot
 * be one (the error is cleared: the caller takes the general path). */
static int view_of(PyObject *obj, Py_buffer *view, int writable, size_t width) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->len < 0 || (size_t)view->itemsize != width || (size_t)view->len % width != 0) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* Reads args[first..first+count) as C longs; 0 (with the exception set) if one is not an int. */
static int longs(PyObject *const *args, Py_ssize_t first, Py_ssize_t count, long *out) {
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = PyLong_AsLong(args[first + i]);
        if (out[i] == -1 && PyErr_Occurred())
            return 0;
    }
    return 1;
}

/* all_reduce(comm, send, recv_or_None, dtype, op) -> toroid_result, or NOT_TAKEN.
 * recv None: in place in send. */
static PyObject *all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long dtype_op[2];
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "all_reduce(comm, send, recv, dtype, op)");
        return NULL;
    }
    void *comm = PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred() || !longs(args, 3, 2, dtype_op))
        return NULL;
    size_t width = width_of(dtype_op[0]);
    if (all_reduce_ptr == NULL || width == 0)
        return PyLong_FromLong(NOT_TAKEN);
    int in_place = args[2] == Py_None || args[2] == args[1];
    Py_buffer send, recv;
    if (!view_of(args[1], &send, in_place, width))
        return PyLong_FromLong(NOT_TAKEN);
    if (!in_place && !view_of(args[2], &recv, 1, width)) {
        PyBuffer_Release(&send);
        return PyLong_FromLong(NOT_TAKEN);
    }
    if (!in_place && recv.len != send.len) {
        PyBuffer_Release(&recv);
        PyBuffer_Release(&send);
        return PyLong_FromLong(NOT_TAKEN);
    }
    void *out = in_place ? send.buf : recv.buf;
    size_t count = (size_t)send.len / width;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = all_reduce_ptr(comm, send.buf, out, count, (int)dtype_op[0], (int)dtype_op[1]);
    Py_END_ALLOW_THREADS
    if (!in_place)
        PyBuffer_Release(&recv);
    PyBuffer_Release(&send);
    return PyLong_FromLong(code);
}

/* broadcast(comm, buf, dtype, root) -> toroid_result, or NOT_TAKEN: in place in buf (the root
 * sends it, the others receive into it). */
static PyObject *broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long dtype_root[2];
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "broadcast(comm, buf, dtype, root)");
        return NULL;
    }
    void *comm = PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred() || !longs(args, 2, 2, dtype_root))
        return NULL;
    size_t width = width_of(dtype_root[0]);
    if (broadcast_ptr == NULL || width == 0 || dtype_root[1] < INT_MIN || dtype_root[1] > INT_MAX)
        return PyLong_FromLong(NOT_TAKEN);
    Py_buffer buf;
    if (!view_of(args[1], &buf, 1, width))
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = broadcast_ptr(comm, buf.buf, buf.buf, (size_t)buf.len / width, (int)dtype_root[0], (int)dtype_root[1]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromLong(code);
}

/* all_reduce_addr(comm, send, recv, count, dtype, op) -> toroid_result: on raw addresses (the
 * torch backend's dense CPU tensors, whose sizes it has checked), as the ctypes call it replaces:
 * the same trust in the addresses as ctypes.CDLL's function objects give. */
static PyObject *all_reduce_addr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long dtype_op[2];
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "all_reduce_addr(comm, send, recv, count, dtype, op)");
        return NULL;
    }
    void *comm = PyLong_AsVoidPtr(args[0]);
    void *send = PyLong_AsVoidPtr(args[1]);
    void *recv = PyLong_AsVoidPtr(args[2]);
    size_t count = PyLong_AsSize_t(args[3]);
    if (PyErr_Occurred() || !longs(args, 4, 2, dtype_op))
        return NULL;
    if (all_reduce_ptr == NULL || width_of(dtype_op[0]) == 0)
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = all_reduce_ptr(comm, send, recv, count, (int)dtype_op[0], (int)dtype_op[1]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

/* broadcast_addr(comm, send, recv, count, dtype, root) -> toroid_result: on raw addresses, as
 * all_reduce_addr. */
static PyObject *broadcast_addr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long dtype_root[2];
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "broadcast_addr(comm, send, recv, count, dtype, root)");
        return NULL;
    }
    void *comm = PyLong_AsVoidPtr(args[0]);
    void *send = PyLong_AsVoidPtr(args[1]);
    void *recv = PyLong_AsVoidPtr(args[2]);
    size_t count = PyLong_AsSize_t(args[3]);
    if (PyErr_Occurred() || !longs(args, 4, 2, dtype_root))
        return NULL;
    if (broadcast_ptr == NULL || width_of(dtype_root[0]) == 0 || dtype_root[1] < INT_MIN || dtype_root[1] > INT_MAX)
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = broadcast_ptr(comm, send, recv, count, (int)dtype_root[0], (int)dtype_root[1]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, "bind(all_reduce, broadcast, widths)"},
    {"all_reduce", (PyCFunction)(void (*)(void))all_reduce, METH_FASTCALL,
     "all_reduce(comm, send, recv_or_None, dtype, op) -> toroid_result, or -1 (not taken)"},
    {"broadcast", (PyCFunction)(void (*)(void))broadcast, METH_FASTCALL,
     "broadcast(comm, buf, dtype, root) -> toroid_result, or -1 (not taken)"},
    {"all_reduce_addr", (PyCFunction)(void (*)(void))all_reduce_addr, METH_FASTCALL,
     "all_reduce_addr(comm, send, recv, count, dtype, op) -> toroid_result, or -1 (not taken)"},
    {"broadcast_addr", (PyCFunction)(void (*)(void))broadcast_addr, METH_FASTCALL,
     "broadcast_addr(comm, send, recv, count, dtype, root) -> toroid_result, or -1 (not taken)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "toroid._fastcall",
    "The binding's blocking all-reduce and broadcast without ctypes (private; see _lib.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    return PyModule_Create(&module);
}

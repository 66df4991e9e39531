/* toroid._fastcall: the blocking all-reduce and broadcast of the Python binding (on numpy
 * buffers and on addresses) and of the torch backend (torch's dist.all_reduce and
 * dist.broadcast of one CPU tensor, blocking or async), the async all-reduce on addresses, and
 * the wait and free of every async call's work, called without ctypes (issue 36: a 4 KiB
 * all-reduce through ctypes costs ~5 us of argument conversion and Python-level checks on top of
 * the library's ~3 us, and through the torch backend's Python checks about as much again).
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
#include <stdint.h>
#include <string.h>

/* The library's signatures (include/toroid.h): the enums are C ints, the result too. */
typedef int (*all_reduce_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int op);
typedef int (*broadcast_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int root);
typedef int (*all_reduce_async_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int op,
                                   void **work);
typedef int (*broadcast_async_fn)(void *comm, const void *send, void *recv, size_t count, int dtype, int root,
                                  void **work);
typedef int (*work_wait_fn)(void *work, int64_t timeout_ms);
typedef void (*work_free_fn)(void *work);

#define NOT_TAKEN (-1)
#define MAX_TYPES 64

static all_reduce_fn all_reduce_ptr;
static broadcast_fn broadcast_ptr;
static all_reduce_async_fn all_reduce_async_ptr; /* the async forms, bound by bind_async */
static broadcast_async_fn broadcast_async_ptr;
static work_wait_fn work_wait_ptr;
static work_free_fn work_free_ptr;
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

/* The arguments of the calls on raw addresses: (comm, send, recv, count, dtype, op or root). */
struct addr_args {
    void *comm, *send, *recv;
    size_t count;
    long dtype, last;
};

/* Parses them into *a; 0 (with the exception set: TypeError naming `usage`) if they do not fit. */
static int addr_args(PyObject *const *args, Py_ssize_t nargs, const char *usage, struct addr_args *a) {
    long dtype_last[2];
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, usage);
        return 0;
    }
    a->comm = PyLong_AsVoidPtr(args[0]);
    a->send = PyLong_AsVoidPtr(args[1]);
    a->recv = PyLong_AsVoidPtr(args[2]);
    a->count = PyLong_AsSize_t(args[3]);
    if (PyErr_Occurred() || !longs(args, 4, 2, dtype_last))
        return 0;
    a->dtype = dtype_last[0];
    a->last = dtype_last[1];
    return 1;
}

/* all_reduce_addr(comm, send, recv, count, dtype, op) -> toroid_result: on raw addresses (the
 * torch backend's dense CPU tensors, whose sizes it has checked), as the ctypes call it replaces:
 * the same trust in the addresses as ctypes.CDLL's function objects give. */
static PyObject *all_reduce_addr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct addr_args a;
    if (!addr_args(args, nargs, "all_reduce_addr(comm, send, recv, count, dtype, op)", &a))
        return NULL;
    if (all_reduce_ptr == NULL || width_of(a.dtype) == 0)
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = all_reduce_ptr(a.comm, a.send, a.recv, a.count, (int)a.dtype, (int)a.last);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

/* broadcast_addr(comm, send, recv, count, dtype, root) -> toroid_result: on raw addresses, as
 * all_reduce_addr. */
static PyObject *broadcast_addr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct addr_args a;
    if (!addr_args(args, nargs, "broadcast_addr(comm, send, recv, count, dtype, root)", &a))
        return NULL;
    if (broadcast_ptr == NULL || width_of(a.dtype) == 0 || a.last < INT_MIN || a.last > INT_MAX)
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = broadcast_ptr(a.comm, a.send, a.recv, a.count, (int)a.dtype, (int)a.last);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

/* ---- async calls and their wait ------------------------------------------------------------
 * An async call through ctypes costs its caller three foreign calls with their argument
 * conversions (the call, toroid_work_wait, toroid_work_free); these take all three. */

/* bind_async(all_reduce_async, broadcast_async, work_wait, work_free): the addresses of those
 * functions. */
static PyObject *bind_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bind_async(all_reduce_async, broadcast_async, work_wait, work_free)");
        return NULL;
    }
    void *ar = PyLong_AsVoidPtr(args[0]);
    void *bc = PyLong_AsVoidPtr(args[1]);
    void *ww = PyLong_AsVoidPtr(args[2]);
    void *wf = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (ar == NULL || bc == NULL || ww == NULL || wf == NULL) {
        PyErr_SetString(PyExc_ValueError, "bind_async: null function");
        return NULL;
    }
    all_reduce_async_ptr = (all_reduce_async_fn)ar;
    broadcast_async_ptr = (broadcast_async_fn)bc;
    work_wait_ptr = (work_wait_fn)ww;
    work_free_ptr = (work_free_fn)wf;
    Py_RETURN_NONE;
}

/* work_free(work) -> None: toroid_work_free (it does not block: freeing an unfinished work does
 * not cancel it). `work` is the address of a live toroid_work, freed once (the binding's Work
 * drops its address as it frees it). */
static PyObject *work_free(PyObject *self, PyObject *arg) {
    (void)self;
    void *work = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred())
        return NULL;
    if (work_free_ptr != NULL && work != NULL)
        work_free_ptr(work);
    Py_RETURN_NONE;
}

/* work_wait(work, timeout_ms) -> toroid_result: toroid_work_wait, the GIL released. `work` is
 * the address of a live toroid_work (the binding's Work holds it until it frees it). */
static PyObject *work_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "work_wait(work, timeout_ms)");
        return NULL;
    }
    void *work = PyLong_AsVoidPtr(args[0]);
    int64_t ms = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (work_wait_ptr == NULL || work == NULL)
        return PyLong_FromLong(NOT_TAKEN);
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = work_wait_ptr(work, ms);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

/* An issued async call's answer: (toroid_result, work address or 0). */
static PyObject *issued(int code, void *work) {
    PyObject *c = PyLong_FromLong(code);
    PyObject *w = c != NULL ? PyLong_FromVoidPtr(code == 0 ? work : NULL) : NULL;
    PyObject *pair = w != NULL ? PyTuple_Pack(2, c, w) : NULL;
    Py_XDECREF(c);
    Py_XDECREF(w);
    return pair;
}

/* all_reduce_addr_async(comm, send, recv, count, dtype, op) -> (toroid_result, work), or -1
 * (not taken): all_reduce_addr, queued. */
static PyObject *all_reduce_addr_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct addr_args a;
    if (!addr_args(args, nargs, "all_reduce_addr_async(comm, send, recv, count, dtype, op)", &a))
        return NULL;
    if (all_reduce_async_ptr == NULL || width_of(a.dtype) == 0)
        return PyLong_FromLong(NOT_TAKEN);
    void *work = NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = all_reduce_async_ptr(a.comm, a.send, a.recv, a.count, (int)a.dtype, (int)a.last, &work);
    Py_END_ALLOW_THREADS
    return issued(code, work);
}

/* ---- the torch backend's blocking all-reduce and broadcast (python/toroid/torch/) ----------
 * torch's dist.all_reduce(tensor) calls ProcessGroupToroid.allreduce([tensor], opts), and
 * dist.broadcast(tensor, src) its broadcast([tensor], opts); with asyncOp False torch takes a
 * None work as done. In Python, the checks that pick the blocking call (the options' type,
 * asyncOp, timeout and reduceOp; the tensor's type, device, layout, contiguity and element type)
 * cost about as much as a 4 KiB all-reduce itself (issue 36). torch_all_reduce and
 * torch_broadcast make the same checks here; a call they do not pass, or an attribute that is not
 * what torch gives (any exception is cleared), is NOT_TAKEN, and the group's Python method takes
 * it as before. The bitwise operators and PREMUL_SUM stay the Python path's. */

static PyObject *t_tensor;       /* torch.Tensor */
static PyObject *t_allreduce;    /* torch.distributed.AllreduceOptions */
static PyObject *t_broadcast;    /* torch.distributed.BroadcastOptions */
static PyObject *t_timedelta;    /* datetime.timedelta */
static PyObject *t_no_timeout;   /* timedelta(0): torch's "none" (its unset value is below it) */
static PyObject *t_strided;      /* torch.strided */
static PyObject *t_dtypes;       /* {torch.dtype: toroid_datatype code} */
#define MAX_OPS 16
static int op_codes[MAX_OPS];    /* toroid_reduce_op of torch's RedOpType number i; -1: not here */
static PyObject *s_wire, *s_comm, *s_handle, *s_async, *s_timeout, *s_reduce_op, *s_root, *s_is_cpu, *s_layout,
    *s_is_contiguous, *s_dtype, *s_numel, *s_data_ptr;

/* bind_torch(Tensor, AllreduceOptions, BroadcastOptions, timedelta, timedelta(0), strided,
 *            dtypes, ops: {RedOpType number: toroid_reduce_op}) */
static PyObject *bind_torch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2]) ||
        !PyType_Check(args[3]) || !PyDict_Check(args[6]) || !PyDict_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "bind_torch(Tensor, AllreduceOptions, BroadcastOptions, timedelta, "
                                         "no_timeout, strided, dtypes, ops)");
        return NULL;
    }
    int codes[MAX_OPS];
    for (int i = 0; i < MAX_OPS; i++)
        codes[i] = -1;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args[7], &pos, &key, &value)) {
        long k = PyLong_AsLong(key), v = PyLong_AsLong(value);
        if (PyErr_Occurred())
            return NULL;
        if (k < 0 || k >= MAX_OPS || v < 0 || v > INT_MAX) {
            PyErr_SetString(PyExc_ValueError, "bind_torch: an operator number out of range");
            return NULL;
        }
        codes[k] = (int)v;
    }
    static const char *names[] = {"_wire", "_comm", "_handle", "asyncOp", "timeout", "reduceOp", "rootRank",
                                  "is_cpu", "layout", "is_contiguous", "dtype", "numel", "data_ptr"};
    PyObject **interned[] = {&s_wire, &s_comm, &s_handle, &s_async, &s_timeout, &s_reduce_op, &s_root,
                             &s_is_cpu, &s_layout, &s_is_contiguous, &s_dtype, &s_numel, &s_data_ptr};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*interned[i] == NULL && (*interned[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    }
    PyObject **kept[] = {&t_tensor, &t_allreduce, &t_broadcast, &t_timedelta, &t_no_timeout,
                         &t_strided, &t_dtypes};
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
        PyObject *old = *kept[i];
        Py_INCREF(args[i]);
        *kept[i] = args[i];
        Py_XDECREF(old);
    }
    memcpy(op_codes, codes, sizeof op_codes);
    Py_RETURN_NONE;
}

/* getattr(obj, name) is `want` (by identity); 0 for anything else. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(obj, name);
    int is = v == want;
    Py_XDECREF(v);
    return is;
}

/* obj.name() is `want` (by identity); 0 for anything else. */
static int call_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *m = PyObject_GetAttr(obj, name);
    PyObject *v = m != NULL ? PyObject_CallNoArgs(m) : NULL;
    int is = v == want;
    Py_XDECREF(v);
    Py_XDECREF(m);
    return is;
}

/* An int (obj.name(), or obj.name itself when `call` is 0) that fits a size_t, in *out; 0 if
 * it is not one. */
static int size_attr(PyObject *obj, PyObject *name, int call, size_t *out) {
    PyObject *m = PyObject_GetAttr(obj, name);
    PyObject *v = m != NULL && call ? PyObject_CallNoArgs(m) : m;
    if (call)
        Py_XDECREF(m);
    int ok = v != NULL && PyLong_Check(v);
    if (ok) {
        *out = PyLong_AsSize_t(v);
        ok = !PyErr_Occurred();
    }
    Py_XDECREF(v);
    return ok;
}

/* How the options (of the exact type `type`, with no timeout of their own: a timedelta <= 0)
 * ask for the call: BLOCKING (asyncOp False: what a blocking call gives, as _waits_at_once in
 * Python), ASYNC (asyncOp True, where the async functions are bound), else 0 (not taken). */
#define BLOCKING 1
#define ASYNC 2
static int call_mode(PyObject *opts, PyObject *type) {
    if ((PyObject *)Py_TYPE(opts) != type)
        return 0;
    PyObject *v = PyObject_GetAttr(opts, s_async);
    int async = v != NULL ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    if (async < 0 || (async == 1 && work_wait_ptr == NULL))
        return 0;
    v = PyObject_GetAttr(opts, s_timeout);
    int none = v != NULL && Py_IS_TYPE(v, (PyTypeObject *)t_timedelta)
                   ? PyObject_RichCompareBool(v, t_no_timeout, Py_LE)
                   : -1;
    Py_XDECREF(v);
    return none != 1 ? 0 : async ? ASYNC : BLOCKING;
}

/* toroid's operator for the options' reduceOp, or -1. torch's ReduceOp hashes as the number of
 * its RedOpType (a PREMUL_SUM with its factor too: not in the table), one attribute read and one
 * hash instead of a comparison per operator; the binding checks that for the torch it runs with
 * before it binds (torch/_fastpath.py). */
static int op_of(PyObject *opts) {
    PyObject *op = PyObject_GetAttr(opts, s_reduce_op);
    Py_hash_t h = op != NULL ? PyObject_Hash(op) : -1;
    Py_XDECREF(op);
    return h >= 0 && h < MAX_OPS ? op_codes[h] : -1;
}

/* The one tensor of `tensors` (a list of one torch.Tensor), when it is dense, contiguous, on the
 * CPU and of a toroid type (as _dense_type in Python): its type code, element count and address. */
struct dense {
    int dtype;
    size_t count;
    void *addr;
};

static int dense_cpu(PyObject *tensors, struct dense *out) {
    if (!PyList_CheckExact(tensors) || PyList_Size(tensors) != 1)
        return 0;
    PyObject *t = PyList_GetItem(tensors, 0); /* borrowed; the list holds it */
    if (t == NULL || !PyObject_TypeCheck(t, (PyTypeObject *)t_tensor) || !attr_is(t, s_is_cpu, Py_True) ||
        !attr_is(t, s_layout, t_strided) || !call_is(t, s_is_contiguous, Py_True))
        return 0;
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    PyObject *code = dtype != NULL ? PyDict_GetItemWithError(t_dtypes, dtype) : NULL; /* borrowed */
    long d = code != NULL ? PyLong_AsLong(code) : -1;
    Py_XDECREF(dtype);
    size_t addr;
    if (width_of(d) == 0 || !size_attr(t, s_numel, 1, &out->count) || !size_attr(t, s_data_ptr, 1, &addr))
        return 0;
    out->dtype = (int)d;
    out->addr = (void *)addr;
    return 1;
}

/* The group's communicator handle (group._comm._handle); NULL when it has none (destroyed: the
 * Python path says so) or when the group has a wire type of its own (compression). */
static void *comm_of(PyObject *group) {
    if (!attr_is(group, s_wire, Py_None))
        return NULL;
    PyObject *comm = PyObject_GetAttr(group, s_comm);
    PyObject *h = comm != NULL ? PyObject_GetAttr(comm, s_handle) : NULL;
    void *handle = h != NULL && PyLong_Check(h) ? PyLong_AsVoidPtr(h) : NULL;
    Py_XDECREF(h);
    Py_XDECREF(comm);
    return handle;
}

/* torch_all_reduce(group, tensors, opts) -> toroid_result, or NOT_TAKEN: the blocking in-place
 * all-reduce (SUM, PRODUCT, MIN, MAX or AVG) of one dense contiguous CPU tensor on the group's
 * communicator; with asyncOp True, the same call queued: (toroid_result, work), the caller
 * keeping the tensor alive until the work is done. */
static PyObject *torch_all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "torch_all_reduce(group, tensors, opts)");
        return NULL;
    }
    struct dense t;
    void *comm;
    int op = -1, mode = 0;
    if (all_reduce_ptr == NULL || t_tensor == NULL || !(mode = call_mode(args[2], t_allreduce)) ||
        (op = op_of(args[2])) < 0 || !dense_cpu(args[1], &t) || (comm = comm_of(args[0])) == NULL) {
        PyErr_Clear();
        return PyLong_FromLong(NOT_TAKEN);
    }
    int code;
    void *work = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (mode == ASYNC)
        code = all_reduce_async_ptr(comm, t.addr, t.addr, t.count, t.dtype, op, &work);
    else
        code = all_reduce_ptr(comm, t.addr, t.addr, t.count, t.dtype, op);
    Py_END_ALLOW_THREADS
    return mode == ASYNC ? issued(code, work) : PyLong_FromLong(code);
}

/* torch_broadcast(group, tensors, opts) -> toroid_result, or NOT_TAKEN: the blocking in-place
 * broadcast of one dense contiguous CPU tensor from opts.rootRank; with asyncOp True, queued, as
 * torch_all_reduce. */
static PyObject *torch_broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "torch_broadcast(group, tensors, opts)");
        return NULL;
    }
    struct dense t;
    void *comm;
    size_t root;
    int mode = 0;
    if (broadcast_ptr == NULL || t_tensor == NULL || !(mode = call_mode(args[2], t_broadcast)) ||
        !size_attr(args[2], s_root, 0, &root) || root > INT_MAX || !dense_cpu(args[1], &t) ||
        (comm = comm_of(args[0])) == NULL) {
        PyErr_Clear();
        return PyLong_FromLong(NOT_TAKEN);
    }
    int code;
    void *work = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (mode == ASYNC)
        code = broadcast_async_ptr(comm, t.addr, t.addr, t.count, t.dtype, (int)root, &work);
    else
        code = broadcast_ptr(comm, t.addr, t.addr, t.count, t.dtype, (int)root);
    Py_END_ALLOW_THREADS
    return mode == ASYNC ? issued(code, work) : PyLong_FromLong(code);
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
    {"bind_async", (PyCFunction)(void (*)(void))bind_async, METH_FASTCALL,
     "bind_async(all_reduce_async, broadcast_async, work_wait, work_free)"},
    {"work_free", work_free, METH_O, "work_free(work) -> None"},
    {"work_wait", (PyCFunction)(void (*)(void))work_wait, METH_FASTCALL,
     "work_wait(work, timeout_ms) -> toroid_result, or -1 (not taken)"},
    {"all_reduce_addr_async", (PyCFunction)(void (*)(void))all_reduce_addr_async, METH_FASTCALL,
     "all_reduce_addr_async(comm, send, recv, count, dtype, op) -> (toroid_result, work), or -1 (not taken)"},
    {"bind_torch", (PyCFunction)(void (*)(void))bind_torch, METH_FASTCALL,
     "bind_torch(Tensor, AllreduceOptions, BroadcastOptions, timedelta, timedelta(0), strided, dtypes, ops)"},
    {"torch_all_reduce", (PyCFunction)(void (*)(void))torch_all_reduce, METH_FASTCALL,
     "torch_all_reduce(group, tensors, opts) -> toroid_result, (toroid_result, work) if async, or -1 (not taken)"},
    {"torch_broadcast", (PyCFunction)(void (*)(void))torch_broadcast, METH_FASTCALL,
     "torch_broadcast(group, tensors, opts) -> toroid_result, (toroid_result, work) if async, or -1 (not taken)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "toroid._fastcall",
    "The binding's all-reduce, broadcast and work wait without ctypes (private; see _lib.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    return PyModule_Create(&module);
}

# Declarations shared by the files included into cext/codec.pyx (compiled as
# the extension module awa_fast._codec); codec.pyx includes this file first.

from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t


cdef extern from "Python.h":
    # Member descriptors (the slots of a msgspec Struct / a __slots__ class).
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags

    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

    PyTypeObject PyMemberDescr_Type

    # The few PyTypeObject fields Cython's own declaration leaves out.
    ctypedef struct _TypeView "PyTypeObject":
        Py_ssize_t tp_basicsize
        Py_ssize_t tp_itemsize
        Py_ssize_t tp_dictoffset
        Py_ssize_t tp_weaklistoffset
        unsigned long tp_flags
        void* tp_alloc
        void* tp_free
        void* tp_init

    unsigned long Py_TPFLAGS_HAVE_GC

    PyObject* PyType_GenericAlloc(PyTypeObject* type, Py_ssize_t nitems) except NULL
    # addresses, to compare with a type's tp_alloc / tp_free
    void* GENERIC_ALLOC_ADDR "((void*)&PyType_GenericAlloc)"
    void* OBJECT_FREE_ADDR "((void*)&PyObject_Free)"

    # Bytes built in place; _PyBytes_Resize grows/shrinks a bytes object we own alone.
    PyObject* _bytes_new "PyBytes_FromStringAndSize" (const char* v, Py_ssize_t n) except NULL
    int _PyBytes_Resize(PyObject** string, Py_ssize_t newsize) except -1
    char* _bytes_data "PyBytes_AS_STRING" (PyObject* o)


cdef extern from *:
    """
    /* Value of an int that fits 60 bits without calling into the C API
       (one or two 30-bit digits on 3.11; "compact" ints on 3.12+).
       Returns 0 when the caller must take the general path. */
    static inline int awa_small_long(PyObject *o, int64_t *out) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
        return 0;
    #else
    #if PyLong_SHIFT == 30
        const digit *d = ((PyLongObject *)o)->ob_digit;
        switch (Py_SIZE(o)) {
            case 0: *out = 0; return 1;
            case 1: *out = (int64_t)d[0]; return 1;
            case -1: *out = -(int64_t)d[0]; return 1;
            case 2: *out = (int64_t)d[0] | ((int64_t)d[1] << 30); return 1;
            case -2: *out = -((int64_t)d[0] | ((int64_t)d[1] << 30)); return 1;
            default: return 0;
        }
    #else
        (void)o; (void)out;
        return 0;
    #endif
    #endif
    }
    """
    bint awa_small_long(object o, int64_t* out) noexcept


# Member type of an object slot (Py_T_OBJECT_EX / T_OBJECT_EX): part of the stable ABI.
cdef enum:
    MEMBER_T_OBJECT_EX = 16


# COPY stream framing: 11-byte signature + int32 flags + int32 extension length; int16 -1.
cdef enum:
    HEADER_LEN = 19
    TRAILER_LEN = 2


# Integer column types, indexes into the range tables in codec.pyx.
cdef enum:
    INT2 = 0
    INT4 = 1
    INT8 = 2


# A bytes object under construction (we hold its only reference).
cdef struct Writer:
    PyObject* buf
    Py_ssize_t len
    Py_ssize_t cap


# Big-endian stores; gcc/clang turn the shifts into one bswap + store.
cdef inline char* put_u16(char* p, uint16_t v) noexcept nogil:
    cdef unsigned char* q = <unsigned char*>p
    q[0] = <unsigned char>(v >> 8)
    q[1] = <unsigned char>v
    return p + 2


cdef inline char* put_u32(char* p, uint32_t v) noexcept nogil:
    cdef unsigned char* q = <unsigned char*>p
    q[0] = <unsigned char>(v >> 24)
    q[1] = <unsigned char>(v >> 16)
    q[2] = <unsigned char>(v >> 8)
    q[3] = <unsigned char>v
    return p + 4


cdef inline char* put_u64(char* p, uint64_t v) noexcept nogil:
    cdef unsigned char* q = <unsigned char*>p
    q[0] = <unsigned char>(v >> 56)
    q[1] = <unsigned char>(v >> 48)
    q[2] = <unsigned char>(v >> 40)
    q[3] = <unsigned char>(v >> 32)
    q[4] = <unsigned char>(v >> 24)
    q[5] = <unsigned char>(v >> 16)
    q[6] = <unsigned char>(v >> 8)
    q[7] = <unsigned char>v
    return p + 8


# One COPY field: int32 length, then the value.
cdef inline char* field_i16(char* p, int64_t v) noexcept nogil:
    return put_u16(put_u32(p, 2), <uint16_t>v)


cdef inline char* field_i32(char* p, int64_t v) noexcept nogil:
    return put_u32(put_u32(p, 4), <uint32_t>v)


cdef inline char* field_i64(char* p, int64_t v) noexcept nogil:
    return put_u64(put_u32(p, 8), <uint64_t>v)

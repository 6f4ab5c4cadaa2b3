# Included by codec.pyx. Conversion of one Python value into one COPY column.


cdef inline int64_t _int_arg(object value, str name, Py_ssize_t row, int typ) except? -1:
    """``operator.index(value)`` checked against the column type ``typ``.

    ``name``/``row`` only name the value in an error message (row -1: an argument).
    """
    cdef int64_t v
    if type(value) is int and awa_small_long(value, &v) and _LO[typ] <= v <= _HI[typ]:
        return v
    return _int_arg_general(value, name, row, typ)


cdef int64_t _int_arg_general(object value, str name, Py_ssize_t row, int typ) except? -1:
    cdef int overflow = 0
    cdef long long v
    if type(value) is not int:
        if not PyIndex_Check(value):
            raise _int_type_error(name, row, value)
        value = PyNumber_Index(value)
    v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow or v < _LO[typ] or v > _HI[typ]:
        raise _overflow(name, row, value, typ)
    return v


cdef const char* _text_arg(object value, str name, Py_ssize_t row, Py_ssize_t* size) except NULL:
    """UTF-8 of a str for a text column (valid while ``value`` lives)."""
    cdef const char* data
    if not isinstance(value, str):
        raise _text_type_error(name, row, value)
    data = PyUnicode_AsUTF8AndSize(value, size)
    if memchr(data, 0, size[0]) != NULL:
        raise _text_nul_error(name, row)
    return data


cdef inline char* _writer_reserve(Writer* w, Py_ssize_t need) except NULL:
    """Room for ``need`` more bytes; returns where to write them."""
    cdef Py_ssize_t cap
    if w.len + need > w.cap:
        cap = w.cap * 2
        if cap < w.len + need:
            cap = w.len + need
        _PyBytes_Resize(&w.buf, cap)
        w.cap = cap
    return _bytes_data(w.buf) + w.len


cdef object _writer_finish(Writer* w):
    """The bytes written so far (the writer gives up its buffer)."""
    if w.len != w.cap:
        _PyBytes_Resize(&w.buf, w.len)
        w.cap = w.len
    result = <object>w.buf
    Py_XDECREF(w.buf)
    w.buf = NULL
    return result

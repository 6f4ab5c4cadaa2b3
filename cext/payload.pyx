# Included by codec.pyx. check_payload: one recursive walk with direct type
# checks; nothing is allocated unless the payload is bad. On a bad value the
# walk returns 1 with ``trail`` = [message, innermost path part, ..., outermost].


# code points as uint32_t: Cython treats Py_UCS4 as a character (str) in arithmetic
cdef uint32_t _NO_BAD_CHAR = 0xFFFFFFFF


cdef inline uint32_t _bad_char(object s) noexcept:
    """First NUL or lone surrogate of a str, else _NO_BAD_CHAR (no encoding)."""
    cdef Py_ssize_t i, n = PyUnicode_GET_LENGTH(s)
    cdef unsigned int kind = PyUnicode_KIND(s)
    cdef void* data = PyUnicode_DATA(s)
    cdef uint32_t c
    if kind == PyUnicode_1BYTE_KIND:  # ASCII / Latin-1: no surrogates possible
        return 0 if memchr(data, 0, <size_t>n) != NULL else _NO_BAD_CHAR
    if kind == PyUnicode_2BYTE_KIND:
        for i in range(n):
            c = (<Py_UCS2*>data)[i]
            if c == 0 or (c & 0xF800) == 0xD800:
                return c
        return _NO_BAD_CHAR
    for i in range(n):
        c = (<uint32_t*>data)[i]
        if c == 0 or (c & 0xFFFFF800) == 0xD800:
            return c
    return _NO_BAD_CHAR


cdef int _walk(object obj, Py_ssize_t depth, Py_ssize_t max_depth, list trail) except -1:
    cdef PyObject* key
    cdef PyObject* value
    cdef Py_ssize_t pos, i
    cdef int overflow = 0
    cdef int64_t small
    cdef uint32_t c
    cdef type t = type(obj)
    if t is str:
        c = _bad_char(obj)
        if c == _NO_BAD_CHAR:
            return 0
        trail.append(_str_message(c, False))
        return 1
    if t is int:
        if awa_small_long(obj, &small):
            return 0
        PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow == 0:
            return 0
        trail.append(_INT_MSG)
        return 1
    if t is dict:
        if depth >= max_depth:
            trail.append(f"nesting deeper than max_depth={max_depth}")
            return 1
        pos = 0
        while PyDict_Next(obj, &pos, &key, &value):
            if type(<object>key) is not str:
                trail.append(
                    f"dict key of type {type(<object>key).__name__} is not a str "
                    "(JSON object keys must be plain str)"
                )
                return 1
            c = _bad_char(<object>key)
            if c != _NO_BAD_CHAR:
                trail.append(_str_message(c, True))
                trail.append(<object>key)
                return 1
            if _walk(<object>value, depth + 1, max_depth, trail):
                trail.append(<object>key)
                return 1
        return 0
    if t is float:
        if isfinite(PyFloat_AS_DOUBLE(obj)):
            return 0
        trail.append(
            f"float {float.__repr__(obj)} is not valid JSON (NaN and infinities are not allowed)"
        )
        return 1
    if t is list:
        if depth >= max_depth:
            trail.append(f"nesting deeper than max_depth={max_depth}")
            return 1
        # no Python code runs during the walk, so the list cannot change under us
        for i in range(PyList_GET_SIZE(obj)):
            if _walk(<object>PyList_GET_ITEM(obj, i), depth + 1, max_depth, trail):
                trail.append(i)
                return 1
        return 0
    if t is tuple:
        if depth >= max_depth:
            trail.append(f"nesting deeper than max_depth={max_depth}")
            return 1
        for i in range(PyTuple_GET_SIZE(obj)):
            if _walk(<object>PyTuple_GET_ITEM(obj, i), depth + 1, max_depth, trail):
                trail.append(i)
                return 1
        return 0
    if obj is None or t is bool:
        return 0
    trail.append(f"unsupported type {t.__name__}; {_TYPES_MSG}")
    return 1


def check_payload(obj, max_depth=32):
    """Raise :class:`~awa_fast.errors.PayloadError` if ``obj`` cannot be stored as jsonb.

    See ``awa_fast._pycodec`` for exactly what is accepted.
    """
    if type(max_depth) is not int:
        max_depth = PyNumber_Index(max_depth)
    if not 0 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth={max_depth} must be in 0..{MAX_DEPTH_LIMIT}")
    cdef list trail = []
    if _walk(obj, 0, <Py_ssize_t>max_depth, trail):
        raise PayloadError(trail[0], _format_path(reversed(trail[1:])))


def dump_payloads(objs, start, out, max_depth, limit, dumps):
    """Check and encode ``objs[start:]`` into ``out`` while they take the fast path.

    See ``awa_fast._pycodec.dump_payloads``.
    """
    if type(objs) is not list:
        raise TypeError(f"objs must be a list, not {type(objs).__name__}")
    if type(out) is not list:
        raise TypeError(f"out must be a list, not {type(out).__name__}")
    if type(max_depth) is not int:
        max_depth = PyNumber_Index(max_depth)
    if not 0 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth={max_depth} must be in 0..{MAX_DEPTH_LIMIT}")
    cdef Py_ssize_t i = PyNumber_Index(start)
    cdef Py_ssize_t lim = PyNumber_Index(limit)
    cdef Py_ssize_t depth = max_depth
    if i < 0:
        raise ValueError(f"start={i} must be >= 0")
    cdef list items = <list>objs
    cdef list dest = <list>out
    cdef list trail = []
    cdef object obj, data
    cdef type t
    # the size is read at every step: dumps is Python code and may change the list
    while i < PyList_GET_SIZE(items):
        obj = <object>PyList_GET_ITEM(items, i)
        t = type(obj)
        if t is not dict and t is not list:
            return i
        if _walk(obj, 0, depth, trail):
            return i
        try:
            data = dumps(obj)
        except Exception:
            return i
        if type(data) is not bytes or PyBytes_GET_SIZE(data) > lim:
            return i
        # keep a compact copy: orjson returns its bytes in a shrunken 1 KiB
        # allocation, and keeping 100,000s of those alive grows the heap by
        # one fresh chunk each (measured 5x slower than copying)
        dest.append(PyBytes_FromStringAndSize(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)))
        i += 1
    return i

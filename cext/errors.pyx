# Included by codec.pyx. Error messages (cold paths): the same strings as
# awa_fast/_pycodec.py builds; the unit tests compare the two.

_IDENT = _re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _format_path(parts):
    out = ["$"]
    for part in parts:
        if type(part) is int:
            out.append(f"[{part}]")
        elif _IDENT.fullmatch(part):
            out.append("." + part)
        else:
            out.append("[" + _json.dumps(part) + "]")
    return "".join(out)


cdef str _what(str name, Py_ssize_t row):
    return name if row < 0 else f"snapshots[{row}].{name}"


def _show_int(value):
    return str(value) if value.bit_length() <= 128 else f"<{value.bit_length()}-bit int>"


cdef object _int_type_error(str name, Py_ssize_t row, object value):
    return TypeError(f"{_what(name, row)} must be an int, not {type(value).__name__}")


cdef object _overflow(str name, Py_ssize_t row, object value, int typ):
    return OverflowError(
        f"{_what(name, row)}={_show_int(value)} does not fit {_TYPE_NAMES[typ]} "
        f"({_LO[typ]}..{_HI[typ]})"
    )


cdef object _text_type_error(str name, Py_ssize_t row, object value):
    return TypeError(f"{_what(name, row)} must be a str, not {type(value).__name__}")


cdef object _text_nul_error(str name, Py_ssize_t row):
    return ValueError(f"{_what(name, row)} contains NUL (\\x00), which PostgreSQL text rejects")


cdef str _str_message(uint32_t c, bint is_key):
    what = "dict key" if is_key else "str"
    if c == 0:
        return f"{what} contains NUL (\\u0000), which PostgreSQL jsonb rejects"
    return f"{what} contains lone surrogate U+{<long>c:04X}, which is not valid UTF-8"


_INT_MSG = "int outside the signed 64-bit range -2**63..2**63-1"
_TYPES_MSG = "allowed: None, bool, int, float, str, list, tuple, dict (exact types, not subclasses)"

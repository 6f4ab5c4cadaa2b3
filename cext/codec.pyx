# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""Compiled codec of awa-fast: payload checks, binary COPY encoders, snapshot decode.

Built from ``cext/codec.pyx`` (with the files it includes) as ``awa_fast._codec``.
Its pure-Python twin is ``awa_fast._pycodec``: same functions, same arguments,
same exceptions and messages, byte-identical output; read that module's
docstring for the decisions both follow. ``awa_fast._impl`` picks one.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.number cimport PyIndex_Check, PyNumber_Index
from cpython.object cimport Py_TYPE, PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.sequence cimport PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.unicode cimport (
    PyUnicode_1BYTE_KIND,
    PyUnicode_2BYTE_KIND,
    PyUnicode_AsUTF8AndSize,
    PyUnicode_DATA,
    PyUnicode_GET_LENGTH,
    PyUnicode_KIND,
    Py_UCS2,
)
from libc.math cimport isfinite
from libc.stdint cimport (
    INT16_MAX, INT16_MIN, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, int64_t, uint16_t, uint32_t,
)
from libc.string cimport memchr, memcpy

import json as _json
import re as _re

from awa_fast.errors import PayloadError
from awa_fast.jobs import ClaimSnapshot

__all__ = [
    "COPY_HEADER",
    "COPY_TRAILER",
    "MAX_DEPTH_LIMIT",
    "check_payload",
    "claim_summary",
    "decode_snapshots",
    "dump_payloads",
    "encode_closure_rows",
    "encode_done_rows",
    "encode_ready_rows",
    "flush_tally",
    "new_jobs",
    "raw_jsonb",
]

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
COPY_TRAILER = b"\xff\xff"
MAX_DEPTH_LIMIT = 512

cdef const char* _HEADER = b"PGCOPY\n\xff\r\n\x00\x00\x00\x00\x00\x00\x00\x00\x00"
cdef int64_t _LANE_ID_LIMIT = 1 << 23   # lane_id << 40 must stay inside int8
cdef int64_t _LANE_SEQ_LIMIT = 1LL << 40
cdef Py_ssize_t _FIELD_MAX = 0x7FFFFFFF  # int32 field length
cdef int64_t _STATE_COMPLETED = 1

cdef int64_t[3] _LO
cdef int64_t[3] _HI
_LO[INT2] = INT16_MIN
_LO[INT4] = INT32_MIN
_LO[INT8] = INT64_MIN
_HI[INT2] = INT16_MAX
_HI[INT4] = INT32_MAX
_HI[INT8] = INT64_MAX
_TYPE_NAMES = ("int2", "int4", "int8")


# Declarations and the inline big-endian writers. Included rather than found
# by name: the module is awa_fast._codec, so Cython would look for _codec.pxd.
include "codec.pxd"
include "errors.pyx"
include "fields.pyx"
include "payload.pyx"
include "snapshots.pyx"
include "flush.pyx"
include "copy_rows.pyx"

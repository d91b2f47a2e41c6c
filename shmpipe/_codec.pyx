# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Encodes a batch (nested tuple/list/dict of arrays and scalars) into a slot
payload without pickle, and decodes a payload into NumPy views of it.

Payload layout (little-endian; the payload starts on a page boundary)::

    0   u32  magic b"SPB1"
    4   u32  meta_nbytes
    8   u64  payload_nbytes   (prefix + meta + padding + data)
    16  meta: the structure, one node after another in prefix order
    D   data region, D = round_up(16 + meta_nbytes, 64); each array at an
        offset from D that is a multiple of 64, C order, its dtype's bytes

Meta nodes (one tag byte, then the node's fields)::

    'N' None   'F' False   'T' True
    'i' i64                        'I' u32 n, n bytes: int, two's complement
    'f' f64                        's' u32 n, n bytes UTF-8
    'b' u32 n, n bytes             '(' u32 n, n nodes (tuple)
    '[' u32 n, n nodes (list)      '{' u32 n, n x (u32 k, k bytes UTF-8 key, node)
    'a' dtype, u8 ndim, ndim x u64 shape, u64 offset        (array)
    'g' dtype, itemsize bytes                               (NumPy scalar)
    dtype: u16 n, n bytes of spec: a dtype.str ("<f4", "|S3"); "#" + the
           repr of numpy.lib.format.dtype_to_descr for structured dtypes;
           "@module:qualname" of the scalar type for registered user dtypes
           (ml_dtypes.bfloat16, for instance). The decoder looks these up
           in a closed table (see dtype_from_name): it never imports,
           evaluates or gets an attribute by a name it read, and never
           makes a dtype that holds Python objects.

The decoder checks every length and offset against the payload, so a
corrupted or hostile slot gives CorruptChannelError, never a crash.
"""

import ast
import re
import sys

import numpy as np
from numpy.lib import format as _npy_format

cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.module cimport PyModule_Check, PyModule_GetDict
from cpython.ref cimport Py_INCREF, PyObject, PyTypeObject
from cpython.type cimport PyType_IsSubtype
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from shmpipe import _batch
from shmpipe._batch import format_path
from shmpipe._spec import ArraySpec
from shmpipe.errors import BatchTypeError, CorruptChannelError

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    PyTypeObject PyArray_Type
    # Steals a reference to descr: declared with void* so the caller does the
    # INCREF by hand (new_array below, the one caller).
    object PyArray_NewFromDescr(PyTypeObject *subtype, void *descr, int nd,
                                cnp.npy_intp *dims, cnp.npy_intp *strides, void *data,
                                int flags, PyObject *obj)

cdef extern from "shmpipe_copy.h":
    void shmp_copy_out(void *dst, const void *src, size_t n) noexcept nogil

cdef extern from *:
    """
    static inline int shmp_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
        return __builtin_mul_overflow(a, b, out);
    }
    """
    bint shmp_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) noexcept nogil

cdef enum:
    MAX_DEPTH = 64            # nesting levels in a batch (_tree.MAX_DEPTH: _batch.TOO_DEEP says it)
    MAX_NDIM = 64             # NumPy's own limit
    COPY_NOGIL_BYTES = 65536  # copies at least this large release the GIL
cdef uint32_t PAYLOAD_MAGIC = 0x31425053  # b"SPB1"

cdef type _ndarray = np.ndarray
cdef type _generic = np.generic
cdef type _void = np.void


cdef inline Py_ssize_t _round_up(Py_ssize_t n, Py_ssize_t to) noexcept nogil:
    return (n + to - 1) // to * to


cdef inline Py_ssize_t data_start(Py_ssize_t meta_len) noexcept nogil:
    return _round_up(PAYLOAD_PREFIX + meta_len, ARRAY_ALIGN)


def dtype_name(dt):
    """The bytes that name dtype `dt` in a payload, or None if it cannot travel."""
    if dt.hasobject or dt.kind in "OT":
        return None
    if dt.fields is not None:
        spec = b"#" + repr(_npy_format.dtype_to_descr(dt)).encode()
    elif dt.num >= 256:  # a user dtype registered with NumPy (bfloat16 and friends)
        spec = f"@{dt.type.__module__}:{dt.type.__qualname__}".encode()
    else:
        spec = dt.str.encode()
    try:
        if dtype_from_name(spec) != dt:
            return None
    except Exception:
        return None
    return spec


# -- dtype names: a closed table ------------------------------------------------
#
# A payload names its dtypes in text another process wrote, so the text is
# looked up, never executed: no import, no getattr, no eval. A name is one of
#
#   * a NumPy built-in, exactly as dtype.str spells it ("<f4", "|S5",
#     "<M8[10s]"): byte order, a kind from _PLAIN_KINDS, a size that kind has;
#   * "#" + the repr of numpy.lib.format.dtype_to_descr of a structured dtype
#     whose leaves are such built-ins (parsed as a literal, checked field by
#     field, nesting and sizes bounded);
#   * "@module:qualname" of an extension dtype (ml_dtypes.bfloat16): found
#     only in a table this process builds from modules it has imported itself
#     (sys.modules), never by importing or by getting an attribute by name.
#
# Whatever is built must also spell its own name back exactly, so a name has
# one meaning, the one the encoder gave it.

_PLAIN_SPEC = re.compile(rb"([<>|])([A-Za-z?])([0-9]{1,10})(?:\[([0-9]{0,10})([A-Za-z]{1,7})\])?")
# NumPy's spellings of the object dtype, told apart for a clearer message.
_OBJECT_SPEC = re.compile(rb"[<>|=]?(?:O[0-9]{0,10}|object|object_)")
_DATETIME_UNITS = frozenset([b"Y", b"M", b"W", b"D", b"h", b"m", b"s", b"ms", b"us", b"ns",
                             b"ps", b"fs", b"as"])
_LONGDOUBLE_SIZE = np.dtype(np.longdouble).itemsize
_PLAIN_KINDS = {  # kind: the item sizes it comes in (None: any, up to _MAX_ITEMSIZE)
    ord("b"): (1,),
    ord("i"): (1, 2, 4, 8),
    ord("u"): (1, 2, 4, 8),
    ord("f"): (2, 4, 8, _LONGDOUBLE_SIZE),
    ord("c"): (8, 16, 2 * _LONGDOUBLE_SIZE),
    ord("M"): (8,),
    ord("m"): (8,),
    ord("S"): None,
    ord("U"): None,
    ord("V"): None,
}
# What repr() of a descr is made of: brackets, commas, spaces, decimal ints
# and quoted str with the escapes repr() writes. Text of anything else is
# refused before ast.literal_eval sees it, so a hostile name cannot make the
# compiler warn (SyntaxWarning on stderr) either. Unambiguous, so no
# backtracking: each token is told apart by its first character.
_STR_BODY = r"(?:[^{q}\\\n\r\x00]|\\(?:[\\'\"abfnrtv]|x[0-9a-fA-F]{{2}}|u[0-9a-fA-F]{{4}}|U[0-9a-fA-F]{{8}}))*"
_DESCR_TEXT = re.compile(
    r"(?:[\[\](), ]|[0-9]+(?![0-9])|'" + _STR_BODY.format(q="'") + "'|\"" + _STR_BODY.format(q='"') + "\")*"
)
_MAX_ITEMSIZE = 0x7FFFFFFF   # NumPy keeps an item's size in a C int
_MAX_STRUCT_DEPTH = 16       # structured dtypes inside structured dtypes
_MAX_SUBARRAY_NDIM = 32      # a field's subarray shape
_SPEC_CACHE_MAX = 1024       # names remembered (hostile payloads can name many)

# name -> dtype of NumPy's own dtypes already checked (names of extension
# dtypes are not kept: see dtype_from_name); bounded.
cdef dict _spec_cache = {}
# module name -> (module, len(its dict), {qualname: dtype}) of extension dtypes.
cdef dict _extension_tables = {}


cdef str _shown(bytes spec):
    """The name as an error message shows it: text where it is text, and not
    all of it where it is long (a hostile one may be 64 KiB)."""
    cdef bytes head = spec[:80]
    try:
        shown = repr(head.decode("utf-8"))
    except UnicodeDecodeError:
        shown = repr(head)
    return shown + ("..." if len(spec) > 80 else "")


def dtype_from_name(bytes spec):
    """The dtype `spec` names; CorruptChannelError if it names none shmpipe
    makes from shared memory. Runs no code the name chooses."""
    dt = _spec_cache.get(spec)
    if dt is not None:
        return dt
    if spec[:1] == b"@":
        # Not cached here: whether this process has imported the module is
        # asked again by every Decoder (each keeps what it found).
        dt = _extension_dtype(spec)
        _refuse_references(dt, _shown(spec))
        return dt
    if spec[:1] == b"#":
        dt = _structured_dtype(spec)
    else:
        dt = _plain_dtype(spec, spec)
    _refuse_references(dt, _shown(spec))
    if len(_spec_cache) >= _SPEC_CACHE_MAX:
        _spec_cache.clear()
    _spec_cache[spec] = dt
    return dt


cdef object _plain_dtype(bytes name, bytes spec):
    """A NumPy built-in dtype, from its dtype.str (`name`, inside `spec`)."""
    if _OBJECT_SPEC.fullmatch(name) is not None:
        # Refused here already, before any dtype is made (see _refuse_references).
        raise CorruptChannelError(f"payload names dtype {_shown(name)}, which holds Python "
                                  "objects and is never made from shared memory")
    m = _PLAIN_SPEC.fullmatch(name)
    if m is None:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which is not a NumPy "
                                  "dtype shmpipe carries")
    _, kind, size, _, unit = m.groups()
    sizes = _PLAIN_KINDS.get(kind[0], False)
    if sizes is False:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose kind "
                                  f"{kind.decode()!r} is not one shmpipe carries")
    n = int(size)
    if (n not in sizes) if sizes is not None else (n * (4 if kind == b"U" else 1) > _MAX_ITEMSIZE):
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose item size is "
                                  "impossible for its kind")
    if unit is not None and (kind not in (b"M", b"m") or unit not in _DATETIME_UNITS):
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose time unit is "
                                  "not one of NumPy's")
    try:
        # The name is now one of the forms above: NumPy parses it as a
        # built-in type code, nothing else.
        dt = np.dtype(name.decode("ascii"))
    except Exception as exc:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which NumPy does "
                                  f"not accept: {exc}") from None
    if dt.num >= 256 or dt.str.encode("ascii") != name:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which is not spelled "
                                  "as shmpipe spells it")
    return dt


cdef object _structured_dtype(bytes spec):
    """A structured dtype from "#" + repr(dtype_to_descr(dt))."""
    try:
        text = spec[1:].decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptChannelError(f"payload names a structured dtype that is not UTF-8 text: "
                                  f"{spec!r}") from None
    if _DESCR_TEXT.fullmatch(text) is None:
        raise CorruptChannelError(f"payload names a structured dtype that is not a dtype "
                                  f"description: {_shown(spec)}")
    try:
        # A literal only (lists, tuples, str, int): literal_eval runs no code.
        # Its own limits (nesting, digits) raise, and so does anything else
        # odd about the text: every one of those is a corrupt name.
        descr = ast.literal_eval(text)
    except Exception as exc:
        raise CorruptChannelError(f"payload names a structured dtype that cannot be read: "
                                  f"{_shown(spec)} ({type(exc).__name__})") from None
    if type(descr) is not list:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which is not a "
                                  "structured dtype")
    dt = _descr_dtype(descr, spec, 0)
    try:
        same = repr(_npy_format.dtype_to_descr(dt)).encode("utf-8") == spec[1:]
    except Exception:
        same = False
    if not same:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which is not spelled "
                                  "as shmpipe spells it")
    return dt


cdef object _descr_dtype(object descr, bytes spec, int depth):
    """numpy.lib.format.descr_to_dtype for a checked descr: every leaf a
    built-in, names str, shapes small tuples of ints, sizes bounded."""
    cdef Py_ssize_t offset = 0
    if depth > _MAX_STRUCT_DEPTH:
        raise CorruptChannelError(f"payload names a structured dtype nested more than "
                                  f"{_MAX_STRUCT_DEPTH} levels deep")
    if type(descr) is str:
        try:
            leaf = (<str>descr).encode("ascii")
        except UnicodeEncodeError:
            raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose field "
                                      f"type {descr!r} is not a NumPy dtype shmpipe carries") from None
        return _plain_dtype(leaf, spec)
    if type(descr) is not list:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose fields are "
                                  "not a list")
    names = []
    formats = []
    titles = []
    offsets = []
    for field in <list>descr:
        if type(field) is not tuple or not (2 <= len(<tuple>field) <= 3):
            raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose fields "
                                      "are not (name, type[, shape])")
        name = field[0]
        if type(name) is tuple and len(<tuple>name) == 2:
            title, name = name
            if type(title) is not str:
                raise CorruptChannelError(f"payload names dtype {_shown(spec)}, with a "
                                          "field title that is not text")
        else:
            title = None
        if type(name) is not str:
            raise CorruptChannelError(f"payload names dtype {_shown(spec)}, with a field "
                                      "name that is not text")
        dt = _descr_dtype(field[1], spec, depth + 1)
        if len(<tuple>field) == 3:
            dt = _subarray(dt, field[2], spec)
        # Unnamed void fields are the padding dtype_to_descr writes out, as
        # numpy.lib.format.descr_to_dtype reads them.
        if not (name == "" and dt.type is np.void and dt.names is None):
            names.append(name)
            formats.append(dt)
            titles.append(title)
            offsets.append(offset)
        offset += dt.itemsize
        if offset > _MAX_ITEMSIZE:
            raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose item size "
                                      "is impossible")
    try:
        return np.dtype({"names": names, "formats": formats, "titles": titles,
                         "offsets": offsets, "itemsize": offset})
    except Exception as exc:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which NumPy does "
                                  f"not accept: {exc}") from None


cdef object _subarray(object dt, object shape, bytes spec):
    """`dt` with a subarray `shape` (a field "('c', '<i4', (2, 3))")."""
    cdef Py_ssize_t itemsize = dt.itemsize
    if type(shape) is not tuple or len(<tuple>shape) > _MAX_SUBARRAY_NDIM:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, with a field shape "
                                  "that is not a short tuple")
    for dim in <tuple>shape:
        if type(dim) is not int or not (0 <= dim <= _MAX_ITEMSIZE):
            raise CorruptChannelError(f"payload names dtype {_shown(spec)}, with a field "
                                      "shape that is not sizes")
        itemsize = itemsize * dim if itemsize * dim <= _MAX_ITEMSIZE else _MAX_ITEMSIZE + 1
    if itemsize > _MAX_ITEMSIZE:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, whose item size is "
                                  "impossible")
    try:
        return np.dtype((dt, shape))
    except Exception as exc:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which NumPy does "
                                  f"not accept: {exc}") from None


cdef object _extension_dtype(bytes spec):
    """An extension dtype ("@ml_dtypes:bfloat16") of a module this process has
    imported itself; the name only selects from what that module defines."""
    try:
        module, sep, qualname = spec[1:].decode("utf-8").partition(":")
    except UnicodeDecodeError:
        raise CorruptChannelError(f"payload names an extension dtype that is not UTF-8 text: "
                                  f"{spec!r}") from None
    if not sep:
        raise CorruptChannelError(f"payload names extension dtype {_shown(spec)} without "
                                  "module:name")
    mod = sys.modules.get(module)
    if mod is None:
        # Importing it would run code the payload chose (a module's import
        # is its code: "@this:s" printed the Zen of Python).
        raise CorruptChannelError(
            f"payload names dtype {_shown(spec)} from module {module!r}, which this process "
            "has not imported; shmpipe never imports a module named in shared memory (import "
            "it in the consumer first)"
        )
    dt = _extension_table(module, mod).get(qualname)
    if dt is None:
        raise CorruptChannelError(f"payload names dtype {_shown(spec)}, but module {module!r} "
                                  f"defines no NumPy extension dtype {qualname!r}")
    return dt


cdef dict _extension_table(str module, object mod):
    """{qualname: dtype} of the extension dtypes `mod` defines: the scalar
    types in its namespace that NumPy has registered (dtype.num >= 256),
    named as dtype_name names them. Built by walking the module's dict,
    not by looking names up, and reading only what runs no Python code:
    types whose metaclass is `type` itself."""
    cdef dict d
    cached = _extension_tables.get(module)
    if not PyModule_Check(mod):
        return {}
    d = <dict>PyModule_GetDict(mod)
    if cached is not None and cached[0] is mod and cached[1] == len(d):
        return cached[2]
    table = {}
    for value in list(d.values()):
        if type(value) is not type or not PyType_IsSubtype(<type>value, _generic):
            continue
        if PyType_IsSubtype(<type>value, _void):
            # NumPy asks a void subclass for a .dtype attribute: not ours to run.
            continue
        try:
            # type's own getters: they read the type's fields, run nothing.
            modname = value.__module__
            if type(modname) is not str or modname != module:
                continue
            dt = np.dtype(value)
            if dt.num >= 256 and not dt.hasobject and dt.type is value:
                table[value.__qualname__] = dt
        except Exception:
            continue
    _extension_tables[module] = (mod, len(d), table)
    return table


cdef int _refuse_references(object dt, str shown) except -1:
    # An array of a dtype that holds references is an array of PyObject
    # pointers: made over bytes another process wrote, each element is an
    # address it chose, and reading one dereferences it (the consumer
    # crashes, or worse). No such dtype is ever made from shared memory,
    # whichever way the payload spells it: "|O8", or a structured dtype with
    # an object field somewhere inside.
    if dt.hasobject:
        raise CorruptChannelError(
            f"payload names dtype {shown}, which holds Python objects and is never made "
            "from shared memory"
        )
    return 0


cdef class Encoder:
    """Turns a batch into a payload: plan() walks it, write() copies it.

    One per producer; it keeps its scratch buffers and dtype cache between
    batches. plan() needs no slot, so the slot is held only for the copy.
    """

    def __cinit__(self):
        self.meta_cap = 256
        self.meta = <char *>PyMem_Malloc(self.meta_cap)
        self.cap_arrays = 16
        self.offsets = <Py_ssize_t *>PyMem_Malloc(self.cap_arrays * sizeof(Py_ssize_t))
        self.sizes = <Py_ssize_t *>PyMem_Malloc(self.cap_arrays * sizeof(Py_ssize_t))
        if self.meta == NULL or self.offsets == NULL or self.sizes == NULL:
            raise MemoryError()
        self.arrays = []
        self.path = []
        self.dtype_specs = {}

    def __dealloc__(self):
        PyMem_Free(self.meta)
        PyMem_Free(self.offsets)
        PyMem_Free(self.sizes)

    # -- meta buffer ----------------------------------------------------------

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        cdef char *grown
        if self.meta_len + n <= self.meta_cap:
            return 0
        cap = self.meta_cap
        while cap < self.meta_len + n:
            cap *= 2
        grown = <char *>PyMem_Realloc(self.meta, cap)
        if grown == NULL:
            raise MemoryError()
        self.meta = grown
        self.meta_cap = cap
        return 0

    cdef int _put(self, const void *src, Py_ssize_t n) except -1:
        self._reserve(n)
        memcpy(self.meta + self.meta_len, src, n)
        self.meta_len += n
        return 0

    cdef int _tag(self, char tag) except -1:
        return self._put(&tag, 1)

    cdef int _u32(self, Py_ssize_t v) except -1:
        cdef uint32_t x
        if v > 0xFFFFFFFF:
            self._fail("too long (more than 2**32 - 1 items or bytes)")
        x = <uint32_t>v
        return self._put(&x, 4)

    cdef int _blob(self, const char *data, Py_ssize_t n) except -1:
        self._u32(n)
        return self._put(data, n)

    cdef int _fail(self, str message) except -1:
        raise BatchTypeError(message, format_path(self.path))

    # -- planning -------------------------------------------------------------

    cdef Py_ssize_t plan(self, object batch, bint template) except -1:
        """Encodes the structure of `batch` and lays out its arrays; returns
        the payload's size in bytes. With `template`, ArraySpec leaves are
        allowed and arrays stand for their shape and dtype only."""
        self.meta_len = 0
        self.n_arrays = 0
        self.data_len = 0
        self.template = template
        del self.arrays[:]
        del self.path[:]
        self._node(batch, 0)
        self.nbytes = data_start(self.meta_len) + self.data_len
        return self.nbytes

    cdef int _node(self, object obj, int depth) except -1:
        cdef type t = type(obj)
        cdef Py_ssize_t i, n
        cdef int overflow = 0
        cdef long long iv
        cdef double fv
        cdef const char *utf8
        if depth > MAX_DEPTH:
            self._fail(_batch.TOO_DEEP)
        if t is _ndarray:
            return self._array(<cnp.ndarray>obj, None)
        if t is dict:
            self._tag(b"{")
            self._u32(len(<dict>obj))
            for key, value in (<dict>obj).items():
                if type(key) is not str:
                    self.path.append(key)
                    self._fail(_batch.key_not_str(key))
                utf8 = PyUnicode_AsUTF8AndSize(key, &n)
                self._blob(utf8, n)
                self.path.append(key)
                self._node(value, depth + 1)
                self.path.pop()
            return 0
        if t is tuple or t is list:
            self._tag(b"(" if t is tuple else b"[")
            n = len(obj)
            self._u32(n)
            for i in range(n):
                self.path.append(i)
                self._node(obj[i], depth + 1)
                self.path.pop()
            return 0
        if obj is None:
            return self._tag(b"N")
        if t is bool:
            return self._tag(b"T" if obj else b"F")
        if t is int:
            iv = PyLong_AsLongLongAndOverflow(obj, &overflow)
            if overflow == 0:
                self._tag(b"i")
                return self._put(&iv, 8)
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            self._tag(b"I")
            return self._blob(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw))
        if t is float:
            fv = obj
            self._tag(b"f")
            return self._put(&fv, 8)
        if t is str:
            utf8 = PyUnicode_AsUTF8AndSize(obj, &n)
            self._tag(b"s")
            return self._blob(utf8, n)
        if t is bytes:
            self._tag(b"b")
            return self._blob(PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj))
        if isinstance(obj, _ndarray):
            return self._array_subclass(obj)
        if isinstance(obj, _generic):
            return self._scalar(obj)
        if self.template and t is ArraySpec:
            return self._array(None, obj)
        if isinstance(obj, (dict, tuple, list)):
            self._fail(_batch.container_subclass(obj))
        self._fail(_batch.unsupported_type(obj))

    cdef int _array_subclass(self, object obj) except -1:
        ma = sys.modules.get("numpy.ma")
        if ma is not None and isinstance(obj, ma.MaskedArray):
            self._fail(_batch.MASKED_ARRAY)
        # Other subclasses (numpy.memmap, ...) travel as plain ndarrays.
        return self._array(<cnp.ndarray>obj, None)

    cdef bytes _spec_of(self, object dt):
        spec = self.dtype_specs.get(dt)
        if spec is None:
            spec = dtype_name(dt)
            if spec is None:
                self._fail(_batch.dtype_refused(dt))
            if len(<bytes>spec) > 0xFFFF:
                self._fail(f"dtype {dt!r} is too complex to describe")
            self.dtype_specs[dt] = spec
        return <bytes>spec

    cdef int _dtype(self, object dt) except -1:
        cdef bytes spec = self._spec_of(dt)
        cdef uint16_t n = <uint16_t>PyBytes_GET_SIZE(spec)
        self._put(&n, 2)
        return self._put(PyBytes_AS_STRING(spec), n)

    cdef int _array(self, cnp.ndarray arr, object spec) except -1:
        cdef int ndim, d
        cdef uint8_t ndim8
        cdef uint64_t dim, nbytes, off
        cdef cnp.npy_intp *dims = NULL
        if arr is not None:
            dt = <object>cnp.PyArray_DESCR(arr)
            ndim = cnp.PyArray_NDIM(arr)
            dims = cnp.PyArray_DIMS(arr)
            shape = None
        else:
            dt = spec.dtype
            shape = spec.shape
            ndim = len(shape)
        if ndim > MAX_NDIM:
            self._fail(f"arrays of more than {MAX_NDIM} dimensions are not supported")
        self._tag(b"a")
        self._dtype(dt)
        ndim8 = <uint8_t>ndim
        self._put(&ndim8, 1)
        nbytes = <uint64_t>(<cnp.dtype>dt).itemsize
        for d in range(ndim):
            dim = <uint64_t>(dims[d] if dims != NULL else shape[d])
            self._put(&dim, 8)
            if shmp_mul_overflow(nbytes, dim, &nbytes):
                self._fail("array too large")
        off = <uint64_t>_round_up(self.data_len, ARRAY_ALIGN)
        self._put(&off, 8)
        if self.n_arrays == self.cap_arrays:
            self._grow_arrays()
        self.offsets[self.n_arrays] = <Py_ssize_t>off
        self.sizes[self.n_arrays] = <Py_ssize_t>nbytes
        self.n_arrays += 1
        self.arrays.append(None if self.template else arr)
        self.data_len = <Py_ssize_t>(off + nbytes)
        return 0

    cdef int _grow_arrays(self) except -1:
        cdef Py_ssize_t cap = self.cap_arrays * 2
        cdef Py_ssize_t *offsets = <Py_ssize_t *>PyMem_Realloc(self.offsets, cap * sizeof(Py_ssize_t))
        if offsets == NULL:
            raise MemoryError()
        self.offsets = offsets
        cdef Py_ssize_t *sizes = <Py_ssize_t *>PyMem_Realloc(self.sizes, cap * sizeof(Py_ssize_t))
        if sizes == NULL:
            raise MemoryError()
        self.sizes = sizes
        self.cap_arrays = cap
        return 0

    cdef int _scalar(self, object obj) except -1:
        cdef Py_ssize_t n
        dt = obj.dtype
        self._tag(b"g")
        self._dtype(dt)
        raw = obj.tobytes()
        # Exactly the dtype's item size, which is what the decoder reads: an
        # empty np.bytes_ ("|S0") gives one byte from tobytes(), np.str_("")
        # four.
        n = (<cnp.dtype>dt).itemsize
        if PyBytes_GET_SIZE(raw) < n:
            self._fail(f"NumPy scalar of dtype {dt!r} gave fewer bytes than its item size")
        return self._put(PyBytes_AS_STRING(raw), n)

    # -- writing --------------------------------------------------------------

    cdef int write(self, unsigned char *payload, Py_ssize_t capacity) except -1:
        """Writes the planned batch into `payload` (capacity bytes).

        Every byte of the payload is defined: the padding between the
        structure and the data, between arrays and after the last one is
        zeroed (only those bytes: this is put()'s hot path, and the rest of
        the slot is not the payload). Otherwise whatever the memory held
        before (an earlier batch, the producer's scratch) would reach the
        consumer, and the same batch would not give the same bytes twice.
        Arrays of a template (reserve) are left as they are, uninitialised
        by design like numpy.empty."""
        cdef uint32_t u32
        cdef uint64_t u64
        cdef Py_ssize_t i, nbytes, start, cursor
        cdef unsigned char *data
        cdef unsigned char *dst
        cdef const unsigned char *src
        cdef cnp.ndarray arr
        if self.nbytes > capacity:
            raise AssertionError("write() called with a payload smaller than the plan")
        u32 = PAYLOAD_MAGIC
        memcpy(payload, &u32, 4)
        u32 = <uint32_t>self.meta_len
        memcpy(payload + 4, &u32, 4)
        u64 = <uint64_t>self.nbytes
        memcpy(payload + 8, &u64, 8)
        memcpy(payload + PAYLOAD_PREFIX, self.meta, self.meta_len)
        start = data_start(self.meta_len)
        memset(payload + PAYLOAD_PREFIX + self.meta_len, 0, start - PAYLOAD_PREFIX - self.meta_len)
        data = payload + start
        cursor = 0  # end of the last array, from data
        for i in range(self.n_arrays):
            # Arrays are laid out in order, each at a multiple of ARRAY_ALIGN.
            if self.offsets[i] > cursor:
                memset(data + cursor, 0, self.offsets[i] - cursor)
            cursor = self.offsets[i] + self.sizes[i]
            obj = self.arrays[i]
            nbytes = self.sizes[i]
            if obj is None or nbytes == 0:
                continue
            arr = <cnp.ndarray>obj
            dst = data + self.offsets[i]
            src = <const unsigned char *>cnp.PyArray_DATA(arr)
            if src == dst:
                continue  # filled in place (reserve)
            if cnp.PyArray_IS_C_CONTIGUOUS(arr):
                if nbytes >= COPY_NOGIL_BYTES:
                    with nogil:
                        shmp_copy_out(dst, src, nbytes)  # streaming stores from a few MiB
                else:
                    memcpy(dst, src, nbytes)
            else:
                # Strided or Fortran-ordered: NumPy copies it into C order.
                dt = <object>cnp.PyArray_DESCR(arr)
                if dt.names is not None:
                    # NumPy copies a structured dtype field by field: the
                    # bytes between fields would be left as they were.
                    memset(dst, 0, nbytes)
                view = new_array(dt, cnp.PyArray_NDIM(arr), cnp.PyArray_DIMS(arr), dst, True, None)
                cnp.PyArray_CopyInto(<cnp.ndarray>view, arr)
        if self.data_len > cursor:  # after trailing empty arrays
            memset(data + cursor, 0, self.data_len - cursor)
        return 0

    cdef bint same_meta(self, const unsigned char *payload) noexcept:
        """Whether `payload` already holds this plan's prefix and meta."""
        cdef uint32_t meta_len
        memcpy(&meta_len, payload + 4, 4)
        return (meta_len == <uint32_t>self.meta_len and
                memcmp(payload + PAYLOAD_PREFIX, self.meta, self.meta_len) == 0)

    cdef bint in_place(self, unsigned char *payload) noexcept:
        """Whether every planned array already lives at its place in `payload`."""
        cdef Py_ssize_t i
        cdef unsigned char *data = payload + data_start(self.meta_len)
        for i in range(self.n_arrays):
            obj = self.arrays[i]
            if obj is None:
                return False
            if self.sizes[i] and <unsigned char *>cnp.PyArray_DATA(<cnp.ndarray>obj) != data + self.offsets[i]:
                return False
            if self.sizes[i] and not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj):
                return False
        return True


cdef object new_array(object dt, int ndim, cnp.npy_intp *dims, void *data, bint writeable,
                      object base):
    """A C-ordered array of `dt` over `data` (not copied), based on `base`."""
    Py_INCREF(dt)
    arr = PyArray_NewFromDescr(&PyArray_Type, <void *>dt, ndim, dims, NULL, data,
                               cnp.NPY_ARRAY_WRITEABLE if writeable else 0, NULL)
    if base is not None:
        cnp.set_array_base(<cnp.ndarray>arr, base)
    return arr


cdef class Decoder:
    """Turns a payload into the batch it holds, as views into the payload.

    Every array's base is `root`: the batch's memory is released when the
    last of them (and root) is gone.
    """

    def __cinit__(self):
        self.dtypes = {}
        self.last_spec = b""
        self.last_dtype = None
        self.spare = None

    cdef object decode(self, unsigned char *payload, Py_ssize_t nbytes, object root,
                       bint writeable, list collect=None):
        cdef _Reader r
        cdef uint32_t magic, meta_len
        cdef uint64_t total
        if nbytes < PAYLOAD_PREFIX:
            raise CorruptChannelError(f"a slot payload of {nbytes} bytes is too short")
        memcpy(&magic, payload, 4)
        memcpy(&meta_len, payload + 4, 4)
        memcpy(&total, payload + 8, 8)
        if magic != PAYLOAD_MAGIC:
            raise CorruptChannelError("a slot does not start with the payload magic")
        if total != <uint64_t>nbytes or <uint64_t>data_start(meta_len) > total:
            raise CorruptChannelError(
                f"a slot's sizes disagree with its header (payload of {nbytes} bytes, header "
                f"says {total}, with {meta_len} bytes of structure)")
        # One _Reader is kept for the next call (allocating one per batch is
        # measurable on the consumer's hot path); taken out while in use, so
        # a decode that starts inside another (none does today) gets its own.
        r = self.spare
        if r is None:
            r = _Reader.__new__(_Reader)
        else:
            self.spare = None
        r.pos = payload + PAYLOAD_PREFIX
        r.end = r.pos + meta_len
        r.data = payload + data_start(meta_len)
        r.data_end = payload + nbytes
        r.root = root
        r.dec = self
        r.writeable = writeable
        r.collect = collect
        try:
            result = r.node(0)
            if r.pos != r.end:
                raise CorruptChannelError("a slot's structure has trailing bytes")
        finally:
            # Nothing of this batch stays referenced from here.
            r.root = None
            r.collect = None
            r.dec = None
            self.spare = r
        return result


cdef class _Reader:
    cdef const unsigned char *pos
    cdef const unsigned char *end
    cdef unsigned char *data
    cdef unsigned char *data_end
    cdef object root
    cdef Decoder dec    # its dtype cache
    cdef bint writeable
    cdef list collect   # when not None, every array made is appended to it

    cdef inline int need(self, Py_ssize_t n) except -1:
        if n < 0 or n > self.end - self.pos:
            raise CorruptChannelError("a slot's structure runs past its end")
        return 0

    cdef inline uint32_t u32(self) except? 0xFFFFFFFF:
        cdef uint32_t v
        self.need(4)
        memcpy(&v, self.pos, 4)
        self.pos += 4
        return v

    cdef inline uint64_t u64(self) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t v
        self.need(8)
        memcpy(&v, self.pos, 8)
        self.pos += 8
        return v

    cdef str text(self, str what):
        cdef uint32_t n = self.u32()
        self.need(n)
        try:
            s = PyUnicode_DecodeUTF8(<const char *>self.pos, n, NULL)
        except UnicodeDecodeError as exc:
            raise CorruptChannelError(f"a slot's structure holds {what} that is not UTF-8 "
                                      f"({exc.reason} at byte {exc.start})") from None
        self.pos += n
        return s

    cdef bytes blob(self):
        cdef uint32_t n = self.u32()
        self.need(n)
        b = PyBytes_FromStringAndSize(<const char *>self.pos, n)
        self.pos += n
        return b

    cdef object dtype(self):
        cdef uint16_t n
        self.need(2)
        memcpy(&n, self.pos, 2)
        self.pos += 2
        self.need(n)
        # The dtype of the last array decoded, if this one is named the same
        # (batch after batch usually is): no bytes object, no dict lookup.
        # (Nothing is remembered until a name gave a dtype: last_dtype None.
        # Without that check an empty name matched the empty start value and
        # gave None for a dtype, which NumPy dereferences: a crash, found by
        # tests/test_codec_fuzz.py with 20,000 examples.)
        last = self.dec.last_spec
        if (self.dec.last_dtype is not None and n == PyBytes_GET_SIZE(last)
                and memcmp(PyBytes_AS_STRING(last), self.pos, n) == 0):
            self.pos += n
            return self.dec.last_dtype
        spec = PyBytes_FromStringAndSize(<const char *>self.pos, n)
        self.pos += n
        dtypes = self.dec.dtypes
        dt = dtypes.get(spec)
        if dt is None:
            try:
                dt = dtype_from_name(spec)
            except CorruptChannelError:
                raise
            except Exception as exc:
                raise CorruptChannelError(f"payload names dtype {_shown(spec)}, which cannot be "
                                          f"read: {exc}") from exc
            if len(dtypes) >= 256:  # a hostile producer may name many
                dtypes.clear()
            dtypes[spec] = dt
        # Only a name that gave a dtype (checked above) is remembered.
        self.dec.last_spec = spec
        self.dec.last_dtype = dt
        return dt

    cdef object node(self, int depth):
        cdef char tag
        cdef uint32_t n, i
        cdef int64_t iv
        cdef double fv
        if depth > MAX_DEPTH:
            raise CorruptChannelError("a slot's structure is nested too deep")
        self.need(1)
        tag = <char>self.pos[0]
        self.pos += 1
        if tag == b"a":
            return self.array()
        if tag == b"{":
            n = self.u32()
            # Each entry takes at least 5 bytes (key length, value tag).
            if n > <uint32_t>((self.end - self.pos) // 5):
                raise CorruptChannelError(f"a slot's structure claims a dict of {n} entries, "
                                          "more than it has room for")
            d = {}
            for i in range(n):
                key = self.text("a dict key")
                if key in d:
                    # The encoder writes a dict's keys once each: a repeat
                    # is a corrupt structure, not a batch with fewer keys.
                    raise CorruptChannelError(f"a slot's structure repeats the dict key {key!r}")
                d[key] = self.node(depth + 1)
            return d
        if tag == b"(" or tag == b"[":
            n = self.u32()
            if n > <uint32_t>(self.end - self.pos):  # each item takes at least one byte
                raise CorruptChannelError(f"a slot's structure claims a {'tuple' if tag == b'(' else 'list'} "
                                          f"of {n} items, more than it has room for")
            items = [self.node(depth + 1) for i in range(n)]
            return tuple(items) if tag == b"(" else items
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            self.need(8)
            memcpy(&iv, self.pos, 8)
            self.pos += 8
            return iv
        if tag == b"I":
            return int.from_bytes(self.blob(), "little", signed=True)
        if tag == b"f":
            self.need(8)
            memcpy(&fv, self.pos, 8)
            self.pos += 8
            return fv
        if tag == b"s":
            return self.text("a str")
        if tag == b"b":
            return self.blob()
        if tag == b"g":
            dt = self.dtype()
            n = (<cnp.dtype>dt).itemsize
            self.need(n)
            raw = PyBytes_FromStringAndSize(<const char *>self.pos, n)
            self.pos += n
            # A scalar owns its bytes (copied out of the slot). Not
            # np.frombuffer: it refuses an item size of 0, and np.bytes_(b"")
            # is a "|S0" scalar the encoder writes.
            return np.ndarray((), dtype=dt, buffer=raw)[()]
        raise CorruptChannelError(f"a slot's structure has an unknown tag {bytes([<uint8_t>tag])!r}")

    cdef object array(self):
        cdef cnp.npy_intp dims[MAX_NDIM]
        cdef uint8_t ndim
        cdef int d
        cdef uint64_t nbytes, dim, off, numpy_size
        dt = self.dtype()
        self.need(1)
        ndim = self.pos[0]
        self.pos += 1
        if ndim > MAX_NDIM:
            raise CorruptChannelError(f"a slot holds an array of {ndim} dimensions, more than "
                                      f"NumPy's {MAX_NDIM}")
        nbytes = <uint64_t>(<cnp.dtype>dt).itemsize
        # NumPy's own check (PyArray_NewFromDescr): the product of the
        # non-zero dims times max(itemsize, 1) must fit in an npy_intp, even
        # when a zero dim makes the array empty ("array is too big" otherwise).
        numpy_size = nbytes if nbytes else 1
        for d in range(ndim):
            dim = self.u64()
            if (dim > <uint64_t>0x7FFFFFFFFFFFFFFF or shmp_mul_overflow(nbytes, dim, &nbytes)
                    or (dim != 0 and shmp_mul_overflow(numpy_size, dim, &numpy_size))
                    or numpy_size > <uint64_t>0x7FFFFFFFFFFFFFFF):
                raise CorruptChannelError(f"a slot holds an array of impossible size (dim {d} "
                                          f"is {dim})")
            dims[d] = <cnp.npy_intp>dim
        off = self.u64()
        if (off % ARRAY_ALIGN != 0 or off > <uint64_t>(self.data_end - self.data)
                or nbytes > <uint64_t>(self.data_end - self.data) - off):
            raise CorruptChannelError(
                f"a slot holds an array outside its payload ({nbytes} bytes at offset {off} "
                f"of a data region of {self.data_end - self.data} bytes, arrays "
                f"{ARRAY_ALIGN}-byte aligned)")
        arr = new_array(dt, ndim, dims, self.data + off, self.writeable, self.root)
        if self.collect is not None:
            self.collect.append(arr)
        return arr


# -- Python-level entry points (tests, the "serialize" benchmark) ---------------

def encoded_size(batch) -> int:
    """Bytes the payload of `batch` takes."""
    cdef Encoder enc = Encoder()
    return enc.plan(batch, False)


def encode(batch):
    """The payload of `batch` as a new 64-byte aligned buffer (a copy).

    Returns a NumPy uint8 array; for tests and benchmarks: the ring writes
    straight into shared memory instead.
    """
    cdef Encoder enc = Encoder()
    cdef Py_ssize_t n = enc.plan(batch, False)
    buf = aligned_empty(n)
    enc.write(<unsigned char *>cnp.PyArray_DATA(<cnp.ndarray>buf), n)
    return buf


cdef unsigned char *_writable_room(object buf, Py_ssize_t n, str caller) except NULL:
    """The start of `buf`, checked to be a 64-byte aligned, writable,
    contiguous uint8 array of at least `n` bytes."""
    cdef cnp.ndarray arr = buf
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"{caller}() needs a writable, contiguous uint8 array")
    if (<size_t>cnp.PyArray_DATA(arr)) % ARRAY_ALIGN:
        raise ValueError(f"{caller}() needs a 64-byte aligned buffer")
    if n > arr.shape[0]:
        from shmpipe.errors import BatchTooLargeError

        raise BatchTooLargeError(n, arr.shape[0])
    return <unsigned char *>cnp.PyArray_DATA(arr)


def encode_into(batch, buf) -> int:
    """Writes the payload of `batch` into `buf` (a 64-byte aligned, writable
    uint8 array, like a slot); returns its size in bytes."""
    cdef Encoder enc = Encoder()
    cdef Py_ssize_t n = enc.plan(batch, False)
    enc.write(_writable_room(buf, n, "encode_into"), n)
    return n


def decode(buf, *, writeable=False):
    """The batch held in `buf` (a uint8 array from encode()), as views of it."""
    cdef Decoder dec = Decoder()
    cdef cnp.ndarray arr = np.ascontiguousarray(buf, dtype=np.uint8)
    # (An empty buffer's address means nothing: it is too short, not unaligned.)
    if (<size_t>cnp.PyArray_DATA(arr)) % ARRAY_ALIGN and arr.nbytes >= PAYLOAD_PREFIX:
        raise ValueError("decode() needs a 64-byte aligned buffer")
    return dec.decode(<unsigned char *>cnp.PyArray_DATA(arr), arr.nbytes, arr, writeable)


def template_size(template) -> int:
    """Bytes the payload of a reserve() template takes (ArraySpec leaves
    allowed; arrays stand for their shape and dtype)."""
    cdef Encoder enc = Encoder()
    return enc.plan(template, True)


def reserve_into(template, buf):
    """Lays out `template` in `buf` (a 64-byte aligned, writable uint8 array
    of at least template_size(template) bytes) and returns its structure
    with writable, uninitialised arrays inside `buf`: what reserve() does
    in a slot, for memory of another kind (a batch larger than a slot)."""
    cdef Encoder enc = Encoder()
    cdef Decoder dec = Decoder()
    cdef Py_ssize_t n = enc.plan(template, True)
    cdef unsigned char *data = _writable_room(buf, n, "reserve_into")
    enc.write(data, n)
    return dec.decode(data, n, buf, True)


def aligned_empty(Py_ssize_t n):
    raw = np.empty(n + ARRAY_ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ARRAY_ALIGN
    return raw[start:start + n]


# -- JSON text, counted before it is parsed ---------------------------------------
#
# The arrow transport's header is JSON (a private copy of it). json.loads
# makes every value it reads into an object (an empty list from two bytes:
# about 20 times the text's size), nests until RecursionError, and parses a
# number of any length (quadratic in its digits). json_census reads the
# text once, in C, before json.loads sees it.

def json_census(bytes text, Py_ssize_t max_values, int max_depth, Py_ssize_t max_number):
    """An upper bound on the values json.loads(text) makes (1 plus the
    ``[ { , :`` outside strings: each value but the first follows one), or
    CorruptChannelError if the text is not ASCII, holds more than
    `max_values` values, nests deeper than `max_depth` brackets, or has a
    number longer than `max_number` characters. Strings are told apart as
    JSON does (a backslash escapes the next character); an ill-formed text
    is json.loads's to refuse, after at most this many values."""
    cdef const unsigned char *s = <const unsigned char *>PyBytes_AS_STRING(text)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(text), i = 0, values = 1, run = 0
    cdef int depth = 0, err = 0
    cdef bint in_str = False
    cdef unsigned char c
    with nogil:
        while i < n:
            c = s[i]
            i += 1
            if c >= 0x80:
                err = 1
                break
            if in_str:
                if c == b'"':
                    in_str = False
                elif c == b'\\':
                    i += 1  # the escaped character, a quote too (one past the end ends the loop)
                continue
            if c == b'"':
                in_str = True
            elif c == b'[' or c == b'{':
                values += 1
                depth += 1
                if depth > max_depth:
                    err = 2
                    break
            elif c == b']' or c == b'}':
                depth -= 1
            elif c == b',' or c == b':':
                values += 1
            elif (c >= b'0' and c <= b'9') or c == b'-' or c == b'+' or c == b'.' or c == b'e' or c == b'E':
                run += 1
                if run > max_number:
                    err = 3
                    break
                continue
            if values > max_values:
                err = 4
                break
            run = 0
    if err == 1:
        raise CorruptChannelError(f"a JSON header holds a byte that is not ASCII (at {i - 1})")
    if err == 2:
        raise CorruptChannelError(f"a JSON header nests more than {max_depth} brackets deep")
    if err == 3:
        raise CorruptChannelError(f"a JSON header holds a number longer than {max_number} characters")
    if err == 4:
        raise CorruptChannelError(f"a JSON header holds more than {max_values:,} values")
    return values

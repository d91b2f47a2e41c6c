# The batch codec, shared with _ring.pyx. See _codec.pyx for the byte layout.

cimport numpy as cnp

cdef enum:
    PAYLOAD_PREFIX = 16   # magic u32, meta_nbytes u32, payload_nbytes u64
    ARRAY_ALIGN = 64      # every array starts on a 64-byte boundary of the payload


cdef class Encoder:
    cdef char *meta
    cdef Py_ssize_t meta_len
    cdef Py_ssize_t meta_cap
    cdef list arrays            # per array leaf: the source ndarray, or None (reserve template)
    cdef Py_ssize_t *offsets    # per array leaf: offset in the data region
    cdef Py_ssize_t *sizes      # per array leaf: bytes
    cdef Py_ssize_t n_arrays
    cdef Py_ssize_t cap_arrays
    cdef Py_ssize_t data_len
    cdef readonly Py_ssize_t nbytes   # payload bytes of the last plan
    cdef bint template
    cdef list path
    cdef dict dtype_specs

    cdef Py_ssize_t plan(self, object batch, bint template) except -1
    cdef int _reserve(self, Py_ssize_t n) except -1
    cdef int _put(self, const void *src, Py_ssize_t n) except -1
    cdef int _tag(self, char tag) except -1
    cdef int _u32(self, Py_ssize_t v) except -1
    cdef int _blob(self, const char *data, Py_ssize_t n) except -1
    cdef int _fail(self, str message) except -1
    cdef int _node(self, object obj, int depth) except -1
    cdef int _array_subclass(self, object obj) except -1
    cdef bytes _spec_of(self, object dt)
    cdef int _dtype(self, object dt) except -1
    cdef int _array(self, cnp.ndarray arr, object spec) except -1
    cdef int _grow_arrays(self) except -1
    cdef int _scalar(self, object obj) except -1
    cdef int write(self, unsigned char *payload, Py_ssize_t capacity) except -1
    cdef bint same_meta(self, const unsigned char *payload) noexcept
    cdef bint in_place(self, unsigned char *payload) noexcept


cdef class Decoder:
    cdef dict dtypes
    cdef bytes last_spec        # the name of the dtype found last, and that dtype
    cdef object last_dtype
    cdef object spare           # a _Reader kept for the next decode
    cdef object decode(self, unsigned char *payload, Py_ssize_t nbytes, object root,
                       bint writeable, list collect=*)


cdef object new_array(object dt, int ndim, cnp.npy_intp *dims, void *data, bint writeable,
                      object base)

"""Builds the Cython extensions; the metadata lives in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

common = dict(
    include_dirs=["csrc", numpy.get_include()],
    depends=["csrc/shmpipe_copy.h", "csrc/shmpipe_ring.h"],  # rebuilt when a header changes
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

extensions = [
    Extension("shmpipe._codec", ["shmpipe/_codec.pyx"], **common),
    Extension("shmpipe._ring", ["shmpipe/_ring.pyx", "csrc/shmpipe_ring.c"], **common),
    Extension("shmpipe._spans", ["shmpipe/_spans.pyx"], **common),
    Extension("shmpipe._tally", ["shmpipe/_tally.pyx"], **common),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
)

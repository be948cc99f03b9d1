"""cffi builder for stockade._native: cdef = stockade_native.h, sources = csrc/*.c."""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

ffibuilder = FFI()
ffibuilder.cdef((HERE / "stockade_native.h").read_text())
ffibuilder.set_source(
    "stockade._native",
    '#include <stddef.h>\n#include "stockade_native.h"\n',
    sources=[os.path.relpath(p, ROOT) for p in sorted(HERE.glob("*.c"))],
    include_dirs=[os.path.relpath(HERE, ROOT)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing", "-pthread"],
    extra_link_args=["-pthread"],  # observe mode's thread (csrc/observe.c)
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

"""cffi builder for stockade._native: cdef = stockade_native.h, sources = csrc/*.c."""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# What GCC 14 and later refuse by default, refused here with any compiler: a host with an
# older GCC must not build what a newer one cannot.
STRICT = ["-Werror=incompatible-pointer-types", "-Werror=implicit-function-declaration", "-Werror=int-conversion",
          "-Werror=implicit-int"]

ffibuilder = FFI()
ffibuilder.cdef((HERE / "stockade_native.h").read_text())
ffibuilder.set_source(
    "stockade._native",
    '#include <stddef.h>\n#include "stockade_native.h"\n',
    sources=[os.path.relpath(p, ROOT) for p in sorted(HERE.glob("*.c"))],
    include_dirs=[os.path.relpath(HERE, ROOT)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing", "-pthread", *STRICT],
    extra_link_args=["-pthread"],  # observe mode's thread (csrc/observe.c)
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

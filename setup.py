# setuptools needs setup.py for cffi_modules; everything else is in pyproject.toml.
# Besides the extension, the build links csrc/launcher into an executable shipped
# inside the package (stockade/stockade-launcher): the pre-spawned launcher, and
# csrc/connect into stockade/stockade-connect: the SOCKS5 connector a --net allow
# sandbox gets as /run/stockade/connect (static where libc.a exists, so the copy runs
# whatever the sandbox's /usr holds).
from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.errors import LinkError
except ImportError:  # setuptools < 65
    from distutils.errors import LinkError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "csrc"))
from build_native import STRICT  # noqa: E402  (the same flags for the launcher and the connector)

LAUNCHER = "stockade-launcher"
CONNECT = "stockade-connect"


class BuildWithLauncher(build_ext):
    def run(self) -> None:
        super().run()
        self.build_launcher()
        self.build_connect()

    def out_dir(self) -> str:
        if self.inplace:
            out_dir = str(HERE / "src" / "stockade")
        else:
            out_dir = os.path.join(self.build_lib, "stockade")
        os.makedirs(out_dir, exist_ok=True)
        return out_dir

    def build_launcher(self) -> None:
        csrc = HERE / "csrc"
        sources = [str(p) for p in sorted((csrc / "launcher").glob("*.c"))] + [str(p) for p in sorted(csrc.glob("*.c"))]
        out_dir = self.out_dir()
        cc = self.compiler
        objs = cc.compile(
            [os.path.relpath(s, HERE) for s in sources],
            output_dir=os.path.join(self.build_temp, "launcher"),
            include_dirs=[str(csrc)],
            extra_postargs=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing", "-fPIE", *STRICT],
        )
        cc.link_executable(objs, LAUNCHER, output_dir=out_dir, extra_postargs=["-pie"])
        os.chmod(os.path.join(out_dir, LAUNCHER), 0o755)

    def build_connect(self) -> None:
        out_dir = self.out_dir()
        cc = self.compiler
        objs = cc.compile(
            ["csrc/connect/connect.c"],
            output_dir=os.path.join(self.build_temp, "connect"),
            extra_postargs=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", *STRICT],
        )
        try:
            cc.link_executable(objs, CONNECT, output_dir=out_dir, extra_postargs=["-static", "-s"])
        except LinkError:  # no static libc here: dynamic, against the libc the sandbox sees in /usr
            cc.link_executable(objs, CONNECT, output_dir=out_dir, extra_postargs=["-s"])
        os.chmod(os.path.join(out_dir, CONNECT), 0o755)


setup(cffi_modules=["csrc/build_native.py:ffibuilder"], cmdclass={"build_ext": BuildWithLauncher})

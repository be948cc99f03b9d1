# setuptools needs setup.py for cffi_modules; everything else is in pyproject.toml.
# Besides the extension, the build links csrc/launcher into an executable shipped
# inside the package (stockade/stockade-launcher): the pre-spawned launcher.
from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
LAUNCHER = "stockade-launcher"


class BuildWithLauncher(build_ext):
    def run(self) -> None:
        super().run()
        self.build_launcher()

    def build_launcher(self) -> None:
        csrc = HERE / "csrc"
        sources = [str(p) for p in sorted((csrc / "launcher").glob("*.c"))] + [str(p) for p in sorted(csrc.glob("*.c"))]
        if self.inplace:
            out_dir = str(HERE / "src" / "stockade")
        else:
            out_dir = os.path.join(self.build_lib, "stockade")
        os.makedirs(out_dir, exist_ok=True)
        cc = self.compiler
        objs = cc.compile(
            [os.path.relpath(s, HERE) for s in sources],
            output_dir=os.path.join(self.build_temp, "launcher"),
            include_dirs=[str(csrc)],
            extra_postargs=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing", "-fPIE"],
        )
        cc.link_executable(objs, LAUNCHER, output_dir=out_dir, extra_postargs=["-pie"])
        os.chmod(os.path.join(out_dir, LAUNCHER), 0o755)


setup(cffi_modules=["csrc/build_native.py:ffibuilder"], cmdclass={"build_ext": BuildWithLauncher})

# setuptools needs setup.py for cffi_modules; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["csrc/build_native.py:ffibuilder"])

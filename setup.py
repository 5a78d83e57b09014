"""Build epd's native kernels at install: one shared library per (kernel, instruction set) of services/kernels/spec.py.

pyproject.toml holds the project's metadata; this file only adds the C libraries, as setuptools extensions
(plain C libraries that services/kernels/loader.py opens with ctypes, not Python modules), so `pip install .`,
the wheel and `pip install -e .` (which builds them in place) all compile them with the build machine's C
compiler.  A library that fails to compile fails the install: a package without its kernels would run
torch's slower paths with nothing but a log line to say so.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
KERNELS_DIR = Path("services") / "kernels"


def _spec():   # services/kernels/spec.py by path: importing the package would need epd's dependencies
    loaded = importlib.util.spec_from_file_location("_epd_kernel_spec", HERE / KERNELS_DIR / "spec.py")
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module   # dataclasses resolve the module's annotations through sys.modules
    loaded.loader.exec_module(module)
    return module


class BuildLibraries(build_ext):
    """Plain C libraries: no PyInit_ symbol to export, nothing of Python to link; built on every core."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel: int = os.cpu_count() or 1

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return ext.export_symbols

    def get_libraries(self, ext: Extension) -> list[str]:
        return ext.libraries


def extensions() -> list[Extension]:
    spec = _spec()
    machine = platform.machine()
    out = []
    for kernel, variant in spec.builds(machine):
        link = ["-fopenmp"] if kernel.openmp else []
        out.append(Extension(
            f"services.kernels.{kernel.library(variant.name)}", [str(KERNELS_DIR / kernel.source)],
            depends=[str(KERNELS_DIR / name) for name in kernel.includes],
            extra_compile_args=spec.compile_flags(kernel, variant, machine), extra_link_args=link,
            libraries=list(kernel.libs)))
    return out


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildLibraries})

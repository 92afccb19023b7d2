"""The native kernels (native/) as the extension localllm._native, and the catalog
(models.toml, at the repository's top level) copied into the package as it is built.

The extension is optional: where no C compiler (or no Python headers) is found the build goes
on without it, and the torch runner uses its pure-torch reference kernels. Everything else
about the package is in pyproject.toml.
"""

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """build_py, and the catalog copied in as localllm/models.toml (a source checkout and an
    editable install read it from the top level: catalog.py)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "localllm" / "models.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).resolve().parent / "models.toml", target)


if sys.platform == "win32":
    args, link = ["/O2"], []
else:
    args, link = ["-O3", "-std=c11", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-pthread"], ["-pthread"]

setup(cmdclass={"build_py": BuildPy}, ext_modules=[Extension(
    "localllm._native",
    sources=["native/module.c", "native/attention.c", "native/pool.c", "native/qmatmul.c", "native/rows.c",
             "native/isa.c", "native/kquant.c", "native/layer.c", "native/rows8.c"],
    depends=["native/localllm_native.h"],
    include_dirs=["native"],
    extra_compile_args=args,
    extra_link_args=link,
    optional=True,
)])

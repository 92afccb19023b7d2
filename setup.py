"""The native kernels (native/) as the extension localllm._native.

Optional: where no C compiler (or no Python headers) is found the build goes on without it,
and the torch runner uses its pure-torch reference kernels. Everything else about the package
is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    args, link = ["/O2"], []
else:
    args, link = ["-O3", "-std=c11", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=fast", "-pthread"], ["-pthread"]

setup(ext_modules=[Extension(
    "localllm._native",
    sources=["native/module.c", "native/attention.c", "native/pool.c", "native/qmatmul.c", "native/rows.c",
             "native/isa.c"],
    depends=["native/localllm_native.h"],
    include_dirs=["native"],
    extra_compile_args=args,
    extra_link_args=link,
    optional=True,
)])

"""Build hook for the optional native codec kernels (ckpt/_native.c).

Everything else is declared in pyproject.toml. The extension is optional: where no
C compiler is present the build goes on without it and ckpt uses its numpy kernels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("ckpt._native", ["ckpt/_native.c"], extra_compile_args=["-O3"], optional=True),
    ]
)

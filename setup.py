"""Build hook: where each package comes from, and the optional native codec kernels.

The top-level folders are fixed by the product's design card (``ckpt/``, ``storage/``,
``cli/``), but ``storage`` and ``cli`` are names that other distributions and users'
own projects also use. So the two lower and upper layers are installed under one
namespace of ours, ``ckpt_store`` (the distribution's name): ``storage/`` becomes
``ckpt_store.storage`` and ``cli/`` becomes ``ckpt_store.cli``. ``ckpt/`` stays ``ckpt``.
Packages are discovered, not listed.

The extension is optional: where no C compiler is present the build goes on without
it and ckpt uses its numpy kernels.
"""

from setuptools import Extension, find_packages, setup

NAMESPACE = "ckpt_store"


def under(folder: str) -> list[str]:
    """``folder``'s packages, named under the namespace."""
    name = f"{NAMESPACE}.{folder}"
    return [name] + [f"{name}.{p}" for p in find_packages(folder)]


setup(
    packages=find_packages(include=["ckpt", "ckpt.*"]) + under("storage") + under("cli"),
    package_dir={f"{NAMESPACE}.storage": "storage", f"{NAMESPACE}.cli": "cli"},
    ext_modules=[
        Extension("ckpt.codecs._native", ["ckpt/codecs/_native.c"], extra_compile_args=["-O3"], optional=True),
    ],
)

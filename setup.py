"""Build the C extension attnx._attnx from csrc/.

Every SIMD variant is compiled into the same extension side by side: each
csrc/kernels/<isa>.c enables its instruction set for itself with a target
pragma, so no global flag ties the build to the CPU it was built on. The
kernels are chosen at run time (csrc/kernels/dispatch.c).
"""

import glob
import os
import sys

import numpy as np
from setuptools import Extension, setup

# the core's sources come from csrc/sources.txt (the one list every build reads),
# the glue is every csrc/python/*.c
with open(os.path.join("csrc", "sources.txt")) as f:
    core = [line.strip() for line in f if line.strip() and not line.startswith("#")]
glue = sorted(glob.glob(os.path.join("csrc", "python", "*.c")))
sources = [os.path.join("csrc", *name.split("/")) for name in core] + glue
# every header (and the SIMD bodies the kernel files include): build_ext rebuilds
# the extension when one is newer than it (`build_ext --inplace` after a header edit)
depends = sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True))

extra_compile_args = []
extra_link_args = []
libraries = []
define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_23_API_VERSION")]
if sys.platform != "win32":
    extra_compile_args += ["-std=c11", "-O3", "-fno-math-errno", "-Wall", "-Wextra",
                           "-Wno-unused-parameter", "-fvisibility=hidden"]
    extra_compile_args += os.environ.get("ATTNX_EXTRA_CFLAGS", "").split()
    extra_link_args += os.environ.get("ATTNX_EXTRA_LDFLAGS", "").split()
    libraries += ["pthread", "m"]

setup(
    ext_modules=[
        Extension(
            "attnx._attnx",
            sources=sources,
            depends=depends,
            include_dirs=[np.get_include(), "csrc"],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            libraries=libraries,
        )
    ]
)

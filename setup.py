"""Build of the optional C kernels (everything else is in pyproject.toml).

``foundry.model.kernels._kernels`` computes matrix-vector products over GGUF weight blocks in place;
``foundry.compression._qsgd`` is QSGD's encoder in one pass; ``foundry.model.kernels._optim`` is
AdamW's step in one pass; ``foundry.transport.gates._gates`` moves a tensor-parallel gate's bytes
over plain TCP sockets without the interpreter in the loop. All are optional: where no C compiler is found the build goes on
without them and ``foundry.model.kernels.quant``, ``foundry.compression.qsgd`` and
``foundry.model.train.optim`` fall back to numpy (the gates to their Python poll loops) (docs/quantization.md, docs/protocol.md and
docs/architecture.md say what that costs).
"""

import platform
from pathlib import Path

from setuptools import Extension, setup

# -ffp-contract=off: multiplications and additions stay separate roundings, the same on every
# architecture, so the kernels give the same bits on x86-64, arm64 and armv7.
# -fno-trapping-math: no code here reads floating-point exception flags, so the compiler may
# compute both sides of a select (branch-free loops such as exp_f's then vectorise); no
# rounding changes.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
if platform.machine().startswith("armv7"):
    # 32-bit Raspberry Pi OS targets ARMv6 floating point by default; every armv7 Pi has NEON.
    FLAGS += ["-mfpu=neon-vfpv4", "-mfloat-abi=hard"]

setup(
    ext_modules=[
        Extension(
            "foundry.model.kernels._kernels",
            # one file per family (csrc/kernels.h says which); the Python interface in module.c,
            # py_ops.c and py_step.c
            sorted(str(p) for p in Path("src/foundry/model/kernels/csrc").glob("*.c")),
            depends=["src/foundry/model/kernels/csrc/kernels.h",
                     "src/foundry/model/kernels/csrc/step_exchange.h",
                     "src/foundry/model/kernels/csrc/py_kernels.h"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "foundry.model.kernels._optim",
            ["src/foundry/model/kernels/_optim.c"],
            # sqrtf of a second moment (never negative) sets no errno: this lets it vectorise.
            extra_compile_args=[*FLAGS, "-fno-math-errno"],
            optional=True,
        ),
        Extension(
            "foundry.transport.gates._gates",
            ["src/foundry/transport/gates/_gates.c"],
            depends=["src/foundry/model/kernels/csrc/step_exchange.h"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "foundry.compression._qsgd",
            ["src/foundry/compression/_qsgd.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
    ]
)

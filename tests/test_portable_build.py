"""The kernels' C builds without its x86 paths, as an ARM build compiles it.

An arm64 or armv7 machine compiles only the portable C and the NEON paths; a call from portable
code into a function that exists only under ``FOUNDRY_X86`` links on x86-64 and nowhere else,
and ``pip install`` on the ARM machine then skips the optional extension (the engine falls back
to numpy, and an ARM rank of a mixed pair loses the bit-identity). ``-DFOUNDRY_PORTABLE``
compiles this host's build the ARM way (csrc/kernels.h); the test links it with a small
``main`` and runs it. ``bench/determinism/cross_arch.py`` checks the bits under qemu.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "src" / "foundry" / "model" / "kernels" / "csrc"

MAIN = r"""
#include <stdio.h>

#include "kernels.h"

int main(void) {
    kernels_init();
    if (pool_set_threads(2) != 0) return 1;
    /* a Q8_0 product of 64 rows (two tasks) of one block each: scale 1, values 1 */
    uint8_t w[64 * 34];
    for (int r = 0; r < 64; r++) {
        w[r * 34] = 0x00;
        w[r * 34 + 1] = 0x3c; /* float16 1.0 */
        for (int i = 0; i < 32; i++) w[r * 34 + 2 + i] = 1;
    }
    float x[32], y[64];
    for (int i = 0; i < 32; i++) x[i] = 0.5f;
    pool_split_below(0);
    if (matmul(T_Q8_0, w, 34, 64, 32, x, 1, y) != 0) return 2;
    for (int r = 0; r < 64; r++)
        if (y[r] < 15.9f || y[r] > 16.1f) return 3; /* 32 x 0.5, the input quantized */
    puts("ok");
    return 0;
}
"""


def test_the_kernels_link_and_run_without_their_x86_paths(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: the extension itself needs one (setup.py)")
    sources = sorted(
        p for p in CSRC.glob("*.c") if not p.name.startswith("py_") and p.name != "module.c"
    )
    main = tmp_path / "main.c"
    main.write_text(MAIN)
    exe = tmp_path / "portable"
    build = subprocess.run(
        [
            cc,
            "-DFOUNDRY_PORTABLE",
            "-O1",
            "-std=c11",
            "-D_GNU_SOURCE",
            f"-I{CSRC}",
            *map(str, sources),
            str(main),
            "-lm",
            "-pthread",
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout.strip()) == (0, "ok"), run

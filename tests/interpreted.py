"""Running Triton kernels on a CPU: a test's code in a subprocess under Triton's interpreter
(TRITON_INTERPRET=1), so that the variable never reaches the other tests' kernels."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PATCH_INTERPRETER = """
# Triton 3.6's interpreter turns a loop bound into an int with int(array of shape (1,)), which
# NumPy >= 2.4 refuses: take its one element instead.
from triton.runtime import interpreter
_patch = interpreter._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_lang_tensor

# Its tl.dot is NumPy's matmul, whose BLAS kernels give a row other bits by the row's place in the
# matrix on some CPUs (OpenBLAS 0.3.31, NumPy 2.4.6), where a GPU's MMA gives a row the same
# whatever the other rows: each output sums its K products here in fp64, in ascending K (an
# add of [..., N] slabs, not a BLAS call), rounded once to the accumulator's dtype.
import numpy as np
import triton.language as tl
_dot = interpreter.InterpreterBuilder.create_dot
def _floats(h):  # bf16 is held as its uint16 bits
    return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype == tl.bfloat16 else h.data
def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    x = _floats(a).astype(np.float64)[..., :, :, None]  # [..., M, K, 1]
    y = _floats(b).astype(np.float64)[..., None, :, :]  # [..., 1, K, N]
    acc = np.add.reduce(x * y, axis=-2)  # [..., M, N]
    return interpreter.TensorHandle(acc.astype(d.data.dtype) + d.data, d.dtype.scalar)
interpreter.InterpreterBuilder.create_dot = create_dot
"""


def interpret(module: str, code: str, timeout: float = 300) -> None:
    """Run `code` after `from {module} import *` (a test module's checks) under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}  # fmt: skip
    script = PATCH_INTERPRETER + f"import torch\nfrom {module} import *\n" + code
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]

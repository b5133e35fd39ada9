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
"""


def interpret(module: str, code: str, timeout: float = 300) -> None:
    """Run `code` after `from {module} import *` (a test module's checks) under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}  # fmt: skip
    script = PATCH_INTERPRETER + f"import torch\nfrom {module} import *\n" + code
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]

"""Triton kernels of the packed KV cache (quantize.py, decode_attention.py, groups.py) and their host code.

Under TRITON_INTERPRET=1 (CPU dry runs, the tests without CUDA) interpret.install speeds up Triton's interpreter.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from kernels import interpret

    interpret.install()

"""Where the kernel tests run: natively on a GPU, else in Triton's CPU interpreter.

Import this before triton (it sets TRITON_INTERPRET=1 when there is no GPU).
"""

import os

import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if GPU else "cpu"
# Triton's interpreter computes through NumPy, which has no bfloat16: that runs on GPUs only
DTYPES = [torch.float32, torch.bfloat16] if GPU else [torch.float32]

import os

# Without a GPU, Triton kernels run in the interpreter (slow: tests keep their shapes small).
# Set before anything imports triton.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

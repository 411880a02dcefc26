"""Triton kernels of the lopd_kernels ops: CUDA devices, or the interpreter (TRITON_INTERPRET=1).

Each module here holds the ``@triton.jit`` kernels of one op and its launchers; the public entry
points and autograd wiring live in ``lopd_kernels/<op>.py``, which imports these lazily so that
``import lopd_kernels`` never needs Triton.
"""

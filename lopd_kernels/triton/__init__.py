"""Triton kernels of the lopd_kernels ops: CUDA devices, or the interpreter (TRITON_INTERPRET=1).

Per op, two modules: ``<op>_kernels.py`` holds the ``@triton.jit`` device code (a second
algorithm for a kernel: ``<op>_kernels_<algorithm>.py``, see ``lopd_kernels/kernel_variants.py``),
``<op>.py`` its launchers (argument checks, grids, launch
defaults); ``_common.py`` the helpers every op's kernels share. The chunked path of
``fused_linear_topk_tail_kl`` has its own pair (``fused_linear_topk_tail_kl_chunked*.py``). The
public entry points and autograd wiring live in ``lopd_kernels/<op>.py``, which imports the
launchers lazily so that ``import lopd_kernels`` never needs Triton.
"""

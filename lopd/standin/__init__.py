"""Random-init stand-ins of real Qwen3 checkpoints, built offline (tests and memory accounts).

:mod:`lopd.standin.build` writes them; ``python -m lopd.standin`` is its command line.
"""

from lopd.standin.build import SHAPES, StandinShape, build_qwen3_tokenizer, build_standin

__all__ = ["SHAPES", "StandinShape", "build_qwen3_tokenizer", "build_standin"]

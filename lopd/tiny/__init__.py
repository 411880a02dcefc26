"""The embedded tiny Qwen3 (``lopd/assets/tiny-qwen3``; ``tiny-qwen3-formats``, the reader of
every method's context format): how it is built and what it can read.

* :mod:`lopd.tiny.data`: its training data, bare and reference-conditioned oracle episodes.
* :mod:`lopd.tiny.sft`: supervised fine-tuning on those episodes.
* :mod:`lopd.tiny.build`: the tokenizer, the model and the deterministic build.
* :mod:`lopd.tiny.formats`: every method's privileged-context format.
* :mod:`lopd.tiny.probe`: what a retrieved reference, in each format, is worth to a model.
"""

"""Where the models compute and in which dtype.

* :mod:`lopd.parallel.distributed`: ranks, device and collectives under ``torchrun``.
* :mod:`lopd.parallel.fsdp`: FSDP2 sharding of student, teacher and encoder backbone.
* :mod:`lopd.parallel.precision`: what is stored and computed in which dtype.
"""

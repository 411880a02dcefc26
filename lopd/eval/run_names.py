"""The names of ``python -m lopd.compare``'s runs: a method and the settings its name carries.

A run name is a base, a method of :data:`lopd.methods.METHODS` or ``lopd-m<m>`` (LOPD at margin
``m``: the margin sweep), followed by any of these suffixes, each at most once and in this order
(one name per run):

==========  ==========================================  =========================================
suffix      setting                                     for
==========  ==========================================  =========================================
``-a5``     ``lopd.context_format=a5``                  text teachers (OPSD, SDPO, SDFT, Skill-SD)
``-sync``   ``lopd.teacher_backbone=sync``              latent teachers (LOPD, its ablations,
``-ema``    ``lopd.teacher_backbone=ema``               LOPD-PPO)
``-grow``   ``bank.grow=true``                          methods that read the bank
``-null``   ``lopd.null_context=true``                  methods with a teacher
==========  ==========================================  =========================================

e.g. ``lopd-ppo-ema-grow``, ``sdft-a5``, ``lopd-ppo-null``. A run's folder is
``<name>-seed<k>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lopd.methods import METHODS, MethodSpec

__all__ = ["RUN_SUFFIXES", "RunName", "method_spec", "parse_run_name"]

_MARGIN_RUN = re.compile(r"lopd-m(\d+(?:\.\d+)?)")

RUN_SUFFIXES: dict[str, str] = {
    "-a5": "lopd.context_format=a5",
    "-sync": "lopd.teacher_backbone=sync",
    "-ema": "lopd.teacher_backbone=ema",
    "-grow": "bank.grow=true",
    "-null": "lopd.null_context=true",
}
"""Run-name suffix -> the override it stands for (module docstring)."""


@dataclass(frozen=True)
class RunName:
    """A parsed run name.

    Attributes:
        method: the registered method it trains.
        base: the name without its suffixes (``lopd-m0.02``, ``lopd-ppo``).
        suffixes: its suffixes, in :data:`RUN_SUFFIXES` order.
        overrides: the ``section.field=value`` overrides the name stands for.
    """

    method: str
    base: str
    suffixes: tuple[str, ...]
    overrides: tuple[str, ...]


def _unknown(name: str) -> ValueError:
    a5 = [m for m, s in METHODS.items() if s.has_teacher and not s.uses_composer]
    return ValueError(
        f"unknown method {name!r}: one of {', '.join(METHODS)}, lopd-m<margin> (e.g. "
        f"lopd-m0.02), with any of these suffixes, in this order: -a5 (for {', '.join(a5)}), "
        "-sync or -ema (a latent teacher's backbone), -grow (a growing bank), -null (the "
        "teacher's context emptied)"
    )


def parse_run_name(name: str) -> RunName:
    """The method, base, suffixes and overrides of a run name.

    Raises:
        ValueError: not a run name (an unknown base, a repeated suffix, a suffix the method
            has no use for, or both ``-sync`` and ``-ema``).
    """
    rest, found = name, []
    while True:
        suffix = next((s for s in RUN_SUFFIXES if rest.endswith(s) and rest != s), None)
        if suffix is None or suffix in found:
            break
        found.append(suffix)
        rest = rest[: -len(suffix)]
    overrides: list[str] = []
    if rest in METHODS:
        method = rest
    elif (match := _MARGIN_RUN.fullmatch(rest)) is not None:
        method = "lopd"
        overrides.append(f"lopd.margin={match.group(1)}")
    else:
        raise _unknown(name)
    spec = METHODS[method]
    allowed = {
        "-a5": spec.has_teacher and not spec.uses_composer,
        "-sync": spec.uses_composer,
        "-ema": spec.uses_composer,
        "-grow": spec.builds_bank,
        "-null": spec.has_teacher,
    }
    suffixes = tuple(s for s in RUN_SUFFIXES if s in found)
    # One name per run: the suffixes are written in the table's order.
    if tuple(reversed(found)) != suffixes or not all(allowed[s] for s in found):
        raise _unknown(name)
    if {"-sync", "-ema"} <= set(found):
        raise _unknown(name)
    overrides += [RUN_SUFFIXES[s] for s in suffixes]
    return RunName(method, rest, suffixes, tuple(overrides))


def method_spec(name: str) -> MethodSpec:
    """The registered method a run name trains (:func:`parse_run_name`).

    Raises:
        ValueError: not a run name.
    """
    return METHODS[parse_run_name(name).method]

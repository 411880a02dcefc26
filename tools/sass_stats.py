"""Static statistics of one kernel's SASS (``cuobjdump -sass`` text): loops, paths, barriers.

Used by ``tools/kernel_report.py``; plain text processing, no GPU and no CUDA toolkit needed.

A *loop* is a backward branch ``@P BRA target`` at offset ``b`` with ``target <= b`` whose range
``[target, b]`` holds no unconditional ``EXIT`` (that excludes the out-of-line stubs the compiler
jumps to with ``BRA.DIV`` and that jump back) and that is not the end-of-code trap (an
unconditional ``BRA`` to itself). Per loop, over the range's forward edges only
(nested loops' back edges dropped, so the range is a DAG in offset order):

* ``min_path``: the fewest instructions from the loop head to its back branch, every
  data-dependent branch taking its cheaper side (for a streaming kernel with a rare slow path,
  the common path);
* ``max_path``: the most (every branch taking its expensive side, nested loops once);
* ``barriers_min_path`` / ``barriers_in_range``: ``BAR.*`` block barriers on that path / anywhere
  in the range;
* ``ldg_bytes_min_path``: bytes one thread loads from global memory (``LDG``) on that path, from
  the access width of each load (``.128`` 16, ``.64`` 8, ``.U16`` / ``.S16`` 2, ``.U8`` /
  ``.S8`` 1, else 4): with the threads per block this gives the vocabulary entries one
  iteration reads, a check on the entries per iteration the kernel's source declares.

NOPs (alignment padding) are not counted.
"""

from __future__ import annotations

import dataclasses
import re

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?(BRA|BRX|JMP|JMX)(\.\w+)*\s+(?:\S+,\s*)?(0x[0-9a-f]+)")


@dataclasses.dataclass
class Instr:
    offset: int
    text: str  # "@P0 BRA 0x4a0" (predicate, opcode, operands)

    @property
    def opcode(self) -> str:
        parts = self.text.split()
        return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]

    @property
    def predicated(self) -> bool:
        return self.text.startswith("@")

    def branch_target(self) -> int | None:
        m = _BRANCH.match(self.text)
        return int(m.group(4), 16) if m else None

    def is_barrier(self) -> bool:
        return self.opcode.startswith("BAR.") or self.opcode == "BAR"

    def ldg_bytes(self) -> int:
        op = self.opcode
        if not op.startswith("LDG"):
            return 0
        mods = op.split(".")[1:]
        for mod, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
            if mod in mods:
                return size
        return 4


@dataclasses.dataclass
class Loop:
    head: int
    back_branch: int
    static_instrs: int
    min_path: int
    max_path: int
    barriers_min_path: int
    barriers_in_range: int
    ldg_bytes_min_path: int
    depth: int = 0  # 0: outermost

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["head"] = f"0x{self.head:x}"
        d["back_branch"] = f"0x{self.back_branch:x}"
        return d


def split_functions(sass: str) -> dict[str, list[Instr]]:
    """``cuobjdump -sass`` text -> {mangled function name: its instructions in offset order}."""
    out: dict[str, list[Instr]] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        m = _INSTR.search(line)
        if m and current is not None:
            out[current].append(Instr(int(m.group(1), 16), m.group(2).strip()))
    return out


def _weight(ins: Instr) -> int:
    return 0 if ins.opcode == "NOP" else 1


def _successors(code: list[Instr], i: int) -> list[int]:
    """Indices reachable from instruction ``i`` (``index_of`` maps offsets to indices)."""
    ins = code[i]
    op = ins.opcode
    nxt = [i + 1] if i + 1 < len(code) else []
    if op in ("EXIT", "RET", "KILL") or op.startswith(("EXIT.", "RET.")):
        return nxt if ins.predicated else []
    target = ins.branch_target()
    if target is None:
        return nxt
    j = _index_of(code, target)
    tgt = [j] if j is not None else []
    conditional = ins.predicated or op.startswith("BRA.DIV")
    return tgt + nxt if conditional else tgt


def _index_of(code: list[Instr], offset: int) -> int | None:
    lo, hi = 0, len(code)
    while lo < hi:
        mid = (lo + hi) // 2
        if code[mid].offset < offset:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(code) and code[lo].offset == offset else None


def _paths(code: list[Instr], a: int, b: int) -> tuple[int, int, int, int]:
    """(min instrs, max instrs, barriers on the min path, LDG bytes on the min path) from index
    ``a`` to index ``b``, forward edges inside ``[a, b]`` only."""
    inf = float("inf")
    best: dict[int, tuple[float, int, int]] = {a: (_weight(code[a]), int(code[a].is_barrier()),
                                                   code[a].ldg_bytes())}  # fmt: skip
    worst: dict[int, float] = {a: _weight(code[a])}
    for i in range(a, b):
        if i not in best:
            continue
        n, bars, ldg = best[i]
        for j in _successors(code, i):
            if not (i < j <= b):
                continue
            ins = code[j]
            cand = (n + _weight(ins), bars + int(ins.is_barrier()), ldg + ins.ldg_bytes())
            if cand[0] < best.get(j, (inf, 0, 0))[0]:
                best[j] = cand
            worst[j] = max(worst.get(j, -inf), worst[i] + _weight(ins))
    if b not in best:
        return 0, 0, 0, 0
    n, bars, ldg = best[b]
    return int(n), int(worst[b]), bars, ldg


def find_loops(code: list[Instr]) -> list[Loop]:
    """Every loop of a function (see the module docstring), outermost first, then by offset."""
    loops = []
    for i, ins in enumerate(code):
        target = ins.branch_target()
        if target is None or target > ins.offset or ins.opcode.startswith("BRA.DIV"):
            continue
        if target == ins.offset and not ins.predicated:
            continue  # the end-of-code trap (`BRA` to itself after the last EXIT)
        a = _index_of(code, target)
        if a is None:
            continue
        body = code[a : i + 1]
        if any(x.opcode == "EXIT" and not x.predicated for x in body):
            continue  # an out-of-line stub jumping back, not a loop
        n_min, n_max, bars, ldg = _paths(code, a, i)
        loops.append(
            Loop(
                head=code[a].offset,
                back_branch=ins.offset,
                static_instrs=sum(_weight(x) for x in body),
                min_path=n_min,
                max_path=n_max,
                barriers_min_path=bars,
                barriers_in_range=sum(x.is_barrier() for x in body),
                ldg_bytes_min_path=ldg,
            )
        )
    for lp in loops:
        lp.depth = sum(
            1
            for o in loops
            if o is not lp and o.head <= lp.head and lp.back_branch <= o.back_branch
        )
    return sorted(loops, key=lambda lp: (lp.depth, lp.head))


def function_stats(code: list[Instr]) -> dict:
    """Whole-function counts: instructions, barriers, loops."""
    return {
        "instrs": sum(_weight(x) for x in code),
        "barriers": sum(x.is_barrier() for x in code),
        "loops": find_loops(code),
    }

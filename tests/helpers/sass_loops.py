"""The instructions and loops of a kernel's SASS (``cuobjdump -sass`` text), for tests that check
what ptxas kept inside a K loop or how many instructions a kernel has."""

from __future__ import annotations

import re


def instructions(sass: str) -> list[tuple[int, str]]:
    """Each instruction of ``sass`` in program order: ``(address, text without the address)``."""
    return [(int(match[1], 16), match[2]) for match in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def innermost_loops(sass: str) -> list[list[str]]:
    """Each innermost loop of ``sass``: the instructions (text without address) from a backward
    branch's target to the branch, for every backward branch whose region holds no other one, in
    program order."""
    lines = instructions(sass)
    loops = []  # (top, bottom) of every backward branch
    for address, text in lines:
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch is not None and int(branch[1], 16) < address:
            loops.append((int(branch[1], 16), address))
    return [
        [text for at, text in lines if top <= at <= bottom]
        for top, bottom in loops
        if not any(top <= inner_top and inner_bottom < bottom for inner_top, inner_bottom in loops)
    ]

"""The command line's argparse types (:mod:`a4prefill.cli`): each parses one option's text and
raises ``argparse.ArgumentTypeError`` saying what it expected, which argparse reports with the
option's name (exit code 2) before any command runs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return integer


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object, parsed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__} {text!r}")
    return value


def device(text: str) -> str:
    """An argparse type: a torch device name (cpu, cuda, cuda:1, ...)."""
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu or cuda, got {text!r}"
        ) from None
    return text


def comma_list(choices: list[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list, each entry one of ``choices``."""

    def entries(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        if not names or any(name not in choices for name in names):
            raise argparse.ArgumentTypeError(f"expected a comma list of {sorted(choices)}, got {text!r}")
        return names

    return entries


def size_specs(text: str) -> list[str]:
    """An argparse type for ``inspect --sizes``: a comma list of ``N`` or ``LO:HI``."""
    from a4prefill.tools.inspect_graphs import parse_spec

    specs = [spec for spec in text.split(",") if spec]
    for spec in specs:
        try:
            parse_spec(spec)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    if not specs:
        raise argparse.ArgumentTypeError(f"expected a comma list of N or LO:HI, got {text!r}")
    return specs

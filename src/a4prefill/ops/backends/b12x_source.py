"""Which ``b12x`` an ``import b12x`` gives: PyPI's b12x 1.5.1, or the copy embedded in FlashInfer.

FlashInfer 0.7.2 and later (what vLLM 0.33 pins) install a top-level ``b12x/__init__.py`` that
replaces ``sys.modules["b12x"]`` with ``flashinfer/experimental/b12x/_api.py`` and resolves every
``b12x.*`` submodule from FlashInfer's tree. Both distributions own ``site-packages/b12x/__init__.py``,
so the one installed last wins, and package metadata (``importlib.metadata``) cannot tell which one
is in use. The module itself can: FlashInfer's copy is loaded from ``_api.py`` inside a
``flashinfer`` folder and has no ``b12x.integration`` package.

Both serve this package: every name :mod:`.b12x_plans`, :mod:`.b12x_moe` and :mod:`.b12x_weights`
use is the same in b12x 1.5.1 and in the copies of FlashInfer 0.7.2.post1 and 0.7.4 (compared by
signature, dataclass fields and body; the copies only add names, optional arguments and paths for
other weight formats; 0.7.3, which vLLM 0.34 pins, is not on PyPI). Which one runs is logged with
the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PYPI = "pypi"
FLASHINFER = "flashinfer"


@dataclass(frozen=True)
class B12xSource:
    """Where ``b12x`` comes from: ``kind`` (:data:`PYPI` or :data:`FLASHINFER`) and the folder."""

    kind: str
    location: str

    def describe(self) -> str:
        name = "PyPI b12x" if self.kind == PYPI else "FlashInfer's embedded b12x"
        return f"{name} ({self.location})"


def b12x_source(module: ModuleType | None = None) -> B12xSource:
    """The source of ``module`` (default: ``import b12x``; raises ``ImportError`` without one)."""
    if module is None:
        import b12x

        module = b12x
    file = Path(getattr(module, "__file__", None) or "")
    folders = [Path(p) for p in getattr(module, "__path__", [])] or [file.parent]
    embedded = file.name == "_api.py" or any("flashinfer" in folder.parts for folder in folders)
    return B12xSource(FLASHINFER if embedded else PYPI, str(folders[0]))

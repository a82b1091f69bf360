"""The triton backend's door to its kernel modules (``kernel_modules``): a kernel module that
does not import is a warning naming it and the error, never a silent change of kernels."""

from __future__ import annotations

import logging

from a4prefill.ops.backends.triton import kernel_modules


def test_a_kernel_module_that_does_not_import_is_named_in_a_warning_once(monkeypatch, caplog):
    def decode():
        raise ImportError("cannot import name 'warpgroup_mma' from 'triton.experimental.gluon'")

    monkeypatch.setattr(kernel_modules, "decode", decode)
    kernel_modules.decode_imports.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=kernel_modules.__name__):
            assert kernel_modules.decode_imports() is False
            assert kernel_modules.decode_imports() is False  # asked again: the answer is kept
    finally:
        kernel_modules.decode_imports.cache_clear()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "decode kernels do not import (ImportError: cannot import name 'warpgroup_mma'" in warning

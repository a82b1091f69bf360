"""Tools change process-wide settings only for a block (``a4prefill.tools.environment``)."""

from __future__ import annotations

import os

import pytest
import torch._inductor.config

from a4prefill.tools.environment import in_process_engine, scoped_settings


def test_variables_and_inductor_config_are_restored_even_after_an_error(monkeypatch):
    monkeypatch.setenv("A4PREFILL_TEST_SET", "before")
    monkeypatch.delenv("A4PREFILL_TEST_NEW", raising=False)
    monkeypatch.setenv("A4PREFILL_TEST_DEFAULT", "user")
    monkeypatch.delenv("A4PREFILL_TEST_UNSET_DEFAULT", raising=False)
    flag = torch._inductor.config.force_disable_caches
    settings = scoped_settings(
        {"A4PREFILL_TEST_SET": "during", "A4PREFILL_TEST_NEW": "new"},
        {"A4PREFILL_TEST_DEFAULT": "tool", "A4PREFILL_TEST_UNSET_DEFAULT": "tool"},
        {"force_disable_caches": not flag},
    )
    with pytest.raises(RuntimeError, match="inside"), settings:
        assert os.environ["A4PREFILL_TEST_SET"] == "during"
        assert os.environ["A4PREFILL_TEST_NEW"] == "new"
        assert os.environ["A4PREFILL_TEST_DEFAULT"] == "user"  # a default never overrides
        assert os.environ["A4PREFILL_TEST_UNSET_DEFAULT"] == "tool"  # but fills what is unset
        assert torch._inductor.config.force_disable_caches is (not flag)
        raise RuntimeError("inside")
    assert os.environ["A4PREFILL_TEST_SET"] == "before"
    assert os.environ["A4PREFILL_TEST_DEFAULT"] == "user"
    assert "A4PREFILL_TEST_NEW" not in os.environ and "A4PREFILL_TEST_UNSET_DEFAULT" not in os.environ
    assert torch._inductor.config.force_disable_caches is flag


def test_an_in_process_engine_without_caches_turns_every_cache_off(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", raising=False)
    settings = in_process_engine(compile_cache=False)
    assert settings["environment"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert settings["defaults"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    assert settings["inductor"] == {"force_disable_caches": True}
    cached = in_process_engine(compile_cache=True)
    assert "VLLM_DISABLE_COMPILE_CACHE" not in cached["defaults"] and "inductor" not in cached


def test_an_in_process_engine_keeps_vllms_cache_root(monkeypatch, tmp_path):
    """Nothing compiled goes there with the caches off, and vLLM's model-info cache there spares
    each engine start a subprocess that imports vLLM; with the compile cache on, it is the cache
    users' vLLM runs share."""
    for compile_cache in (False, True):
        monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
        settings = in_process_engine(compile_cache=compile_cache)
        assert "VLLM_CACHE_ROOT" not in settings["defaults"] | settings["environment"]
        with scoped_settings(**settings):
            assert "VLLM_CACHE_ROOT" not in os.environ
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
        with scoped_settings(**in_process_engine(compile_cache=compile_cache)):
            assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path)

"""The one settings resolution: explicit settings, the legacy variable, defaults, validation."""

from __future__ import annotations

import logging

import pytest

from a4prefill import SplitPrefillPass
from a4prefill.settings import (
    LEGACY_THRESHOLD_ENV,
    A4PrefillSettings,
    ResolvedSettings,
    resolve_settings,
)


def resolve(settings: A4PrefillSettings | None = None, legacy: str | None = None, engine_limit: int = 0):
    environ = {} if legacy is None else {LEGACY_THRESHOLD_ENV: legacy}
    return resolve_settings(settings or A4PrefillSettings(), engine_limit, environ)


def legacy_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if LEGACY_THRESHOLD_ENV in r.getMessage()]


@pytest.mark.parametrize(
    ("legacy", "enabled", "warning"),
    [
        (None, True, None),
        ("0", True, "deprecated"),
        (" 256 ", True, "deprecated"),
        ("", False, "not an integer >= 0"),
        ("   ", False, "not an integer >= 0"),
        ("-1", False, "not an integer >= 0"),
        ("1.5", False, "not an integer >= 0"),
        ("1e3", False, "not an integer >= 0"),
        ("yes please", False, "not an integer >= 0"),
    ],
)
def test_legacy_variable_is_an_on_off_switch_with_exactly_one_warning(legacy, enabled, warning, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the pass and the plugin resolve again and again: still one warning
            assert resolve(legacy=legacy).enabled is enabled
    messages = legacy_warnings(caplog)
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warning in messages[0], messages


@pytest.mark.parametrize("legacy", ["", "junk", "64"])
@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_enabled_wins_over_the_legacy_variable(legacy, explicit):
    assert resolve(A4PrefillSettings(enabled=explicit), legacy=legacy).enabled is explicit


@pytest.mark.parametrize("legacy", ["off", "", "64", "0"])
@pytest.mark.parametrize("explicit", [True, False])
def test_the_one_message_says_what_is_in_force(legacy, explicit, caplog):
    """Issue 27: with ``enabled`` given, the legacy variable is ignored and the one warning says
    so and says whether A4 prefill is on; it never claims the variable switched anything."""
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            resolve(A4PrefillSettings(enabled=explicit), legacy=legacy)
    (message,) = legacy_warnings(caplog)
    assert "ignored" in message and f"enabled={str(explicit).lower()} is in force" in message
    assert f"A4 prefill is {'on' if explicit else 'off'}" in message
    assert "switches A4 prefill on" not in message and "not an integer" not in message


def test_captured_limit_is_the_users_else_the_engines():
    assert resolve(engine_limit=512).captured_limit == 512
    assert resolve(A4PrefillSettings(captured_limit=8), engine_limit=512).captured_limit == 8
    assert resolve(A4PrefillSettings(captured_limit=0), engine_limit=512).captured_limit == 0
    assert resolve().captured_limit == 0


def test_the_pass_resolves_through_the_same_function(monkeypatch):
    monkeypatch.setenv(LEGACY_THRESHOLD_ENV, "")
    assert SplitPrefillPass(A4PrefillSettings(captured_limit=4)).resolved() == ResolvedSettings(False, 4, ())
    assert SplitPrefillPass(A4PrefillSettings(enabled=True)).resolved().enabled is True
    bound = SplitPrefillPass().for_engine(resolve_settings(A4PrefillSettings(excluded_layers=("mtp",)), 256))
    assert bound.resolved() == ResolvedSettings(False, 256, ("mtp",))


def test_excluded_by_names_the_matching_pattern():
    settings = resolve(A4PrefillSettings(excluded_layers=("mtp", r"layers\.1\.")))
    assert settings.excluded_by("model.layers.1.mlp.experts") == r"layers\.1\."
    assert settings.excluded_by("model.mtp.0.mlp.experts") == "mtp"
    assert settings.excluded_by("model.layers.11.mlp.experts") is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"captured_limit": -3}, "captured_limit must be an integer >= 0"),
        ({"captured_limit": True}, "captured_limit must be an integer >= 0"),
        ({"enabled": "yes"}, "enabled must be true or false"),
        ({"excluded_layers": "mtp"}, "excluded_layers must be a list"),
        ({"excluded_layers": ["("]}, "is not a regex"),
        ({"excluded_layers": [3]}, "is not a string"),
        ({"enable": True}, r"unknown a4prefill setting\(s\) \['enable'\]"),
        ({"prefill_precision": "fp8"}, r"prefill_precision must be one of \['a4', 'a8'\], got 'fp8'"),
        ({"prefill_precision": "A8"}, r"prefill_precision must be one of \['a4', 'a8'\], got 'A8'"),
        ({"prefill_precision": None}, r"prefill_precision must be one of \['a4', 'a8'\], got None"),
        ({"prefill_precision": ["a8"]}, r"prefill_precision must be one of \['a4', 'a8'\], got \['a8'\]"),
        (
            {"prefill_precison": "a8"},
            r"unknown a4prefill setting\(s\) \['prefill_precison'\]; known: \[.*'prefill_precision'",
        ),
        (["enabled"], "must be a JSON object"),
    ],
)
def test_invalid_settings_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        A4PrefillSettings.from_mapping(raw)


@pytest.mark.parametrize("precision", ["a4", "a8"])
def test_prefill_precision_goes_through_the_one_resolution(precision):
    """The setting as given reaches the resolved settings (and so the pass's uuid and the engine)
    unchanged, whatever the legacy variable says; not given, it is ``a4`` (today's behaviour)."""
    given = A4PrefillSettings.from_mapping({"prefill_precision": precision})
    assert resolve(given).prefill_precision == precision
    assert resolve(given, legacy="0").prefill_precision == precision
    assert resolve(given).as_dict()["prefill_precision"] == precision
    assert (
        resolve().prefill_precision == "a4" == resolve(A4PrefillSettings.from_mapping({})).prefill_precision
    )
    assert (
        resolve(given).as_dict()
        != resolve(
            A4PrefillSettings.from_mapping({"prefill_precision": {"a4": "a8", "a8": "a4"}[precision]})
        ).as_dict()
    )


def test_the_settings_values_are_the_ops_prefill_precisions():
    from a4prefill.ops.precision import A4, A8, PREFILL_PRECISIONS

    assert PREFILL_PRECISIONS == (A4, A8) == ("a4", "a8")
    with pytest.raises(ValueError, match=r"a4prefill\.prefill_precision must be one of"):
        ResolvedSettings(True, 0, (), prefill_precision="w4a16")

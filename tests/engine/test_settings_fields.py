"""engine.config.settings.Settings declares a typed field per setting of the schema (engine/config/table.py): the same
names in the same order, a type that admits the schema's type and default, and the schema's default."""
from __future__ import annotations

import typing
from dataclasses import MISSING, fields

import pytest

from engine.config.loading import load_settings
from engine.config.settings import Settings
from engine.config.table import SETTINGS

EXTRA = ["sources", "print_config", "preset", "config"]


def _admits(annotation, value) -> bool:
    """Whether a value fits a field annotation (str, int | str, list[str], str | None, ...)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, type(int | str)) \
        else (annotation,)
    for option in options:
        origin = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return True
        if origin is not type(None) and isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
            return True
    return False


def test_one_field_per_setting_in_schema_order():
    assert [f.name for f in fields(Settings)] == [s.name for s in SETTINGS] + EXTRA


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_field_type_and_default_follow_the_schema(setting):
    hints = typing.get_type_hints(Settings)
    f = next(f for f in fields(Settings) if f.name == setting.name)
    default = f.default_factory() if f.default is MISSING else f.default
    assert default == setting.default
    assert _admits(hints[setting.name], default)
    sample = {str: "x", int: 3, float: 0.5, bool: True, list: ["a"]}[setting.type]
    assert _admits(hints[setting.name], sample), f"{setting.name}: {hints[setting.name]} does not admit {sample!r}"


def test_every_parsed_value_fits_its_field():
    """Values as load_settings produces them (flags of every kind) fit the declared types."""
    settings, _ = load_settings(["--port", "9000", "--kv-capacity", "4096", "--max-shared-prefixes", "auto",
                                 "--model-alias", "claude-*=local", "--temperature", "0.7", "--greedy"], env={})
    hints = typing.get_type_hints(Settings)
    for s in SETTINGS:
        value = getattr(settings, s.name)
        assert _admits(hints[s.name], value), f"{s.name}={value!r} does not fit {hints[s.name]}"
    assert settings.port == 9000 and settings.kv_capacity == 4096 and settings.source("port") == "flag:--port"

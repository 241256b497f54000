"""EngineConfig: the engine's typed view of the settings schema."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config.loading import load_settings
from engine.config.engine_config import EngineConfig
from engine.config.table import SETTINGS


def test_every_field_is_a_setting_with_the_schemas_default():
    by_name = {s.name: s for s in SETTINGS}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in by_name, f"EngineConfig.{f.name} is not in the settings schema"
        assert f.default == by_name[f.name].default, f.name


def test_from_settings_carries_every_source():
    settings, problems = load_settings(["--kv-window", "4096", "--kv-retrieve", "1024", "--host-kv-mib", "512",
                                        "--max-concurrency", "2", "--spec", "ngram"], {"NINFER_PREFILL_CHUNK": "256"})
    assert not problems
    c = EngineConfig.from_settings(settings)
    assert (c.kv_window, c.kv_retrieve, c.host_kv_mib, c.max_concurrency, c.spec, c.prefill_chunk) == \
        (4096, 1024, 512, 2, "ngram", 256)
    assert c.speculative and not EngineConfig().speculative


def test_frozen_and_replace_names_unknown_fields():
    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_context = 5
    assert c.replace(max_context=128).max_context == 128 and c.max_context == 0
    with pytest.raises(TypeError, match="no field kv_windw"):
        c.replace(kv_windw=4)
    with pytest.raises(ValueError, match="max_concurrency must be at least 1"):
        EngineConfig(max_concurrency=0)

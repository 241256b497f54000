"""The chat/agent sampling modes come from an editable TOML file; a broken file is a clear settings problem."""
import pytest

from engine import modes
from engine.config.loading import ConfigError, load_settings, sampling_defaults
from engine.errors import NInferError


def test_shipped_modes_are_the_field_reports_values():
    m = modes.load_modes(modes.SHIPPED)
    assert m["chat"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0,
                         "frequency_penalty": 0.0}
    assert m["agent"]["temperature"] == 0.2 and m["agent"]["top_p"] == 0.8 and m["agent"]["presence_penalty"] == 0.05


def test_user_copy_wins_and_drives_sampling_defaults(tmp_path, monkeypatch):
    user = tmp_path / "modes.toml"
    user.write_text(modes.SHIPPED.read_text().replace("temperature = 0.2", "temperature = 0.15"))
    monkeypatch.setattr(modes, "user_modes_path", lambda: user)
    settings, _ = load_settings(["--mode", "agent"], {})
    assert sampling_defaults(settings)["temperature"] == 0.15


@pytest.mark.parametrize("edit, words", [
    (("top_p = 0.8", "top_p = 1.5"), "agent.top_p"),
    (("[agent]", "[agnet]"), "[agent] is missing"),
    (("min_p = 0.0\npresence_penalty = 0.05", "min_p = 0.0\nmin_q = 1\npresence_penalty = 0.05"), "min_q"),
])
def test_broken_user_copy_is_reported_with_the_file(tmp_path, monkeypatch, edit, words):
    user = tmp_path / "modes.toml"
    user.write_text(modes.SHIPPED.read_text().replace(*edit))
    monkeypatch.setattr(modes, "user_modes_path", lambda: user)
    with pytest.raises(NInferError) as e:
        modes.load_modes()
    assert words in str(e.value) and str(user) in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings([], {})
    assert words in str(e.value)

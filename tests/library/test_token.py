"""The token for gated repositories: kept in the OS keyring (a keyring backend in memory here), or in the hub client's
token file where no keyring backend exists, saying so; used for the hub's API and downloads; never logged."""
from __future__ import annotations

import stat

import keyring
import pytest
from keyring.backend import KeyringBackend
from keyring.backends import fail

from engine.library import hub as libhub, token
from engine.library.resolve import resolve_hf

REPO = "test-org/Tiny-Llama-GGUF"
SECRET = "hf_secret_for_the_test"


class MemoryKeyring(KeyringBackend):
    priority = 1

    def __init__(self):
        super().__init__()
        self.items: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.items.get((service, username))

    def set_password(self, service, username, password):
        self.items[(service, username)] = password

    def delete_password(self, service, username):
        self.items.pop((service, username), None)


@pytest.fixture
def memory_keyring():
    before = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(before)


@pytest.fixture
def no_keyring():
    before = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    yield
    keyring.set_keyring(before)


def test_a_token_in_the_keyring_opens_a_gated_repository_and_is_never_logged(tiny_repo, hf_home, memory_keyring,
                                                                             caplog):
    tiny_repo.gated_token = SECRET
    with pytest.raises(libhub.LibraryError, match="gated") as e:
        libhub.list_files(REPO)
    assert "keyring" in e.value.remedy
    where = token.save_token(f"  {SECRET}\n")
    assert "OS keyring (MemoryKeyring)" in where
    assert memory_keyring.items == {(token.KEYRING_SERVICE, token.KEYRING_USER): SECRET}
    assert not token.token_file().exists()  # the keyring holds it, not a file
    with caplog.at_level("DEBUG"):
        path = resolve_hf(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny_repo.files["Tiny-Llama-Q4_K_M.gguf"]
    assert SECRET not in caplog.text
    token.forget_token()
    assert token.load_token() is None and not memory_keyring.items


def test_without_a_keyring_the_token_goes_to_the_token_file_saying_so(tiny_repo, hf_home, no_keyring, monkeypatch):
    tiny_repo.gated_token = SECRET
    where = token.save_token(SECRET)
    assert "no OS keyring" in where and str(hf_home / "token") in where
    assert (hf_home / "token").read_text() == SECRET
    assert stat.S_IMODE((hf_home / "token").stat().st_mode) == 0o600
    assert token.load_token() == SECRET
    assert sorted(f.quant for f in libhub.list_files(REPO)) == ["Q4_K_M", "Q8_0"]  # (the mmproj F16 rides along)
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    assert token.load_token() == "hf_from_the_environment"  # the environment wins


def test_an_empty_token_is_refused(hf_home, no_keyring):
    with pytest.raises(libhub.LibraryError, match="empty"):
        token.save_token("  ")

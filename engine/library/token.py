"""The Hugging Face token for gated and private repositories: kept in the OS keyring (the ``keyring`` package: macOS
Keychain, Windows Credential Locker, the Secret Service on Linux), or, where no keyring backend exists, in the hub
client's token file (``$HF_HOME/token``, where ``hf auth login`` puts it), and the caller is told which. Looked up
in this order: HF_TOKEN, the keyring, the token file. The token is never logged or put in an error message."""
from __future__ import annotations

import os
from pathlib import Path

from engine.library.errors import LibraryError

KEYRING_SERVICE = "ninfer"
KEYRING_USER = "huggingface-token"


def token_file() -> Path:
    """The hub client's token file, read from the environment when called (HF_TOKEN_PATH, else HF_HOME/token)."""
    if os.environ.get("HF_TOKEN_PATH"):
        return Path(os.environ["HF_TOKEN_PATH"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "token"


def _keyring():
    """The keyring backend, or None where there is none (a headless Linux without a Secret Service, say)."""
    try:
        import keyring
        from keyring.backends import fail

        backend = keyring.get_keyring()
    except Exception:  # a broken keyring configuration counts as none
        return None
    return None if isinstance(backend, fail.Keyring) else backend


def keyring_name() -> str | None:
    backend = _keyring()
    return type(backend).__name__ if backend is not None else None


def load_token() -> str | None:
    """HF_TOKEN, else the keyring's token, else the token file's; None when there is none."""
    env = os.environ.get("HF_TOKEN", "").strip()
    if env:
        return env
    backend = _keyring()
    if backend is not None:
        try:
            stored = backend.get_password(KEYRING_SERVICE, KEYRING_USER)
        except Exception:  # a locked or failing keyring: the token file is the fallback
            stored = None
        if stored:
            return stored
    try:
        return token_file().read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def save_token(token: str) -> str:
    """Stores ``token``; returns where, in words (for the user). Raises LibraryError when it cannot be stored."""
    token = token.strip()
    if not token:
        raise LibraryError("The token is empty.", "Paste a token from https://huggingface.co/settings/tokens.")
    backend = _keyring()
    if backend is not None:
        try:
            backend.set_password(KEYRING_SERVICE, KEYRING_USER, token)
            return f"Saved in the OS keyring ({type(backend).__name__})."
        except Exception as e:  # e.g. a locked keyring the user declined to unlock: fall back to the file
            why = f"the OS keyring refused it ({type(e).__name__})"
    else:
        why = "this system has no OS keyring"
    path = token_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token)
    except OSError as e:
        raise LibraryError(f"Cannot save the token: {why}, and {path} cannot be written ({e.strerror or e}).",
                           "Set HF_TOKEN in the environment instead.") from None
    return f"Saved in the Hugging Face token file {path}: {why}."


def forget_token() -> None:
    """Removes the token from the keyring (the token file is the hub client's: `hf auth logout` removes it)."""
    backend = _keyring()
    if backend is not None:
        try:
            backend.delete_password(KEYRING_SERVICE, KEYRING_USER)
        except Exception:  # nothing stored
            pass

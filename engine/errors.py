"""Errors the user sees: each says what went wrong and what to do about it."""


class NInferError(Exception):
    """A user-facing failure. ``str(err)`` is the full message: problem, then remedy."""

    def __init__(self, problem: str, remedy: str = ""):
        self.problem = problem
        self.remedy = remedy
        super().__init__(f"{problem} {remedy}".strip() if remedy else problem)


class ModelLoadError(NInferError):
    """The model file or folder cannot be used."""

"""Speculative decoding: a proposer drafts tokens (ngram prompt lookup, a draft model, or MTP heads), the target
verifies them in one forward pass (engine.spec.verify), and the Speculator adapts the draft length."""
from engine.spec.speculator import Speculator
from engine.spec.verify import verify

__all__ = ["Speculator", "verify"]

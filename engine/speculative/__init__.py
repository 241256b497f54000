"""Speculative decoding: a proposer drafts tokens (ngram prompt lookup, a draft model, or MTP heads), the target
verifies them in one forward pass (engine.speculative.verify), and the Speculator adapts the draft length."""
from engine.speculative.speculator import Speculator
from engine.speculative.verify import verify

__all__ = ["Speculator", "verify"]

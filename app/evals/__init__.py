"""The evaluation reports panel (ninfer-eval's reports)."""

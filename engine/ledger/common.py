"""Constants shared by the ledger modules."""
from __future__ import annotations


from engine.memory.dtypes import FLOAT_FORMATS
from engine.memory.geometry import PAGE_SIZE, ceil_div as _ceil_div  # noqa: F401
from engine.config.table import SETTINGS


MIB = 2**20
GIB = 2**30
ACTIVATION_BYTES_PER_HIDDEN = 32  # 16 activations of bf16 per hidden unit per prefill-chunk token
DFLASH2_DRAFT_BYTES = 2 * 10**9  # seed 1: "~2 GB draft weights"
HOST_RUNTIME_MIB = {"gpu": 1536, "cpu": 1024}
CPU_KV_RAM_FRACTION = 0.25  # KV auto on the CPU takes at most this share of RAM
DEFAULT_DRAFT_TOKENS = {"ngram": 4, "draft": 4, "mtp": 4, "dflash2": 5}
# Bits per parameter of each weight format, with its scales (kernels/quant.py defaults): int8 per output channel,
# int4 symmetric in groups of 32 with an fp16 scale, ternary in groups of 64 with an fp16 scale.
WEIGHT_BITS = {**{f.name: float(f.bits) for f in FLOAT_FORMATS.values()}, "int8": 8.0, "int4": 4.5, "ternary": 2.25}
SYNTHETIC_NAMES = ("qwen3.5-27b-like",)

_DEFAULTS = {s.name: s.default for s in SETTINGS}


"""The floating-point formats by name, once: the settings' short names (fp32, fp16, bf16), torch's names (float32,
float16, bfloat16) and their bytes. Torch-free, so the ledger and the app count bytes without loading the engine;
the KV layouts (geometry.py), the recurrent-state specs (specs.py), the state pool and the model's dtypes all read
this table."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FloatFormat:
    name: str  # as the settings spell it: fp32
    torch_name: str  # as torch spells it: float32 (torch.float32)
    bytes: int

    @property
    def bits(self) -> int:
        return 8 * self.bytes


FLOAT_FORMATS = {f.name: f for f in (FloatFormat("fp32", "float32", 4), FloatFormat("fp16", "float16", 2),
                                     FloatFormat("bf16", "bfloat16", 2))}
_BY_TORCH_NAME = {f.torch_name: f for f in FLOAT_FORMATS.values()}


def auto_float(on_gpu: bool) -> FloatFormat:
    """What "auto" means for the activations and the KV cache: bf16 on a GPU, fp32 on the CPU."""
    return FLOAT_FORMATS["bf16" if on_gpu else "fp32"]


def float_format(name: str) -> FloatFormat:
    """By either spelling ("fp16" or "float16", or str(torch.float16)); a ValueError naming the choices else."""
    key = name.removeprefix("torch.")
    found = FLOAT_FORMATS.get(key) or _BY_TORCH_NAME.get(key)
    if found is None:
        raise ValueError(f"unknown floating-point format {name!r}; one of {', '.join(FLOAT_FORMATS)}")
    return found

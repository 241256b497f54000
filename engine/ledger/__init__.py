"""The memory ledger: every byte a configuration will claim, line by line, against the VRAM and RAM budgets.

``build_ledger(shape, settings, vram_mib=..., ram_mib=...)`` decides ``kv_capacity auto`` (what fits in VRAM after
every other line, capped at max_context x max_concurrency), computes GPU pages, host pages and the context a sequence
can reach, and ``Ledger.check()`` refuses a configuration that cannot fit *before anything loads*, naming the line
that overflows. ``format_ledger`` prints it like a bank statement; ``Ledger.as_dict`` feeds the launcher's stacked
bar. The arithmetic is standard library only (no torch, no Qt); model files are read for metadata only, through the
engine's GGUF / config.json readers (imported when a path is read).

KV layout: the contract for the KV-memory work
----------------------------------------------
Only full-attention layers hold KV. Per token, per full-attention layer, per KV head (D = head_dim):

=========  =====================================================  ==========================================
dtype      K                                                      V
=========  =====================================================  ==========================================
fp32       D x 4 B                                                D x 4 B
fp16/bf16  D x 2 B                                                D x 2 B
k8v8       D x int8 + one fp16 scale (symmetric, absmax/127)      D x int8 + one fp16 scale
k8v4       as k8v8                                                D/2 B of int4 (2 a byte, low nibble first) +
                                                                  one fp16 scale per group of 32 along D
                                                                  (symmetric: value = (q - 8) x scale)
k4v4       int4 in groups of 32 along D, one fp16 scale a group   as K
rk4v4      as k4v4, K rotated (a Hadamard transform along D) before quantizing; the rotation is not stored,
           so the bytes are those of k4v4
=========  =====================================================  ==========================================

All integer formats are symmetric (no zero point, no min). When D is not a multiple of 32 the int4 group is the
largest even divisor of D up to 32. engine/memory/kv/quant.py implements this layout (codes and fp16 scales in tensors
[pages, 64, kv_heads, ...]); a test keeps the two byte counts equal.
Pages hold PAGE_SIZE = 64 tokens of every full-attention layer: page bytes = 64 x bytes per token.
Planning-only layouts (the engine has no kernels for them; they reproduce the seeds' format): ``k4v4-e8`` and
``rk4v4-e8`` store each group's scale as an 8-bit exponent (1 B, a power of two) instead of fp16.

Worked numbers (Qwen3.5-27B-like: 16 full-attention layers x 4 KV heads x 256):
bf16 64 KiB/token (4 MiB a page); k8v8 33,024 B (2.02 MiB); k8v4 25,728 B (1.57 MiB, 0.39x bf16);
k4v4/rk4v4 18,432 B (1.125 MiB); rk4v4-e8 17,408 B (1.0625 MiB = 1.11 MB). The seeds quote "~1.10 MiB a page"
for rk4v4-e8: our e8 layout is 1.0625 MiB (1.114 MB, so their figure reads like decimal MB), and fp16 scales give
1.125 MiB; the two bracket it within 4%.

Images (vision-language models)
-------------------------------
Image tokens are prompt tokens: each image's <|image_pad|> tokens (one per merged 2 x 2 block of patches, at most
max_image_pixels / (patch x merge)^2) take KV pages like text tokens and count in the context. The tower adds its
own lines (engine/ledger/vision.py): its weights, its activations for the largest image (max_image_pixels:
the lower of the processor's max_pixels and --max-image-pixels), and the encoder cache in host memory.

Recurrent state (hybrid models)
-------------------------------
Gated-DeltaNet (linear-attention) layers have no KV but a fixed state per sequence: per linear layer
num_v_heads x head_k_dim x head_v_dim values in fp32 (fp16 with ``gdn_state_fp16``) plus the short-convolution
state (conv_kernel - 1) x conv_dim in bf16. Qwen3.5-27B: 48 linear layers, 48 value heads, 128 x 128, conv kernel 4,
conv_dim 2 x 16 x 128 + 48 x 128 = 10,240 (config.json fields linear_num_value_heads, linear_num_key_heads,
linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim; the same defaults as Modular MAX's
Qwen3_5Config) = 144 MiB + 2.8 MiB per sequence in fp32, 72 MiB + 2.8 MiB in fp16. ``ModelShape.state_bytes``
overrides it. The state line counts the slots the engine allocates (engine.memory.geometry.state_slots): one per
sequence, one more per sequence with speculative decoding (the checkpoint a rejected draft rolls back to), and one
prefix snapshot per sequence while prefix reuse is on.

KV pool and host tier
---------------------
``kv_capacity auto`` = min(pages wanted, pages that fit). Wanted, per sequence: the whole max_context; with ring
mode (a ``kv_window`` shorter than max_context, or ``kv_ring on``) the GPU pages one windowed sequence owns, exactly
engine.memory.geometry.WindowSpec.footprint: the sink page, the window and one
prefill chunk (+2 pages for unaligned edges) and the staging pages ``kv_retrieve`` fetches back; with ``kv_ring off``
the window; all x max_concurrency. What fits: the KV device's budget minus every other line on it (without a GPU, at
most CPU_KV_RAM_FRACTION of RAM). The host tier holds host_kv_mib // page bytes pages. A windowed sequence writes
every full page through to the host, so the host pool is the reach of one sequence (sequences share the pools; with
ring auto a sequence within the window needs no host page), and a max_context sequence needs max_context / 64 host
pages. engine.build sizes the engine's pools with this ledger (``include_weights=False``, on the memory measured after
loading), so what ``ninfer-doctor --ledger`` and the app show is what the engine allocates.

What the seeds' ledgers give (tests/engine/test_ledger.py reproduces each):
- seed 1, 12 GB + DFlash2: 8.87 GiB weights + 1.86 GiB drafter + 0.43 GiB KV (17,920 k8v4 tokens) + state,
  workspace and 1 GiB headroom = 12.47 GiB > 12 GiB ("~12.4 GiB, OOM"): refused, naming the draft line.
  With MTP it fits and 2.24 GiB stay free ("~2.25 GiB free").
- seed 2, RTX 3060: sink + window 65,536 + one 4096-token chunk + 2 edge pages = 1091 GPU pages (the seed: 1080,
  1% apart); 2048 MiB of e8 host pages reach 123,328 tokens: their 121,232-token run fits, 131,072 does not ("128K
  is a hard ceiling"). Their "~1.36 GiB host KV" is not reproduced: this engine's host copy of a 128K sequence is
  2.13 GiB (the pages beyond the GPU's alone would be 1.00 GiB).

Estimates (marked as such in every output)
------------------------------------------
- activations/workspace: prefill_chunk x hidden x 2 B x 16 (residual, norms, q/k/v/o, the MLP's gate/up, matmul
  workspace), plus fp32 logits for the decode batch. Calibration: the seed's cuBLAS big-chunk prefill at 4096 tokens
  added 690 MiB (8475 -> 9165 MiB); the estimate gives 640 MiB. Doubled on the CPU (fp32 activations).
- MTP draft: one decoder layer (attention + MLP) plus the 2h -> h projection, at the main weights' bytes per
  parameter (the head ships inside the checkpoint and is quantized with it), plus its one layer of KV.
- DFlash2 draft: 2 GB, the seed's figure ("~2 GB draft weights").
- host runtime: Python, PyTorch, tokenizer and server, plus CUDA's host side when a GPU is used.
The headroom line is memory deliberately left unallocated (the desktop eats 0.5-1 GB of VRAM); ``free`` in the
outputs is what nvidia-smi would show: the budget minus the allocated lines.
"""
from engine.ledger.common import (  # noqa: F401
    ACTIVATION_BYTES_PER_HIDDEN, CPU_KV_RAM_FRACTION, DEFAULT_DRAFT_TOKENS, DFLASH2_DRAFT_BYTES, GIB,
    HOST_RUNTIME_MIB, MIB, PAGE_SIZE, SYNTHETIC_NAMES, WEIGHT_BITS)
from engine.memory.geometry import KVLayout, KV_DTYPES, KV_LAYOUTS, resolve_kv_dtype  # noqa: F401
from engine.ledger.shapes import LinearAttention, ModelShape  # noqa: F401
from engine.ledger.core import Ledger, LedgerLine, LedgerProblem, build_ledger, format_ledger  # noqa: F401
from engine.ledger.cli import add_ledger_arguments, run_ledger, wants_ledger  # noqa: F401

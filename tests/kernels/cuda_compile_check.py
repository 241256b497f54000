"""Compile every Triton kernel for NVIDIA targets WITHOUT a GPU (triton's bundled ptxas), with the launch parameters
the wrappers pick on a GPU, and report registers and spills (ptxas -v). Run in a process without TRITON_INTERPRET:

    python -m tests.kernels.cuda_compile_check [arch ...]      (default: 80 90; prints one JSON line per kernel)

The interpreter never exercises the GPU compiler (layouts, tl.dot shape/dtype rules, register allocation); this does.
A case's launch is its num_warps, or a dict of compile options plus "aligned": the arguments a GPU launch sees as
multiples of 16 (triton specializes pointers and integers so; the gated delta cases use it, for their tiles' loads).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import (gated_delta, gated_delta_chunk, kv_write, moe, paged_attention, qlinear, quest, rms_norm,
                     rope, silu_and_mul)

I32 = "i32"


def cases():
    qsig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "y_ptr": "*bf16", "M": I32,
            "N": I32, "K": I32, "stride_xm": I32, "stride_ym": I32, "stride_wn": I32, "stride_sn": I32, "GROUP": I32,
            "FMT": "constexpr", "PER_CHANNEL": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "PRECISION": "constexpr"}
    for fmt, code in qlinear.FMT_CODE.items():
        for per_channel in ([True, False] if fmt == "int8" else [False]):
            for m, xdt, prec in ((1, "bf16", "tf32"), (4, "bf16", "tf32"), (256, "bf16", "tf32"), (4, "fp32", "ieee")):
                bm, bn, bk, warps = qlinear.launch_blocks(m, 4096, 4096)
                sig = dict(qsig, x_ptr=f"*{xdt}", y_ptr=f"*{xdt}", w_ptr="*i8" if fmt == "int8" else "*u8")
                yield (f"qgemm {fmt}{' per-channel' if per_channel else ''} M={m} x={xdt}", qlinear._qgemm_kernel,
                       sig, {"FMT": code, "PER_CHANNEL": per_channel, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                             "PRECISION": prec}, warps)
        bn, bk = qlinear.DEQUANT_BLOCKS
        yield (f"dequantize_to {fmt}", qlinear._dequant_kernel,
               {"w_ptr": "*i8" if fmt == "int8" else "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "out_ptr": "*bf16",
                "N": I32, "K": I32, "stride_wn": I32, "stride_sn": I32, "stride_on": I32, "GROUP": I32,
                "FMT": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
               {"FMT": code, "BLOCK_N": bn, "BLOCK_K": bk}, 4)
    yield from paged_attention_cases()
    for has_res in (False, True):
        yield (f"rms_norm res={has_res}", rms_norm._rms_norm_kernel,
               {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16",
                "N": I32, "stride_x": I32, "stride_r": I32, "stride_o": I32, "stride_res": I32, "eps": "fp32",
                "HAS_RES": "constexpr", "BLOCK": "constexpr"}, {"HAS_RES": has_res, "BLOCK": 4096}, 8)
    yield ("rope", rope._rope_kernel,
           {"x_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16",
            "H": I32, "HALF": I32, "stride_xt": I32, "stride_xh": I32, "stride_ot": I32, "stride_oh": I32,
            "stride_c": I32, "stride_s": I32, "BLOCK_H": "constexpr", "BLOCK_D": "constexpr"},
           {"BLOCK_H": 32, "BLOCK_D": 64}, 4)
    yield ("silu_and_mul", silu_and_mul._silu_and_mul_kernel,
           {"x_ptr": "*bf16", "out_ptr": "*bf16", "N": I32, "stride_x": I32, "stride_o": I32, "BLOCK": "constexpr"},
           {"BLOCK": 1024}, 4)
    yield from more_cases()
    yield from gated_delta_cases()
    yield from moe_cases()


def paged_attention_cases():
    """Float pages (bf16 at D 64/128/256, fp32 at D 64/128), quantized pages (k8v8, k8v4, k4v4 = rk4v4) with bf16
    queries at D 64/128/256 and with fp32 queries at D 64/128; D 96 pads to BLOCK_D 128 (the same compile).
    Precision and tiles: what the wrapper picks on a GPU."""
    strides = ("stride_qb stride_qh stride_kp stride_kt stride_kh stride_ksp stride_kst stride_ksh stride_vp stride_vt "
               "stride_vh stride_vsp stride_vst stride_vsh stride_ptb stride_ob stride_oh D GROUP").split()
    code_type = {8: "*i8", 4: "*u8"}
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    combos = [("bf16", 0, 0, (64, 128, 256)), ("fp32", 0, 0, (64, 128))]
    combos += [("bf16", kb, vb, (64, 128, 256)) for kb, vb in ((8, 8), (8, 4), (4, 4))]
    combos += [("fp32", kb, vb, (64, 128)) for kb, vb in ((8, 8), (8, 4), (4, 4))]
    for dt, kbits, vbits, dims in combos:
        quantized = bool(kbits)
        prec = paged_attention.dot_precision(dtypes[dt], dtypes[dt], quantized)
        for d in dims:
            group = 4  # every GQA group <= 16 pads to BLOCK_G 16: one compile covers them
            block_d, block_t, warps = paged_attention.launch_params(d, quantized, prec)
            kt, vt = code_type.get(kbits, f"*{dt}"), code_type.get(vbits, f"*{dt}")
            sig = {"q_ptr": f"*{dt}", "k_ptr": kt, "ks_ptr": "*fp16" if kbits else kt, "v_ptr": vt,
                   "vs_ptr": "*fp16" if vbits else vt, "pt_ptr": "*i32", "len_ptr": "*i32", "o_ptr": f"*{dt}",
                   "qk_scale": "fp32", **{s: I32 for s in strides}, "PAGE": "constexpr", "BLOCK_T": "constexpr",
                   "BLOCK_G": "constexpr", "BLOCK_D": "constexpr", "K_BITS": "constexpr", "K_GROUP": "constexpr",
                   "V_BITS": "constexpr", "V_GROUP": "constexpr", "PRECISION": "constexpr"}
            name = f"k{kbits}v{vbits}" if quantized else "float"
            yield (f"paged_attention {name} q={dt} D={d} group={group} {prec}", paged_attention._paged_decode_kernel,
                   sig, {"PAGE": 64, "BLOCK_T": block_t, "BLOCK_G": max(16, triton.next_power_of_2(group)),
                         "BLOCK_D": block_d, "K_BITS": kbits, "K_GROUP": 32 if kbits == 4 else 1, "V_BITS": vbits,
                         "V_GROUP": 32 if vbits == 4 else 1, "PRECISION": prec}, warps)


def more_cases():
    for bits, code in ((8, "*i8"), (4, "*u8")):
        for d in (64, 128, 256):
            g = d if bits == 8 else 32
            yield (f"kv_quant_write int{bits} D={d}", kv_write._kv_quant_write_kernel,
                   {"x_ptr": "*bf16", "slot_ptr": "*i64", "code_ptr": code, "scale_ptr": "*fp16", "stride_xt": I32,
                    "stride_xh": I32, "H": I32, "D": "constexpr", "G": "constexpr", "BITS": "constexpr"},
                   {"D": d, "G": g, "BITS": bits}, 1 if d <= 128 else 2)
    yield ("quest", quest._quest_kernel,
           {"q_ptr": "*fp32", "kmin_ptr": "*fp32", "kmax_ptr": "*fp32", "out_ptr": "*fp32", "N": I32, "D": I32,
            "stride_qh": I32, "stride_qr": I32, "stride_kn": I32, "stride_kh": I32, "stride_on": I32, "stride_oh": I32,
            "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}, {"BLOCK_N": 64, "BLOCK_D": 64}, 4)


def gated_delta_cases():
    """The gated delta rule at Qwen3.5's shapes (Dk = Dv = 128; HK 16, HV 48 are runtime values): decode over fp32 and
    fp16 state pools, with and without step slots, fp32 and bf16 q/k/v; the three prefill kernels; the conv update.
    Tiles, warps, stages and dot precision: what the wrappers pick on a GPU."""
    dk = dv = 128

    def sig_of(fn, types):  # every other runtime argument an i32
        return {p.name: "constexpr" if p.is_constexpr else types.get(p.name, I32) for p in fn.params}

    def aligned(sig):
        return [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride") or n in ("DK", "DV")]

    block_k, block_v, warps = gated_delta.recurrent_launch_params(dk, dv)
    fn = gated_delta._gdn_recurrent_kernel
    combos = (("fp32", "fp32", False), ("fp32", "fp16", True), ("bf16", "fp32", True), ("bf16", "fp16", False))
    for x, st, steps in combos:
        sig = sig_of(fn, {"q_ptr": f"*{x}", "k_ptr": f"*{x}", "v_ptr": f"*{x}", "g_ptr": "*fp32", "beta_ptr": "*fp32",
                          "state_ptr": f"*{st}", "slot_ptr": "*i64", "step_ptr": "*i64", "o_ptr": "*fp32",
                          "q_scale": "fp32", "eps": "fp32"})
        yield (f"gdn_recurrent qkv={x} state={st} steps={steps}", fn, sig,
               {"HAS_STEPS": steps, "BLOCK_K": block_k, "BLOCK_V": block_v},
               {"num_warps": warps, "aligned": aligned(sig)})

    p = gated_delta_chunk.chunk_launch_params(dk, dv)
    tiles = {"C": gated_delta_chunk.CHUNK, "BLOCK_K": p["block_k"], "TWO_HALVES": p["halves"],
             "PRECISION": gated_delta_chunk.GPU_PRECISION}
    fp32_ptrs = ("g_ptr", "beta_ptr", "w_ptr", "u_ptr", "a_ptr", "rq_ptr", "rk_ptr", "h_ptr", "o_ptr")
    for x in ("fp32", "bf16"):
        fn = gated_delta_chunk._chunk_prepare_kernel
        sig = sig_of(fn, {**{n: "*fp32" for n in fp32_ptrs}, "q_ptr": f"*{x}", "k_ptr": f"*{x}", "v_ptr": f"*{x}",
                          "q_scale": "fp32", "eps": "fp32"})
        yield (f"gdn_chunked prepare qkv={x}", fn, sig,
               {"C": tiles["C"], "BLOCK_K": p["prepare_k"], "BLOCK_V": p["prepare_v"], "PRECISION": tiles["PRECISION"]},
               {"num_warps": p["prepare_warps"], "num_stages": p["stages"], "aligned": aligned(sig)})
        fn = gated_delta_chunk._chunk_output_kernel
        sig = sig_of(fn, {**{n: "*fp32" for n in fp32_ptrs}, "q_ptr": f"*{x}"})
        yield (f"gdn_chunked output q={x}", fn, sig, {**tiles, "BLOCK_V": p["out_v"]},
               {"num_warps": p["out_warps"], "num_stages": p["stages"], "aligned": aligned(sig)})
    for x, st in (("fp32", "fp32"), ("bf16", "fp16")):
        fn = gated_delta_chunk._chunk_state_kernel
        sig = sig_of(fn, {**{n: "*fp32" for n in fp32_ptrs}, "k_ptr": f"*{x}", "src_ptr": f"*{st}",
                          "dst_ptr": f"*{st}"})
        yield (f"gdn_chunked state k={x} state={st}", fn, sig, {**tiles, "BLOCK_V": p["state_v"]},
               {"num_warps": p["state_warps"], "num_stages": p["stages"], "aligned": aligned(sig)})

    fn = gated_delta._causal_conv_update_kernel
    for x, st in (("fp32", "fp32"), ("bf16", "bf16")):
        sig = sig_of(fn, {"x_ptr": f"*{x}", "w_ptr": "*fp32", "state_ptr": f"*{st}", "slot_ptr": "*i64",
                          "o_ptr": "*fp32"})
        yield (f"causal_conv_update x={x} state={st} K=4", fn, sig, {"K": 4, "BLOCK_C": 256},
               {"num_warps": 2, "aligned": aligned(sig)})


def moe_cases():
    """The fused-MoE kernels (kernels/moe.py) at Qwen3.5-35B-A3B's shapes (H 2048, I 512, E 256, k 8): dense bf16
    (tl.dot on bf16 tiles) and fp32, and every low-bit format with bf16 activations (tf32 dots), at the decode and
    the prompt tiles the wrapper picks on a GPU."""
    e, k = 256, 8
    formats = [("bf16", moe.DENSE, False, "*bf16", "*bf16"), ("fp32", moe.DENSE, False, "*fp32", "*fp32")]
    formats += [(f"{fmt}{' per-channel' if pc else ''}", code, pc, "*i8" if fmt == "int8" else "*u8", "bf16")
                for fmt, code in qlinear.FMT_CODE.items() for pc in ([True, False] if fmt == "int8" else [False])]
    for name, code, per_channel, wt, xt in formats:
        xt = xt if xt.startswith("*") else f"*{xt}"
        native, prec = xt == "*bf16" and code == moe.DENSE, "ieee" if xt == "*fp32" else "tf32"
        st = wt if code == moe.DENSE else ("*fp32" if per_channel else "*fp16")
        for pairs in (k, 2048 * k):  # one token's experts; a 2048-token prompt's
            bm, bn, bk, warps = moe.launch_blocks(pairs, e, 512, 2048, False)
            for fn, out in ((moe._gate_up_kernel, "act_ptr"), (moe._down_kernel, "y_ptr")):
                sig = {p.name: "constexpr" if p.is_constexpr else I32 for p in fn.params}
                sig |= {"x_ptr": xt, "act_ptr": xt, "w_ptr": wt, "s_ptr": st, "m_ptr": st, "sorted_ptr": "*i32",
                        "expert_ptr": "*i32", "y_ptr": "*fp32", "rw_ptr": "*fp32"}
                sig = {n: t for n, t in sig.items() if n in {p.name for p in fn.params}}
                aligned = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride")]
                yield (f"fused_moe {fn.__name__.strip('_')} {name} x={xt[1:]} pairs={pairs}", fn, sig,
                       {"FMT": code, "PER_CHANNEL": per_channel, "NATIVE": native, "BLOCK_M": bm, "BLOCK_N": bn,
                        "BLOCK_K": bk, "PRECISION": prec}, {"num_warps": warps, "aligned": aligned})


def ptxas_info(ptx: str, arch: int) -> dict:
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    gpu = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([exe, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def main() -> None:
    archs = [int(a) for a in sys.argv[1:]] or [80, 90]
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, sig, consts, launch in cases():
            options = dict(launch) if isinstance(launch, dict) else {"num_warps": launch}
            names = list(sig)
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in options.pop("aligned", ())}
            row = {"arch": arch, "kernel": name, "num_warps": options["num_warps"]}
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                                   options=options)
                row.update(ok=True, **ptxas_info(k.asm["ptx"], arch))
            except Exception as e:  # reported, the test fails on it
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""ninfer-bench's roofline: the stream read bandwidth (the last-level cache read from sysfs, the buffer sized from it),
the roofline columns of the table (bytes per decode token x tok/s / bandwidth) and the --gemv mode's plumbing. No
timing assertions: only that the numbers are computed from what they say."""
from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from engine.tools.bench import gemv, machine
from engine.tools.bench.cli import main
from engine.tools.bench.machine import MIB, last_level_cache, measure_read_bandwidth, stream_bytes
from engine.tools.bench.measure import add_roofline, format_table


def _cache(root, index, level, kind, size):
    folder = root / f"index{index}"
    folder.mkdir(parents=True)
    (folder / "level").write_text(f"{level}\n")
    (folder / "type").write_text(f"{kind}\n")
    (folder / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_highest_level_sysfs_lists(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "64K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    _cache(tmp_path, 3, 3, "Unified", "491520K")
    assert last_level_cache(str(tmp_path)) == 491520 * 1024
    assert last_level_cache(str(tmp_path / "absent")) is None


def test_the_stream_buffer_is_several_times_the_cache_within_bounds():
    gib = 1 << 30
    assert stream_bytes(480 * MIB, 20 * gib) == machine.STREAM_LLC_TIMES * 480 * MIB
    assert stream_bytes(None, 20 * gib) == machine.STREAM_MIN_BYTES  # no cache known: the floor
    assert stream_bytes(8 * MIB, 20 * gib) == machine.STREAM_MIN_BYTES
    assert stream_bytes(4 * gib, 64 * gib) == machine.STREAM_MAX_BYTES
    assert stream_bytes(480 * MIB, 2 * gib) == gib // 2  # a quarter of the memory available
    assert stream_bytes(480 * MIB, 10 * MIB) == 2 * MIB  # whole MiB
    assert stream_bytes(480 * MIB, 2 * MIB) == MIB  # and at least one


def test_the_stream_read_measures_every_pass_and_names_them():
    threads = torch.get_num_threads()
    out = measure_read_bandwidth(torch.device("cpu"), nbytes=16 * MIB, repeat=3, threads=1)
    assert out["bytes"] == 16 * MIB and len(out["passes"]) == 3 and out["gbps"] > 0
    assert out["gbps"] == sorted(out["passes"])[1] and out["threads"] == 1
    assert torch.get_num_threads() == threads  # restored
    text = machine.describe_stream(out)
    assert "GB/s" in text and "16 MiB" in text and "median of 3" in text


def test_the_roofline_is_bytes_times_tokens_per_second_over_the_bandwidth():
    ours = dict(decode_tps=50.0, bytes_per_decode_token=200e6)
    add_roofline(ours, stream_gbps=20.0)
    assert ours["roofline_tps"] == pytest.approx(100.0)
    assert ours["roofline_fraction"] == pytest.approx(200e6 * 50.0 / 20e9) == pytest.approx(0.5)
    through_api = add_roofline(dict(decode_tps=50.0, bytes_per_decode_token=0.0), 20.0)
    assert "roofline_tps" not in through_api  # no bytes per token, no roofline


def _column(tps, per_token):
    return dict(ttft_s=0.1, prefill_tps=100.0, decode_tps=tps, decode_gbps=per_token * tps / 1e9,
                bytes_per_decode_token=per_token, tokens=[1, 2, 3])


def test_the_table_has_the_roofline_rows_for_each_engine():
    ours, theirs = _column(50.0, 200e6), _column(10.0, 500e6)
    for column in (ours, theirs):
        add_roofline(column, 20.0)
    text = format_table({"cpu": "x"}, ours, theirs, None, peer="llama.cpp")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["roofline tok/s"] == ["100.0", "40.0"]
    assert rows["decode/roofln"] == ["0.50", "0.25"]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines.index(next(x for x in lines if "roofline tok/s" in x)) == lines.index(
        next(x for x in lines if "decode GB/s" in x)) + 1  # next to GB/s
    alone = format_table({}, dict(_column(50.0, 200e6)), None, None, peer="none")
    assert "roofline" not in alone  # no bandwidth measured: no rows


def test_bench_json_and_table_carry_the_roofline(tmp_path, capsys):
    from tests.engine.test_bench import _tiny_llama_folder

    out = tmp_path / "bench.json"
    assert main([str(_tiny_llama_folder(tmp_path / "tiny")), "--device", "cpu", "--prompt-tokens", "16",
                 "--gen-tokens", "4", "--repeat", "1", "--compare", "none", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ours, stream = result["ninfer"], result["stream_read"]
    assert stream["gbps"] > 0 and stream["bytes"] >= MIB
    assert ours["roofline_fraction"] == pytest.approx(
        ours["bytes_per_decode_token"] * ours["decode_tps"] / (stream["gbps"] * 1e9))
    assert "stream read bandwidth" in result["machine"]
    text = capsys.readouterr().out
    assert "| roofline tok/s" in text and "| decode/roofln" in text


def test_gemv_shapes_and_weights():
    assert gemv.parse_shapes("14336x4096,64X32") == [(14336, 4096), (64, 32)]
    for bad in ("14336", "10x33", "0x64", "ax64"):
        with pytest.raises(ValueError, match="--gemv-shapes"):
            gemv.parse_shapes(bad)
    qw = gemv.make_weight("q4_1", 64, 128)
    assert qw.format == "int4_asym" and qw.qweight.shape == (64, 64) and qw.mins is not None
    assert gemv.weight_bytes(qw) == 64 * 64 + 2 * 64 * 4 * 2
    assert gemv.make_weight("q8_out", 64, 128).scales.dtype == torch.float32


def test_gemv_mode_reports_each_format_and_path(cpp_kernels, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gemv, "last_level_cache", lambda: MIB)  # a small pass: 2 MiB of copies
    monkeypatch.setattr(gemv, "measure_read_bandwidth", lambda device: dict(
        gbps=10.0, bytes=MIB, llc=MIB, threads=1, passes=[9.0, 10.0, 11.0]))
    out = tmp_path / "gemv.json"
    assert main(["--gemv", "--gemv-shapes", "256x512", "--gemv-formats", "q4_0,q8_out", "--repeat", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    variants = len(gemv.cpu_native.gemv_paths()) * len(gemv.cpu_native.GEMV_SPLITS)
    assert len(result["results"]) == 2 * variants and result["stream_gbps"] == 10.0
    for r in result["results"]:
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["of_stream"] == pytest.approx(r["gbps"] / 10.0) and r["copies"] >= 2
        assert r["best_gbps"] >= r["gbps"] * (1 - 1e-9)
    text = capsys.readouterr().out
    assert "| q4_0 | 256x512 | 1 | avx2, static |" in text and "other processes' CPU load" in text


def test_gemv_mode_refuses_bad_arguments(capsys):
    args = Namespace(gemv_formats="q3_k", gemv_shapes="64x64", gemv_rows=1, threads=0, repeat=1, json=None)
    assert gemv.run_from_args(args, "x") == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["--gemv", "--gemv-rows", "0"]) == 2
    assert main(["--gemv", "--gemv-shapes", "64x31"]) == 2

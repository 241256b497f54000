"""--cuda-graphs' static decode path through the Triton kernels (the CUDA path; here in the interpreter): batches
padded to a power of two with dummy rows, the page-table decode attention kernel over the whole batch at once,
the same logits as the eager path (which runs the kernel one sequence at a time)."""
import torch

from tests.engine.test_cuda_graphs import decode_logits, rel


def test_static_decode_on_triton_matches_eager(tmp_path, monkeypatch):
    from kernels import paged_attention
    from tests.engine.helpers import our_model, tiny_hf_model

    _, folder = tiny_hf_model("llama", tmp_path, seed=7)
    model = our_model(folder)
    batches = []
    real = paged_attention.paged_decode_attention
    monkeypatch.setattr(paged_attention, "paged_decode_attention",
                        lambda q, *a, **k: batches.append(q.shape[0]) or real(q, *a, **k))
    eager, _ = decode_logits(model, False, [70, 5, 130], 3)
    assert set(batches) == {1}  # the general forward: one kernel call per sequence
    batches.clear()
    default, _ = decode_logits(model, None, [70, 5, 130], 3)
    assert batches == [3] * 3 * model.cfg.num_layers  # unpadded: the kernel over the step's own 3 rows
    assert rel(default, eager) < 1e-5
    batches.clear()
    static, runner = decode_logits(model, True, [70, 5, 130], 3)
    assert batches == [4] * 3 * model.cfg.num_layers  # one call per layer and step, for the padded batch
    assert rel(static, eager) < 1e-5
    assert torch.equal(static.argmax(-1), eager.argmax(-1))
    assert list(runner.graphs.entries) == [(4, 4)] and runner.graphs.entries[(4, 4)].runs == 3

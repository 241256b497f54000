"""--cuda-graphs: the static decode path (fixed-size tensors per batch/page bucket, dummy rows on a scratch page, the
page-table attention) gives the eager decode path's logits. The capture itself needs a GPU; here the static forward
is called directly (ModelRunner(static_decode=True)), the code the graph would record. The same path through the
Triton kernels (interpreter): tests/kernels/test_static_decode_on_triton.py."""
import pytest
import torch

from engine.errors import NInferError
from engine.model.graphs import DecodeGraphs, bucket, resolve_cuda_graphs
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from tests.engine.helpers import PAGE, make_engine, our_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.engine.helpers import tiny_hf_model
    _, folder = tiny_hf_model("llama", tmp_path_factory.mktemp("graphs"), seed=11)
    return our_model(folder)


def decode_logits(model, static: bool | None, lens: list[int], steps: int, kv_dtype=torch.float32, seed: int = 0):
    """Prefills one sequence per length, then `steps` decode steps of all of them together: the decode logits
    [steps, len(lens), vocab], and the runner. `static`: True runs the decode steps as a graph would (padded, the
    page-table kernel or its twin), None as the runner does by default (the step's own sizes; on the CPU row views),
    False through the general forward (sequence by sequence: the reference)."""
    runner = ModelRunner(model, 16, kv_dtype, PAGE, static_decode=bool(static))
    if static is False:
        runner.graphs = None
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lens:
        tokens = torch.randint(0, 512, (n,), generator=gen).tolist()
        seqs.append((tokens, runner.pool.allocate(-(-(n + steps) // PAGE))))
        runner.run([Work(tokens, 0, seqs[-1][1], "last")])
    out = []
    for step in range(steps):
        works = [Work([(31 * step + 7 * i) % 512], len(t) + step, pages, "last") for i, (t, pages) in enumerate(seqs)]
        out.append(torch.cat(runner.run(works)))
    return torch.stack(out), runner


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("lens", [[9], [70, 5, 130], [64, 63]])
def test_static_decode_matches_eager(model, lens, one_thread):
    """Batch 1, 3 (padded to 4: one dummy row) and 2, sequences over 1-3 pages (page bucket 1, 2 or 4), 5 steps:
    the static path's logits equal the eager path's within float32 summation-order noise (the eager decode uses
    grouped_attention, the static one the paged-attention twin), and the same argmax."""
    eager, _ = decode_logits(model, False, lens, 5)
    static, runner = decode_logits(model, True, lens, 5)
    assert rel(static, eager) < 1e-5
    assert torch.equal(static.argmax(-1), eager.argmax(-1))
    g = runner.graphs
    assert g.steps == 5  # every decode step ran static (the prefills eagerly)
    want = {(bucket(len(lens)), bucket(-(-(n + 5) // PAGE))) for n in lens}
    assert set(g.entries) <= {(bucket(len(lens)), p) for p in (1, 2, 4)} and len(g.entries) <= len(want) + 1
    assert sum(e.runs for e in g.entries.values()) == 5  # buckets reused, not one static set per step


@pytest.mark.parametrize("kv_dtype", [torch.float32, "k8v4"])
def test_the_cpus_default_decode_is_the_static_forward_at_its_own_sizes(model, kv_dtype, one_thread):
    """By default the CPU decodes through the same static forward, unpadded (batch 3 stays 3, no scratch page) and
    reading each row's pages as views: the general forward's logits, every step on this path, no bucket kept."""
    reference, _ = decode_logits(model, False, [70, 5, 130], 4, kv_dtype)
    default, runner = decode_logits(model, None, [70, 5, 130], 4, kv_dtype)
    assert rel(default, reference) < 1e-6
    assert torch.equal(default.argmax(-1), reference.argmax(-1))
    g = runner.graphs
    assert g.steps == 4 and not g.padded and g.row_views and g.entries == {}
    assert runner.kv.num_pages == runner.pool.num_pages == 16


@pytest.mark.parametrize("kv_dtype", ["k8v8", "k4v4", "rk4v4"])
def test_static_decode_with_quantized_kv(model, kv_dtype, one_thread):
    """Quantized KV: the static path passes the codes and scales to the paged kernel (its twin here), which reads
    the same codes the eager path dequantizes, so only the summation order differs."""
    eager, _ = decode_logits(model, False, [70, 5, 130], 4, kv_dtype)
    static, runner = decode_logits(model, True, [70, 5, 130], 4, kv_dtype)
    assert rel(static, eager) < 1e-5
    assert torch.equal(static.argmax(-1), eager.argmax(-1))
    assert runner.graphs.steps == 4


def test_dummy_rows_write_only_the_scratch_page(model, one_thread):
    """The scratch page lies beyond the page pool (which never hands it out); a padded step changes no other KV
    row than the real sequences' new ones."""
    runner = ModelRunner(model, 4, torch.float32, PAGE, static_decode=True)
    assert runner.kv.num_pages == 5 and runner.pool.num_pages == 4 and runner.graphs.scratch_page == 4
    pages = runner.pool.allocate(4)
    assert 4 not in pages
    runner.run([Work(list(range(10)), 0, pages[:1], "last")])
    before = [t.clone() for t in runner.kv.k]
    runner.run([Work([3], 10, pages[:1], "last")])  # batch 1: no dummy; then batch 3 -> 4: one dummy row
    runner.run([Work([4], 11, pages[:1], "last"), Work([5], 0, pages[1:2], "last"), Work([6], 0, pages[2:3], "last")])
    for layer, old in enumerate(before):
        new = runner.kv.k[layer]
        changed = {(p, r) for p, r in (new != old).any(-1).any(-1).nonzero().tolist()}
        assert changed - {(4, 0)} == {(pages[0], 10), (pages[0], 11), (pages[1], 0), (pages[2], 0)}


def test_only_plain_decode_steps_run_static(model, one_thread):
    runner = ModelRunner(model, 8, torch.float32, PAGE, static_decode=True)
    g = runner.graphs
    pages = runner.pool.allocate(2)
    assert g.why_not([Work([1, 2, 3], 0, pages)]) == "not a decode step"  # prefill
    assert g.why_not([Work([1], 5, pages), Work([1, 2], 5, pages, "all")]) == "not a decode step"  # verification
    assert g.why_not([Work([1], 5, pages)]) is None
    model.keep_hidden = True
    try:
        assert g.why_not([Work([1], 5, pages)]) == "MTP drafting reads the hidden states"
    finally:
        model.keep_hidden = False


def test_windowed_sequences_decode_eagerly_with_the_eager_tokens(model, one_thread):
    """A windowed sequence's table (TieredPages, itself a list of its GPU pages in no logical order) is not a page
    list the static path can read: its decode steps run eagerly, and the tokens are those of a runner without the
    static path."""
    from engine.engine import Engine

    prompt = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(4)).tolist()

    def generate(static: bool):
        runner = ModelRunner(model, 40, torch.float32, PAGE, host_pages=16, static_decode=static)
        engine = Engine(runner, max_concurrency=1, prefill_chunk=128, max_context=1024, kv_window=128, max_shared_prefixes=0,
                        kv_retrieve=512).start()
        try:
            tokens = [o.token_ids for o in engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0))]
        finally:
            engine.shutdown()
        return tokens, runner

    static, runner = generate(True)
    assert runner.graphs.steps == 0  # every decode step of the windowed sequence ran eagerly
    assert static == generate(False)[0]


def test_engine_greedy_tokens_are_the_eager_engines(model, one_thread):
    """Through the engine: 3 concurrent requests of different lengths (decode batches of 3, then fewer as they
    finish), greedy, the same tokens as an engine without the static path."""
    prompts = [list(range(5, 75)), [9, 8, 7], list(range(100, 230))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = {}
    for static in (False, True):
        engine = make_engine(ModelRunner(model, 16, torch.float32, PAGE, static_decode=static), max_concurrency=4)
        try:
            streams = [engine.submit(p, SamplingParams(**{**params.__dict__, "max_tokens": 24 - 4 * i}))
                       for i, p in enumerate(prompts)]
            got[static] = [[t for out in s for t in out.token_ids] for s in streams]
        finally:
            engine.shutdown()
        if static:
            assert engine.runner.graphs.steps > 0
    assert got[True] == got[False]


def test_setting_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_cuda_graphs("off", cpu) is False and resolve_cuda_graphs("off", cuda) is False
    assert resolve_cuda_graphs("auto", cpu) is False
    with pytest.raises(NInferError, match="needs a CUDA GPU, but the model runs on the cpu") as err:
        resolve_cuda_graphs("on", cpu)
    assert "--cuda-graphs auto" in err.value.remedy
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    assert resolve_cuda_graphs("auto", cuda) is False  # no Triton: no page-table kernel, no graphs
    with pytest.raises(NInferError, match="needs Triton"):
        resolve_cuda_graphs("on", cuda)
    monkeypatch.delenv("NINFER_NO_TRITON")
    from kernels import dispatch
    if dispatch.triton_available():
        assert resolve_cuda_graphs("auto", cuda) is True


def test_on_is_refused_on_the_cpu_by_build_engine(engine_for):
    with pytest.raises(NInferError, match="--cuda-graphs on needs a CUDA GPU"):
        engine_for(None, device="cpu", cuda_graphs="on", max_context=256, max_concurrency=1)


def test_capture_needs_cuda(model):
    runner = ModelRunner(model, 4, torch.float32, PAGE)
    with pytest.raises(NInferError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(runner, 4, capture=True)


def test_bench_passes_the_settings_through(monkeypatch):
    from engine.tools.bench import cli as bench
    args = bench.build_parser().parse_args(["--cuda-graphs", "off", "--prefill-cublas"])
    assert args.cuda_graphs == "off" and args.prefill_cublas is True
    assert bench.build_parser().parse_args([]).cuda_graphs == "auto"


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay() recomputes the static forward (as a faithful graph
    would), optionally corrupted (as a broken capture might)."""

    def __init__(self, graphs, entry, corrupt: bool):
        self.graphs, self.entry, self.corrupt, self.replays = graphs, entry, corrupt, 0

    def replay(self):
        self.replays += 1
        out = self.graphs._forward(self.entry)
        self.entry.out = out + 1.0 if self.corrupt else out


def with_fake_graphs(runner, corrupt: bool = False, fail: bool = False):
    """Makes the runner's static path record a FakeGraph for each new bucket (or fail to)."""
    g = runner.graphs
    make = g._entry

    def entry(batch, pages):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        new = (batch, pages) not in g.entries
        e = make(batch, pages)
        if new:
            e.graph = FakeGraph(g, e, corrupt)
        return e

    g._entry = entry
    return g


@pytest.mark.parametrize("how", ["faithful", "corrupt", "fail"])
def test_replay_is_checked_once_and_a_bad_capture_falls_back_to_eager(model, how, one_thread, monkeypatch, caplog):
    """The replay path (graph recorded, inputs copied in, replay, outputs cloned): a faithful graph keeps serving
    every step after one check against the eager static forward; a graph whose first replay differs, or a capture
    that raises, is dropped with a warning and every step (that one included) is decoded eagerly, with the eager
    path's logits."""
    eager, _ = decode_logits(model, False, [9, 70], 4)
    made, real = {}, ModelRunner

    def runner_factory(*args, **kwargs):
        runner = real(*args, **kwargs)
        if kwargs.get("static_decode"):
            made["graphs"] = with_fake_graphs(runner, corrupt=how == "corrupt", fail=how == "fail")
            made["runner"] = runner
        return runner

    monkeypatch.setattr(f"{__name__}.ModelRunner", runner_factory)
    with caplog.at_level("WARNING", logger="ninfer.graphs"):
        static, runner = decode_logits(model, True, [9, 70], 4)
    assert rel(static, eager) < 1e-5 and torch.equal(static.argmax(-1), eager.argmax(-1))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if how == "faithful":
        assert runner.graphs is made["graphs"] and not warnings
        [e] = runner.graphs.entries.values()
        assert e.graph.replays == 4 and e.runs == 4
    else:
        assert runner.graphs is None and len(warnings) == 1
        assert ("differs from the same step run eagerly" if how == "corrupt" else "failed") in warnings[0]

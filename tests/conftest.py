import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Nothing in the tests writes into the user's NInfer folders (settings, data such as the library's last use), and
# no two test processes share one: each pytest-xdist worker makes its own (the workers inherit the controller's).
if not os.environ.get("NINFER_HOME") or os.environ.get("NINFER_TESTS_HOME") == os.environ["NINFER_HOME"]:
    import tempfile

    os.environ["NINFER_HOME"] = os.environ["NINFER_TESTS_HOME"] = tempfile.mkdtemp(prefix="ninfer-tests-home-")
# Under pytest-xdist the workers share the cores: each computes on its share, as many threads as it has cores (two
# workers on two cores each running two threads would fight over both).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("OMP_NUM_THREADS"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# Compiled CPU kernels (inductor's and the C++ unit, engine/kernel_cache.py) come from the user's kernel cache, shared
# by this run, the processes it starts and later runs: each build is keyed by what made it, so it is made once per
# machine and source, not once per run.
from engine.kernel_cache import use_kernel_cache  # noqa: E402

use_kernel_cache()


import pytest  # noqa: E402

MAX_WORKERS = 4  # each worker loads the embedded model and the tiny hybrids once: more cost memory, gain little


# The longest modules (docs/DEVELOPING.md, the --durations of a run) go first, so that the workers of `-n auto
# --dist loadfile` end together instead of one running the agent check alone at the end; the rest keep their order.
# A module missing here only costs balance.
LONGEST_FIRST = ("tests/api/test_agent_check.py", "tests/engine/test_cpu_step.py", "tests/engine/test_spec.py",
                 "tests/kernels/test_engine_on_triton.py", "tests/engine/test_kv_quant.py",
                 "tests/engine/test_eval.py", "tests/kernels/test_cuda_compile.py", "tests/engine/test_prefix.py",
                 "tests/engine/test_bench.py", "tests/engine/test_train_tiny_hybrid.py",
                 "tests/kernels/test_static_decode_on_triton.py", "tests/engine/test_bench_modes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest in order


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not loaded
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default options): one worker per core, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@pytest.fixture(scope="session")
def cpp_kernels():
    """The C++ CPU kernels (kernels/cpu_native.py), built or loaded from the kernel cache on first use, never at
    collection. The project's dependencies bring what they need (a C++ compiler, ninja): not building is a failure."""
    from kernels import cpu_native

    why = cpu_native.ready()
    assert why is None, why


@pytest.fixture(scope="session")
def engine_for():
    """engine_for(model=None, **settings) -> a new LoadedEngine (engine.build) for `model` (None: the embedded
    default) under EngineConfig(**settings), not started. The model is loaded once per set of the settings that shape
    it (engine.build.MODEL_FIELDS) for the whole session; each call assembles a fresh engine over it (sequence memory,
    runner, Engine: cheap), which the test may start, step and shut down as its own. Engines still running at the
    end of the session are shut down. Two engines over one model run one at a time (tests run one at a time).
    A test that changes the model itself (marks its layers, say) asks for `own_model=True`: a model of its own."""
    from engine.build import MODEL_FIELDS, assemble_engine, load_model
    from engine.config.engine_config import EngineConfig
    from engine.hardware import resolve_device

    models: dict[tuple, object] = {}
    made: list = []

    def make(model=None, own_model: bool = False, **settings):
        config = EngineConfig().replace(**settings)
        config = config.replace(device=resolve_device(config.device))  # "auto" and "cpu" load one model here
        key = (str(model), config.spec == "mtp", *(getattr(config, f) for f in MODEL_FIELDS))
        if own_model:
            made.append(assemble_engine(load_model(model, config), config))
            return made[-1]
        if key not in models:
            models[key] = load_model(model, config)
        made.append(assemble_engine(models[key], config))
        return made[-1]

    yield make
    for loaded in made:
        loaded.engine.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory):
    """tiny_qwen35(seed=0, **overrides) -> (transformers model, folder): the seeded, perturbed tiny Qwen3.5 hybrid
    of tests/engine/qwen35_models.tiny_checkpoint, built and saved once per (seed, overrides) for the session. The
    oracle and the folder are shared: a test reads them, and copies the folder before changing files in it."""
    from tests.engine.qwen35_models import tiny_checkpoint

    built: dict[tuple, tuple] = {}

    def make(seed: int = 0, **overrides):
        key = (seed, *sorted((k, repr(v)) for k, v in overrides.items()))
        if key not in built:
            built[key] = tiny_checkpoint(tmp_path_factory.mktemp(f"qwen35-{seed}") / "tiny-qwen35", seed, **overrides)
        return built[key]

    return make

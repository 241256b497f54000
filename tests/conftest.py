import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Nothing in the tests writes into the user's NInfer folders (settings, data such as the library's last use).
if not os.environ.get("NINFER_HOME"):
    import tempfile

    os.environ["NINFER_HOME"] = tempfile.mkdtemp(prefix="ninfer-tests-home-")
# Compiled CPU kernels (inductor's and the C++ unit, engine/kernel_cache.py) come from the user's kernel cache, shared
# by this run, the processes it starts and later runs: each build is keyed by what made it, so it is made once per
# machine and source, not once per run.
from engine.kernel_cache import use_kernel_cache  # noqa: E402

use_kernel_cache()


import pytest  # noqa: E402


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

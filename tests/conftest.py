import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Nothing in the tests writes into the user's NInfer folders (settings, data such as the library's last use).
if not os.environ.get("NINFER_HOME"):
    import tempfile

    os.environ["NINFER_HOME"] = tempfile.mkdtemp(prefix="ninfer-tests-home-")
# One cache of compiled CPU kernels (inductor's and the C++ kernels', engine/model/head.py) for the whole run and the
# processes it starts, whatever NINFER_HOME a test sets for itself: each is built once a run, not once a process.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.environ["NINFER_HOME"], "cache", "inductor"))

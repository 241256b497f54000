import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Nothing in the tests writes into the user's NInfer folders (settings, data such as the library's last use).
if not os.environ.get("NINFER_HOME"):
    import tempfile

    os.environ["NINFER_HOME"] = tempfile.mkdtemp(prefix="ninfer-tests-home-")

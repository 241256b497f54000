import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# The whole suite once ended in "Fatal Python error: bool_dealloc" at interpreter exit, after every test passed: a C
# extension used by some test releases references to False/True that it does not own, and over ~1,700 tests that
# drained the interpreter's own (Python 3.11's booleans are not immortal). Until that extension is found, the suite
# holds enough references that the count cannot reach zero.
_BOOL_REFERENCES = [False, True] * 1_000_000

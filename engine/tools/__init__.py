"""Command-line tools that sit beside the engine and drive it from outside: ``ninfer-bench`` (bench/),
``ninfer-doctor`` (doctor.py) and the GPU check behind scripts/gpu_check.sh (gpu_check.py).

The engine never imports this package; each tool imports the parts of the engine it measures or reports on."""

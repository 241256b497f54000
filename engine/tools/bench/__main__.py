"""python -m engine.tools.bench: the same as ninfer-bench."""
import sys

from engine.tools.bench.cli import main

sys.exit(main())

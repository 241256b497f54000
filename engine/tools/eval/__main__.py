"""python -m engine.tools.eval: the same as ninfer-eval."""
import sys

from engine.tools.eval.cli import main

sys.exit(main())

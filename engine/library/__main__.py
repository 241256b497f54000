import sys

from engine.library.cli import main

sys.exit(main())

import sys

from hisparse_core.cli import main

sys.exit(main())

import sys

from hisparse_core.launcher import main

sys.exit(main())

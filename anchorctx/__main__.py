import sys

from anchorctx.cli import main

sys.exit(main())

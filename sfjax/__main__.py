import sys

from sfjax.cli import main

sys.exit(main())

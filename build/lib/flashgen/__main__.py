import sys

from flashgen.cli import main

sys.exit(main())

import sys

from hier_localsgd.cli import main

sys.exit(main())

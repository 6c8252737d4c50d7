import sys

from zoneq.cli import main

sys.exit(main())

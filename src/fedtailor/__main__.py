import sys

from fedtailor.cli import main

sys.exit(main())

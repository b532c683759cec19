import sys

from palestra.cli import main

sys.exit(main())

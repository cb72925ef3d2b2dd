import sys

from lightning_hpc.cli import main

sys.exit(main())

import sys

from lightning_hpc.cli import main

if __name__ == "__main__":  # not in the processes multiprocessing spawns, which import the main module again
    sys.exit(main())

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import mg_helpers.py
# Tiny tensors on a shared 2-core machine: intra-op threads only add contention.
torch.set_num_threads(1)

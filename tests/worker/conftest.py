import torch

# Tiny tensors on a shared 2-core machine: extra intra-op threads only spin against each other.
torch.set_num_threads(1)

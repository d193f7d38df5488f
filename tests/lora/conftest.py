import torch

# Tiny models on a shared 2-core machine: extra intra-op threads only spin against each other
# (measured ~30x slower per op under load).
torch.set_num_threads(1)

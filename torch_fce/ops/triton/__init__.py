"""Triton kernels (no autograd, no torch.library: the launchers are called by backends)."""

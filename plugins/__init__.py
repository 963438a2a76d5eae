"""Kernels: Triton kernels, launchers, torch ops and plain-PyTorch references."""

"""Device code: Triton kernels, one concern per module."""

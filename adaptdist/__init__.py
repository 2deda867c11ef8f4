"""adaptdist: an end-to-end adaptive distributed training compiler for PyTorch."""

__version__ = "0.1.0"

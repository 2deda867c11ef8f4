"""Describing and measuring the machines a job runs on.

One job per module:

- :mod:`.hardware`  facts about this machine (cores, memory, CPU features) and the
  default, *uncalibrated* figures estimated from them;
- :mod:`.detect`    ``adaptdist cluster detect``: a cluster file for this machine;
- :mod:`.fit`       the alpha-beta least-squares fit of collective timings;
- :mod:`.bench`     what every rank runs while profiling (collectives, matmul, elementwise);
- :mod:`.profile`   ``adaptdist cluster profile``: launch the ranks, show progress, write
  a calibrated cluster file.

The data model itself lives in :mod:`adaptdist.cluster`. This package imports nothing
at import time so that ``adaptdist.cluster`` may import :mod:`.hardware` freely.
"""

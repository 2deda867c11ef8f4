"""The ``adaptdist`` command: every subcommand's arguments and body, one module per command family.

- :mod:`.main`      the parser, ``train``, ``plan``, ``compile``, ``run`` and the dispatch (:func:`main`);
- :mod:`.common`    what several commands share (``--plan`` as a plan object);
- :mod:`.estimate`  ``adaptdist estimate``;
- :mod:`.explain`   ``adaptdist explain NODE``;
- :mod:`.cluster`   ``adaptdist cluster detect|profile``;
- :mod:`.launch`    ``adaptdist launch script.py``.

Commands sit above every layer (compiler, cost models, runtime, calibration); nothing below imports
this package. ``python -m adaptdist.cli`` runs :func:`main`.
"""

from .main import main

__all__ = ["main"]

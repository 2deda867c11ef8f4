"""One rank of an elastic ``adaptdist train --nproc MIN:MAX`` job, started by its own torchrun agent.

``python -m adaptdist.cli.elastic_worker OUT/train_config.pkl``: the configuration is a pickle the launching
``adaptdist train`` wrote into its own ``--out`` for its own ranks (never a file from elsewhere).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import os

    from ..errors import AdaptdistError
    from ..runtime.worker import run_worker

    argv = sys.argv[1:] if argv is None else argv
    cfg = pickle.loads(Path(argv[0]).read_bytes())
    try:
        run_worker(cfg)
    except AdaptdistError as e:  # recorded in OUT/status; one line here, not a traceback per rank
        print(f"rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

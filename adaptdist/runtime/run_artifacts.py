"""One rank of ``adaptdist run`` under torchrun, for clusters of several hosts.

On each host::

    torchrun --nnodes H --nproc-per-node N --rdzv-endpoint HOST:PORT \\
        -m adaptdist.runtime.run_artifacts DIR [--steps S] [--data FILE] [--out DIR]

Every rank checks the artifacts (files, hashes, versions: :func:`adaptdist.program.check_artifacts`; its
world size against the manifest's) before loading its program, then runs the same step loop as
``adaptdist run`` (:func:`data_spec` is where both take their batches). Nothing here imports the compiler.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from ..errors import UsageError


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, check the artifacts, and run this rank (torchrun sets RANK and WORLD_SIZE)."""
    ap = argparse.ArgumentParser(prog="python -m adaptdist.runtime.run_artifacts")
    ap.add_argument("artifacts", metavar="DIR")
    from ..arg_types import positive, seed

    ap.add_argument("--steps", type=positive(int), default=100)
    ap.add_argument("--data", default=None)
    ap.add_argument("--lr", type=positive(float), default=2e-3)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--seed", type=seed, default=0)
    ap.add_argument("--out", default="runs/artifacts")
    ap.add_argument("--timeout-s", type=positive(float), default=300.0)
    args = ap.parse_args(argv)
    from ..errors import AdaptdistError, RuntimeLaunchError
    from ..program import check_artifacts, check_model_file
    from .worker import TrainConfig, first_attempt_of_launch, run_worker

    try:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeLaunchError("RANK/WORLD_SIZE are not set: start this module with torchrun "
                                     "(or use `adaptdist run DIR` for local ranks)")
        d = Path(args.artifacts)
        manifest = check_artifacts(d, None)
        check_model_file(manifest, d)
        world = int(os.environ["WORLD_SIZE"])
        if world != manifest["world_size"]:
            raise RuntimeLaunchError(f"{str(d)!r} was compiled for {manifest['world_size']} ranks; torchrun started "
                                     f"{world}")
        kinds = {k for _, _, k in manifest.get("cluster_hosts", [])} or {"cpu"}
        from safetensors.torch import load_file

        from ..throughput import manifest_unit

        unit, items = manifest_unit(manifest, [load_file(str(d / "example_batch.safetensors"))["b0"]])
        cfg = TrainConfig(first_attempt=first_attempt_of_launch(args.out), program_dir=str(d), out_dir=args.out,
                          data=data_spec(manifest, d, args.data, args.seed),
                          steps=args.steps, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                          threads_per_rank=max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))),
                          timeout_s=args.timeout_s, backend="nccl" if kinds == {"cuda"} else "gloo",
                          items_per_step=items, unit=unit,
                          model_name=str(manifest.get("model")), rng=manifest.get("rng", "per-rank"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        run_worker(cfg)
    except AdaptdistError as e:
        print(f"adaptdist: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def data_spec(manifest: Mapping[str, Any], directory: Path, data: str | None, seed: int) -> Any:
    """Where ``adaptdist run`` takes batches: the model file's ``data(batch_size, seq_len, path=--data)`` when it
    has one, else the example batch saved with the artifacts.

    Raises:
        UsageError: ``--data`` given but the model file (if still there) defines no data().
    """
    from ..model_spec import load_module
    from .worker import DataSpec

    B, T = manifest["batch_size"], manifest["seq_len"]
    model_file = Path(manifest.get("model_file", ""))
    if model_file.is_file():
        module = load_module(str(model_file))
        if callable(getattr(module, "data", None)):
            from safetensors.torch import load_file

            from .batch_check import batch_shapes

            example = load_file(str(directory / "example_batch.safetensors"))  # the batch the programs were built for
            return DataSpec(str(model_file), "data", B, T, path=data, seed=seed,
                            batch_shapes=batch_shapes(example[f"b{i}"] for i in range(len(example))))
    if data:
        raise UsageError(f"--data was given but the model file {str(model_file)!r} (recorded in the manifest) "
                         "is missing or defines no data(batch_size, seq_len, path=...) function")
    return DataSpec(str(model_file), None, B, T, batch_file=str(directory / "example_batch.safetensors"))


def check_data_fits(manifest: Mapping[str, Any], directory: Path, data: str | None) -> None:
    """``adaptdist run --data``: data other than the compile's must give the model the parameter shapes the programs
    were compiled for (a model file that sizes its model from the data, as builtin:dlrm's tables from the
    MovieLens ids, would otherwise fail on an index outside a table, deep in a rank).

    Artifacts from before the manifest recorded ``param_shapes`` are not checked.

    Raises:
        UsageError: a parameter whose shape differs: names it, both shapes, both data and the command to recompile.
    """
    shapes = manifest.get("param_shapes")
    if not shapes or data == manifest.get("data"):
        return
    import contextlib
    import io

    from ..model_spec import ModelSpec

    spec = ModelSpec.parse(str(manifest["model"]))
    with contextlib.redirect_stderr(io.StringIO()):
        model, _, _ = spec.build(int(manifest["batch_size"]), int(manifest["seq_len"]), data_path=data)
    for name, t in model.state_dict().items():
        if name in shapes and list(t.shape) != list(shapes[name]):
            was = manifest.get("data") or "the model file's default data"
            raise UsageError(
                f"--data {data!r} needs {name} of shape {list(t.shape)}, but the artifacts in {str(directory)!r} were "
                f"compiled for {was!r} with shape {list(shapes[name])} (the model is sized from its data); compile "
                f"for this data: adaptdist compile {manifest['model']} --data {data} -o DIR, then adaptdist run DIR")


if __name__ == "__main__":
    sys.exit(main())

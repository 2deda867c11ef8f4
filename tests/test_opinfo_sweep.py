"""Op coverage on torch's OpInfo database (``tests/opinfo_harness.py``), on a fixed sample of ops.

Each op of :data:`SAMPLE` (pointwise, reductions, views, matmuls, norms, losses, indexing), under a batch
split over 2 and 3 simulated ranks and with its first input sharded on another dim, must be ``supported``
(lowered, no batch gather, equal to eager) or listed in ``tests/opinfo_expected_failures.json`` with the
category it ends in; never a ``bug`` (a wrong value or a crash). The list must not hold an op that now
passes, so it cannot rot. The full sweep over every op is ``benchmarks/bench_opinfo.py`` (and the
``bench``-marked test here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch's OpInfo database imports it

import opinfo_harness as h  # noqa: E402

EXPECTED_PATH = Path(__file__).with_name("opinfo_expected_failures.json")

SAMPLE = (
    # pointwise
    "add", "mul", "div.no_rounding_mode", "sub", "abs", "exp", "log", "sigmoid", "tanh", "pow", "where",
    "clamp", "nn.functional.gelu", "nn.functional.silu", "nn.functional.relu", "lerp", "addcmul",
    # reductions
    "sum", "mean", "amax", "var", "std", "prod", "max.reduction_with_dim", "logsumexp", "norm", "cumsum",
    # views and layout
    "view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "flatten", "cat", "stack",
    "split", "chunk", "narrow", "flip",
    # matmuls
    "mm", "bmm", "matmul", "addmm", "nn.functional.linear", "einsum",
    # norms and softmax
    "nn.functional.layer_norm", "nn.functional.group_norm", "softmax", "log_softmax",
    # losses
    "nn.functional.mse_loss", "nn.functional.cross_entropy", "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.smooth_l1_loss",
    # indexing
    "index_select", "gather", "take_along_dim", "nn.functional.embedding",
    # batches of matrices and others (opinfo2): the crash of pad.circular on 3 ranks, linalg's batch dims
    "nn.functional.pad.circular", "cholesky", "linalg.slogdet", "cdist", "unfold", "nn.functional.bilinear",
    # over the split batch without gathering it (opinfo90): two-pass variance, all-reduced max, norms, diagonals,
    # scatter by global row, _chunk_cat on a rank holding no rows
    "var.unbiased", "max.reduction_no_dim", "masked.amax", "linalg.norm", "trace", "diagonal", "scatter_reduce.amax",
    "_chunk_cat",
)


def expected() -> dict:
    return json.loads(EXPECTED_PATH.read_text())


@pytest.fixture(scope="module")
def ops():
    return h.ops_by_key()


@pytest.fixture(scope="module")
def outcomes(ops):
    missing = [k for k in SAMPLE if k not in ops]
    assert not missing, f"no such OpInfo entries (renamed in this torch?): {missing}"
    return {k: h.run_op(ops[k]) for k in SAMPLE}


_RANK = {"bug": 4, "refused": 3, "gathers": 2, "xfail": 1, "supported": 0}


def _check(key: str, per: dict, listed: dict) -> list[str]:
    """What is wrong with one op's outcomes (per setting, per world size) against the list: a bug anywhere,
    or a setting whose worst outcome is neither supported nor the listed category."""
    bad = []
    for setting, by_w in per.items():
        want = listed.get(key, {}).get(setting)
        for w, o in by_w.items():
            if o.category == "bug":
                bad.append(f"BUG {key} [{setting}, {w} ranks]: {o.reason}")
        if any(o.category == "bug" for o in by_w.values()):
            continue
        worst = max(by_w.values(), key=lambda o: _RANK[o.category])
        where = f"{key} [{setting}]"
        if worst.category != "supported" and want is None:
            bad.append(f"{where}: {worst.category} ({worst.reason}) but not in {EXPECTED_PATH.name}")
        elif worst.category != "supported" and want["category"] != worst.category:
            bad.append(f"{where}: {worst.category} ({worst.reason}), listed as {want['category']}")
        elif worst.category == "supported" and want is not None:
            bad.append(f"{where}: now supported, but listed as {want['category']} ({want['reason']}): "
                       f"remove it from {EXPECTED_PATH.name}")
    return bad


@pytest.mark.timeout(900)  # the first one builds `outcomes` (every sample op): >300 s on a loaded machine
def test_sample_supported_or_expected(outcomes):
    listed = expected()
    bad = [line for k, per in outcomes.items() for line in _check(k, per, listed)]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(900)  # the first one builds `outcomes` (every sample op): >300 s on a loaded machine
def test_sample_batch_split_lowers_most(outcomes):
    """Of the sample's ops with a backward, >= 90% lower under a batch split and equal eager."""
    from adaptdist import _torch_compat as compat

    ops = {h.op_key(o): o for o in compat.opinfo_db()}
    bw = [k for k in SAMPLE if ops[k].supports_autograd]
    ok = [k for k in bw if all(o.category == "supported" for o in outcomes[k]["batch"].values())]
    assert len(ok) >= 0.9 * len(bw), sorted(set(bw) - set(ok))


def test_expected_failures_name_real_ops_and_reasons(ops):
    listed = expected()
    unknown = sorted(k for k in listed if k not in ops)
    assert not unknown, f"{EXPECTED_PATH.name} lists ops this torch's op_db lacks: {unknown}"
    for k, per in listed.items():
        for setting, entry in per.items():
            assert setting in h.SETTINGS, (k, setting)
            assert entry["category"] in ("gathers", "refused", "xfail"), (k, setting, entry)
            assert entry["reason"].strip(), f"{k} [{setting}]: an expected failure needs its reason"


@pytest.mark.bench
@pytest.mark.timeout(3600)
def test_full_sweep_matches_expected(ops):
    """Every op of op_db (benchmarks/bench_opinfo.py's sweep, without DTensor): supported or listed, no bug,
    and no listed op that now passes."""
    listed = expected()
    bad = [line for k, op in ops.items() for line in _check(k, h.run_op(op), listed)]
    assert not bad, "\n".join(bad)

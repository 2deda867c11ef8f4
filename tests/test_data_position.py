"""A resumed run's data position: data(start_step=) where the model file's data() takes it, else batches replayed
from the start (and the log says so); either way the batch of step k is the one an uninterrupted run sees."""

import itertools
import textwrap

import torch

from adaptdist.runtime.worker import DataSpec, global_batches, positioned_batches


def _spec(tmp_path, with_start_step: bool) -> DataSpec:
    f = tmp_path / f"m{int(with_start_step)}.py"
    arg = ", start_step=0" if with_start_step else ""
    skip = "    for _ in range(start_step):\n        next(it)\n" if with_start_step else ""
    f.write_text(textwrap.dedent(f"""
        import torch

        def _gen(batch_size, seed):
            g = torch.Generator().manual_seed(seed)
            while True:
                yield (torch.randn(batch_size, 3, generator=g),)

        def data(batch_size, seq_len, seed=0{arg}):
            it = _gen(batch_size, seed)
    """) + textwrap.indent(skip, "") + "    return it\n")
    return DataSpec(str(f), "data", 4, 1, seed=3)


def test_start_step_and_replay_give_the_batch_of_that_step(tmp_path):
    notes = []
    for with_start_step in (True, False):
        spec = _spec(tmp_path, with_start_step)
        want = list(itertools.islice(global_batches(spec), 7))[5]
        got = next(positioned_batches(spec, 5, notes.append))
        assert torch.equal(got[0], want[0])
    assert len(notes) == 1 and "takes no start_step=: replayed 5 batches" in notes[0]


def test_the_builtin_corpus_takes_start_step():
    from adaptdist.models.gpt import data

    want = list(itertools.islice(data(3, 8, seed=2), 4))[3]
    got = next(data(3, 8, seed=2, start_step=3))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

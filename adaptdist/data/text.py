"""Byte-level text corpora: a UTF-8 file, or the embedded default.

The embedded default corpus is the source text of a fixed list of Python
standard-library modules, which every CPython installation ships, so the main
job needs no download and no data directory.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import DataError

# Stable, text-heavy stdlib modules (docstrings and code), about 1 MB together.
EMBEDDED_MODULES = (
    "argparse", "textwrap", "string", "collections", "functools", "heapq", "bisect",
    "difflib", "inspect", "json.decoder", "json.encoder", "pathlib", "pprint",
    "statistics", "fractions", "calendar", "shutil", "tempfile", "typing", "dataclasses",
)


@dataclass(frozen=True)
class ByteCorpus:
    """A text as a 1-D ``uint8`` tensor of its UTF-8 bytes; ``name`` says where it came from."""

    data: torch.Tensor
    name: str

    @staticmethod
    def from_path(path: str) -> "ByteCorpus":
        """Read a UTF-8 text file.

        Raises:
            DataError: the file does not exist, is a directory, is empty, or is not UTF-8 text.
        """
        p = Path(path)
        if not p.exists():
            raise DataError(f"data file {str(p)!r} does not exist; pass --data with a UTF-8 text file")
        if not p.is_file():
            raise DataError(f"data path {str(p)!r} is not a file; pass --data with a UTF-8 text file")
        raw = p.read_bytes()
        if not raw:
            raise DataError(f"data file {str(p)!r} is empty; pass a UTF-8 text file with some text in it")
        if b"\x00" in raw[:65536]:
            raise DataError(f"data file {str(p)!r} is not text (it contains NUL bytes); pass a UTF-8 text file")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"data file {str(p)!r} is not UTF-8 text (invalid byte at offset {e.start}); "
                "convert it to UTF-8 or pass another file"
            ) from None
        return ByteCorpus(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone(), str(p))

    @staticmethod
    def embedded() -> "ByteCorpus":
        """The default corpus: source text of :data:`EMBEDDED_MODULES`.

        Raises:
            DataError: this Python installation ships none of those sources.
        """
        parts = []
        for mod in EMBEDDED_MODULES:
            spec = importlib.util.find_spec(mod)
            origin = getattr(spec, "origin", None) if spec else None
            if origin and origin.endswith(".py") and Path(origin).is_file():
                parts.append(Path(origin).read_bytes())
        if not parts:
            raise DataError(
                "this Python installation ships no standard-library sources for the embedded corpus; "
                "pass --data with a UTF-8 text file"
            )
        raw = b"\n".join(parts)
        return ByteCorpus(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone(), "embedded:python-stdlib")

    def __len__(self) -> int:
        return self.data.numel()

    def batches(self, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless random windows: ``(tokens, targets)``, each ``int64[batch_size, seq_len]``.

        ``targets`` is ``tokens`` shifted by one byte. The same seed gives the same batches; ``start_step=k``
        starts at the batch a fresh iterator yields after ``k`` batches (a resumed run's data position), drawing
        only the window offsets of the batches it skips.

        Raises:
            DataError: the corpus is shorter than ``seq_len + 1`` bytes.
        """
        n = len(self)
        if seq_len + 1 > n:
            raise DataError(
                f"--seq-len {seq_len} is longer than the data {self.name!r} allows ({n} bytes; a "
                f"window needs seq_len + 1); use --seq-len {max(1, n - 1)} or less, or more text"
            )
        g = torch.Generator().manual_seed(seed)
        offsets_t = torch.arange(seq_len + 1)
        for _ in range(start_step):
            torch.randint(0, n - seq_len, (batch_size,), generator=g)
        while True:
            starts = torch.randint(0, n - seq_len, (batch_size,), generator=g)
            win = self.data[starts[:, None] + offsets_t].long()
            yield win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def decode(self, tokens: torch.Tensor) -> str:
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")

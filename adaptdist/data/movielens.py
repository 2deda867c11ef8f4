"""Movie ratings in the MovieLens layout: a folder with ``ratings.csv`` (``userId,movieId,rating,timestamp``) and
``movies.csv`` (``movieId,title,genres``, genres separated by ``|``), or, where there is no such folder, a generated
data set of the same shape.

Ids are remapped to dense indices (users in order of first appearance in ``ratings.csv``, movies in the order of
``movies.csv``, genres in order of first appearance there); a movie's genres become a bag of genre indices + 1,
padded with 0 to the widest bag. The split into training and validation ratings is fixed: the ratings sorted by
timestamp (ties in file order), the last :data:`VALIDATION_FRACTION` of them held out, so the model is validated
on ratings made after every rating it trained on.

MovieLens' license forbids redistribution: nothing here ships or copies its files; the default folder is
``../shared/data/movielens-small`` beside the project (:data:`DEFAULT_DIR`), read where it is.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import DataError

DEFAULT_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "movielens-small"
"""``../shared/data/movielens-small`` from the project's root (GroupLens' ml-latest-small, where present)."""
RATINGS_FILE, MOVIES_FILE = "ratings.csv", "movies.csv"
RATINGS_COLUMNS = ("userId", "movieId", "rating", "timestamp")
MOVIES_COLUMNS = ("movieId", "title", "genres")
VALIDATION_FRACTION = 0.2
"""The share of ratings, the latest by timestamp, held out for validation."""
MAX_ID = 2**63 - 1
GENERATED_SHAPE = dict(num_users=610, num_movies=9742, num_genres=20, num_ratings=100_836, max_genres=10)
"""ml-latest-small's counts: 610 users, 9,742 movies, 20 genres (with "(no genres listed)"), 100,836 ratings, at
most 10 genres per movie."""


@dataclass(frozen=True)
class Ratings:
    """All ratings of a data set, ids remapped to dense indices.

    Attributes:
        users: ``int64[N]`` user index of each rating, in ``[0, num_users)``.
        movies: ``int64[N]`` movie index, in ``[0, num_movies)``.
        ratings: ``float32[N]`` the rating (MovieLens: 0.5 to 5 stars in half steps).
        timestamps: ``int64[N]`` seconds since 1970.
        movie_genres: ``int64[num_movies, max_genres]`` each movie's genre indices + 1, padded with 0.
        num_users: number of distinct users.
        genre_names: the genres, in index order.
        source: where the data came from (the folder, or ``generated: ...``), for logs.
        generated: True for a generated data set.
    """

    users: torch.Tensor
    movies: torch.Tensor
    ratings: torch.Tensor
    timestamps: torch.Tensor
    movie_genres: torch.Tensor
    num_users: int
    genre_names: tuple[str, ...]
    source: str
    generated: bool = False

    def __post_init__(self) -> None:
        """Raises DataError: the tensors disagree in length, or an index is outside its table."""
        n = self.users.numel()
        if any(t.shape != (n,) for t in (self.movies, self.ratings, self.timestamps)):
            raise DataError(f"{self.source}: users, movies, ratings and timestamps must be 1-D of one length, got "
                            f"{[list(t.shape) for t in (self.users, self.movies, self.ratings, self.timestamps)]}")
        for name, t, size in (("user", self.users, self.num_users), ("movie", self.movies, self.num_movies),
                              ("genre", self.movie_genres, self.num_genres + 1)):
            if t.numel() and not (0 <= int(t.min()) and int(t.max()) < size):
                raise DataError(f"{self.source}: a {name} index is outside [0, {size}) (min {int(t.min())}, max "
                                f"{int(t.max())})")

    @property
    def num_movies(self) -> int:
        return self.movie_genres.shape[0]

    @property
    def num_genres(self) -> int:
        return len(self.genre_names)

    @property
    def max_genres(self) -> int:
        return self.movie_genres.shape[1]

    def __len__(self) -> int:
        return self.users.numel()

    def split(self, validation_fraction: float = VALIDATION_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
        """``(train_rows, validation_rows)``: ``int64`` row indices, the latest ``validation_fraction`` of the
        ratings by timestamp (ties in file order) for validation, the rest (in time order) for training.

        Raises:
            DataError: fewer than 2 ratings, or a fraction that leaves either part empty.
        """
        n = len(self)
        n_val = round(n * validation_fraction)
        if not 0 < n_val < n:
            raise DataError(f"{self.source}: {n} ratings cannot be split into training and validation "
                            f"({validation_fraction:.0%} held out leaves {n_val} for validation); more ratings needed")
        order = torch.sort(self.timestamps, stable=True).indices
        return order[: n - n_val], order[n - n_val:]

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch of rows ``index``: ``(users int64[B], movies int64[B], genres int64[B, max_genres],
        ratings float32[B])``."""
        movies = self.movies[index]
        return self.users[index], movies, self.movie_genres[movies], self.ratings[index]

    def describe(self) -> str:
        return (f"{len(self):,} ratings of {self.num_movies:,} movies by {self.num_users:,} users, "
                f"{self.num_genres} genres")


def resolve(path: str | Path | None) -> Ratings:
    """The data ``--data`` names: the folder ``path``; with None, :data:`DEFAULT_DIR` where it exists, else
    :func:`generate` (``Ratings.generated`` says which).

    Raises:
        DataError: ``path`` is given but is not a folder with both files, or its files are bad (see :func:`load`).
    """
    if path is None:
        return load(DEFAULT_DIR) if DEFAULT_DIR.is_dir() else generate()
    return load(path)


def load(directory: str | Path) -> Ratings:
    """Read ``directory/movies.csv`` and ``directory/ratings.csv``.

    Raises:
        DataError: the folder or a file is missing; a file is empty, not UTF-8, lacks a column, has a row with
            another number of fields than its header, an id that is not a whole number in ``[0, 2**63)``, a rating
            that is not a finite number, a timestamp that is not a whole number, a movie listed twice, or a rating
            of a movie ``movies.csv`` does not list. Each names the file and the 1-based line.
    """
    d = Path(directory)
    if not d.is_dir():
        what = "is a file" if d.exists() else "does not exist"
        raise DataError(f"--data {str(d)!r} {what}; pass a folder with {RATINGS_FILE} ({','.join(RATINGS_COLUMNS)}) "
                        f"and {MOVIES_FILE} ({','.join(MOVIES_COLUMNS)}), e.g. MovieLens' ml-latest-small")
    for name in (MOVIES_FILE, RATINGS_FILE):
        if not (d / name).is_file():
            raise DataError(f"--data {str(d)!r} has no {name}; a MovieLens folder holds {RATINGS_FILE} and "
                            f"{MOVIES_FILE}")
    movie_index, movie_genres, genre_names = _read_movies(d / MOVIES_FILE)
    users, movies, ratings, stamps = _read_ratings(d / RATINGS_FILE, movie_index, d / MOVIES_FILE)
    return Ratings(users, movies, ratings, stamps, movie_genres, int(users.max()) + 1, genre_names, str(d))


def _rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """``(line, fields in the order of columns)`` of each data row of the CSV file ``path`` (blank lines skipped),
    after checking its header.

    Raises:
        DataError: empty file, missing columns, a row of another width than the header, or a byte that is not
            UTF-8; names the file and line.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        line = 1
        try:
            header = next(reader, None)
            if not header:
                what = "the file is empty" if header is None else "the first line is blank"
                raise DataError(f"{path}:1: {what}; the file must start with the header {','.join(columns)}")
            header = [h.strip() for h in header]
            missing = [c for c in columns if c not in header]
            if missing:
                raise DataError(f"{path}:1: the header has no column {', '.join(map(repr, missing))} (it has "
                                f"{', '.join(header)}); the file must start with the header {','.join(columns)}")
            where = [header.index(c) for c in columns]
            rows = 0
            for fields in reader:
                line = reader.line_num
                if not fields:
                    continue
                if len(fields) != len(header):
                    raise DataError(f"{path}:{line}: {len(fields)} field(s), but the header names {len(header)} "
                                    f"({', '.join(header)}); a missing column, or a comma in an unquoted field")
                rows += 1
                yield line, [fields[i].strip() for i in where]
            if rows == 0:
                raise DataError(f"{path}:{reader.line_num + 1}: no data after the header; the file holds no rows")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{line + 1}: not UTF-8 text ({e.reason}); convert the file to UTF-8") from None
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: not a readable CSV row ({e})") from None


def _id(text: str, column: str, path: Path, line: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise DataError(f"{path}:{line}: {column} {text!r} is not an id (a whole number from 0 to 2**63-1); fix or "
                        "drop the row") from None
    if not 0 <= value <= MAX_ID:
        raise DataError(f"{path}:{line}: {column} {text!r} is out of range (ids are whole numbers from 0 to "
                        "2**63-1); fix or drop the row")
    return value


def _read_movies(path: Path) -> tuple[dict[int, int], torch.Tensor, tuple[str, ...]]:
    """``({movieId: movie index}, int64[movies, max_genres] genre bags (index + 1, 0 pads), genre names)``."""
    index: dict[int, int] = {}
    first_line: dict[int, int] = {}
    bags: list[list[int]] = []
    genres: dict[str, int] = {}
    for line, (movie, _title, names) in _rows(path, MOVIES_COLUMNS):
        mid = _id(movie, "movieId", path, line)
        if mid in index:
            raise DataError(f"{path}:{line}: movieId {mid} is listed again (first at line {first_line[mid]}); each "
                            "movie must be listed once")
        bag = [genres.setdefault(g, len(genres)) + 1 for g in dict.fromkeys(n.strip() for n in names.split("|"))
               if g]
        if not bag:
            raise DataError(f"{path}:{line}: movieId {mid} has no genres (the column is empty); MovieLens writes "
                            "'(no genres listed)' for none")
        index[mid], first_line[mid] = len(index), line
        bags.append(bag)
    width = max(len(b) for b in bags)
    table = torch.zeros(len(bags), width, dtype=torch.long)
    for i, b in enumerate(bags):
        table[i, : len(b)] = torch.tensor(b)
    return index, table, tuple(genres)


def _read_ratings(path: Path, movie_index: dict[int, int], movies_path: Path):
    users: dict[int, int] = {}
    u, m, r, t = [], [], [], []
    for line, (user, movie, rating, stamp) in _rows(path, RATINGS_COLUMNS):
        uid = _id(user, "userId", path, line)
        mid = _id(movie, "movieId", path, line)
        if mid not in movie_index:
            raise DataError(f"{path}:{line}: movieId {mid} is out of range: {movies_path} does not list it; add the "
                            "movie there or drop the rating")
        try:
            value = float(rating)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise DataError(f"{path}:{line}: rating {rating!r} is not a number (expected e.g. 3.5)")
        try:
            seconds = int(stamp)
        except ValueError:
            raise DataError(f"{path}:{line}: timestamp {stamp!r} is not a whole number of seconds since "
                            "1970") from None
        u.append(users.setdefault(uid, len(users)))
        m.append(movie_index[mid])
        r.append(value)
        t.append(seconds)
    return (torch.tensor(u, dtype=torch.long), torch.tensor(m, dtype=torch.long),
            torch.tensor(r, dtype=torch.float32), torch.tensor(t, dtype=torch.long))


def generate(seed: int = 0, num_users: int = GENERATED_SHAPE["num_users"],
             num_movies: int = GENERATED_SHAPE["num_movies"], num_genres: int = GENERATED_SHAPE["num_genres"],
             num_ratings: int = GENERATED_SHAPE["num_ratings"], max_genres: int = GENERATED_SHAPE["max_genres"]
             ) -> Ratings:
    """A synthetic data set with MovieLens' shape (the defaults: ml-latest-small's counts), the same for the same
    arguments: users and movies drawn with skewed popularity (a Zipf-like law), 1 to ``max_genres`` genres per
    movie, and ratings from a low-rank taste model (user and movie biases, 8 latent factors, genre affinities,
    noise) rounded to half stars in ``[0.5, 5]``, so that a model has something to learn; timestamps spread over
    twenty years with each user's ratings in a window of their own."""
    g = torch.Generator().manual_seed(seed)
    k = 8
    user_f = torch.randn(num_users, k, generator=g)
    movie_f = torch.randn(num_movies, k, generator=g)
    genre_f = torch.randn(num_genres, k, generator=g)
    n_bag = 1 + (torch.rand(num_movies, generator=g) ** 4 * max_genres).long().clamp(max=max_genres - 1)
    # each movie's genres: its n_bag most likely under Gumbel-perturbed log popularities (sampling without
    # replacement, Gumbel top-k), the first movie with the widest bag
    genre_logp = -torch.log(torch.arange(1, num_genres + 1, dtype=torch.float32))
    gumbel = -torch.log(-torch.log(torch.rand(num_movies, num_genres, generator=g).clamp(1e-9, 1 - 1e-9)))
    chosen = torch.topk(genre_logp + gumbel, min(max_genres, num_genres), dim=1).indices + 1
    n_bag[0] = min(max_genres, num_genres)
    keep = torch.arange(chosen.shape[1]) < n_bag[:, None]
    bags = torch.zeros(num_movies, max_genres, dtype=torch.long)
    bags[:, : chosen.shape[1]] = torch.where(keep, chosen, 0)
    one_hot = torch.zeros(num_movies, num_genres + 1).scatter_(1, bags, 1.0)[:, 1:]
    genre_mean = one_hot @ genre_f / one_hot.sum(1, keepdim=True)
    user_p = 1.0 / torch.arange(1, num_users + 1, dtype=torch.float32) ** 0.8
    movie_p = 1.0 / torch.arange(1, num_movies + 1, dtype=torch.float32) ** 0.9
    users = torch.multinomial(user_p, num_ratings, replacement=True, generator=g)
    users[:num_users] = torch.arange(num_users)  # every user rates at least once
    movies = torch.multinomial(movie_p, num_ratings, replacement=True, generator=g)
    movies = movies[torch.randperm(num_ratings, generator=g)]
    user_b = 0.4 * torch.randn(num_users, generator=g)
    movie_b = 0.4 * torch.randn(num_movies, generator=g)
    taste = ((user_f[users] * (movie_f[movies] + genre_mean[movies])).sum(1) / math.sqrt(2 * k))
    raw = 3.5 + user_b[users] + movie_b[movies] + 0.8 * taste + 0.5 * torch.randn(num_ratings, generator=g)
    ratings = (raw * 2).round().clamp(1, 10) / 2
    start = torch.randint(828_000_000, 1_500_000_000, (num_users,), generator=g)
    stamps = start[users] + torch.randint(0, 40_000_000, (num_ratings,), generator=g)
    shape = f"{num_users} users, {num_movies} movies, {num_genres} genres, {num_ratings} ratings, seed {seed}"
    return Ratings(users, movies, ratings.float(), stamps, bags, num_users,
                   tuple(f"genre{i}" for i in range(num_genres)), f"generated: {shape}", generated=True)


def steps_per_epoch(train_rows: int, batch_size: int) -> int:
    """Full batches of ``batch_size`` in ``train_rows`` ratings (each epoch's last partial batch is dropped)."""
    return train_rows // batch_size


def epoch_batches(data: Ratings, rows: torch.Tensor, batch_size: int, seed: int = 0, start_step: int = 0
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless batches :meth:`Ratings.rows` of ``batch_size`` ratings from ``rows``: each epoch a permutation of
    them drawn from ``(seed, epoch)`` (the same on every rank), cut into full batches (the last partial batch of an
    epoch is dropped: the programs are compiled for one batch size). ``start_step=k`` starts at the batch a fresh
    iterator yields after ``k`` batches (a resumed run's data position), drawing only that epoch's permutation.

    Raises:
        DataError: ``batch_size`` is larger than ``rows``.
    """
    per_epoch = steps_per_epoch(rows.numel(), batch_size)
    if per_epoch == 0:
        raise DataError(f"--batch-size {batch_size} is larger than the {rows.numel():,} training ratings of "
                        f"{data.source}; use --batch-size {rows.numel()} or less")
    epoch, step = divmod(start_step, per_epoch)
    while True:
        g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
        order = rows[torch.randperm(rows.numel(), generator=g)]
        for s in range(step, per_epoch):
            yield data.rows(order[s * batch_size: (s + 1) * batch_size])
        epoch, step = epoch + 1, 0


def save(data: Ratings, directory: str | Path) -> Path:
    """Write ``data`` as a MovieLens folder (``ratings.csv``, ``movies.csv``) that :func:`load` reads back to the
    same indices, e.g. a :func:`generate`\\ d set for the multi-process tests and benchmarks (never MovieLens'
    own files: their license forbids copies). Ids are the indices (users + 1, movies + 1). Returns the folder."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / MOVIES_FILE, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(MOVIES_COLUMNS)
        for m, bag in enumerate(data.movie_genres.tolist()):
            w.writerow([m + 1, f"movie {m + 1}", "|".join(data.genre_names[g - 1] for g in bag if g)])
    with open(d / RATINGS_FILE, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(RATINGS_COLUMNS)
        for u, m, r, t in zip(data.users.tolist(), data.movies.tolist(), data.ratings.tolist(),
                              data.timestamps.tolist()):
            w.writerow([u + 1, m + 1, f"{r:g}", t])
    return d

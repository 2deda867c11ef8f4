"""adaptdist/data/movielens.py: MovieLens-layout ratings (written here as tiny CSVs made up for the tests, never
MovieLens' own files), the fixed split by timestamp, per-epoch batches, the generated fallback, and every kind of
bad data as a DataError naming the file and the line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from adaptdist.data import movielens as ml
from adaptdist.errors import DataError

MOVIES = """movieId,title,genres
10,"Harbour, The (1990)",Drama|Romance
20,Rockets (2001),Action|Sci-Fi|Drama
30,Quiet Days (1985),(no genres listed)
40,Laughs (1999),Comedy
"""

# user 7 first, then 3, then 5; timestamps out of order, two equal (ties keep file order)
RATINGS_ROWS = [
    (7, 10, "4.0", 500), (7, 20, "3.5", 100), (3, 10, "5.0", 300), (3, 30, "2.0", 900), (5, 40, "1.5", 200),
    (5, 20, "4.5", 300), (7, 40, "3.0", 700), (3, 40, "0.5", 800), (5, 10, "2.5", 600), (7, 30, "4.0", 1000),
]


def write_data(folder: Path, ratings_rows=RATINGS_ROWS, movies: str = MOVIES,
               header: str = "userId,movieId,rating,timestamp") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "movies.csv").write_text(movies)
    (folder / "ratings.csv").write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in ratings_rows))
    return folder


def test_load_remaps_ids_to_dense_indices_and_genres_to_padded_bags(tmp_path):
    data = ml.load(write_data(tmp_path / "ml"))
    assert len(data) == 10 and data.num_users == 3 and data.num_movies == 4
    assert data.genre_names == ("Drama", "Romance", "Action", "Sci-Fi", "(no genres listed)", "Comedy")
    # users by first appearance (7 -> 0, 3 -> 1, 5 -> 2), movies in movies.csv's order (10, 20, 30, 40 -> 0..3)
    assert data.users.tolist() == [0, 0, 1, 1, 2, 2, 0, 1, 2, 0]
    assert data.movies.tolist() == [0, 1, 0, 2, 3, 1, 3, 3, 0, 2]
    assert data.movie_genres.tolist() == [[1, 2, 0], [3, 4, 1], [5, 0, 0], [6, 0, 0]]  # genre index + 1, 0 pads
    assert data.ratings.dtype == torch.float32 and data.ratings[1].item() == 3.5
    users, movies, genres, ratings = data.rows(torch.tensor([1, 4]))
    assert genres.tolist() == [[3, 4, 1], [6, 0, 0]] and ratings.tolist() == [3.5, 1.5]
    assert not data.generated and data.source == str(tmp_path / "ml")


def test_the_split_holds_out_the_latest_ratings_and_is_fixed(tmp_path):
    data = ml.load(write_data(tmp_path / "ml"))
    train, val = data.split()
    assert len(train) == 8 and len(val) == 2  # 20% of 10
    assert data.timestamps[train].max() <= data.timestamps[val].min()
    assert data.timestamps[val].tolist() == [900, 1000]
    assert train.tolist()[:4] == [1, 4, 2, 5]  # time order; the two ratings at 300 in file order (rows 2, 5)
    again = ml.load(tmp_path / "ml").split()
    assert torch.equal(train, again[0]) and torch.equal(val, again[1])
    with pytest.raises(DataError, match="cannot be split"):
        ml.load(write_data(tmp_path / "one", RATINGS_ROWS[:1])).split()


def test_batches_shuffle_every_epoch_from_the_seed_and_resume_at_a_step(tmp_path):
    data = ml.load(write_data(tmp_path / "ml"))
    train, _ = data.split()
    it = ml.epoch_batches(data, train, 4, seed=3)
    epochs = [[next(it) for _ in range(2)] for _ in range(3)]  # 8 training ratings: 2 batches per epoch
    for epoch in epochs:
        seen = torch.cat([b[0] * 100 + b[1] * 10 for b in epoch])  # (user, movie) of each row
        assert sorted(seen.tolist()) == sorted((data.users[train] * 100 + data.movies[train] * 10).tolist())
        for users, movies, genres, ratings in epoch:
            assert users.shape == (4,) and genres.shape == (4, 3) and ratings.dtype == torch.float32
            assert torch.equal(genres, data.movie_genres[movies])
    orders = [torch.cat([b[3] for b in e]).tolist() for e in epochs]
    assert orders[0] != orders[1] or orders[1] != orders[2]  # shuffled anew each epoch
    again = ml.epoch_batches(data, train, 4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(next(again), epochs[0][0]))  # same seed, same batches
    other = [next(ml.epoch_batches(data, train, 4, seed=s))[3].tolist() for s in range(4, 8)]
    assert any(o != epochs[0][0][3].tolist() for o in other)
    resumed = ml.epoch_batches(data, train, 4, seed=3, start_step=3)  # epoch 1's second batch
    assert all(torch.equal(a, b) for a, b in zip(next(resumed), epochs[1][1]))
    with pytest.raises(DataError, match="--batch-size 9 is larger than the 8 training ratings"):
        next(ml.epoch_batches(data, train, 9))


def test_the_last_partial_batch_of_an_epoch_is_dropped(tmp_path):
    data = ml.load(write_data(tmp_path / "ml"))
    train, _ = data.split()
    assert ml.steps_per_epoch(len(train), 3) == 2
    it = ml.epoch_batches(data, train, 3, seed=0)
    assert all(next(it)[0].shape == (3,) for _ in range(7))


def _replace_row(i: int, row: tuple):
    rows = list(RATINGS_ROWS)
    rows[i] = row
    return rows


# (what to write, file the message names, line, words of the message)
BAD = {
    "ratings header lacks a column": (dict(header="userId,movieId,timestamp"), "ratings.csv", 1, "no column 'rating'"),
    "a row lacks a field": (dict(ratings_rows=_replace_row(2, (3, 10, 300))), "ratings.csv", 4, "3 field(s)"),
    "rating not a number": (dict(ratings_rows=_replace_row(3, (3, 30, "good", 900))), "ratings.csv", 5,
                            "rating 'good' is not a number"),
    "rating nan": (dict(ratings_rows=_replace_row(0, (7, 10, "nan", 500))), "ratings.csv", 2, "is not a number"),
    "user id negative": (dict(ratings_rows=_replace_row(5, (-5, 20, "4.5", 300))), "ratings.csv", 7,
                         "userId '-5' is out of range"),
    "user id too large": (dict(ratings_rows=_replace_row(5, (2**64, 20, "4.5", 300))), "ratings.csv", 7,
                          "is out of range"),
    "movie id not a number": (dict(ratings_rows=_replace_row(1, (7, "x20", "3.5", 100))), "ratings.csv", 3,
                              "movieId 'x20' is not an id"),
    "unknown movie": (dict(ratings_rows=_replace_row(9, (7, 99, "4.0", 1000))), "ratings.csv", 11,
                      "movieId 99 is out of range"),
    "timestamp not whole": (dict(ratings_rows=_replace_row(4, (5, 40, "1.5", "2.5e2"))), "ratings.csv", 6,
                            "timestamp '2.5e2'"),
    "ratings header only": (dict(ratings_rows=[]), "ratings.csv", 2, "no data after the header"),
    "movies empty": (dict(movies=""), "movies.csv", 1, "the file is empty"),
    "movies header lacks genres": (dict(movies="movieId,title\n10,A\n"), "movies.csv", 1, "no column 'genres'"),
    "movie listed twice": (dict(movies=MOVIES + "20,Again (2002),Drama\n"), "movies.csv", 6,
                           "movieId 20 is listed again (first at line 3)"),
    "movie without genres": (dict(movies=MOVIES.replace("Comedy", "")), "movies.csv", 5, "has no genres"),
    "movie row with an unquoted comma": (dict(movies=MOVIES.replace('"Harbour, The (1990)"', "Harbour, The")),
                                         "movies.csv", 2, "4 field(s)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_is_a_data_error_naming_the_file_and_line(tmp_path, case):
    kwargs, file, line, words = BAD[case]
    folder = write_data(tmp_path / "ml", **kwargs)
    with pytest.raises(DataError) as e:
        ml.load(folder)
    assert f"{folder / file}:{line}:" in str(e.value) and words in str(e.value), str(e.value)


def test_an_empty_ratings_file_and_missing_files_are_data_errors(tmp_path):
    folder = write_data(tmp_path / "ml")
    (folder / "ratings.csv").write_text("")
    with pytest.raises(DataError, match=r"ratings.csv:1: the file is empty"):
        ml.load(folder)
    (folder / "ratings.csv").write_bytes(b"userId,movieId,rating,timestamp\n7,10,4.0,5\xff\n")
    with pytest.raises(DataError, match=r"ratings.csv:\d+: not UTF-8"):
        ml.load(folder)
    (folder / "ratings.csv").unlink()
    with pytest.raises(DataError, match="has no ratings.csv"):
        ml.load(folder)
    with pytest.raises(DataError, match="does not exist; pass a folder with ratings.csv"):
        ml.resolve(tmp_path / "nowhere")  # a folder named explicitly never falls back to generated data
    with pytest.raises(DataError, match="is a file"):
        ml.load(folder / "movies.csv")


def test_without_the_default_folder_a_generated_data_set_of_its_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(ml, "DEFAULT_DIR", tmp_path / "absent")
    data = ml.resolve(None)
    assert data.generated and data.source.startswith("generated")
    shape = ml.GENERATED_SHAPE
    assert (len(data), data.num_users, data.num_movies, data.num_genres, data.max_genres) == (
        shape["num_ratings"], shape["num_users"], shape["num_movies"], shape["num_genres"], shape["max_genres"])
    assert data.users.unique().numel() == data.num_users and int(data.movies.max()) < data.num_movies
    assert set(data.ratings.unique().tolist()) <= {x / 2 for x in range(1, 11)}
    bags = data.movie_genres
    assert bool((bags[:, 0] > 0).all()) and int(bags.max()) <= data.num_genres  # every movie has a genre
    assert int((bags > 0).sum(1).max()) == data.max_genres
    assert torch.equal(ml.resolve(None).ratings, data.ratings)  # the same every time
    monkeypatch.setattr(ml, "DEFAULT_DIR", write_data(tmp_path / "present"))
    assert not ml.resolve(None).generated  # the default folder where it exists


def test_ratings_check_themselves():
    data = ml.generate(num_users=4, num_movies=6, num_genres=3, num_ratings=20, max_genres=2)
    with pytest.raises(DataError, match="a movie index is outside"):
        dataclasses.replace(data, movies=data.movies + 6)
    with pytest.raises(DataError, match="one length"):
        dataclasses.replace(data, ratings=data.ratings[:-1])


def test_save_writes_a_folder_that_loads_back_to_the_same_ratings(tmp_path):
    """Ids are renumbered on load (users by first appearance, genres by first appearance in movies.csv): the same
    ratings, movies and table sizes, each movie with the same genre names."""
    data = ml.generate(num_users=9, num_movies=12, num_genres=4, num_ratings=60, max_genres=3)
    back = ml.load(ml.save(data, tmp_path / "gen"))
    assert (back.num_users, back.num_movies, back.num_genres, back.max_genres) == \
        (data.num_users, data.num_movies, data.num_genres, data.max_genres)
    for name in ("movies", "ratings", "timestamps"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    relabel = dict(zip(data.users.tolist(), back.users.tolist()))
    assert len(set(relabel.values())) == data.num_users and [relabel[u] for u in data.users.tolist()] == back.users.tolist()

    def names(d, m):
        return sorted(d.genre_names[g - 1] for g in d.movie_genres[m].tolist() if g)

    assert all(names(back, m) == names(data, m) for m in range(data.num_movies))

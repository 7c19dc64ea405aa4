"""The bundled plays: present, split by whole play, held-out text absent from training, deterministic batches."""
import pytest
import torch

from loco_lab import data
from loco_lab.data import TRAIN_PLAYS, VALIDATION_PLAYS, ByteCorpus


def test_bundled_plays_present_and_split_by_play():
    assert not set(TRAIN_PLAYS) & set(VALIDATION_PLAYS)
    for play in TRAIN_PLAYS + VALIDATION_PLAYS:
        text = data.read_play(play)
        assert len(text) > 50_000 and text.isascii(), play
        assert b"Gutenberg" not in text, play


def test_held_out_text_not_in_training():
    corpus = ByteCorpus()
    train = bytes(corpus.train.tolist())
    for play in VALIDATION_PLAYS:
        text = data.read_play(play)
        # distinctive 120-byte passages from across the held-out play never occur in the training text
        for start in range(2_000, len(text) - 120, len(text) // 12):
            assert text[start:start + 120] not in train, (play, start)
    assert bytes(corpus.validation.tolist()).count(data.read_play(VALIDATION_PLAYS[0])) == 1


def test_train_batches_deterministic_and_tiled_by_rank():
    corpus = ByteCorpus()
    world, per_rank, seq = 4, 3, 32
    parts = [corpus.train_batch(7, 1, world * per_rank, seq, r, world) for r in range(world)]
    again = corpus.train_batch(7, 1, world * per_rank, seq, 2, world)
    assert torch.equal(parts[2][0], again[0])
    x, y = parts[0]
    assert x.shape == (per_rank, seq) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    firsts = torch.cat([p[0][:, :4] for p in parts])
    assert len({tuple(r.tolist()) for r in firsts}) == world * per_rank  # ranks take different windows
    other = corpus.train_batch(8, 1, world * per_rank, seq, 0, world)
    assert not torch.equal(other[0], x)


def test_validation_windows_same_count_on_every_rank():
    corpus = ByteCorpus()
    counts = [sum(x.shape[0] for x, _ in corpus.validation_batches(30, 64, r, 4, 5)) for r in range(4)]
    assert counts == [7, 7, 7, 7]


def test_a_users_text_file_holds_out_its_last_tenth(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_bytes(bytes(range(32, 127)) * 100)
    corpus = data.load_corpus(str(path), 16)
    assert corpus.train.numel() == 8550 and corpus.validation.numel() == 950
    assert bytes(corpus.train.tolist()) + bytes(corpus.validation.tolist()) == path.read_bytes()
    x, y = corpus.train_batch(0, 0, 4, 16, 0, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_folder_holds_out_whole_files_named_after_the_bundled_validation_plays(tmp_path):
    for name in ("hamlet_gut", "macbeth_gut", "tempest_gut"):
        (tmp_path / f"{name}.txt").write_bytes(name.encode() * 50)
    (tmp_path / "notes.md").write_text("not a .txt: ignored")
    corpus = data.load_corpus(str(tmp_path), 8)
    assert corpus.validation_plays == ("macbeth_gut.txt", )
    assert corpus.train_plays == ("hamlet_gut.txt", "tempest_gut.txt")
    assert b"macbeth" not in bytes(corpus.train.tolist()) and b"notes" not in bytes(corpus.train.tolist())
    other = tmp_path / "other"
    other.mkdir()
    for name in "abcdefghij":
        (other / f"{name}.txt").write_bytes(name.encode() * 10)
    assert data.load_corpus(str(other), 8).validation_plays == ("j.txt", )  # the last 10% of the files by name


def test_missing_or_too_small_text_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--text .*nope: no such file or folder"):
        data.load_corpus(str(tmp_path / "nope"), 16)
    (tmp_path / "only.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="needs at least 2 .txt files"):
        data.load_corpus(str(tmp_path), 16)


@pytest.mark.parametrize("size", [0, 200, 1280])
def test_a_text_file_too_short_for_the_context_says_how_many_bytes_it_needs(tmp_path, size):
    """128-byte context: the last 10% must hold a 129-byte window, so 1281 bytes (1152 + 129) is the least."""
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * size)
    with pytest.raises(ValueError, match=rf"--text .*short.txt: {size} bytes is too short for a context of 128 "
                                         rf"bytes: a file needs at least 1281 bytes"):
        data.load_corpus(str(path), 128)
    assert data.file_bytes_needed(128, 0.1) == 1281 and data.bytes_needed(128) == (130, 129)
    path.write_bytes(b"x" * 1281)
    corpus = data.load_corpus(str(path), 128)
    next(corpus.validation_batches(4, 128, 0, 1, 4))
    corpus.train_batch(0, 0, 4, 128, 0, 1)


def test_a_folder_too_short_for_the_context_says_how_many_bytes_it_needs(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 100)
    (tmp_path / "macbeth.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"too little text for a context of 64 bytes: the training part holds 100 "
                                         r"bytes and the held-out macbeth.txt 0; they need at least 66 and 65"):
        data.load_corpus(str(tmp_path), 64)
    with pytest.raises(ValueError, match=r"the bundled plays: too little text for a context of 10000000 bytes"):
        data.load_corpus(None, 10_000_000)

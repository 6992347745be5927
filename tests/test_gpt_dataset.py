"""GPT samples over an indexed dataset, specified from first principles: the shuffled documents read as one stream
of tokens, sample k is stream[k*seq, k*seq + seq + 1), then the samples are shuffled; plus --split, blends, the flags
and the per-rank slicing of engine.data. The corpora are synthetic (token = 1000 x document + position, so every
token says where it came from): they test the plumbing."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.arguments import parse_args
from common.data_flags import parse_blend, parse_split
from common.errors import ConfigError, InputError
from engine.data import build_data_iterators
from engine.datasets.blended_dataset import BlendedDataset, build_blending_indices
from engine.datasets.builder import build_train_dataset, check_data
from engine.datasets.gpt_dataset import GPTDataset, split_documents
from engine.datasets.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.support.megatron import megatron_datasets

LENGTHS = [5, 0, 7, 3, 11, 1, 4, 9]  # an empty document and a one-token one: boundaries at every kind of place


def _corpus(prefix, lengths=LENGTHS, base=0):
    writer = IndexedDatasetWriter(prefix, np.int32)
    for d, n in enumerate(lengths):
        writer.add_document([base + 1000 * d + j for j in range(n)])
    writer.finalize()
    return IndexedDataset(prefix)


def _unshuffled(dataset: GPTDataset) -> list[list[int]]:
    order = np.argsort(dataset.shuffle_index)
    return [dataset[int(i)].tolist() for i in order]


@pytest.mark.parametrize("seq, num_samples", [(4, 3), (4, 30), (6, 25), (2, 100)])
def test_samples_are_overlapping_windows_of_the_shuffled_document_stream(tmp_path, seq, num_samples):
    corpus = _corpus(tmp_path / "c")
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    dataset = GPTDataset(corpus, documents, num_samples, seq, seed=3)
    stream = np.concatenate([corpus[int(d)] for d in dataset.document_index]).tolist()
    assert len(dataset) >= num_samples
    assert len(dataset) == (len(stream) - 1) // seq  # every whole sample, the partial last one dropped
    for k, sample in enumerate(_unshuffled(dataset)):
        assert sample == stream[k * seq:k * seq + seq + 1]
    epochs = len(dataset.document_index) // len(documents)
    assert sorted(dataset.document_index.tolist()) == sorted(documents.tolist() * epochs)


def test_one_epoch_covers_every_token_of_the_split(tmp_path):
    corpus = _corpus(tmp_path / "c")
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    dataset = GPTDataset(corpus, documents, num_samples=1, seq_length=4, seed=0)
    seen = {t for i in range(len(dataset)) for t in dataset[i].tolist()}
    every = {t for d in documents for t in corpus[int(d)].tolist()}
    stream_tail = sum(LENGTHS) - 1 - len(dataset) * 4  # tokens after the last whole sample's label
    assert len(every - seen) == stream_tail


def test_the_seed_fixes_the_order(tmp_path):
    corpus = _corpus(tmp_path / "c")
    documents = np.arange(len(LENGTHS), dtype=np.int32)

    def samples(seed):
        dataset = GPTDataset(corpus, documents, 20, 4, seed)
        return [dataset[i].tolist() for i in range(len(dataset))]

    assert samples(7) == samples(7)
    assert samples(7) != samples(8)


def test_a_little_used_last_epoch_is_shuffled_on_its_own(tmp_path):
    """40 tokens an epoch, seq 4: 9 samples per epoch. 10 samples need 2 epochs but only 1 sample of the second,
    below 80% of it: the last epoch's documents stay together at the end, and the samples of the first epoch are
    shuffled among themselves."""
    corpus = _corpus(tmp_path / "c")
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    dataset = GPTDataset(corpus, documents, num_samples=10, seq_length=4, seed=1)
    assert len(dataset.document_index) == 2 * len(documents)
    assert sorted(dataset.document_index[len(documents):].tolist()) == documents.tolist()
    before_last = (sum(LENGTHS) - 1) // 4
    assert sorted(dataset.shuffle_index[:before_last].tolist()) == list(range(before_last))


def test_split_cuts_consecutive_documents_as_megatron_rounds():
    train, valid, test = split_documents(100, parse_split("98,2,0"))
    assert (train.tolist(), valid.tolist(), test.tolist()) == (list(range(98)), [98, 99], [])
    assert [len(s) for s in split_documents(10, parse_split("969,30,1"))] == [10, 0, 0]  # round(9.69), round(9.99)
    assert parse_split("1") == (1.0, 0.0, 0.0)


def test_blend_follows_the_weights_in_every_prefix():
    dataset_index, sample_index = build_blending_indices([0.7, 0.3], 1000)
    counts = np.cumsum(np.eye(2, dtype=int)[dataset_index], axis=0)
    n = np.arange(1, 1001)
    assert np.all(np.abs(counts[:, 0] - 0.7 * n) <= 1) and np.all(np.abs(counts[:, 1] - 0.3 * n) <= 1)
    for d in (0, 1):  # each dataset is read in its own order, no sample twice
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


@pytest.mark.parametrize("data_path, message", [
    (["0.7", "A", "B"], "odd count"), (["x", "A", "1", "B"], "'x' (before A) is not a number"),
    (["0", "A", "1", "B"], "must be a positive number"), (["nan", "A", "1", "B"], "must be a positive number"),
])
def test_blend_weights_that_do_not_parse(data_path, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_blend(data_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(["--model", "tiny", "--data-path", *data_path])


@pytest.mark.parametrize("split", ["a,b", "1,2,3,4", "-1,2", "0,0,0", "inf,1"])
def test_bad_split(split):
    with pytest.raises(ConfigError, match="--split"):
        parse_args(["--model", "tiny", "--split", split])


def _config(data_path, *extra):
    return parse_args(["--model", "tiny", "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--train-iters", "5", "--split", "100,0,0", "--seed", "5", "--vocab-size", "8000",
                       "--data-path", *data_path, *extra],
                      world_size=2)


def test_flags_build_a_blend_of_two_corpora(tmp_path):
    _corpus(tmp_path / "a", base=0)
    _corpus(tmp_path / "b", lengths=[30, 20, 10], base=500)
    dataset = build_train_dataset(_config(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")]))
    assert isinstance(dataset, BlendedDataset) and len(dataset) == 5 * 8
    from_b = [(dataset[i] % 1000 >= 500).all() for i in range(len(dataset))]
    assert sum(from_b) == 12  # 0.3 x 40 samples


def test_each_data_parallel_rank_reads_its_slice_of_the_global_batch(tmp_path):
    _corpus(tmp_path / "c")
    run_config = _config([str(tmp_path / "c")])
    dataset = build_train_dataset(run_config)
    batches = []
    for dp_rank in (0, 1):
        state = SimpleNamespace(rank=dp_rank, dp_rank=dp_rank, dp_size=2, cp_rank=0, cp_size=1,
                                virtual_pipeline_size=None,
                                is_pipeline_first_stage=True, is_pipeline_last_stage=True)
        (iterator,) = build_data_iterators(run_config, state, torch.device("cpu"))
        batches.append([next(iterator) for _ in range(run_config.num_microbatches * 2)])  # two iterations
    for iteration in range(2):
        mbs = run_config.num_microbatches
        rows = [torch.cat([b.tokens for b in batches[d][iteration * mbs:(iteration + 1) * mbs]]) for d in (0, 1)]
        labels = [torch.cat([b.labels for b in batches[d][iteration * mbs:(iteration + 1) * mbs]]) for d in (0, 1)]
        expected = torch.stack([torch.from_numpy(dataset[iteration * 8 + k]) for k in range(8)])
        assert torch.equal(torch.cat(rows), expected[:, :-1]) and torch.equal(torch.cat(labels), expected[:, 1:])


def test_bad_data_is_refused_before_any_sample(tmp_path):
    _corpus(tmp_path / "c")  # token ids up to 7008: a vocabulary of 7009 holds them, one of 7008 does not
    check_data(_config([str(tmp_path / "c")], "--vocab-size", "7009"))
    with pytest.raises(ConfigError, match="token id 7008 is outside --vocab-size 7008"):
        check_data(_config([str(tmp_path / "c")], "--vocab-size", "7008"))
    with pytest.raises(InputError, match="no such index file"):
        check_data(_config([str(tmp_path / "missing")]))
    _corpus(tmp_path / "small", lengths=[3])
    with pytest.raises(ConfigError, match="training split .* is empty"):
        check_data(parse_args(["--model", "tiny", "--split", "0,1,0", "--data-path", str(tmp_path / "small")]))


def test_mock_and_real_data_are_alternatives():
    with pytest.raises(ConfigError, match="alternatives"):
        parse_args(["--model", "tiny", "--mock-data", "--data-path", "p"])
    assert parse_args(["--model", "tiny", "--data-path", "p"]).train.mock_data is False


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Megatron-LM's dataset package with its compiled C++ helpers (tests/support/megatron.py)."""
    with megatron_datasets(tmp_path_factory.mktemp("mlm"), helpers=True) as package:
        yield package


@pytest.mark.parametrize("seq, num_samples", [(4, 3), (4, 30), (6, 25), (2, 100), (3, 10)])
def test_sample_index_equals_megatrons_build_sample_idx(tmp_path, megatron, seq, num_samples):
    """Same document index in, the same [samples + 1, 2] table out as Megatron's C++: the samples Megatron would
    train on, in the same order, since the shuffles make the same RandomState calls. Over 20 seeds, some document
    index starts with an empty document (the corpus has two), the one place where Megatron's table is not simply
    where each sample's first token lies."""
    corpus = _corpus(tmp_path / "c", lengths=[0, *LENGTHS])
    documents = np.arange(len(LENGTHS) + 1, dtype=np.int32)
    first_empty = 0
    for seed in range(20):
        ours = GPTDataset(corpus, documents, num_samples, seq, seed)
        epochs = len(ours.document_index) // len(documents)
        theirs = megatron.helpers_cpp.build_sample_idx_int32(corpus.sequence_lengths.copy(), ours.document_index, seq,
                                                         epochs, int(corpus.sequence_lengths.sum()), True, 1)
        assert np.array_equal(ours.sample_index, theirs), seed
        first_empty += corpus.sequence_lengths[ours.document_index[0]] == 0
    assert first_empty > 0


@pytest.mark.parametrize("seq, num_samples, split", [(4, 25, "100,0,0"), (4, 10, "100,0,0"), (3, 40, "80,20,0"),
                                                     (8, 5, "7,2,1")])
def test_megatrons_gpt_dataset_gives_the_same_samples(tmp_path, megatron, seq, num_samples, split):
    """Megatron's own GPTDataset over the same files, split, seed and sample count: sample for sample the same tokens
    (a single epoch, a separately shuffled last epoch, and splits that leave documents out). Its tokenizer, of which
    only the ids it reads are needed, is a stand-in."""
    import importlib
    from types import SimpleNamespace

    theirs_module = importlib.import_module("megatron.core.datasets.gpt_dataset")
    indexed = importlib.import_module("megatron.core.datasets.indexed_dataset")
    train_split = importlib.import_module("megatron.core.datasets.utils").Split.train
    corpus = _corpus(tmp_path / "c", lengths=[0, *LENGTHS])
    documents = split_documents(corpus.num_documents, parse_split(split))[0]
    for seed in (0, 5):
        config = theirs_module.GPTDatasetConfig(
            random_seed=seed, sequence_length=seq, blend=None, split=split, path_to_cache=None, mmap_bin_files=True,
            tokenizer=SimpleNamespace(eod=0, pad=-1, vocab_size=10**4, unique_identifiers={"class": "stand-in"}),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        theirs = theirs_module.GPTDataset(indexed.IndexedDataset(str(tmp_path / "c")), str(tmp_path / "c"), documents,
                                          num_samples, train_split, config)
        ours = GPTDataset(corpus, documents, num_samples, seq, seed)
        assert len(ours) == len(theirs)
        for i in range(len(ours)):
            assert ours[i].tolist() == theirs._query_document_sample_shuffle_indices(i)[0].tolist(), (seed, i)

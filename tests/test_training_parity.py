"""A parallel run trains exactly the single-process model: same data, same losses, same grad norms, same weights.

Every layout below runs pretrain on gloo ranks (fp32, CPU) for 5 steps, a global batch of 8 in micro-batches of 1
(4 to 8 per DP rank), and is compared with the same configuration on a world of one (tests.support.parity), to 1e-5
relative. The clip threshold is below every step's grad norm, so clipping is active and the norms compared are the
ones it uses.
"""
import pytest
import torch

from common.arguments import parse_args
from engine.data import MicroBatchIterator, MockGPTDataset, micro_batch_samples
from tests.support.gloo import run_distributed
from tests.support.parity import assert_rank_matches, flag_value, reference, train_rank

CLIP = 0.05
BASE = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
        "--clip-grad", str(CLIP), "--mock-data"]

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2": (2, []),
    "tp2-dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-dp2-distopt": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "tp2-dp2-distopt-overlap": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--use-distributed-optimizer", "--overlap-grad-reduce",
                                    "--overlap-param-gather", "--ddp-bucket-size", "20000"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_run_equals_single_process(layout):
    world, flags = LAYOUTS[layout]
    results = run_distributed(train_rank, world, BASE + flags)
    ref = reference(tuple(BASE), flag_value(flags, "--tensor-model-parallel-size"))
    assert min(ref["grad_norms"]) > CLIP, "clipping must be active on every step"
    assert ref["losses"][-1] < ref["losses"][0], "the reference must actually train"
    for rank, res in enumerate(results):
        assert res["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
        assert res["params"].keys() == ref["params"].keys()
        assert_rank_matches(res, ref, rank)


def test_global_batch_is_the_same_samples_whatever_the_layout():
    gbs, mbs = 16, 2
    for dp in (1, 2, 4, 8):
        num_micro = gbs // (mbs * dp)
        for iteration in (0, 3):
            seen = [k for d in range(dp) for m in range(num_micro)
                    for k in micro_batch_samples(iteration, m, d, dp, mbs, gbs)]
            assert seen == list(range(iteration * gbs, (iteration + 1) * gbs))


def test_sample_depends_only_on_seed_and_index():
    a, b = MockGPTDataset(1000, 32, seed=7), MockGPTDataset(1000, 32, seed=7)
    assert torch.equal(a[5], b[5])
    assert not torch.equal(a[5], a[6])
    assert not torch.equal(a[5], MockGPTDataset(1000, 32, seed=8)[5])
    tokens = a[5]
    assert tokens.shape == (33,) and 0 <= tokens.min() and tokens.max() < 1000
    # odd positions follow the seeded successor table: the structure the model can learn
    assert torch.equal(tokens[1::2], a.successor[tokens[0::2][:16]])


def test_labels_are_the_next_tokens_and_middle_stages_read_nothing():
    cfg = parse_args(["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "8"], world_size=2)
    dataset = MockGPTDataset(1000, 32, seed=1)
    both = MicroBatchIterator(dataset, cfg, dp_rank=1, dp_size=2, device=torch.device("cpu"), needs_tokens=True,
                              needs_labels=True)
    batch = next(both)
    assert batch.tokens.shape == batch.labels.shape == (2, 32)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert torch.equal(batch.tokens[0], dataset[4][:-1])  # DP rank 1 of 2 starts at sample 8 / 2
    middle = MicroBatchIterator(dataset, cfg, dp_rank=1, dp_size=2, device=torch.device("cpu"), needs_tokens=False,
                                needs_labels=False)
    assert next(middle).tokens is None and next(middle).labels is None

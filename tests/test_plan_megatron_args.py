"""`plan` and `simulate` take a Megatron-LM command line as it is (--megatron-args "..." or the flags after --):
the flags that change the prediction are used, the others listed as not affecting it, an unknown one named."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.support.cli import run as run_cli

REPO = Path(__file__).resolve().parent.parent


def run_sh_flags() -> list[str]:
    """The flags runs/megatron/run.sh passes pretrain_gpt.py (its ARGS array), the run directory filled in."""
    text = (REPO / "runs/megatron/run.sh").read_text()
    block = text[text.index("ARGS=(") + len("ARGS=("):text.index(")\n# shellcheck")]
    return shlex.split(block.replace('"$RUN_DIR/tb"', "/tmp/run/tb"))


def test_plan_reproduces_the_reference_run_from_megatrons_own_command_line():
    """docs/engine.md, "The reference run": 60,821,504 parameters per layer, 1,498,482,688 in all, 749,240,320 and
    749,242,368 per stage, 374,636,544 and 374,638,592 per GPU, 12 bytes of static state per TP-local parameter,
    4,495,663,104 B on a stage-1 GPU, a bubble of 1/9 of the step."""
    code, out, err = run_cli(["plan", "--json", "--world-size", "8", "--megatron-args", shlex.join(run_sh_flags())])
    assert code == 0, err
    plan = json.loads(out)
    params, memory = plan["params"], plan["memory"]
    assert params["per_layer"] == 60_821_504 and params["total"] == 1_498_482_688
    assert params["per_stage"] == [749_240_320, 749_242_368] and params["per_rank"] == [374_636_544, 374_638_592]
    assert memory["bytes_per_param"] == 12 and memory["static_bytes_per_stage"][1]["total"] == 4_495_663_104
    assert plan["pipeline"]["bubble_fraction"] == pytest.approx(1 / 9)
    flags = plan["megatron_flags"]
    assert "--num-layers" in flags["used"] and "--tokenizer-type" in flags["not_affecting"]
    assert "--eval-iters" in flags["not_affecting"] and "--tensorboard-dir" in flags["not_affecting"]
    assert plan["config"]["tp"] == 2 and plan["config"]["sequence_parallel"]


def test_the_flags_after_a_double_dash_are_the_same_command_line():
    code, out, _ = run_cli(["plan", "--world-size", "8", "--", "pretrain_gpt.py", *run_sh_flags()])
    assert code == 0
    assert out.startswith("Megatron-LM flags used: --transformer-impl --num-layers")
    assert "not affecting the prediction: --use-mcore-models --lr" in out
    assert "1,498,482,688 total" in out


def test_an_unknown_flag_is_named():
    code, _, err = run_cli(["plan", "--megatron-args", "--num-layers 2 --num-layer 4 --hidden-size 64"])
    assert code == 2 and err.count("\n") == 1
    assert "--num-layer is not a Megatron-LM flag" in err


def test_a_flag_the_formulas_do_not_read_is_listed_as_not_modelled():
    args = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings "
            "512 --vocab-size 1000 --micro-batch-size 1 --bf16 --tp-comm-overlap --transformer-impl local")
    code, out, err = run_cli(["plan", "--megatron-args", args])
    assert code == 0, err
    assert "not modelled (Megatron's defaults assumed): --tp-comm-overlap" in out
    assert "implementation: local, unfused attention, foreach Adam" in out
    assert "core_attention.probs" not in out and "attention scores" not in out  # the peak names its phase instead


def test_simulate_takes_the_command_line_with_its_implementation():
    """The issue's shape (Llama-3.2-1B widths, 2 layers, seq 4096, local attention, micro-batch 2): its peak is
    the loss's forward with the 2 GiB score matrices of both layers kept, far above the flash-attention path's."""
    common = ("--num-layers 2 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 "
              "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 "
              "--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
              "--position-embedding-type rope --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 "
              "--global-batch-size 8 --bf16 --use-distributed-optimizer --vocab-size 128256 --no-rope-fusion "
              "--no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion")
    peaks = {}
    for impl in ("local", "transformer_engine"):
        code, out, err = run_cli(["simulate", "--json", "--world-size", "1", "--hardware", "H200",
                                  "--megatron-args", f"{common} --transformer-impl {impl}"])
        assert code == 0, err
        peaks[impl] = json.loads(out)["memory"]["per_stage"][0]["total"]
    score_matrices = 2 * 2 * 32 * 4096 * 4096  # bf16, b heads s s, one layer
    assert peaks["local"] - peaks["transformer_engine"] > 2 * score_matrices  # both layers' probs + the buffer


def test_megatron_lms_pipeline_split_flags_are_read():
    """A Megatron-LM line with uneven stages: the flags are used (not "not modelled"), and the plan's stages hold the
    split's layers (10 layers over 4 stages as 1, 4, 4, 1; then 6 + 2 ends over 4 as 1, 2, 2, 1)."""
    common = ("--num-layers 10 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings "
              "512 --vocab-size 1000 --micro-batch-size 1 --global-batch-size 4 --bf16 "
              "--pipeline-model-parallel-size 4")
    code, out, err = run_cli(["plan", "--world-size", "4", "--json", "--megatron-args",
                              common + " --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1"])
    assert code == 0, err
    assert json.loads(out)["params"]["layers_per_stage"] == [1, 4, 4, 1]
    code, out, err = run_cli(["plan", "--world-size", "4", "--megatron-args",
                              common.replace("--num-layers 10", "--num-layers 6")
                              + " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"])
    assert code == 0, err
    assert "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split" in out.splitlines()[0]
    assert "not modelled" not in out
    assert "stage 0: 1 layer(s)" in out and "stage 1: 2 layer(s)" in out


def test_virtual_stages_per_rank_is_the_interleaving_its_layers_per_stage_twin_gives():
    """Megatron-LM's two spellings of interleaving: 6 layers over PP 2 as 3 virtual stages a rank or 1 layer a virtual
    stage (validate_args derives the virtual size from either); the plan is the same, and the flag is used."""
    common = ("--num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings "
              "512 --vocab-size 1000 --micro-batch-size 1 --bf16 --global-batch-size 8 "
              "--pipeline-model-parallel-size 2")
    plans = []
    for interleave in ("--num-virtual-stages-per-pipeline-rank 3", "--num-layers-per-virtual-pipeline-stage 1"):
        code, out, err = run_cli(["plan", "--json", "--world-size", "2", "--megatron-args", f"{common} {interleave}"])
        assert code == 0, err
        plans.append(json.loads(out))
    assert "--num-virtual-stages-per-pipeline-rank" in plans[0]["megatron_flags"]["used"]
    assert plans[0]["pipeline"]["bubble_fraction"] == pytest.approx(1 / (3 * 8 + 1))
    assert {k: v for k, v in plans[0].items() if k != "megatron_flags"} == \
        {k: v for k, v in plans[1].items() if k != "megatron_flags"}


def test_uneven_stages_take_their_virtual_size_from_virtual_stages_per_rank():
    """Megatron-LM interleaves uneven stages only by --num-virtual-stages-per-pipeline-rank (validate_args refuses
    layers per virtual stage with a first or last stage count); the refusal names it, and with it the plan runs:
    6 layers as 2 + 4 over PP 2, V 2."""
    common = ("--num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --max-position-embeddings "
              "512 --vocab-size 1000 --micro-batch-size 1 --global-batch-size 8 --pipeline-model-parallel-size 2 "
              "--decoder-first-pipeline-num-layers 2")
    code, _, err = run_cli(["plan", "--world-size", "2", "--megatron-args",
                            f"{common} --num-layers-per-virtual-pipeline-stage 1"])
    assert code == 2 and "--num-virtual-stages-per-pipeline-rank" in err
    code, out, err = run_cli(["plan", "--json", "--world-size", "2", "--megatron-args",
                              f"{common} --num-virtual-stages-per-pipeline-rank 2"])
    assert code == 0, err
    assert json.loads(out)["config"]["vpp"] == 2

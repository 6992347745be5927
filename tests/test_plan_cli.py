"""`train-ledger plan`: the CLI contract (JSON keys, text breakdown, one-line errors with status 2, no torch)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The reference run (docs/engine.md) runs the llama3.2-1b shape untied.
REFERENCE = ["--model", "llama3.2-1b", "--world-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--micro-batch-size", "1",
        "--global-batch-size", "16", "--bf16", "--untie-embeddings-and-output-weights"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "plan", *args], capture_output=True, text=True,
                          timeout=60)


def plan_json(*args: str) -> dict:
    out = plan(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_reference_plan_json():
    p = plan_json(*REFERENCE)
    assert p["params"]["total"] == 1_498_482_688
    assert p["params"]["per_layer"] == 60_821_504
    assert [round(n / 1e6, 1) for n in p["params"]["per_stage"]] == [749.2, 749.2]
    assert round(p["params"]["per_rank_max"] / 1e6, 1) == 374.6
    assert p["memory"]["bytes_per_param"] == 2 + 4 + 12 / 2
    assert round(p["memory"]["static_bytes_per_rank_max"] / 1e9, 2) == 4.50
    assert p["pipeline"]["num_microbatches"] == 16 // (1 * 2)
    assert p["pipeline"]["bubble_fraction"] == pytest.approx(1 / (8 + 1))
    assert "(p-1)/(v*m+p-1)" in p["pipeline"]["bubble_convention"]
    assert len(p["memory"]["activation_bytes_per_stage"]) == len(p["memory"]["peak_bytes_per_stage"]) == 2
    for stage, peak in enumerate(p["memory"]["peak_bytes_per_stage"]):
        assert peak > p["memory"]["activation_bytes_per_stage"][stage] + 4e9
    assert {"dp.reduce_scatter.grads[fp32]", "dp.all_gather.params[bf16]",
            "tp.all_gather.activations[bf16]"} <= set(p["comm"]["bytes_per_step"])
    tokens = 16 * 8192
    assert p["flops"]["per_token"] == pytest.approx(p["flops"]["per_step"] / tokens)
    assert p["flops"]["palm_6n"]["per_step"] == p["flops"]["palm_6n"]["per_token"] * tokens
    assert "megatron" in p["flops"]["convention"] and "palm" in p["flops"]["palm_6n"]["convention"]


def test_embeddings_are_tied_unless_untied_as_in_megatron():
    h, v, per_layer = 2048, 128256, 60_821_504
    tied = plan_json("--model", "llama3.2-1b")["params"]
    assert (tied["total"], tied["embeddings"]) == (16 * per_layer + v * h + h, "tied") == (1_235_814_400, "tied")
    untied = plan_json("--model", "llama3.2-1b", "--untie-embeddings-and-output-weights")["params"]
    assert (untied["total"], untied["embeddings"]) == (16 * per_layer + 2 * v * h + h, "untied")
    # PP2: the last stage holds a copy of the embedding besides its 8 layers and the final norm
    pp2 = plan_json("--model", "llama3.2-1b", "--world-size", "2", "--pipeline-model-parallel-size", "2")["params"]
    assert pp2["embedding_copy_on_last_stage"]
    assert pp2["per_stage"] == [8 * per_layer + v * h, 8 * per_layer + h + v * h]
    lines = [plan(*args).stdout.splitlines()[1] for args in (("--model", "llama3.2-1b"), REFERENCE)]
    assert lines[0].startswith("parameters: 1,235,814,400 total (tied embedding and output layer as Llama-3.2-1B's "
                               "published config: tie_word_embeddings true)")
    assert lines[1].startswith("parameters: 1,498,482,688 total (untied embedding and output layer by "
                               "--untie-embeddings-and-output-weights)")


@pytest.mark.parametrize("args, says", [
    (["--model", "llama3.1-8b"], "8,030,261,248 total (untied embedding and output layer as Llama-3.1-8B's published "
                                 "config: tie_word_embeddings false)"),
    (["--model", "llama3.1-8b", "--untie-embeddings-and-output-weights"],
     "8,030,261,248 total (untied embedding and output layer as Llama-3.1-8B's published config"),
    (["--model", "tiny"], "(tied embedding and output layer as the tiny preset: Megatron's default)"),
    (["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
      "--vocab-size", "100", "--seq-length", "16"],
     "(tied embedding and output layer by Megatron's default: no --untie-embeddings-and-output-weights)"),
], ids=["published-untied", "flag-restates-the-preset", "tiny", "custom-shape"])
def test_the_plan_says_whether_the_output_layer_is_tied_and_why(args, says):
    out = plan(*args)
    assert out.returncode == 0, out.stderr
    assert says in out.stdout.splitlines()[1]
    assert plan_json(*args)["params"]["embeddings_reason"] in out.stdout.splitlines()[1]


def test_precision_follows_megatron():
    assert plan_json("--model", "tiny", "--world-size", "2")["memory"]["bytes_per_param"] == 16     # fp32 default
    assert plan_json("--model", "tiny", "--world-size", "2", "--bf16")["memory"]["bytes_per_param"] == 18


def test_vocab_padding_is_reported():
    p = plan_json("--model", "tiny", "--world-size", "2", "--tensor-model-parallel-size", "2")
    assert p["params"]["vocab"] == {"size": 1000, "padded": 1008, "padding_rows": 8,
                                    "rule": "multiple of make_vocab_size_divisible_by 8 x tp 2"}


def test_text_breakdown_per_stage():
    out = plan(*REFERENCE)
    assert out.returncode == 0, out.stderr
    assert "stage 0:" in out.stdout and "stage 1:" in out.stdout
    assert "1,498,482,688" in out.stdout and "static 4.19 GiB" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["--model", "tiny", "--world-size", "6", "--tensor-model-parallel-size", "4"], "world size 6"),
    # a grid wider than the world: the grid named, not the global batch its default of dp = 0 would make
    (["--model", "tiny", "--world-size", "2", "--tensor-model-parallel-size", "4"],
     "world size 2 is not divisible by tp 4"),
    (["--model", "tiny", "--world-size", "3", "--tensor-model-parallel-size", "3"], "--num-attention-heads 8"),
    (["--model", "tiny", "--world-size", "4", "--global-batch-size", "6"], "--global-batch-size 6"),
    (["--model", "tiny", "--no-such-flag"], "--no-such-flag"),
])
def test_bad_config_is_one_line_and_status_2(args, needle):
    out = plan(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr


def test_plan_does_not_import_torch():
    code = ("import sys, contextlib, io; from cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['plan', *{REFERENCE!r}, '--json'])\n"
            "assert rc == 0\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_uneven_stages_in_the_plan():
    """Llama-3.1-8B's 32 layers over 4 stages as 7, 9, 9, 7 (Megatron-LM's --decoder-first/last-pipeline-num-layers):
    a middle stage is 9 x 218,112,000 parameters, the first 7 of them and the 128,256 x 4,096 embedding."""
    p = plan_json("--model", "llama3.1-8b", "--world-size", "4", "--pipeline-model-parallel-size", "4",
                  "--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
                  "--global-batch-size", "8")
    assert p["params"]["layers_per_stage"] == [7, 9, 9, 7]
    assert p["params"]["per_stage"][:2] == [7 * 218_112_000 + 128_256 * 4_096, 9 * 218_112_000]
    text = plan("--model", "llama3.1-8b", "--world-size", "4", "--pipeline-model-parallel-size", "4",
                "--decoder-first-pipeline-num-layers", "7", "--global-batch-size", "8")
    assert text.returncode == 2 and text.stderr.count("\n") == 1
    assert "the 25 middle layers are not divisible by 3 middle stage(s)" in text.stderr

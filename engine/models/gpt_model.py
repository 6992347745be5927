"""The Llama-style GPT model of one pipeline stage (or virtual chunk), as Megatron's GPTModel.

    pre_process:  VocabParallelEmbedding (ids [b, s] -> [s, b, h], or [s/tp, b, h] under sequence parallelism)
    decoder:      TransformerBlock over this stage's global layer numbers (final RMSNorm when post_process)
    post_process: output layer = ColumnParallelLinear over the padded vocabulary, gather_output=False, feeding the
                  vocab-parallel cross entropy; its weight is its own (--untie-embeddings-and-output-weights) or
                  the embedding's (share_embeddings_and_output_weights, Megatron's default). With
                  --cross-entropy-fusion-impl linear it is a LinearCrossEntropyModule, which given the labels
                  returns the loss, computed chunk by chunk without the whole logits
                  (engine/fusions/fused_linear_cross_entropy.py).

Tied embeddings (Megatron's LanguageModule.setup_embeddings_and_output_layer): on a stage that holds both, the output
layer multiplies by the embedding's weight, one parameter used twice. Under PP > 1 the last stage's output layer
keeps a weight of its own, marked `shared_embedding` (and `shared`: the grad norm counts the first stage's copy
only); it starts at zero and an all-reduce over the embedding group (first and last pipeline rank, same TP rank)
gives it the first stage's values. finalize_model_grads all-reduces the two copies' grads each step, so both apply
the same update.

Every parameter's initial value depends only on (seed, its global name), so any TP / PP / VPP split of the model
starts from the weights of the single-process model.

Context parallelism (cp_size C > 1): the model sees s/C tokens, chunks i and 2C-1-i of the sequence
(engine.context_parallel); RoPE rotates them at their true positions and every attention layer runs ring attention
over the CP group. Nothing else in the model knows about CP: every other op is per token.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from common.config import ModelConfig, RecomputeConfig, RunConfig
from common.config.pipeline_layers import chunk_layer_numbers
from common.errors import ConfigError
from engine.fp8_utils import convert_to_fp8
from engine.fusions.fused_linear_cross_entropy import LinearCrossEntropyModule
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    set_gradient_accumulation_fusion,
)
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit
from engine.transformer.attention import SelfAttention, set_attention_backend
from engine.transformer.moe.moe_layer import MoEContext
from engine.transformer.ring_attention import CPGroup
from engine.transformer.rotary import RotaryEmbedding
from engine.transformer.transformer_block import TransformerBlock
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


class GPTModel(torch.nn.Module):
    def __init__(self, config: ModelConfig, parallel_state: Any, *, pre_process: bool, post_process: bool,
                 layer_numbers: list[int], sequence_parallel: bool, params_dtype: torch.dtype,
                 device: torch.device | str, probes: ProbeSetProtocol = NullProbeSet(), seed: int = 1234,
                 recompute: RecomputeConfig = RecomputeConfig(), num_microbatches: int = 1):
        """parallel_state needs tp_size, tp_rank and (when tp_size > 1) groups["tp"], and for tied embeddings split
        over pipeline stages pp_size and groups["embedding"], for experts split over EP ep_size, ep_rank and
        groups["ep"]; seed is --seed; num_microbatches is the schedule's per step (MoE: the load-balancing loss's
        gradient scale)."""
        super().__init__()
        if not config.llama_style:  # the GPT style (GeLU MLP, biases, LayerNorm, learned positions): formulas only
            raise ConfigError(f"this engine builds the Llama-style layer only (SwiGLU, no biases, RMSNorm, RoPE), not "
                              f"swiglu={config.swiglu} add_bias_linear={config.add_bias_linear} "
                              f"normalization={config.normalization} "
                              f"position_embedding_type={config.position_embedding_type}")
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.tp = TPGroup.from_parallel_state(parallel_state, probes)
        self.sequence_parallel = sequence_parallel and self.tp.size > 1
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, self.tp.size)
        std = config.init_method_std
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                self.padded_vocab_size, config.hidden_size, tp=self.tp,
                init=MasterWeightInit(std, seed, "embedding.word_embeddings.weight", config.vocab_size),
                params_dtype=params_dtype, device=device, reduce_scatter_embeddings=self.sequence_parallel)
        cp_size = parallel_state.cp_size
        self.rotary_pos_emb = RotaryEmbedding(config.head_dim, config.rotary_base, cp_size, parallel_state.cp_rank)
        self.decoder = TransformerBlock(config, layer_numbers, post_process=post_process, tp=self.tp,
                                        sequence_parallel=self.sequence_parallel, params_dtype=params_dtype,
                                        device=device, seed=seed, recompute=recompute,
                                        moe=(MoEContext.from_parallel_state(parallel_state, probes, num_microbatches)
                                             if config.is_moe else None))
        if cp_size > 1:
            cp = CPGroup.from_parallel_state(parallel_state, probes)
            for module in self.decoder.modules():
                if isinstance(module, SelfAttention):
                    module.set_context_parallel(cp)
        if post_process:
            output_layer = dict(
                tp=self.tp, init=MasterWeightInit(std, seed, "output_layer.weight", config.vocab_size),
                params_dtype=params_dtype, device=device, gather_output=False, sequence_parallel=self.sequence_parallel,
                skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights)
            self.output_layer = (
                LinearCrossEntropyModule(config.hidden_size, self.padded_vocab_size, vocab_size=config.vocab_size,
                                         **output_layer) if config.linear_cross_entropy
                else ColumnParallelLinear(config.hidden_size, self.padded_vocab_size, **output_layer))
        if self.share_embeddings_and_output_weights:
            self._setup_embeddings_and_output_layer(parallel_state)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """Tied embeddings: the embedding's weight where this chunk has one, else the output layer's (its copy)."""
        if self.pre_process:
            return self.embedding.weight
        return self.output_layer.weight if self.post_process else None

    def _setup_embeddings_and_output_layer(self, parallel_state: Any) -> None:
        weight = self.shared_embedding_or_output_weight()
        if weight is None:
            return
        if self.pre_process and self.post_process:
            return  # used by the embedding and the output layer: set_embedding_gradient_fusion says how they sum
        if parallel_state.pp_size == 1:
            raise ConfigError("tied embeddings need the embedding and the output layer in one model chunk or on "
                              "different pipeline ranks; use --untie-embeddings-and-output-weights with a virtual "
                              "pipeline on one rank")
        weight.shared_embedding = True
        if self.post_process:
            weight.shared = True
            weight.data.zero_()
        dist.all_reduce(weight.data, group=parallel_state.groups["embedding"])

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """The activation received from the previous stage; Megatron's schedules pass a one-element list."""
        if isinstance(input_tensor, (list, tuple)):
            (input_tensor,) = input_tensor
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: input_ids [b, s]; later stages read set_input_tensor's activation.

        Returns, on the last stage, the per-token loss [b, s] (fp32) given labels [b, s], else the vocab-parallel
        logits [s, b, V_padded/tp]; on other stages the hidden states [s, b, h] ([s/tp, b, h] under SP).
        """
        if self.pre_process:
            hidden_states = self.embedding(input_ids)
        else:
            hidden_states = self.decoder.input_tensor
        seq_len = hidden_states.shape[0] * (self.tp.size if self.sequence_parallel else 1)
        cos, sin = self.rotary_pos_emb(seq_len, hidden_states.device, hidden_states.dtype)
        hidden_states = self.decoder(hidden_states, cos, sin)
        if not self.post_process:
            return hidden_states
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None and self.config.linear_cross_entropy:
            return self.output_layer(hidden_states, weight=output_weight, labels=labels)
        logits = self.output_layer(hidden_states, weight=output_weight)
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp, self.config.vocab_size)
        return loss.t().contiguous()


def build_model_chunks(run_config: RunConfig, parallel_state: Any, device: torch.device | str,
                       probes: ProbeSetProtocol = NullProbeSet()) -> list[GPTModel]:
    """This rank's model: one GPTModel per virtual pipeline chunk (one without VPP); under --fp8-format its layers'
    linears compute in fp8 (engine/fp8_utils.py); core attention runs on --attention-backend's kernel."""
    parallel, model_config = run_config.parallel, run_config.model
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    params_dtype = torch.bfloat16 if run_config.train.bf16 else torch.float32
    chunks = []
    for chunk in range(vpp):
        layers = list(chunk_layer_numbers(parallel, model_config.num_layers, parallel_state.pp_rank, chunk))
        chunks.append(GPTModel(
            model_config, parallel_state,
            pre_process=parallel_state.is_pipeline_first_stage and chunk == 0,
            post_process=parallel_state.is_pipeline_last_stage and chunk == vpp - 1,
            layer_numbers=layers, sequence_parallel=parallel.sequence_parallel, params_dtype=params_dtype,
            device=device, probes=probes, seed=run_config.train.seed, recompute=run_config.recompute,
            num_microbatches=run_config.num_microbatches))
    if run_config.implementation.fp8:
        convert_to_fp8(chunks, run_config.implementation, torch.device(device))
    set_attention_backend(chunks, run_config.implementation.attention_backend)
    for chunk in chunks:
        set_gradient_accumulation_fusion(chunk, run_config.implementation.gradient_accumulation_fusion)
    set_embedding_gradient_fusion(chunks, run_config.implementation.embedding_gradient_accumulation_fusion)
    return chunks


def set_embedding_gradient_fusion(chunks: list[GPTModel], on: bool) -> None:
    """Whether the embedding's lookup adds its gradient into main_grad itself (tensor_parallel/layers.py). Off, a
    weight tied to the output layer in the same chunk gets Megatron's zero_out_wgrad: the output layer's fused
    wgrad then hands autograd zeros, not a placeholder, to sum with the lookup's dense gradient."""
    for chunk in chunks:
        if chunk.pre_process:
            chunk.embedding.gradient_accumulation_fusion = on
            if not on and chunk.post_process and chunk.share_embeddings_and_output_weights:
                chunk.embedding.weight.zero_out_wgrad = True

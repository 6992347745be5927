"""Core attention's memory on one TP rank, one micro-batch, by backend (common/config ImplementationConfig): what it
keeps for backward, what it allocates beyond that while it runs forward or backward, and the buffer Megatron-LM
keeps between steps for it.

flash (flash / fused attention, torch's SDPA): the output (linear_proj's input) and an fp32 logsumexp per head and
token; no [b, heads, s, s] tensor. unfused (Megatron-LM's DotProductAttention): the softmax's output on the whole
score matrix, E = b x heads/t x s^2 elements, in the activation dtype (or, with --attention-softmax-in-fp32, in fp32
and as the 16-bit copy bmm keeps), dropout's mask and output, and the context's contiguous copy; the scores
themselves are written into a buffer of E elements that Megatron keeps for the whole run (its "mpu" global memory
buffer). docs/formulas.md, "Megatron-LM's saved set", derives each term; tests/test_megatron_memory.py holds them to
what Megatron-LM's own code keeps.
"""
from __future__ import annotations

from common.config import RunConfig
from common.ops.sizes import DTYPE_BYTES, fused_softmax, local_seq_length, score_elements

FP32 = 4
def _tokens(cfg: RunConfig) -> int:
    return local_seq_length(cfg) * cfg.train.micro_batch_size


def _activation(cfg: RunConfig) -> int:
    return DTYPE_BYTES[cfg.train.params_dtype]


def saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """What the core attention keeps for backward: the output linear_proj reads (its saved input) included."""
    impl, t = cfg.implementation, cfg.parallel.tensor_model_parallel_size
    a, tokens, query = _activation(cfg), _tokens(cfg), cfg.model.num_attention_heads * cfg.model.head_dim // t
    if not impl.unfused_attention:
        heads = cfg.model.num_attention_heads // t
        return {"core_attention.output=linear_proj.input": a * tokens * query,
                "core_attention.logsumexp[fp32]": FP32 * cfg.train.micro_batch_size * heads * local_seq_length(cfg)}
    e = score_elements(cfg)
    fp32 = impl.attention_softmax_in_fp32 and not fused_softmax(cfg)
    saved = ({"core_attention.softmax[fp32]": FP32 * e, "core_attention.probs[16-bit copy]": a * e} if fp32
             else {"core_attention.probs": a * e})
    if impl.attention_dropout > 0:
        saved |= {"core_attention.dropout_mask[bool]": e, "core_attention.dropout_output": a * e}
    return saved | {"core_attention.context=linear_proj.input": a * tokens * query}


def keeps_mask(cfg: RunConfig) -> bool:
    """The dataloader's mask stays alive until backward: torch's masked_fill_ keeps it (the fused causal kernel and
    flash attention never read it)."""
    impl = cfg.implementation
    return impl.create_attention_mask and impl.unfused_attention and not fused_softmax(cfg)


def mask_bytes(cfg: RunConfig) -> int:
    """Megatron's dataloader mask, [b, 1, s, s] booleans (--no-create-attention-mask-in-dataloader: none)."""
    if not cfg.implementation.create_attention_mask:
        return 0
    s = cfg.model.seq_length
    return cfg.train.micro_batch_size * s * s


def forward_transient(cfg: RunConfig) -> int:
    """Bytes core attention holds beyond its saved tensors while its forward runs. Unfused: the baddbmm's scores
    stay referenced until DotProductAttention.forward returns (and, with the softmax in fp32, their fp32 copy the
    mask is applied to in place)."""
    impl = cfg.implementation
    if not impl.unfused_attention:
        return 0
    e, a = score_elements(cfg), _activation(cfg)
    return e * (a + FP32) if impl.attention_softmax_in_fp32 and not fused_softmax(cfg) else e * a


def backward_transient(cfg: RunConfig) -> int:
    """The most core attention's backward holds at once, its own saved tensors included, on top of its inputs.
    Unfused, torch's 16-bit softmax: masked_fill_ ran in place on a view of the scores, so its backward goes
    through AsStridedBackward (a zeroed copy of the scores' gradient) and CopySlices (a copy, and masked_fill's
    clone and result): four score-sized gradients once the probabilities are freed. fp32 softmax: the fp32 gradient
    of the 16-bit cast, softmax_backward's fp32 output and the fp32 probabilities. The fused kernel: the
    probabilities, their gradient and the kernel's output. Flash: the saved tensors and their gradients, small."""
    impl = cfg.implementation
    if not impl.unfused_attention:
        return 0
    e, a = score_elements(cfg), _activation(cfg)
    if fused_softmax(cfg):
        return 3 * a * e
    return 3 * FP32 * e if impl.attention_softmax_in_fp32 else 4 * a * e


def persistent_buffer_bytes(cfg: RunConfig) -> int:
    """Megatron-LM's global memory buffer ("mpu"), allocated at first use and kept: the unfused scores (baddbmm's
    output buffer, E elements), and under sequence parallelism with Megatron's local linear layers the all-gathered
    [s, b, h] input; it holds the larger."""
    impl = cfg.implementation
    if not impl.megatron:
        return 0
    a, sizes = _activation(cfg), [0]
    if impl.unfused_attention:
        sizes.append(a * score_elements(cfg))
    if cfg.parallel.sequence_parallel and impl.transformer_impl == "local":
        sizes.append(a * _tokens(cfg) * cfg.model.hidden_size)
    return max(sizes)

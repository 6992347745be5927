"""A layer's self-attention kernels: linear_qkv, rope, core attention (flash attention, or under context
parallelism ring attention's blocks and merges), the output's layout copy and linear_proj.

Core attention, causal, on [b, heads, s, d] views of [s, b, heads, d]: QK^T and PV are 4 b heads s^2 d FLOPs
forward, halved by the mask; backward 2.5x (flash attention's recomputation of the scores included).

Ring attention (C > 1: engine/transformer/ring_attention.py; docs/formulas.md, "Context parallel") runs on the CP
rank's L = s/C tokens, C block kernels a pass, keyed apart from the dense kernel by `queries` and `causal` (seq: L,
every block's keys). With Megatron's load balancing a block is the causal diagonal (L x L) or an unmasked half
block, L/2 queries against L keys (the other half-block shape, L queries against L/2 keys, has as many query-key
pairs and is timed as this one): L^2/2 pairs either way, 2 b heads L^2 d FLOPs forward, 2.5x backward. Beside the
blocks one `ring_attention.merge` kernel a pass: the forward's online-softmax merges, the backward's dQ / dK-dV
accumulations.

rope is split_qkv_and_rotate on the fused QKV viewed as [s, b, groups, heads per group + 2, d] (none with learned
positions); attention_output.copy the [b, heads, s, d] -> [s, b, heads d] layout change before linear_proj.
Megatron-LM's own layers (Shapes.megatron) compute some of these unfused: megatron.py's kernels take their place.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, Passes, kernel, passes
from common.ops.linear import Linear, linear
from common.ops.megatron import UnfusedAttentionOps, repeat_kv, unfused_attention, unfused_rope
from common.ops.shapes import Shapes

BACKWARD_OVER_FORWARD = 2.5  # flash attention's backward FLOPs over its forward's


@dataclass(frozen=True)
class RingOps(OpGroup):
    causal: Passes  # the diagonal block, L x L
    half: Passes  # L/2 queries x L keys
    merge: Passes

    def block(self, causal: bool) -> Passes:
        return self.causal if causal else self.half


@dataclass(frozen=True)
class SelfAttentionOps(OpGroup):
    qkv: Linear
    rope: Passes | None  # None with learned positions
    core: Passes | None  # flash attention (C = 1)
    ring: RingOps | None  # ring attention (C > 1)
    output_copy: Kernel
    proj: Linear
    unfused: UnfusedAttentionOps | None = None  # Megatron's DotProductAttention, in place of `core`
    repeat_kv: Passes | None = None  # its K and V repeated to every head (GQA)


def _heads(sh: Shapes) -> dict[str, int]:
    return dict(batch=sh.micro_batch, heads=sh.heads, kv_heads=sh.kv_heads, seq=sh.seq)


def _forward_flops(sh: Shapes) -> float:
    """Causal attention's (or one ring block's) forward: L^2/2 query-key pairs, 4 d FLOPs each."""
    return 2.0 * sh.micro_batch * sh.heads * sh.seq ** 2 * sh.head_dim


def core_attention(sh: Shapes) -> Passes:
    """Keyed apart by `fused` under the engine's --attention-backend fused (cuDNN's kernel, not torch's pick)."""
    forward = _forward_flops(sh)
    return passes("core_attention", forward, forward * BACKWARD_OVER_FORWARD, **_heads(sh), head_dim=sh.head_dim,
                  **({"fused": 1} if sh.fused_attention else {}))


def ring_block(sh: Shapes, causal: bool) -> Passes:
    forward = _forward_flops(sh)
    return passes("core_attention", forward, forward * BACKWARD_OVER_FORWARD, **_heads(sh),
                  queries=sh.seq if causal else sh.seq // 2, causal=int(causal), head_dim=sh.head_dim)


def ring_ops(sh: Shapes) -> RingOps:
    return RingOps(causal=ring_block(sh, True), half=ring_block(sh, False),
                   merge=passes("ring_attention.merge", **_heads(sh), head_dim=sh.head_dim, cp=sh.cp))


def rope(sh: Shapes) -> Passes:
    return passes("rope", seq=sh.seq, batch=sh.micro_batch, groups=sh.kv_heads, width=sh.heads // sh.kv_heads + 2,
                  head_dim=sh.head_dim)


def self_attention_ops(sh: Shapes) -> SelfAttentionOps:
    mg = sh.megatron
    unfused = mg is not None and mg.unfused_attention
    rotary = (unfused_rope(sh) if mg is not None and mg.unfused_rope else rope(sh)) if sh.rope else None
    return SelfAttentionOps(qkv=linear("linear_qkv", sh.tokens, sh.qkv, sh.hidden, fp8=sh.fp8), rope=rotary,
                            core=core_attention(sh) if sh.cp == 1 and not unfused else None,
                            ring=ring_ops(sh) if sh.cp > 1 else None,
                            output_copy=kernel("attention_output.copy", numel=sh.tokens * sh.query),
                            proj=linear("linear_proj", sh.tokens, sh.hidden, sh.query, fp8=sh.fp8),
                            unfused=unfused_attention(sh) if unfused else None,
                            repeat_kv=repeat_kv(sh) if unfused and mg.repeat_kv else None)

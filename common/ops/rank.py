"""Everything one pipeline rank computes, as catalogue entries: its layers' kernels (every layer alike), the
embedding on the first stage, the output layer and the vocab-parallel cross-entropy on the last (the final norm is
the layers' norm kernel), and the work priced per element: the optimizer step over the rank's main params and the
zeroing of its grad buffers (RATE_OPS: measured at one size, scaled to the run's element counts; torch's foreach
AdamW under Megatron-LM's local implementation, megatron.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, Passes, passes
from common.ops.layer import LayerOps, layer_ops
from common.ops.linear import Linear, linear, main_grad_add, runs_in_fp8
from common.ops.megatron import OPTIMIZER_STEP_FOREACH, fp32_cross_entropy
from common.ops.shapes import Shapes

OPTIMIZER_STEP, GRAD_BUFFER_ZERO = "optimizer.step", "grad_buffer.zero"
RATE_OPS = (OPTIMIZER_STEP, GRAD_BUFFER_ZERO)  # every rank's per-element work (its sweep times both)
PER_ELEMENT = (*RATE_OPS, OPTIMIZER_STEP_FOREACH)  # every op priced per element (Megatron-LM's foreach AdamW too)


@dataclass(frozen=True)
class Rate:
    """Work priced per element, in its elements' dtype: the optimizer's (the params'), the grad buffer's (the main
    grads')."""
    name: str
    dtype: str


@dataclass(frozen=True)
class HeadOps(OpGroup):
    output_layer: Linear
    cross_entropy: Passes


@dataclass(frozen=True)
class RankOps(OpGroup):
    shapes: Shapes
    layer: LayerOps
    embedding: Passes | None  # first stage
    head: HeadOps | None  # last stage
    optimizer: Rate
    grad_buffer: Rate
    main_grad_adds: tuple[Kernel, ...] = ()  # without gradient-accumulation fusion (unfused_wgrad_adds)

    @property
    def rates(self) -> tuple[Rate, Rate]:
        return self.optimizer, self.grad_buffer


def hook_add(sh: Shapes, wgrad: Kernel) -> Kernel | None:
    """DDP's hook's add after `wgrad`, where its gradient is a 16-bit tensor: without gradient-accumulation fusion,
    except an fp8 linear's wgrad, which includes its own add."""
    return main_grad_add(wgrad) if sh.unfused_wgrad and not runs_in_fp8(wgrad) else None


def unfused_wgrad_adds(sh: Shapes, groups: tuple[OpGroup, ...]) -> tuple[Kernel, ...]:
    """hook_add of each wgrad of `groups`: one entry a weight size (none with the fusion)."""
    adds = (hook_add(sh, k) for g in groups for k in g.kernels() if k.name.endswith(".wgrad"))
    return tuple(dict.fromkeys(a for a in adds if a is not None))


INTO_MAIN_GRAD = "into_main_grad"  # the embedding's dim: the lookup adds its rows into main_grad, no dense gradient


def into_main_grad(k: Kernel) -> bool:
    """An embedding kernel of this engine's lookup that adds its rows into main_grad (bytes, host recipe)."""
    return dict(k.dims).get(INTO_MAIN_GRAD) == 1


def embedding(sh: Shapes) -> Passes:
    """The word embedding's lookup and its gradient: the rows added into main_grad by the lookup itself (this
    engine), or dense and added into main_grad by DDP's hook (Megatron-LM, and this engine's runs before)."""
    fused = {INTO_MAIN_GRAD: 1} if sh.embedding_into_main_grad else {}
    return passes("embedding", tokens=sh.tokens, vocab=sh.vocab, hidden=sh.hidden, **fused)


def head(sh: Shapes) -> HeadOps:
    """Megatron-LM's own layers compute the loss in fp32 (vocab_parallel_cross_entropy, megatron.py)."""
    loss = (fp32_cross_entropy(sh) if sh.megatron is not None
            else passes("cross_entropy", tokens=sh.tokens, vocab=sh.vocab))
    return HeadOps(output_layer=linear("output_layer", sh.tokens, sh.vocab, sh.hidden, fp8=sh.fp8_output_layer),
                   cross_entropy=loss)


def optimizer_rate(sh: Shapes) -> Rate:
    foreach = sh.megatron is not None and sh.megatron.foreach_optimizer
    return Rate(OPTIMIZER_STEP_FOREACH if foreach else OPTIMIZER_STEP, sh.dtype)


def rank_ops(sh: Shapes, first_stage: bool, last_stage: bool) -> RankOps:
    layer, last = layer_ops(sh), head(sh) if last_stage else None
    return RankOps(shapes=sh, layer=layer, embedding=embedding(sh) if first_stage else None, head=last,
                   optimizer=optimizer_rate(sh), grad_buffer=Rate(GRAD_BUFFER_ZERO, sh.grad_dtype),
                   main_grad_adds=unfused_wgrad_adds(sh, (layer,) if last is None else (layer, last)))

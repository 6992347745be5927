"""What --cuda-graph-impl local keeps allocated on a rank from the capture on (engine/transformer/cuda_graphs.py);
docs/formulas.md, "CUDA graphs", derives it.

torch.cuda.make_graphed_callables keeps, for each graphed layer, four tensors of the layer's input shape [s, b, h]:
its sample input and its static gradient output (allocated before the captures), its static output and the
gradient of its input (in the graphs' pool); and one gradient per parameter, which its backward returns: the norms'
weights' gradients and, for each linear weight, the placeholder of the weight's shape that gradient-accumulation
fusion hands autograd (the GEMM added the gradient into main_grad). The warm-up passes run on a side stream and the
captures on another; cuBLAS and cuBLASLt give each stream a workspace of its own through the caching allocator,
which stays allocated: two more sets of the device's workspaces.

The layers' saved activations live in the pool too, in blocks the allocator counts as free once the captures are
done (the backward's capture released them; each replay writes them again): they are in no memory_allocated figure,
so a graphed layer adds nothing to the saved activations of the peak (activations.chunk_activation_bytes).
"""
from __future__ import annotations

from common.config import RunConfig
from common.ops.sizes import local_seq_length
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.params import params_per_layer

WORKSPACE_STREAMS = 2  # the warm-up's side stream and the capture stream
STATIC_TENSORS = "CUDA graphs: each layer's static input, output and their gradients"
PARAMETER_GRADS = "CUDA graphs: each layer's parameter gradients (linear weights' placeholders)"
STREAM_WORKSPACES = "CUDA graphs: the warm-up and capture streams' cuBLAS / cuBLASLt workspaces"


def graph_bytes(cfg: RunConfig, workspaces: int = 0) -> dict[str, int]:
    """The graphs' allocated bytes on a rank by term (none for an eager run); workspaces: the device's allocator
    workspaces of one stream (peak_memory.persistent_bytes' figure)."""
    if not cfg.implementation.graphed_layers:
        return {}
    m, a = cfg.model, DTYPE_BYTES[cfg.train.params_dtype]
    layers = m.num_layers  # check_cuda_graphs: no pipeline, so every layer is on this rank
    hidden = a * local_seq_length(cfg) * cfg.train.micro_batch_size * m.hidden_size
    terms = {STATIC_TENSORS: layers * 4 * hidden, PARAMETER_GRADS: layers * a * params_per_layer(m),
             STREAM_WORKSPACES: WORKSPACE_STREAMS * workspaces}
    return {name: n for name, n in terms.items() if n}

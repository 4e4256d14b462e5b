"""Output-discarding recompute: free an activation after its consumers saved it, recompute it
just before their backward needs it (Megatron-core's ``CheckpointWithoutOutput``, in pure PyTorch).

Usage (Megatron style)::

    ckpt = CheckpointWithoutOutput(name="input_layernorm")
    h = ckpt.checkpoint(norm, x)             # norm runs without a graph; only x is saved
    y = qkv(h)                               # qkv saves h itself (save_original_input=True)
    ckpt.discard_output_and_register_recompute(y)   # h's storage is freed now

When the gradient reaches ``y`` (before ``qkv``'s backward reads ``h``), ``norm`` is re-run on
the saved ``x`` with the forward's RNG state (CPU, CUDA, Megatron's CUDA RNG tracker), FP8
region and torch autocast state, and the result is copied into the *very storage* ``qkv``
saved. Gradients then flow to ``x`` and to ``norm``'s parameters as if nothing was discarded
(bitwise: same kernels, same inputs, same dropout masks). ``recompute_discarding_output`` is
the functional form.

Contract (what this module checks, and the errors it raises):

- **Consumers must save the original.** A discard only frees memory when every consumer saved
  the output *itself*. Any module (ours, parallel wrappers, user modules) that has a
  ``save_original_input`` attribute and receives the output while it is set to False makes the
  discard raise ``MissingSaveOriginalInputError`` naming that module and the fix. We never flip
  the flag behind the user's back, and we check it even with FP8 off (where the linear saves its
  input anyway): a model must not start failing at the moment FP8 is switched on.
- **No reads of a discarded output.** The outputs are returned as a thin tensor subclass; any
  torch op on one (or on a view of one) between discard and recompute raises
  ``DiscardedOutputError`` naming the checkpointed module, the op and, for module calls, the
  reading module -- instead of a storage-size error or a crash. Ops run on plain aliases, so no
  kernel or consumer ever holds the subclass; the guard covers forward reads. A backward that
  reads the output before the hook fired cannot be checked: hook a tensor downstream of every
  consumer (the blocks in ``megatron_fp8.blocks`` do).
- **At most one recompute per step**; hooks on several tensors recompute on the first to fire.
- **No leaks**: saved inputs live in the autograd graph only; a step whose backward never
  reaches the hook frees them with the graph (the checkpoint drops its own references at once
  when no hook tensor needs grad).
- **Evaluation**: under ``torch.no_grad()`` ``checkpoint`` just calls ``fn`` and the discard is
  a no-op.

``checkpoint_layers`` is the plain activation checkpoint (whole layers, MLPs) in the same
environment: megatron-core's full and module recompute under FP8 without Transformer Engine.

Delayed scaling inside ``fn`` (e.g. the MLA up-projection): the recompute casts with the scales
the forward used and records no amax, so a recompute running after later micro-batches' forwards
(pipelining) still reproduces the forward bitwise and leaves the amax history untouched.
"""

from .core import CheckpointWithoutOutput, recompute_discarding_output
from .guard import DiscardedOutputError, MissingSaveOriginalInputError
from .layers import checkpoint_layers

__all__ = [
    "CheckpointWithoutOutput",
    "DiscardedOutputError",
    "MissingSaveOriginalInputError",
    "checkpoint_layers",
    "recompute_discarding_output",
]

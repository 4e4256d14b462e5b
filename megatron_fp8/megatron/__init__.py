"""megatron-core glue: GPT layer specs whose linears are megatron_fp8's, and the FP8 region
built from Megatron's ``fp8*`` settings. The only subpackage (with ``parallel/_mcore.py``) that
imports megatron-core, and only when a function here is called.

* ``get_gpt_layer_spec`` / ``get_gpt_block_spec`` / ``to_fp8_spec`` (``specs.py``): megatron-core
  specs (a block spec for sequence parallelism: its final norm is ours too).
* ``fp8_context`` / ``recipe_from_megatron`` (``fp8.py``): ``fp8_autocast`` from a Megatron
  ``TransformerConfig`` (or Megatron-LM ``args``); needs megatron-core only for the default
  amax-reduction group.
"""

from .fp8 import fp8_context, recipe_from_megatron
from .specs import get_gpt_block_spec, get_gpt_layer_spec, to_fp8_spec

__all__ = ["get_gpt_layer_spec", "get_gpt_block_spec", "to_fp8_spec", "fp8_context", "recipe_from_megatron"]

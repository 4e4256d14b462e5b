"""``python -m megatron_fp8.megatron.launch SCRIPT [ARGS...]``: run a Megatron-LM script (e.g.
``pretrain_gpt.py``) as ``__main__`` with the plug-in installed first.

Without Transformer Engine, always start Megatron-LM this way: megatron-core checks its
``TransformerConfig`` against TE before Megatron-LM imports ``--spec``, and rejects or mis-checks
several configurations there: MoE with ``--fp8-format`` (it asks for TE >= 1.7; ``compat.py`` says
how the plug-in validates it instead), ``--fp8-format`` with ``--recompute-modules layernorm`` or
``moe_act`` (TE's version is compared, or delayed scaling is refused for TE's reasons), and RoPE
fusion (Megatron-LM's default; ``rope.py`` fills the slot megatron-core's config checks). Under torchrun:
``torchrun --nproc_per_node 8 -m megatron_fp8.megatron.launch pretrain_gpt.py --spec
megatron_fp8.megatron.plugin layer_spec ...``.

``--count-gemms`` (before SCRIPT): at exit, each rank prints how many FP8 GEMMs ran and on which
backend (native cuBLAS, our Triton kernels, emulated): proof that a run was FP8 end to end; and
how many FP8 layer forwards the lean eager path served against the general one (``ops.paths``).
"""

from __future__ import annotations

import atexit
import collections
import os
import runpy
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..gemm import GemmCall


def _kind(call: GemmCall) -> str:
    """Which kernel ran a recorded GEMM: ``cublaslt`` / ``triton`` from the name's last bracket
    (``"wgrad[3][cublaslt]"``: expert 3's wgrad), else the backend (``native``: torch's
    ``scaled_mm``; ``emulate``)."""
    last = call.name.rpartition("[")[2].rstrip("]")
    return last if last in ("cublaslt", "triton") else call.backend.value


class _Tally:
    """What ``--count-gemms`` keeps of a recorded GEMM: its kernel's count. A list of the calls
    would grow by every GEMM of every step for the whole run (long-lived objects that Python's
    collector walks again and again)."""

    def __init__(self) -> None:
        self.kinds: collections.Counter[str] = collections.Counter()

    def append(self, call: GemmCall) -> None:
        self.kinds[_kind(call)] += 1


def _count_gemms() -> None:
    """Count every FP8 GEMM of the run per kernel; print the counts at exit."""
    from .. import gemm
    from ..ops import paths

    tally_of = _Tally()
    recording, counting = gemm.record_gemms(tally_of), paths.count_paths()
    recording.__enter__()  # open for the whole process (the references keep them open)
    forwards = counting.__enter__()

    def tally(counts: collections.Counter[str]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"

    def report() -> None:
        rank = os.environ.get("RANK", "0")
        kinds = tally_of.kinds
        print(f"megatron_fp8 [rank {rank}]: {sum(kinds.values())} FP8 GEMMs ({tally(kinds)})", flush=True)
        print(f"megatron_fp8 [rank {rank}]: {sum(forwards.values())} FP8 layer forwards ({tally(forwards)})",
              flush=True)

    atexit.register(report)
    _keep.extend((recording, counting))


_keep: list[object] = []


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--count-gemms":
        args = args[1:]
        _count_gemms()
    if not args or not args[0].endswith(".py"):
        raise SystemExit("usage: python -m megatron_fp8.megatron.launch [--count-gemms] SCRIPT.py [ARGS...] "
                         "(e.g. pretrain_gpt.py from a Megatron-LM checkout)")
    script = os.path.abspath(args[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_fp8.megatron.launch: {args[0]} does not exist")
    from . import plugin

    plugin.install()  # (importing it installs it too; again here if it was imported earlier)

    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` would: its folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

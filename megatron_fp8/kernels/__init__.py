"""Every GPU kernel of the package and its launcher, in one place (imported only where a GPU path
runs; Triton is not needed otherwise):

========================  =====================================================================
module                    kernels
========================  =====================================================================
``triton_cast``           the tile casts (rowwise + transposed columnwise copies and scales)
``triton_persistent``     current scaling's one-launch cast (amax, scale and cast)
``triton_scale``          amaxes, scales, delayed scaling's per-step state
``triton_tiles``          what the two cast kernels share (tiles, quantization, lookups)
``cuda_cast``             the CUDA C tile cast (``cuda_cast.cu``, built by NVRTC at first use)
``triton_grouped``        the experts' grouped FP8 GEMMs, and HYBRID block GEMMs with one group
``triton_launch``         launching Triton kernels without Triton's per-call host cost
``cublaslt``              cuBLASLt called directly for the block GEMMs with an E5M2 operand
========================  =====================================================================

The quantizers reach the casts through ``quant.kernels`` (which picks a kernel or the
reference); the GEMM core reaches the grouped GEMMs.
"""

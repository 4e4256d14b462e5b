#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py, unmodified, training with megatron_fp8's FP8 layers on mock data.
#
#   MEGATRON_LM=~/Megatron-LM bash examples/megatron_lm/pretrain_gpt_fp8.sh [dense-1b|moe] [RECIPE] [ARGS...]
#
# RECIPE: tensorwise (default), blockwise, delayed or mxfp8 (mxfp8 is emulated below Blackwell).
# ARGS go to pretrain_gpt.py after ours (e.g. --recompute-granularity selective --recompute-modules
# layernorm). GPUS (default 1) sets the processes per node; MEGATRON_FP8_CONFIG, if set, names
# the YAML of per-layer save_original_input rules (examples/megatron_lm/flags.yaml).
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM)}"
model=${1:-dense-1b}; recipe=${2:-tensorwise}; shift $(( $# < 2 ? $# : 2 ))
format=hybrid  # E4M3 weights/activations, E5M2 gradients: what Megatron users pass with every recipe
[ "$recipe" = mxfp8 ] && format=e4m3

case $model in
  dense-1b) MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
                   --group-query-attention --num-query-groups 8) ;;
  moe) MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
              --group-query-attention --num-query-groups 8 --num-experts 16 --moe-router-topk 4
              --moe-ffn-hidden-size 1024 --moe-shared-expert-intermediate-size 2048 --moe-grouped-gemm
              --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2) ;;
  *) echo "model: dense-1b or moe, not $model" >&2; exit 2 ;;
esac

# The plug-in is the --spec below; starting through megatron_fp8.megatron.launch installs it before
# megatron-core validates the config, which it must for MoE (or layernorm / moe_act recompute) with
# --fp8-format and no Transformer Engine, and for Megatron's RoPE fusion (on by default; the plug-in's
# kernel when TE is absent). --count-gemms prints the FP8 GEMMs per backend at exit. Megatron's default
# --gradient-accumulation-fusion stays on: our linears add their wgrad into main_grad without apex (the
# plug-in builds megatron-core's own output layer unfused where apex is missing, and says so); pass
# --no-gradient-accumulation-fusion to turn ours off too.
PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1 \
torchrun --standalone --nproc_per_node "${GPUS:-1}" -m megatron_fp8.megatron.launch --count-gemms \
  "$MEGATRON_LM/pretrain_gpt.py" \
  --spec megatron_fp8.megatron.plugin layer_spec \
  --fp8-format "$format" --fp8-recipe "$recipe" \
  "${MODEL[@]}" \
  --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 \
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
  --untie-embeddings-and-output-weights --bf16 --transformer-impl local \
  --no-masked-softmax-fusion --no-bias-swiglu-fusion \
  --no-bias-dropout-fusion --no-persist-layer-norm --attention-softmax-in-fp32 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --train-iters 50 --log-interval 10 --eval-iters 0 --eval-interval 1000000 \
  --lr 1e-4 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 --seed 1234 \
  "$@"

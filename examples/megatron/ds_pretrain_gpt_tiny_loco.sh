#!/usr/bin/env bash
# A tiny GPT pre-trained by Megatron-DeepSpeed's own, unmodified pretrain_gpt.py under DeepSpeed ZeRO-3 with
# qgZ (zero_quantized_gradients) and LoCo (zeropp_loco_param), launched through deepspeed-loco's module runner.
# Shaped like run_deepspeed_example.sh in Megatron-DeepSpeed's own repository; see docs/frameworks.md.
#
#   pip install -r examples/megatron/requirements.txt   # what Megatron imports (six, pybind11, regex, ...)
#   MEGATRON=/path/to/Megatron-DeepSpeed bash examples/megatron/ds_pretrain_gpt_tiny_loco.sh [extra pretrain_gpt.py args]
#
# Environment (defaults in brackets): MEGATRON (required), NUM_GPUS [1], TRAIN_ITERS [20], OUTPUT_DIR
# [megatron_loco_out], DATA_PATH [$OUTPUT_DIR/data/tiny_text_document, written offline by make_data.py if absent],
# NLAYERS [2], HIDDEN [128], HEADS [4], SEQ_LEN [128], MICRO_BATCH [4], VOCAB_SIZE [1024], BF16 [0],
# LOCO_BITS [4], ERROR_FEEDBACK [false], GROUP_SIZE [256], ERR_BETA [0.8], RESET_T [1024], MASTER_PORT [29500],
# DRY_RUN [0: 1 writes the DeepSpeed config and prints the command without running it].
# CPU only: DS_ACCELERATOR=cpu NUM_GPUS=2 starts 2 gloo processes (tests/unit/test_megatron_example.py).
# The defaults are the README's recommended 4/4 config: plain qgZ through this library's reduce, no error buffers
# (LoCo did not pay at 4 bits in any window measured: docs/when_loco_pays.md). LoCo's error feedback:
# ERROR_FEEDBACK=true, advised at 2 bits for models up to ~10M parameters (LOCO_BITS=2 ERROR_FEEDBACK=true).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
: "${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}"
MEGATRON=$(cd "$MEGATRON" && pwd)

NUM_GPUS=${NUM_GPUS:-1}
TP=1
PP=1
NLAYERS=${NLAYERS:-2}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
SEQ_LEN=${SEQ_LEN:-128}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=$(( MICRO_BATCH * NUM_GPUS ))
TRAIN_ITERS=${TRAIN_ITERS:-20}
VOCAB_SIZE=${VOCAB_SIZE:-1024}
ZERO_STAGE=3
LOCO_BITS=${LOCO_BITS:-4}
ERROR_FEEDBACK=${ERROR_FEEDBACK:-false}
GROUP_SIZE=${GROUP_SIZE:-256}
ERR_BETA=${ERR_BETA:-0.8}
RESET_T=${RESET_T:-1024}
BF16=${BF16:-0}

OUTPUT_DIR=${OUTPUT_DIR:-megatron_loco_out}
mkdir -p "$OUTPUT_DIR"
OUTPUT_DIR=$(cd "$OUTPUT_DIR" && pwd)
DATA_PATH=${DATA_PATH:-$OUTPUT_DIR/data/tiny_text_document}
DS_CONFIG=$OUTPUT_DIR/ds_config_z${ZERO_STAGE}_qgz_loco.json

if [ "$BF16" = 1 ]; then bf16=true; precision_args="--bf16"; else bf16=false; precision_args=""; fi
cat <<EOT > "$DS_CONFIG"
{
  "train_batch_size": $GLOBAL_BATCH,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH,
  "steps_per_print": 1,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE,
    "zero_quantized_gradients": true,
    "zeropp_loco_param": {
      "err_beta": $ERR_BETA,
      "reset_T": $RESET_T,
      "intra_node_bits": $LOCO_BITS,
      "inter_node_bits": $LOCO_BITS,
      "group_size": $GROUP_SIZE,
      "error_feedback": $ERROR_FEEDBACK
    }
  },
  "bf16": {"enabled": $bf16},
  "wall_clock_breakdown": false
}
EOT

ds_args=""
ds_args=" --deepspeed ${ds_args}"
ds_args=" --no-pipeline-parallel ${ds_args}"  # GPTModel, not GPTModelPipe: ZeRO-3 does not combine with DeepSpeed's pipeline engine
ds_args=" --deepspeed_config=$DS_CONFIG ${ds_args}"
ds_args=" --zero-stage=$ZERO_STAGE ${ds_args}"

# Megatron's CUDA kernels it would JIT-build or take from Apex: the unfused PyTorch paths instead
fusion_args="--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion"

# deepspeed.compression.compress (gone from DeepSpeed 0.19, imported by megatron/training.py): compat/sitecustomize.py;
# Apex (imported on CUDA): the real one when importable, else the PyTorch stand-in
pythonpath="$HERE/compat"
if ! python3 -c "import amp_C, fused_layer_norm_cuda" >/dev/null 2>&1; then
    pythonpath="$pythonpath:$HERE/compat/apex_standin"
fi
# torchvision (imported by Megatron's vision modules, unused by pretrain_gpt): the real one when it imports (a wheel
# built for another torch does not: "operator torchvision::nms does not exist"), else the stand-in
if ! python3 -c "import torchvision" >/dev/null 2>&1; then
    pythonpath="$pythonpath:$HERE/compat/torchvision_standin"
fi
export PYTHONPATH="$pythonpath:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

# the `deepspeed` command, as a module (it needs no console script on PATH)
launcher=(python3 -m deepspeed.launcher.runner --num_nodes 1 --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
cmd=("${launcher[@]}" --module deepspeed_loco.run "$MEGATRON/pretrain_gpt.py"
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size $PP
    --num-layers "$NLAYERS"
    --hidden-size "$HIDDEN"
    --num-attention-heads "$HEADS"
    --seq-length "$SEQ_LEN"
    --max-position-embeddings "$SEQ_LEN"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 1.0e-3
    --min-lr 1.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 2
    --log-interval 1
    --eval-iters 1
    --eval-interval 1000000
    --save-interval 1000000
    --data-path "$DATA_PATH"
    --data-impl mmap
    --tokenizer-type NullTokenizer
    --vocab-size "$VOCAB_SIZE"
    --split 98,2,0
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    $precision_args
    $fusion_args
    $ds_args
    "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "DS_CONFIG=$DS_CONFIG"
    echo "PYTHONPATH=$PYTHONPATH"
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
if [ ! -f "$DATA_PATH.bin" ]; then
    python3 "$HERE/make_data.py" --megatron "$MEGATRON" --out "${DATA_PATH%_text_document}" --vocab-size "$VOCAB_SIZE"
fi
cd "$OUTPUT_DIR"
"${cmd[@]}"

#!/usr/bin/env bash
# Quantize a model too large for one node: 2 nodes of 8 GPUs, one rank per GPU (NCCL). Run this same script on
# every node, with HOST set to the first node's address; MODEL_DIR, OUT_DIR and CKPT_DIR on a filesystem every node
# sees. shardcal reads RANK / WORLD_SIZE / LOCAL_RANK from torchrun; each rank reads only its own slice of the
# checkpoint. The checkpoint directory makes the run resumable after a failure, also on another number of ranks.
#
#   HOST=node0 NNODES=2 NPROC=8 examples/multinode.sh MODEL_DIR OUT_DIR CKPT_DIR [calib.jsonl]
set -euo pipefail
model_dir=$1 out_dir=$2 ckpt_dir=$3 data=${4:-}
shardcal plan "$model_dir" --recipe fp8-dynamic --world-size $(( ${NNODES:-2} * ${NPROC:-8} ))
torchrun --nnodes "${NNODES:-2}" --nproc-per-node "${NPROC:-8}" --rdzv-backend c10d \
    --rdzv-endpoint "${HOST:?set HOST to the first node}:${PORT:-29500}" --rdzv-id "${JOB_ID:-shardcal}" \
    examples/fp8_for_vllm.py "$model_dir" "$out_dir" --checkpoint-dir "$ckpt_dir" ${data:+--data "$data"}

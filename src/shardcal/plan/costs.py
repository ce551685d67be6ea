"""The planner's cost constants, in one place: what the code holds beyond the exact sizes of its tensors (the copies
an operation makes, the temporaries per element of a weight or per token, a fixed runtime allowance).

Every other figure of a plan is an exact function of the shapes. The constants were fitted to the peaks of the code
itself, on float32 and bfloat16 weights. What measures them: ``benchmarks/plan_accuracy.py`` runs whole
calibrations and holds each rank's measured peak to the plan those constants add up to (the constants of one batch
through a layer, of the weights and their quantizers, of the process and of ``[rotation] residual``); the
checkpoint constants are held to the bytes a real ``--checkpoint-dir`` holds by ``tests/plan/test_plan.py``. The
algorithms' own constants live with their memory models (:mod:`shardcal.algorithms.memory` and each algorithm's
module).
"""

from __future__ import annotations

MiB = 2**20

# ------------------------------------------------------------------------------------ the process

#: Per process, beyond its tensors (module objects, FSDP2 state, thread pools): a base and an amount per decoder layer.
RUNTIME_BASE_BYTES = 34 * MiB
RUNTIME_PER_LAYER_BYTES = MiB // 10

# ------------------------------------------------------------------------------------ one batch through a layer

#: The largest intermediates of one batch through a decoder layer, in float32 elements per token: the MLP holds
#: this many hidden- and intermediate-sized tensors at its widest, attention this many hidden- and query-sized ones.
FORWARD_MLP_HIDDEN, FORWARD_MLP_INTERMEDIATE = 3, 3
FORWARD_ATTN_HIDDEN, FORWARD_ATTN_QUERY = 2, 6
#: A sparse layer's router, in float32 elements per token and expert (its logits and routing weights).
ROUTER_PER_EXPERT = 2
#: Attention with an explicit mask (a sliding window shorter than the sequence): bytes per query-key pair, per head
#: (the float32 scores) and once (the boolean mask).
MASKED_SCORE_BYTES_PER_HEAD, MASK_BYTES = 4, 1
#: A Linear that rotates its inputs holds the rotated copy and one butterfly round's result beside its input
#: (float32 elements per token and input feature).
ROTATION_COPIES = 2
#: Embedding a batch: bytes per token and ``head_dim`` element of the rotary tables computed with it (float32 angles,
#: cos and sin), beside the hidden states.
EMBED_ROTARY_BYTES = 12
#: The layer-output SQNR of one batch: float64 copies of the output, the reference and their difference (bytes per
#: element of the batch's hidden states, beside the output itself).
SQNR_BYTES = 32

# ------------------------------------------------------------------------------------ weights and their quantizers

#: Bytes per weight element of the temporaries of an operation, by observer or number-format kind: the observer
#: calibrating a weight's scales (``max``: one copy in the weight's dtype); fake-quantizing a weight in a forward;
#: encoding it for export (the encoded tensors included).
OBSERVER_BYTES = {"mse": 22, "percentile": 44}
FAKE_QUANT_BYTES = {"int": 9, "fp8": 9, "nvfp4": 25, "mx": 13}
ENCODE_BYTES = {"int": 20, "fp8": 9, "nvfp4": 25, "mx": 16}
#: What fake-quantizing or encoding a weight that is not float32 adds per element (its float32 copy).
NOT_FLOAT32_BYTES = 4

# ------------------------------------------------------------------------------------ before and after the layers

#: ``[rotation] residual``: float64 copies of a weight while it is rotated (the value, the signed copy, the work
#: buffers of the transforms), and float32 copies of the probe's logits (before, after, their difference).
RESIDUAL_WEIGHT_COPIES, PROBE_LOGIT_COPIES = 4, 3
#: A checkpoint commit's metadata per tensor it holds for each finished layer (a changed weight, a quantizer's
#: state): its safetensors header entry and its lines in the manifest (the listing, the layer report).
CHECKPOINT_ENTRY_BYTES = 512
#: A checkpoint commit's fixed metadata per rank (an allowance: its manifest's and files' headers).
CHECKPOINT_RANK_BYTES = 4096

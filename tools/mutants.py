"""The mutation check's catalogue: small, deliberate breaks of the core modules, each a claim of the docs.

``Mutant(id, module, old, new, description)`` replaces the text ``old`` (which must occur exactly once in
``src/shardcal/<module>``) by ``new``. ``break-*`` are the audit's breaks (docs/testing.md, "The audit's breaks").
``harmless`` gives the reason a mutant cannot be caught and does not matter; ``tests`` overrides the module's test
set (tools/mutation.py, ``TESTS``); ``line`` pins ``old`` to one line (the mechanical operator mutants of ``--all``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    old: str
    new: str
    description: str
    harmless: str = ""
    tests: tuple[str, ...] | None = None
    line: int | None = None  # operator mutants: ``old`` is this (1-based) line, which may occur elsewhere too


CATALOGUE: list[Mutant] = [
    # ------------------------------------------------------------------ the audit's breaks (docs/testing.md)
    Mutant(
        "break-1",
        "models/checkpoint.py",
        "            return tensor_slice[start:stop]\n",
        "            return self.get(key)[start:stop]\n",
        "the checkpoint reader reads each whole tensor, then slices it",
    ),
    Mutant(
        "break-2a",
        "layerwise/batches.py",
        "    return Batch(ids_out, None if bool(mask_out.all()) else mask_out)\n",
        "    return Batch(ids_out, None)\n",
        "batching drops the padding mask",
    ),
    Mutant(
        "break-2b",
        "quant/quantizer.py",
        "self._observer.observe(real_positions(x), self._pass)",
        "self._observer.observe(x, self._pass)",
        "activation observers count padded positions",
    ),
    Mutant(
        "break-2c",
        "layerwise/steps.py",
        "with torch.no_grad(), real_tokens_of(x.token_mask):",
        "with torch.no_grad(), real_tokens_of(None):",
        "a layer step never declares the batch's token mask (observers and algorithm statistics see padding)",
    ),
    Mutant(
        "break-3",
        "layerwise/steps.py",
        '            if propagate == "qdq" or step.outputs is None:\n',
        "            if step.outputs is None:\n",
        'propagate="qdq" reuses the full-precision outputs of the observing pass',
    ),
    Mutant(
        "break-4a",
        "layerwise/moe.py",
        "        for q in silenced:\n            q.mode = QuantMode.DISABLED\n",
        "        for q in silenced:\n            q.mode = QuantMode.COLLECT\n",
        "all-experts mode does not silence the experts during the routed pass (tokens counted twice)",
    ),
    Mutant(
        "break-4b",
        "layerwise/moe.py",
        "amax = torch.stack([s.amax for s in seen]).amax(dim=0)",
        "amax = torch.stack([s.amax for s in seen]).amin(dim=0) / 2",
        "dead-expert fallback: half the siblings' minimum instead of their maximum",
    ),
    Mutant(
        "break-5",
        "calib/runner.py",
        "fingerprinted = options.fingerprint() | (",
        "fingerprinted = {} | (",
        "the resume fingerprint ignores the run's options",
    ),
    # ------------------------------------------------------------------ reading checkpoints, sharded loading
    Mutant(
        "ckpt-index-key",
        "models/checkpoint.py",
        "        if key not in self._file_keys[file]:\n",
        "        if False:\n",
        "a key the index lists but its shard lacks is not reported",
    ),
    Mutant(
        "ckpt-outside",
        "models/checkpoint.py",
        "        if file.parent != root:\n",
        "        if False:\n",
        "an index entry pointing outside the model directory is accepted",
    ),
    Mutant(
        "sharded-full-then-rows",
        "loading/sharded.py",
        "                    rows = source.rows(reader, start, stop)\n",
        "                    rows = source.full(reader)[start:stop]\n",
        "the sharded loader reads each parameter whole and keeps its rows",
    ),
    Mutant(
        "sharded-counter",
        "loading/sharded.py",
        "                    read += rows.numel() * rows.element_size()\n",
        "                    read += rows.numel()\n",
        "bytes_read counts elements, not bytes",
    ),
    Mutant(
        "sources-all-experts",
        "loading/sources.py",
        "        return torch.stack([torch.cat([reader.get(k) for k in self.parts[e]]) for e in range(start, stop)])\n",
        "        every = [torch.cat([reader.get(k) for k in part]) for part in self.parts]\n"
        "        return torch.stack(every)[start:stop]\n",
        "fused experts: every expert read, then the rank's experts kept",
    ),
    Mutant(
        "fsdp-local-rows",
        "sharding/fsdp2.py",
        "    return offset[0], offset[0] + shape[0]\n",
        "    return 0, shape[0]\n",
        "local_rows: every rank thinks it holds the first rows",
    ),
    Mutant(
        "fsdp-sync",
        "sharding/fsdp2.py",
        "                    local.copy_(full[start:stop].to(local.dtype))\n",
        "                    pass\n",
        "weight edits of a gathered layer are not written back into the shards",
    ),
    Mutant(
        "fsdp-reshard",
        "sharding/fsdp2.py",
        "    layer.set_reshard_after_forward(False, recurse=False)\n    try:",
        "    layer.set_reshard_after_forward(True, recurse=False)\n    try:",
        "layer_unsharded reshards after every call (one gather per forward, not per step)",
    ),
    # ------------------------------------------------------------------ batches and padding
    Mutant(
        "batch-given-mask",
        "layerwise/batches.py",
        "        mask_out[i, : ids.numel()] = 1 if mask is None else mask\n",
        "        mask_out[i, : ids.numel()] = 1\n",
        "a mask given with the data is ignored (every position of a row counts)",
    ),
    Mutant(
        "batch-rank-blocks",
        "layerwise/batches.py",
        "    start = rank * base + min(rank, extra)\n",
        "    start = rank * base\n",
        "ranks' batch blocks overlap when the batches do not divide evenly",
    ),
    Mutant(
        "batch-fingerprint-mask",
        "layerwise/batches.py",
        "        if batch.attention_mask is not None:\n            digest.update(",
        "        if False:\n            digest.update(",
        "the data fingerprint ignores the padding mask",
    ),
    Mutant(
        "batch-vocab-bound",
        "layerwise/batches.py",
        "(vocab_size is not None and high >= vocab_size)",
        "(vocab_size is not None and high > vocab_size)",
        "a token id equal to the vocabulary size is accepted",
    ),
    Mutant(
        "tokens-dense",
        "quant/tokens.py",
        "    if x.dim() > mask.dim() and tuple(x.shape[: mask.dim()]) == tuple(mask.shape):\n        return x[mask.to(x.device)]\n",
        "    if x.dim() > mask.dim() and tuple(x.shape[: mask.dim()]) == tuple(mask.shape):\n        return x\n",
        "dense activations [B, L, ...] keep their padded positions",
    ),
    Mutant(
        "tokens-flat",
        "quant/tokens.py",
        "    if x.dim() >= 1 and x.shape[0] == flat.numel():\n        return x[flat.to(x.device)]\n",
        "    if x.dim() >= 1 and x.shape[0] == flat.numel():\n        return x\n",
        "flattened tokens [B*L, ...] (all-experts mode) keep their padded positions",
    ),
    Mutant(
        "tokens-subset",
        "quant/tokens.py",
        "        return x[subset.to(x.device)]\n",
        "        return x\n",
        "an expert's routed tokens keep their padded positions",
    ),
    Mutant(
        "moe-routed-mask",
        "layerwise/moe.py",
        "            self.real[id(expert)] = mask.to(token.device)[token]\n",
        "            self.real[id(expert)] = torch.ones_like(token, dtype=torch.bool)\n",
        "routed experts: every routed token counts as real",
    ),
    Mutant(
        "moe-fallback-off",
        "calib/runner.py",
        "    fallbacks = fallback_unobserved(step.layer)\n",
        "    fallbacks = []\n",
        "experts that saw no token keep amax 0 (no fallback)",
    ),
    Mutant(
        "experts-fused-all",
        "quant/experts.py",
        "        chosen = real if all_tokens else real & (index.reshape(x.shape[0], -1) == e).any(dim=-1)\n",
        "        chosen = real\n",
        "fused experts: every expert observes every token, also in routed mode",
    ),
    Mutant(
        "experts-block-input",
        "quant/experts.py",
        "    amax = torch.stack([q.amax for q in quantizers]).amax(dim=0)\n    return fake_quantize(",
        "    amax = quantizers[0].amax\n    return fake_quantize(",
        "fused experts: the block input is quantized with expert 0's range, not the largest",
    ),
    # ------------------------------------------------------------------ the layer runner
    Mutant(
        "runner-weights-fp",
        "calib/runner.py",
        "        q.mode = QuantMode.DISABLED  # the observing passes run the layer in full precision\n",
        "        q.mode = QuantMode.QUANTIZE  # the observing passes run the layer in full precision\n",
        "the observing pass runs with quantized weights",
    ),
    Mutant(
        "batches-sqnr-tokens",
        "layerwise/batches.py",
        "        while rows < len(per_row) and held < tokens:\n",
        "        while rows < len(per_row) and held <= tokens:\n",
        "the SQNR sample takes one sequence more when its tokens are exactly sqnr_tokens",
    ),
    Mutant(
        "runner-sqnr-whole-batch",
        "calib/runner.py",
        "        quantized = step.forward(i, rows).to(fp_outputs[i].device).double()\n",
        "        quantized = step.forward(i)[:rows].to(fp_outputs[i].device).double()\n",
        "the SQNR pass runs the whole batch its sample rows are in",
    ),
    Mutant(
        "steps-head-calls",
        "layerwise/steps.py",
        "            x = head.with_hidden(x.hidden_states[:rows])\n",
        "            x = x.with_hidden(x.hidden_states[:rows])\n",
        "a batch's first rows run with the whole batch's arguments (masks, rotary tables)",
    ),
    Mutant(
        "runner-sqnr-padding",
        "calib/runner.py",
        "        real = None if step.inputs[i].token_mask is None else step.inputs[i].token_mask[:rows]\n",
        "        real = None\n",
        "the layer SQNR counts padded positions",
    ),
    Mutant(
        "runner-sqnr-noise",
        "calib/runner.py",
        "        sums[1] += (quantized - reference).pow(2).sum().cpu()\n",
        "        sums[1] += (quantized - reference).abs().sum().cpu()\n",
        "the SQNR's noise is a sum of absolute errors",
    ),
    Mutant(
        "runner-checkpoint-every",
        "calib/runner.py",
        "step.index % options.checkpoint_every == 0",
        "step.index % 1 == 0",
        "checkpoint_every is ignored (a commit after every layer)",
    ),
    Mutant(
        "runner-expert-masks",
        "calib/runner.py",
        "        with moe if moe is not None else contextlib.nullcontext(), ExpertTokenMasks(step.layer), counting:\n",
        "        with moe if moe is not None else contextlib.nullcontext(), counting:\n",
        "routed MoE experts see their padded tokens",
    ),
    Mutant(
        "runner-resume-restore",
        "calib/runner.py",
        "    restore_weights(model, resume.weights)\n",
        "    pass\n",
        "resume does not restore weights that an algorithm changed",
        tests=(
            "tests/algorithms/test_algorithms.py::test_gptq_resume_is_bit_identical",
            "tests/calib/test_calibrate.py",
        ),
    ),
    Mutant(
        "steps-keep-all",
        "layerwise/steps.py",
        "        del step, outputs\n",
        '        globals().setdefault("_kept", []).append(step)\n        del step, outputs\n',
        "every layer's activations stay alive to the end",
    ),
    Mutant(
        "steps-offload-default",
        "layerwise/steps.py",
        '        offload_activations = device.type != "cpu"\n',
        '        offload_activations = device.type == "cpu"\n',
        "activations are offloaded by default on CPU, not on an accelerator",
        harmless="on a CPU-only machine the cache and the layers are both on the CPU, so nothing can tell; the "
        "prepared GPU check (benchmarks/gpu_check.py) runs the accelerator path",
    ),
    Mutant(
        "steps-offload-ignored",
        "layerwise/steps.py",
        '    cache_device = torch.device("cpu") if offload_activations else device\n',
        "    cache_device = device\n",
        "offload_activations=True is ignored",
        harmless="as above: on CPU the cache device is the compute device either way (benchmarks/gpu_check.py)",
    ),
    Mutant(
        "steps-next-inputs",
        "layerwise/steps.py",
        "        inputs = [x.with_hidden(out) for out, x in zip(outputs, inputs)]\n",
        "        inputs = [x.with_hidden(x.hidden_states) for out, x in zip(outputs, inputs)]\n",
        "every layer gets the embeddings as input",
    ),
    # ------------------------------------------------------------------ checkpoint / resume (both kinds' base, calibration's)
    Mutant(
        "ckpt-fingerprint",
        "layerwise/checkpoint.py",
        "            if stored.get(key) != value:\n",
        "            if key == 'world_size' and stored.get(key) != value:\n",
        "only the world size of a checkpoint is checked on resume",
    ),
    Mutant(
        "ckpt-options",
        "calib/checkpoint.py",
        '        "options": digest(options),\n',
        '        "options": digest({}),\n',
        "the checkpoint fingerprint drops the options",
    ),
    Mutant(
        "ckpt-sha",
        "layerwise/checkpoint.py",
        "        if sha256(path) != expected:\n",
        "        if False:\n",
        "a corrupt checkpoint file is used",
    ),
    # ------------------------------------------------------------------ number formats, observers, quantizers
    Mutant(
        "fmt-scale",
        "quant/formats.py",
        "    scale = amax.float() / f.qmax\n",
        "    scale = amax.float() / (f.qmax + 1)\n",
        "int/fp8 scale is amax / (qmax + 1)",
    ),
    Mutant(
        "fmt-int8-qmin",
        "quant/formats.py",
        '"int8": Format("int8", "int", 8, -128.0, 127.0)',
        '"int8": Format("int8", "int", 8, -127.0, 127.0)',
        "int8 clamps at -127",
    ),
    Mutant(
        "fmt-round-half-up",
        "quant/formats.py",
        '    q = scaled.round_() if f.kind == "int" else',
        '    q = scaled.add_(0.5).floor_() if f.kind == "int" else',
        "int rounding is half-up, not half-to-even",
    ),
    Mutant(
        "fmt-e2m1-tie",
        "quant/formats.py",
        "    return x.add_(c).sub_(c).copysign_(c).nan_to_num_(nan=0.0)  # NaN stays NaN through the steps: -> 0.0\n",
        "    return x.nextafter_(c).add_(c).sub_(c).copysign_(c).nan_to_num_(nan=0.0)\n",
        "E2M1: 0.25 rounds up to 0.5 (not to even, 0)",
    ),
    Mutant(
        "reuse-python-callback",
        "quant/reuse.py",
        "        self._ref = weakref.ref(x, self._kept.pop)\n",
        "        self._ref = weakref.ref(x, lambda ref: self._kept.pop(ref))\n",
        "a kept result is dropped by Python code, where a Ctrl-C would be lost with a traceback",
    ),
    Mutant(
        "session-weight-search-owner-only",
        "quant/session.py",
        "        owners[i] = min(range(ranks), key=lambda r: load[r])\n",
        "        owners[i] = 0\n",
        "every searched weight goes to rank 0: the ranks do not share the search",
    ),
    Mutant(
        "session-weight-search-unshared",
        "quant/session.py",
        "            quantizer.set_amax(*merged)\n",
        "            quantizer.set_amax(*[torch.zeros_like(m) for m in merged])\n",
        "a rank that did not search a weight keeps zeros instead of the owner's ranges",
    ),
    Mutant(
        "fmt-e2m1-negative-zero",
        "quant/formats.py",
        "    x.add_(0.0)\n",
        "    pass\n",
        "E2M1: -0.0 keeps its sign (code 8; compressed-tensors gives 0.0)",
    ),
    Mutant(
        "fmt-fp8-scale-eps",
        "quant/formats.py",
        "_FP8_SCALE_EPS = 0.125",
        "_FP8_SCALE_EPS = 0.25",
        "a zero nvfp4 block scale becomes 0.25 (compressed-tensors: 0.125)",
    ),
    Mutant(
        "fmt-pack-offset",
        "quant/formats.py",
        "    v = values.to(torch.int64) + 2 ** (bits - 1)\n",
        "    v = values.to(torch.int64) + 2 ** bits - 1\n",
        "int packing offsets values by 2**bits - 1",
    ),
    Mutant(
        "gran-group-shape",
        "quant/granularity.py",
        "            self.amax_shape = shape[:-1] + (shape[-1] // g,)\n",
        "            self.amax_shape = (shape[-1] // g,)\n",
        "per-group weights get one amax per group of columns, shared by all rows",
    ),
    Mutant(
        "obs-count",
        "quant/observers.py",
        "            self.count += x.numel()\n",
        "            self.count += x.shape[0]\n",
        "observers count rows, not elements",
    ),
    Mutant(
        "obs-pct-cumsum",
        "quant/observers.py",
        "        idx = (counts.cumsum(-1) < target[:, None]).sum(-1).clamp(max=bins - 1)\n",
        "        idx = (counts.cumsum(-1) <= target[:, None]).sum(-1).clamp(max=bins - 1)\n",
        "percentile: the bin after the one holding the percentile",
    ),
    Mutant(
        "obs-pct-edge",
        "quant/observers.py",
        "        amax = (idx + 1).double() / bins * rng\n",
        "        amax = idx.double() / bins * rng\n",
        "percentile: the lower edge of the bin, not its upper edge",
    ),
    Mutant(
        "obs-mse-grid",
        "quant/observers.py",
        "[1.0 - i / grid for i in range(steps + 1)]",
        "[1.0 - i / grid for i in range(steps)]",
        "mse: the smallest candidate (max_shrink) is never tried",
    ),
    Mutant(
        "sq-derived-amax-unsmoothed",
        "algorithms/smoothquant.py",
        "            top = (act / scales[m.key].to(act.device)).max()",
        "            top = act.max()",
        "SmoothQuant's derived input amax ignores the smoothing scales",
    ),
    Mutant(
        "runner-kept-outputs-ignored",
        "calib/runner.py",
        '    if observing or not (propagate == "qdq" or kept):',
        '    if observing or propagate != "qdq":',
        "the observing pass runs although the algorithm kept the layer's outputs",
        tests=("tests/algorithms/test_algorithms.py",),
    ),
    Mutant(
        "obs-mse-argmax",
        "quant/observers.py",
        "        best = self.errors.min(dim=0).indices",
        "        best = self.errors.max(dim=0).indices",
        "mse picks the worst candidate",
    ),
    Mutant(
        "quantizer-state-dict",
        "quant/quantizer.py",
        "            self._calibrated = not any(bool(torch.isnan(t).any()) for t in ranges)\n",
        "            self._calibrated = True\n",
        "a state dict with NaN amax loads as calibrated",
    ),
    Mutant(
        "quantizer-extra-pass",
        "quant/quantizer.py",
        "        if pass_idx >= self.num_passes:\n",
        "        if pass_idx > self.num_passes:\n",
        "a quantizer records in a pass past its last",
    ),
    Mutant(
        "merge-sums",
        "quant/merge.py",
        '    for op in ("max", "sum"):\n',
        '    for op in ("max",):\n',
        "sums (counts, histograms, error sums) are not merged across ranks",
    ),
    Mutant(
        "session-passes",
        "quant/session.py",
        "    return max((q.num_passes for q in quantizers), default=0)\n",
        "    return min((q.num_passes for q in quantizers), default=0)\n",
        "a layer runs as many passes as its quickest quantizer needs",
    ),
    # ------------------------------------------------------------------ export
    Mutant(
        "export-owner",
        "export/plan.py",
        "            Unit(i, prefix, kind, module, i % world_size, _entries_for(assigned[prefix], params, quant, fused, fmt))\n",
        "            Unit(i, prefix, kind, module, 0, _entries_for(assigned[prefix], params, quant, fused, fmt))\n",
        "rank 0 writes every unit (ranks do not share the writing)",
    ),
    Mutant(
        "export-shard-bound",
        "export/plan.py",
        "                if current and size + e.nbytes > max_shard_bytes:\n",
        "                if current and size > max_shard_bytes:\n",
        "a shard may grow past max_shard_bytes",
    ),
    Mutant(
        "export-input-scale",
        "export/compressed_tensors/tensors.py",
        '    return {"input_scale": scales["scale"].to(SCALE_DTYPE).reshape(1)}\n',
        '    return {"input_scale": (scales["scale"] * 2).to(SCALE_DTYPE).reshape(1)}\n',
        "the exported input scale is twice the calibrated one",
    ),
    Mutant(
        "export-ignore",
        "export/plan.py",
        "    ignore = [name for name, m in model.named_modules() if _linear_like(m) and name not in quant]\n",
        "    ignore = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in quant]\n",
        "routers held as plain 2-D weights (not nn.Linear) are left out of ignore",
    ),
    Mutant(
        "export-format-int",
        "export/compressed_tensors/config.py",
        "    if input is not None and w_int:\n        return INT_QUANTIZED\n",
        "    if input is not None and w_int:\n        return PACK_QUANTIZED\n",
        "W8A8 int is written as pack-quantized",
    ),
    Mutant(
        "export-header-pad",
        "export/shards.py",
        '    raw += b" " * (-len(raw) % 8)\n',
        "",
        "shard headers are not padded to 8 bytes",
    ),
    Mutant(
        "export-overwrite-old",
        "export/export.py",
        "    if old is not None:\n        shutil.rmtree(old, ignore_errors=True)\n",
        "",
        "an overwritten export's old directory is left behind",
    ),
    Mutant(
        "export-staging-cleanup",
        "export/export.py",
        "        if rank == 0 and staging.exists():\n            shutil.rmtree(staging, ignore_errors=True)\n",
        "        pass\n",
        "a failed export leaves its staging directory",
    ),
    # ------------------------------------------------------------------ evaluation
    Mutant(
        "eval-shift",
        "data/perplexity.py",
        "            logits = _logits(model(batch))[:, :-1]\n            targets = batch[:, 1:]\n",
        "            logits = _logits(model(batch))[:, 1:]\n            targets = batch[:, 1:]\n",
        "perplexity scores each position's own token, not the next one",
    ),
]

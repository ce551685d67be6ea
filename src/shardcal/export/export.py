"""``export_checkpoint``: a calibrated (plain or FSDP2-sharded) model -> a checkpoint directory (compressed-tensors).

Collective under torch.distributed: every rank calls it. The flow (see docs/reference/export-format.md):

1. every rank builds the same :class:`~.layout.ExportPlan` from module structure (nothing gathered yet); anything
   that cannot be exported (uncalibrated quantizers, specs the export format cannot express: :mod:`.quant_modules`)
   fails here, on every rank alike, before any collective;
2. rank 0 checks the destination and creates a staging directory next to it (same filesystem; :mod:`.destination`)
   and tells the others its name;
3. unit by unit (decoder layers, other FSDP units, the root), every rank takes part in the gather and the unit's
   owner encodes and appends its tensors to its own shard files; after each unit one small all-reduce tells every
   rank whether any rank failed, so all of them stop together;
4. rank 0 writes the index, tokenizer files, report and config.json into the staging directory (:mod:`.metadata`),
   then renames it to ``out_dir`` (an existing one, with ``overwrite`` and only when it holds nothing but an earlier
   export, is renamed away first and deleted after).

An export that fails or is interrupted leaves no ``out_dir`` (and removes its staging directory).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe
from ..errors import ExportError
from ..quant.expert_layout import bias_slice, weight_slice
from ..quant.fused import fused_layer, share_ranges
from ..quant.quantizer import TensorQuantizer
from ..runtime.distributed import all_gather_strings, broadcast_json, ranks_with_flag, world
from ..runtime.faults import fault_point
from ..runtime.fsutil import check_apart
from ..sharding.fsdp2 import fsdp2_root_unsharded, layer_unsharded
from ..sharding.residency import decoder_layers_replaced
from .consumers import deployment, export_features
from .destination import prepare_staging, swap_into_place, unmark_staging
from .format import DEFAULT_FORMAT, ExportFormat, get_format
from .layout import Entry, ExportPlan, Unit, build_plan, laid_out_layer
from .metadata import model_config_dict, write_metadata
from .quant_modules import QuantModule, find_kv_cache, find_quant_modules, scheme_words
from .shards import RankShardWriter, RunningShardWriter

#: Largest shard file (bytes of tensor data), as transformers' default ``max_shard_size="5GB"``.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: What ``dtype=`` (``--export-dtype``) takes: the floating dtypes unquantized tensors may be stored in.
EXPORT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_dtype(dtype: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``dtype`` as a torch dtype (None stays None); anything but bfloat16, float16 or float32 is an
    :class:`ExportError` naming ``what`` (the parameter or flag)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in EXPORT_DTYPES:
        raise ExportError(f"{what} {dtype!r}: unquantized tensors are stored as {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


# ----------------------------------------------------------------------------------------------- writing


@contextlib.contextmanager
def _gathered(model: nn.Module, unit: Unit) -> Iterator[None]:
    """The unit's parameters unsharded on every rank (collective); nested FSDP units gathered with it."""
    if unit.kind == "root":
        with fsdp2_root_unsharded(model):
            yield
        return
    from torch.distributed.fsdp import FSDPModule

    with contextlib.ExitStack() as stack:
        stack.enter_context(layer_unsharded(unit.module))
        for sub in unit.module.modules():
            if sub is not unit.module and isinstance(sub, FSDPModule):
                stack.enter_context(layer_unsharded(sub))
        yield


def _plain(t: torch.Tensor, what: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise RuntimeError(f"export: {what} is still sharded while its unit is gathered (an FSDP unit the plan missed)")
    return t.detach()


def _encode_module(plan: ExportPlan, name: str, made: dict[str, TensorQuantizer]) -> dict[str, torch.Tensor]:
    qm = plan.quant_modules[name]
    weight = _plain(qm.weight(), f"{qm.name}.weight")
    wq = qm.weight_quantizer if qm.weight_quantizer is not None else _export_weight_quantizer(plan, name, made)
    return plan.export_format.encode_module(qm.format, wq, weight, qm.input_quantizer, qm.input_rotation)


def _export_weight_quantizer(plan: ExportPlan, name: str, made: dict[str, TensorQuantizer]) -> TensorQuantizer:
    """The weight quantizer of a module quantized at export from a weight-only recipe: the same calibration
    calibrate() runs, with the range shared across the layer vLLM fuses it into (its siblings are calibrated with
    it and kept in ``made``, the unit's)."""
    if name not in made:
        fused = fused_layer(name)
        siblings = [
            n
            for n, qm in plan.quant_modules.items()
            if n == name or (fused is not None and qm.weight_quantizer is None and fused_layer(n) == fused)
        ]
        for n in siblings:
            qm = plan.quant_modules[n]
            weight = _plain(qm.weight(), f"{n}.weight")
            made[n] = TensorQuantizer(
                qm.spec_weight, tuple(weight.shape), device=weight.device, name=f"{n}.weight_quantizer"
            )
            made[n].calibrate_from(weight)
        share_ranges({n: made[n] for n in siblings}, "weight")
    return made[name]


def _write_unit(model: nn.Module, plan: ExportPlan, entries: list[Entry], writer: RankShardWriter) -> None:
    """Write ``entries`` of one gathered unit (this rank's)."""
    encoded: dict[str, dict[str, torch.Tensor]] = {}
    made: dict[str, TensorQuantizer] = {}  # weight quantizers calibrated at export, this unit's
    for entry in entries:
        if entry.source[0] in ("param", "buffer"):
            get = model.get_parameter if entry.source[0] == "param" else model.get_buffer
            tensor = _plain(get(entry.source[1]), entry.key)
            if tensor.dtype != entry.dtype:  # a mixed-precision gather: store the parameters' own dtype
                tensor = tensor.to(entry.dtype)
        elif entry.source[0] == "expert_bias":  # one expert's bias of fused experts, under its per-expert name
            _, module_name, expert, projection = entry.source
            bias = bias_slice(model.get_submodule(module_name), int(expert), projection)
            tensor = _plain(bias, entry.key).to(entry.dtype).contiguous()
        elif entry.source[0] == "kv":  # k_scale / v_scale of an attention's KV-cache quantizer
            _, attention, suffix = entry.source
            tensor = plan.kv_cache[attention].export_scales()[suffix].to(entry.dtype)
            _check_scale(entry.key, tensor)
        elif entry.source[0] == "expert":  # an unquantized slice of fused experts, under its per-expert name
            _, module_name, expert, projection = entry.source
            tensor = _plain(weight_slice(model.get_submodule(module_name), int(expert), projection), entry.key)
            tensor = tensor.to(entry.dtype).contiguous()
        else:
            _, module_name, suffix = entry.source
            if module_name not in encoded:
                encoded = {module_name: _encode_module(plan, module_name, made)}
            tensor = encoded[module_name][suffix]
            if entry.key.endswith("scale"):  # a quantization scale (a model's own *_scale parameter may be anything)
                _check_scale(entry.key, tensor)
        writer.write(entry, tensor)


def _in_a_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if isinstance(error, ExportError) else f"{type(error).__name__}: {text}"


def _check_scale(key: str, scale: torch.Tensor) -> None:
    """Refuse a scale no runtime can use: zero, negative, NaN or infinite (vLLM would compute garbage silently)."""
    values = scale.float()
    bad = ~torch.isfinite(values) | (values <= 0)
    if bool(bad.any()):
        first = values.reshape(-1)[bad.reshape(-1)][0].item()
        raise ExportError(
            f"{key}: {int(bad.sum())} of {values.numel()} scale value(s) are zero, negative, NaN or infinite (e.g. "
            f"{first}); recalibrate (or exclude the module) before exporting"
        )


# ----------------------------------------------------------------------------------------------- entry point


def export_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    recipe: str | Path | Recipe | None = None,
    report: Any = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | Path | None = None,
    config_dir: str | Path | None = None,
    format: str | ExportFormat = DEFAULT_FORMAT,
    dtype: str | torch.dtype | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write ``model`` (calibrated: its targeted Linears are ``QuantLinear``) as a checkpoint in ``format``.

    ``out_dir`` gets ``config.json`` (the model's config — ``model.config.raw`` for shardcal's models, anything
    with ``to_dict()`` such as transformers' configs, else ``config_dir/config.json`` — plus ``quantization_config``),
    shards
    ``model-0000i-of-0000N.safetensors`` of at most ``max_shard_bytes`` of tensor data each (a larger single tensor
    gets its own), ``model.safetensors.index.json``, the tokenizer / generation files of ``tokenizer_dir`` and, with
    ``report`` (a :class:`~shardcal.calib.report.CalibrationReport`), ``calibration_report.json``. Tensor names are the
    module's state-dict names; fused experts (3-D parameters) are stored per expert under the names the original
    checkpoints use (``mlp.experts.{e}.gate_proj.weight`` ...), which is what vLLM loads.

    ``recipe`` (optional): every quantized module must match it; a plain Linear it targets is quantized at export
    (weight-only or dynamic-input recipes only). Collective under torch.distributed (every rank calls it; with an
    FSDP2-wrapped model no rank gathers more than one unit at a time, and ranks share the writing). Atomic: a
    failed export leaves no ``out_dir``. An existing non-empty ``out_dir`` is replaced only when it holds an earlier
    shardcal export and nothing else (its manifest ``shardcal_export.json`` lists its files) and ``overwrite`` is
    set; a directory holding any other file is refused, never deleted.
    Returns ``out_dir``. Problems with the destination or the model raise :class:`~shardcal.errors.ExportError`.

    ``format``: the checkpoint format, a name from :func:`shardcal.export.format.formats` (``"compressed-tensors"``,
    the one today) or an :class:`~shardcal.export.format.ExportFormat`; an unknown name is an ``ExportError``.

    ``dtype``: the dtype of every unquantized floating tensor (embeddings, norms, biases, the LM head, unquantized
    Linears): ``"bfloat16"``, ``"float16"`` or ``"float32"``; None stores each in the model's own dtype (a bf16
    checkpoint calibrated in float32 is best exported with ``dtype="bfloat16"``: ``shardcal calibrate`` passes the
    source checkpoint's dtype). ``config.json``'s dtype key says it. ``source``: the model directory the export was
    made from, recorded in the export's manifest (``shardcal eval`` compares the two when it is at hand).
    """
    session = ExportSession(
        model, out_dir, recipe, overwrite=overwrite, max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
        config_dir=config_dir, format=format, dtype=dtype, source=source,
    )  # fmt: skip
    try:
        session.write_remaining()
        return session.finish(report)
    except BaseException:
        session.abort()
        raise


class ExportSession:
    """One export being written (collective: every rank makes one with the same arguments): the plan, the staging
    directory beside ``out_dir``, this rank's shard files. Units are written as they become available — all of them
    after the calibration (:func:`export_checkpoint`), or a streamed model's decoder layers one at a time, each while
    its step still holds it (:meth:`write_held_layer`) — then :meth:`finish` writes the metadata and moves the
    directory into place; :meth:`abort` (after any failure) removes the staging directory. The arguments are
    :func:`export_checkpoint`'s; ``planned``: the plan, when the caller made it (a streamed run plans from the
    model's structure before calibrating: :func:`plan_streamed_export`). ``layers_laid_out_when_written``: the
    decoder layers may be calibrated into other modules than ``planned`` says (a streamed run whose recipe has a
    ``[fallback]``): each is laid out when it is written (:func:`~.layout.laid_out_layer`), its shard files sealed
    as they fill (:class:`~.shards.RunningShardWriter`), and :meth:`finish` makes the plan again from the calibrated
    model, which the files must match."""

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | Path,
        recipe: str | Path | Recipe | None = None,
        *,
        overwrite: bool = False,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        tokenizer_dir: str | Path | None = None,
        config_dir: str | Path | None = None,
        format: str | ExportFormat = DEFAULT_FORMAT,
        dtype: str | torch.dtype | None = None,
        source: str | Path | None = None,
        planned: ExportPlan | None = None,
        layers_laid_out_when_written: bool = False,
    ):
        self.model = model
        self.out_dir = Path(out_dir).absolute()
        self.tokenizer_dir = Path(tokenizer_dir).absolute() if tokenizer_dir is not None else None
        self.recipe = load_recipe(recipe) if recipe is not None and not isinstance(recipe, Recipe) else recipe
        self.overwrite = overwrite
        self.rank, self.world_size = world()
        self.max_shard_bytes, self.stored_dtype = max_shard_bytes, export_dtype(dtype)
        self.layers_laid_out_when_written = layers_laid_out_when_written
        check_apart(
            self.out_dir, "out_dir", {"tokenizer_dir": self.tokenizer_dir, "config_dir": config_dir}, ExportError
        )
        self.plan = planned or build_plan(model, self.recipe, self.world_size, max_shard_bytes, get_format(format),
                                          self.stored_dtype)  # fmt: skip
        self.config = model_config_dict(model, Path(config_dir) if config_dir is not None else None, self.stored_dtype)
        self.source = str(Path(source).absolute()) if source is not None else None
        self.written: set[int] = set()  # unit indices
        self.staging: Path | None = None
        self.writer: RankShardWriter | RunningShardWriter | None = None
        try:
            self._prepare_staging()
            if layers_laid_out_when_written:
                self.writer = RunningShardWriter(self.staging, self.rank, max_shard_bytes)
            else:
                self.writer = RankShardWriter(self.staging, [s for s in self.plan.shards if s.rank == self.rank])
        except BaseException:
            self.abort()
            raise

    def _prepare_staging(self) -> None:
        """Rank 0 checks the destination and creates the staging directory; every rank must see it (collective)."""
        prepared: tuple[str, str] | None = None
        if self.rank == 0:
            try:
                prepared = ("ok", str(prepare_staging(self.out_dir, self.overwrite, self.tokenizer_dir)))
            except ExportError as exc:
                prepared = ("error", str(exc))
        prepared = tuple(broadcast_json(prepared))
        if prepared[0] == "error":
            raise ExportError(prepared[1])
        self.staging = staging = Path(prepared[1])  # abort() removes it from here on
        missing = ranks_with_flag(not staging.is_dir())
        if missing:
            raise ExportError(
                f"{staging}: the staging directory is not visible on rank(s) {missing}; export to a directory on a "
                "filesystem that every rank shares"
            )

    def write_remaining(self) -> None:
        """Every unit not written yet, one gather at a time (collective)."""
        for unit in self.plan.units:
            if unit.index not in self.written:
                with _gathered(self.model, unit):
                    self._write(unit, self.plan)

    def write_held_layer(self, index: int, layer: nn.Module) -> None:
        """Decoder layer ``index``, held whole on every rank by its step (collective; the owner writes). Its quantized
        modules must be the ones the plan was made for (:func:`plan_streamed_export`), else :class:`ExportError` —
        unless the layers are laid out when written."""
        unit = next(u for u in self.plan.units if u.kind == "layer" and u.name.endswith(f".{index}"))
        found = find_quant_modules(layer, self.recipe, self.plan.export_format, prefix=unit.name)
        kv_cache = find_kv_cache(layer, self.recipe, self.plan.export_format, prefix=unit.name)
        if self.layers_laid_out_when_written:
            fmt, dtype = self.plan.export_format, self.stored_dtype
            unit = laid_out_layer(unit, layer, found, kv_cache, self.world_size, fmt, dtype)
        else:
            _check_as_planned(self.plan, unit, found, kv_cache)
        self._write(unit, replace(self.plan, quant_modules=found, kv_cache=kv_cache))

    def _write(self, unit: Unit, plan: ExportPlan) -> None:
        """Write one gathered unit: each rank encodes and writes its entries of it (a decoder layer's are spread
        over the ranks, any other unit's are its owner's), and every rank learns whether any of that failed, and
        why."""
        error: BaseException | None = None
        mine = unit.writes(self.rank)
        if mine:
            try:
                fault_point("export.unit", unit=unit.index, unit_name=unit.name)
                with torch.no_grad():
                    _write_unit(self.model, plan, mine, self.writer)
            except Exception as exc:
                error = exc
        self._agree(error, f"writing {unit.name}")
        self.written.add(unit.index)

    def _agree(self, error: BaseException | None, doing: str) -> None:
        """Every rank learns whether any failed ``doing`` something (collective), and why: raise then."""
        whys = all_gather_strings(_in_a_line(error) if error is not None else "")
        if error is not None:
            raise error
        failed = next((r for r, why in enumerate(whys) if why), None)
        if failed is not None:
            raise ExportError(f"export to {self.out_dir} failed on rank {failed} {doing}: {whys[failed]}")

    def _name_files_as_laid_out(self) -> None:
        """Layers laid out when written: the plan made again from the calibrated model (the layout a resident
        export of it has); this rank's sealed files must hold its shards' tensors, in order, and take their names
        (collective)."""
        error: BaseException | None = None
        try:
            final = build_plan(self.model, self.recipe, self.world_size, self.max_shard_bytes,
                               self.plan.export_format, self.stored_dtype, structure_only=True)  # fmt: skip
            mine = [s for s in final.shards if s.rank == self.rank]
            written = [[(e.key, e.dtype, e.shape) for e in entries] for entries in self.writer.seal()]
            if written != [[(e.key, e.dtype, e.shape) for e in s.entries] for s in mine]:
                raise ExportError(
                    f"rank {self.rank}'s shard files, laid out layer by layer, do not hold the tensors of the calibrated "
                    "model's layout (a shardcal bug: please report it)"
                )
            self.writer.rename([s.file for s in mine])
            self.plan = final
        except Exception as exc:
            error = exc
        self._agree(error, "naming its shard files")

    def finish(self, report: Any = None) -> Path:
        """All units written: rank 0 writes the metadata and moves the export into place (collective); returns
        ``out_dir``. Warns, once, naming the runtimes that will refuse the export or compute something else with it
        (:mod:`.consumers`)."""
        if not self.writer.done:
            raise RuntimeError("export plan: this rank's shards are incomplete")
        if self.layers_laid_out_when_written:
            self._name_files_as_laid_out()
        self.writer.close()
        outcome: tuple[str, str] | None = None
        if self.rank == 0:
            try:
                unmark_staging(self.staging)
                write_metadata(self.config, self.plan, self.staging, report, self.tokenizer_dir, self.source)
                swap_into_place(self.staging, self.out_dir, self.overwrite)
                self.staging = None
                outcome = ("ok", "")
            except ExportError as exc:
                outcome = ("error", str(exc))
            except BaseException as exc:
                broadcast_json(("error", f"export to {self.out_dir} failed on rank 0: {exc!r}"))
                raise
        outcome = tuple(broadcast_json(outcome))
        if outcome[0] == "error":
            raise ExportError(outcome[1])
        said = deployment(export_features(self.plan.quant_modules.values(), bool(self.plan.kv_cache)))
        if self.rank == 0 and (warning := said.warning(self.out_dir)) is not None:
            import warnings

            warnings.warn(warning, stacklevel=3)
        return self.out_dir

    def abort(self) -> None:
        """After a failure or an interruption: close this rank's files; rank 0 removes the staging directory."""
        if self.writer is not None:
            self.writer.close()
        if self.rank == 0 and self.staging is not None and self.staging.exists():
            shutil.rmtree(self.staging, ignore_errors=True)


def _check_as_planned(plan: ExportPlan, unit: Unit, found: dict[str, QuantModule], kv_cache: dict[str, Any]) -> None:
    """An :class:`ExportError` when a layer calibrated into other quantized modules than its planned export."""
    planned = {n: qm for n, qm in plan.quant_modules.items() if n.startswith(unit.name + ".")}
    for name in sorted(set(planned) | set(found)):
        want, got = planned.get(name), found.get(name)
        same = want is not None and got is not None
        if not same or (want.scheme_key, want.input_rotation) != (got.scheme_key, got.input_rotation):
            raise ExportError(
                f"{name}: calibrated as {scheme_words(got)}, but its streamed export was planned as "
                f"{scheme_words(want)}"
            )
    if set(kv_cache) != {n for n in plan.kv_cache if n.startswith(unit.name + ".")}:
        raise ExportError(f"{unit.name}: its KV-cache quantizers differ from its planned export")


def plan_streamed_export(
    model: nn.Module,
    recipe: Recipe,
    attach: Any,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    format: str | ExportFormat = DEFAULT_FORMAT,
    dtype: str | torch.dtype | None = None,
) -> ExportPlan:
    """The export plan of a streamed model (its decoder layers on the meta device) before it is calibrated: a
    meta-device copy of each layer gets what calibration will attach to it (``attach(layer, recipe, prefix)``:
    :func:`shardcal.calib.attach.quantize_modules`), and the plan is made from that structure. Every rank alike."""
    import copy

    from ..sharding.registry import decoder_layer_prefix, require_decoder_layers

    layers = require_decoder_layers(model)
    prefix = decoder_layer_prefix(model, layers)
    twins = nn.ModuleList(copy.deepcopy(layer) for layer in layers)
    for i, twin in enumerate(twins):
        attach(twin, recipe, f"{prefix}.{i}")
    with decoder_layers_replaced(model, layers, twins):
        return build_plan(
            model, recipe, world()[1], max_shard_bytes, get_format(format), export_dtype(dtype), structure_only=True
        )

"""What a planned calibration writes to disk: the export's shard files, as the export plan (:mod:`shardcal.export.layout`)
splits them, and the most a ``--checkpoint-dir`` holds between two commits."""

from __future__ import annotations

import itertools
import math

import torch

from ..calib.runner import commit_points
from ..export.export import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES
from ..export.format import ExportFormat, get_format, module_sizes
from ..export.layout import Entry, Unit, kv_cache_entries, split_into_shards
from ..export.shards import header_bytes
from ..models.checkpoint import dominant_floating_dtype
from ..quant.kv_cache import kv_cache_attentions
from .costs import CHECKPOINT_ENTRY_BYTES, CHECKPOINT_RANK_BYTES
from .prepared import PlannedRun, PreparedModel

#: A quantized Linear's stored tensors, by ``(out_features, in_features, input rotation)``: ``(suffix, dtype, shape,
#: bytes)`` each.
_Stored = list[tuple[str, torch.dtype, tuple[int, ...], int]]


def stored_dtype(m: PreparedModel, export_dtype: str) -> torch.dtype:
    """What the export stores the unquantized floating tensors in: ``export_dtype``, or for ``"auto"`` the
    checkpoint's own floating dtype (the rule the export follows, :func:`~shardcal.models.checkpoint.
    dominant_floating_dtype`, over the files' dtypes; the memory dtype when planning from config.json alone)."""
    if export_dtype != "auto":
        return EXPORT_DTYPES[export_dtype]
    found = dominant_floating_dtype((p.file_dtype, math.prod(p.shape)) for p in m.params)
    return found or m.dtype


def export_entries(
    m: PreparedModel, export_format: ExportFormat | str | None = None, export_dtype: str = "auto"
) -> dict[str, list[tuple[Entry, int]]]:
    """Per export unit (in the order every rank writes them), the tensors it stores in ``export_format`` (default
    compressed-tensors) and their sizes: a quantized Linear's weight becomes the tensors the format says, its input
    rotation's included (:func:`~shardcal.export.format.module_sizes`, which the export plan asks too), every other
    parameter is stored as it is, a floating one in the dtype :func:`stored_dtype` gives."""
    fmt = get_format(export_format)
    unquantized_dtype = stored_dtype(m, export_dtype)
    quantized = {t.linear.name: t for t in m.targets if t.weight is not None}
    out: dict[str, list[tuple[Entry, int]]] = {u: [] for u in m.export_units}
    own_units = set(m.export_units[:-1])
    layouts: dict[tuple[int, int, int | None], _Stored] = {}  # one recipe: by shape and input rotation
    for p in m.params:
        unit = p.unit if p.unit in own_units else "<root>"
        module, _, leaf = p.name.rpartition(".")
        t = quantized.get(module)
        if t is not None and leaf == "weight":
            key = (t.linear.out_features, t.linear.in_features, t.rotation)
            if key not in layouts:
                spec_in = t.input.spec if t.input is not None else None
                stored = fmt.module_format(t.weight.spec, spec_in)
                sizes = module_sizes(fmt, stored, t.weight.spec, spec_in, *key)
                layouts[key] = [(k, dt, shape, n) for k, (dt, shape, n) in sizes.items()]
            out[unit] += [
                (Entry(f"{module}.{k}", dt, shape, ("quant", module, k)), n) for k, dt, shape, n in layouts[key]
            ]
        else:
            dtype = unquantized_dtype if p.dtype.is_floating_point else p.dtype
            entry = Entry(p.name, dtype, p.shape, ("param", p.name))
            out[unit].append((entry, entry.nbytes))
    if m.recipe.kv_cache is not None:  # each decoder layer's quantized attention: its KV-cache scales
        layers = m.st.model.get_submodule(m.st.layer_prefix)
        for layer, prefix in zip(layers, m.layer_names):
            for name, _ in kv_cache_attentions(layer, prefix, m.recipe.matches):
                out[prefix] += [(e, e.nbytes) for e in kv_cache_entries(name)]
    return out


def unit_entries(m: PreparedModel, export_dtype: str = "auto") -> dict[str, list[tuple[Entry, int]]]:
    """:func:`export_entries` in the default format, computed once per prepared model and export dtype."""
    if export_dtype not in m.entries:
        m.entries[export_dtype] = export_entries(m, export_dtype=export_dtype)
    return m.entries[export_dtype]


def export_files(
    m: PlannedRun, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, export_format: ExportFormat | str | None = None
) -> list[tuple[str, int]]:
    """``(file name, size in bytes)`` of every shard the export writes in ``export_format`` (default
    compressed-tensors): the units' entries given to their owners and split into files by the export plan itself
    (:func:`~shardcal.export.layout.split_into_shards`), each file its safetensors header and its tensors."""
    dtype = m.s.export_dtype
    stored = (
        unit_entries(m.prepared, dtype) if export_format is None else export_entries(m.prepared, export_format, dtype)
    )
    units = [
        Unit(
            index=index,
            name=unit,
            kind=m.unit_kind(unit),
            module=None,
            owner=m.owner(index, unit),
            entries=[e for e, _ in stored[unit]],
        )
        for index, unit in enumerate(m.export_units)
    ]
    shards = split_into_shards(units, m.s.world_size, max_shard_bytes)
    return [(shard.file, len(header_bytes(shard.entries)) + shard.nbytes) for shard in shards]


def checkpoint_dir_bytes(m: PlannedRun) -> int:
    """The most a ``--checkpoint-dir`` holds: a commit's files beside the previous commit's (deleted after; a
    streamed run's weights files stay, each commit adding the layers since the last), their metadata included (:data:`~.costs.CHECKPOINT_ENTRY_BYTES`, :data:`~.costs.CHECKPOINT_RANK_BYTES`)."""
    world, layers = m.s.world_size, m.st.num_layers
    seq, hidden, e = m.s.seq_len, m.st.hidden_size, m.e
    acts = sum(m.rows[b] * seq * hidden * e for b in range(len(m.rows)))
    weights_upto, entries_upto = [0], [0]
    for i, unit in enumerate(m.layer_names):  # the ranks' own rows of each layer together: the whole layer
        groups = m.unit_groups.get(unit, {})
        weights_upto.append(weights_upto[-1] + sum(n * rows * row * size for (rows, row, size, _), n in groups.items()))
        quantizers = sum(q is not None for t in m.targets_of[i] for q in (t.weight, t.input, t.output))
        entries_upto.append(entries_upto[-1] + quantizers + (sum(groups.values()) if m.changes_weights else 0))
    commits = commit_points(layers, m.s.options.checkpoint_every)

    def files(k: int) -> int:
        return (
            (acts if k < layers else 0)
            + (weights_upto[k] if m.changes_weights else 0)
            + m.quantizer_upto[k - 1]
            + CHECKPOINT_ENTRY_BYTES * entries_upto[k]
            + CHECKPOINT_RANK_BYTES * world
        )

    def kept(k: int) -> int:  # a streamed run's commits add the new layers' weights beside the earlier ones' files
        return weights_upto[k] if m.changes_weights and m.s.streamed else 0

    return max([files(commits[0])] + [files(a) + files(b) - kept(a) for a, b in itertools.pairwise(commits)])

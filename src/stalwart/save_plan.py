"""What the saves of one run reuse while the layout of their state stays the same.

A DCP save spends a fixed time per save, whatever its size, on work whose
result depends only on the *layout* of the state (its keys, shapes, dtypes,
sharding): the local and global plans and the ``Metadata``, the pickle of
``.metadata``, and the ``torch.save`` of every small non-tensor value. For a 192-tensor AdamW
state that was more than a third of a 64 MiB save's CPU time. ``SavePlanCache``
keeps these results from one save to the next; ``CachingSavePlanner`` is the
DCP planner that uses it.

What the cache is keyed on, and why that is exact:

- A rank's local plan (one ``WriteItem`` per value) is DCP's
  ``create_local_plan`` of the flattened state dict, a function of each
  value's key and, for a plain ``torch.Tensor``, of exactly the properties
  its item records (dtype, shape, layout, requires_grad, pinned memory).
  The last plan's items are reused when every key and those properties are
  the same, in the same order, and the rank is the same kind (coordinator or
  not); a tensor subclass (DTensor, ShardedTensor) or a value that plans its
  own items (``__create_write_items__``) makes DCP plan it anew.
- The global plan and ``Metadata`` are a pure function of every rank's local
  plan (DCP's ``create_global_plan``); the local plans are still built on
  every save, and the cached result is reused only when the list of every
  rank's local plan equals the cached one (keys, chunk offsets and sizes,
  dtypes and every other tensor property, the flattening map, the number of
  ranks). Anything else builds the plan anew, as DCP would.
- ``.metadata``'s bytes (and those of its JSON twin, ``.metadata.json``) are
  reused only when its content equals the cached one but for the staging
  directory's name and the save's id, which are replaced in the bytes by
  strings of the same length (so the pickle's opcodes are the same, and the
  JSON's structure); anything else is encoded anew.
- A non-tensor value's ``torch.save`` bytes are reused only when the value is
  plain data (None, bool, int, float, str, bytes, and lists, tuples and dicts
  of them) whose ``pickle`` is byte for byte the cached one, under the same
  ``torch.save`` settings.

The writer also keeps here each file's write results (reused where a result
says the same: the same item object, file, offset and length) and, for a
save in the background, its prepared records (reused only for the very
staging buffer a record views, under the same ``torch.save`` settings; see
``writer._prepared``).

Unlike DCP's own ``enable_plan_caching`` (class-level state shared by every
save of the process), one cache belongs to one run's saves: two managers in
one process never see each other's plans.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from stalwart import metadata_json
from stalwart.state.plain import is_plain_data

if TYPE_CHECKING:  # the writer imports this module
    from stalwart.writer import PreparedRecords

__all__ = ["CachingSavePlanner", "SavePlanCache", "encode_metadata"]

_TORCH_SAVE_PROTOCOL = 2
"""The pickle protocol ``torch.save`` writes with by default."""


@dataclasses.dataclass(slots=True)
class _Pickled:
    """``.metadata``'s bytes, its JSON twin's, and what they were encoded from."""

    metadata: Metadata
    storage_data: dict[Any, Any]
    directory: Path
    save_id: str
    data: bytes
    json_data: bytes | None


class SavePlanCache:
    """One run's reusable planning results (see the module docstring). Thread-safe.

    One instance lives as long as its manager; ``hits`` and ``misses`` count
    the saves whose global plan was reused or built.
    """

    MAX_VALUES = 1024
    """Non-tensor values whose ``torch.save`` bytes are kept, the oldest dropped first."""
    MAX_VALUE_BYTES = 64 * 1024
    """Larger values are saved anew every time (and are no fixed cost then)."""
    MAX_FILES = 64
    """Files whose write results (and prepared records) are kept (``file_results``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: tuple[list[SavePlan], list[SavePlan], Metadata] | None = None
        self._local: tuple[list[Any], list[WriteItem]] | None = None
        self._pickled: _Pickled | None = None
        self._values: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()
        self._results: dict[str, list[WriteResult]] = {}
        self._records: dict[str, PreparedRecords] = {}
        self.hits = 0
        self.misses = 0

    def local_items(
        self, state_dict: dict[str, Any], is_coordinator: bool
    ) -> list[WriteItem] | None:
        """The last local plan's items if it was planned for a flattened state dict of the
        same ``_item_keys`` (compared in place: no key is made for a state that matches)."""
        with self._lock:
            cached = self._local
        if cached is None or not _same_keys(cached[0], state_dict, is_coordinator):
            return None
        return list(cached[1])

    def keep_local_items(self, keys: list[Any] | None, items: list[WriteItem]) -> None:
        """Remember the items DCP planned for ``keys`` (None: not cacheable)."""
        if keys is not None:
            with self._lock:
                self._local = (keys, list(items))

    def file_results(self, storage_key: str) -> list[WriteResult]:
        """The write results of the last save's file named ``storage_key`` (none: [])."""
        with self._lock:
            return self._results.get(storage_key, [])

    def file_records(self, storage_key: str) -> PreparedRecords | None:
        """The prepared records (``writer.PreparedRecords``) of the last save's file named
        ``storage_key``, kept for a state of staged tensors; None if there are none."""
        with self._lock:
            return self._records.get(storage_key)

    def keep_file_results(
        self,
        storage_key: str,
        results: list[WriteResult],
        records: PreparedRecords | None = None,
    ) -> None:
        """Remember a file's write results (and prepared records, if any), for the next
        save's file of that name to reuse."""
        with self._lock:
            if len(self._results) >= self.MAX_FILES:
                self._results.clear()  # a rank's files are a few names: only a renumbering
                self._records.clear()
            self._results[storage_key] = results
            if records is None:
                self._records.pop(storage_key, None)
            else:
                self._records[storage_key] = records

    def drop_records(self) -> None:
        """Forget every file's prepared records: the staged buffers they view were replaced.

        Only memory rides on it: a record is reused only for the very tensor it
        was built from, so a kept one is never wrong, but it holds its tensor,
        a buffer the staging area dropped, until the next save of its file.
        """
        with self._lock:
            self._records.clear()

    def global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata] | None:
        """The cached global plan and metadata if ``all_plans`` equals the cached local plans."""
        with self._lock:
            cached = self._plans
            if cached is None or cached[0] != all_plans:
                self.misses += 1
                return None
            self.hits += 1
        # A copy: the writer sets the storage fields of the Metadata it is given.
        return list(cached[1]), dataclasses.replace(cached[2])

    def keep_global_plan(
        self, all_plans: list[SavePlan], global_plans: list[SavePlan], metadata: Metadata
    ) -> None:
        """Remember the global plan built from ``all_plans`` (only after it was validated)."""
        with self._lock:
            self._plans = (list(all_plans), list(global_plans), dataclasses.replace(metadata))

    def metadata_files(self, metadata: Metadata) -> tuple[bytes, bytes | None]:
        """``encode_metadata(metadata)``, reusing the last save's bytes when only its names differ."""
        meta = metadata.storage_meta
        directory, save_id = _names(meta)
        with self._lock:
            last = self._pickled
        if last is not None and directory is not None and save_id is not None:
            spliced = _splice(last, metadata, directory, save_id)
            if spliced is not None:
                return spliced
        data, json_data = encode_metadata(metadata)
        if directory is not None and save_id is not None:
            with self._lock:
                self._pickled = _Pickled(
                    metadata=_without_storage(metadata),
                    storage_data=dict(metadata.storage_data or {}),
                    directory=directory,
                    save_id=save_id,
                    data=data,
                    json_data=json_data,
                )
        return data, json_data

    def saved_value(self, value: Any, settings: tuple[Any, ...] | None) -> io.BytesIO:
        """``torch.save(value)`` into a new buffer, its bytes reused for plain data seen before.

        ``settings`` is ``writer.record_settings()``; None saves anew.
        """
        key = _value_key(value, settings)
        if key is not None:
            with self._lock:
                data = self._values.get(key)
                if data is not None:
                    self._values.move_to_end(key)
                    return io.BytesIO(data)
        buf = io.BytesIO()
        torch.save(value, buf)
        if key is not None:
            with self._lock:
                self._values[key] = buf.getvalue()
                while len(self._values) > self.MAX_VALUES:
                    self._values.popitem(last=False)
        return buf


def _names(meta: StorageMeta | None) -> tuple[Path | None, str | None]:
    """The checkpoint directory and save id a ``StorageMeta`` names (None: not the usual form)."""
    if meta is None or not isinstance(meta.checkpoint_id, Path) or meta.load_id is not None:
        return None, None
    return meta.checkpoint_id, meta.save_id if isinstance(meta.save_id, str) else None


def _without_storage(metadata: Metadata) -> Metadata:
    return dataclasses.replace(metadata, storage_data=None, storage_meta=None)


def encode_metadata(metadata: Metadata) -> tuple[bytes, bytes | None]:
    """``.metadata``'s bytes (DCP's pickle) and ``.metadata.json``'s (None: not encodable)."""
    return pickle.dumps(metadata), metadata_json.encode(metadata)


def _splice(
    last: _Pickled, metadata: Metadata, directory: Path, save_id: str
) -> tuple[bytes, bytes | None] | None:
    """The last save's metadata files with this save's names, or None when more differs.

    The pickle (or JSON) of two objects that differ only in strings of the
    same length is the same but for those strings' encoded bytes, each
    written once (a checked condition): replacing them is encoding the new
    object.
    """
    old_name, new_name = last.directory.name, directory.name
    meta = metadata.storage_meta
    assert meta is not None
    if (
        last.directory.parent != directory.parent
        or len(old_name) != len(new_name)
        or len(last.save_id) != len(save_id)
        or meta.modules != []
        # The same layout shares one state_dict_metadata object (a cache hit):
        # comparing it then costs nothing; the storage offsets are compared in full.
        or last.metadata != _without_storage(metadata)
        or last.storage_data != metadata.storage_data
    ):
        return None
    names = ((old_name, new_name), (last.save_id, save_id))
    data = _replace_once(last.data, names, str.encode)
    if data is None:
        return None
    if last.json_data is None:
        return data, None
    json_data = _replace_once(last.json_data, names, lambda s: json.dumps(s)[1:-1].encode())
    return None if json_data is None else (data, json_data)


def _replace_once(
    data: bytes, names: tuple[tuple[str, str], ...], encode: Callable[[str], bytes]
) -> bytes | None:
    """``data`` with each old name's encoding replaced by the new one's (same length, once)."""
    for old, new in names:
        old_b, new_b = encode(old), encode(new)
        if len(old_b) != len(new_b) or data.count(old_b) != 1:
            return None
        data = data.replace(old_b, new_b)
    return data


def _value_key(value: Any, settings: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """The cache key of a plain-data value (its pickle), None for anything else."""
    if settings is None or not is_plain_data(value):
        return None
    try:
        pickled = pickle.dumps(value, protocol=_TORCH_SAVE_PROTOCOL)
    except (pickle.PicklingError, RecursionError):
        return None
    if len(pickled) > SavePlanCache.MAX_VALUE_BYTES:
        return None
    return (*settings, pickled)


def _item_keys(state_dict: dict[str, Any], is_coordinator: bool) -> list[Any] | None:
    """What DCP's local plan of a flattened ``state_dict`` depends on; None: not cacheable."""
    keys: list[Any] = [is_coordinator]
    for fqn, obj in state_dict.items():
        if type(obj) is torch.Tensor:
            keys.append(_tensor_key(fqn, obj))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None  # DTensor, ShardedTensor and the like: planned by DCP every time
        else:
            keys.append(fqn)  # a BYTE_IO item: its key only
    return keys


def _tensor_key(fqn: str, obj: torch.Tensor) -> tuple[Any, ...]:
    # Exactly what _create_write_item_for_tensor reads (TensorProperties.create_from_tensor).
    return (fqn, obj.dtype, obj.shape, obj.layout, obj.requires_grad, obj.is_pinned())


def _same_keys(keys: list[Any], state_dict: dict[str, Any], is_coordinator: bool) -> bool:
    """``_item_keys(state_dict, is_coordinator) == keys``, key by key, none kept.

    The list of keys, thousands of objects alive at once for a large model, set
    off Python's collections in a save written in the background; one key at a
    time is made and dropped.
    """
    if len(keys) != len(state_dict) + 1 or keys[0] != is_coordinator:
        return False
    for n, (fqn, obj) in enumerate(state_dict.items(), start=1):
        if type(obj) is torch.Tensor:
            if keys[n] != _tensor_key(fqn, obj):
                return False
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return False  # never cached: see _item_keys
        elif keys[n] != fqn:
            return False
    return True


def _plain_tensor_at(obj: Any, offset: Any) -> bool:
    """``find_tensor_shard``'s answer is ``obj`` itself: a plain tensor looked up at its origin."""
    return type(obj) is torch.Tensor and (
        offset is None or (len(offset) == obj.dim() and not any(offset))
    )


class CachingSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner``, reusing ``cache``'s results where the layout is unchanged.

    One instance per ``dcp.save``; the cache outlives it. ``settings`` is
    ``writer.record_settings()`` of this save (None: no value is reused).
    """

    def __init__(self, cache: SavePlanCache, *, settings: tuple[Any, ...] | None) -> None:
        super().__init__()
        self._cache = cache
        self._settings = settings

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # DCP walks the flattened state once more to flatten nested ShardedTensors;
        # only a tensor subclass can be one, so a state without any skips that walk.
        sharded = self.flatten_sharded_tensors
        self.flatten_sharded_tensors = False
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        finally:
            self.flatten_sharded_tensors = sharded
        if sharded and any(
            isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
            for v in self.state_dict.values()
        ):
            self.state_dict = _flatten_sharded_tensors(self.state_dict)

    def create_local_plan(self) -> SavePlan:
        items = self._cache.local_items(self.state_dict, self.is_coordinator)
        if items is None:
            plan = super().create_local_plan()
            self._cache.keep_local_items(
                _item_keys(self.state_dict, self.is_coordinator), plan.items
            )
            return plan
        self.plan = SavePlan(items, planner_data=self.mappings if self.flatten_state_dict else None)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if _plain_tensor_at(obj, index.offset):
            return obj
        return super().lookup_object(index)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cached = self._cache.global_plan(all_plans)
        if cached is not None:
            self.global_plan, self.metadata = cached
            return cached
        global_plans, metadata = super().create_global_plan(all_plans)
        self._cache.keep_global_plan(all_plans, global_plans, metadata)
        return global_plans, metadata

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return self._cache.saved_value(object, self._settings)
        return super().transform_object(write_item, object)

from __future__ import annotations

import numpy as np
import pytest

from services.protocol.items import (
    FieldElem,
    FieldSpec,
    flat_slices,
    item_payload_nbytes,
    metadata_only,
)
from services.protocol.tensors import RawTensor


def _qwen_item() -> dict[str, FieldElem]:
    return {
        "pixel_values": FieldElem(np.zeros((16, 1176), np.float32), FieldSpec.flat([(0, 16, None)])),
        "image_grid_thw": FieldElem(np.array([1, 4, 4], np.int64), FieldSpec.batched(keep_on_cpu=True)),
    }


def test_metadata_only_keeps_given_keys_in_item_order():
    item = _qwen_item()
    light = metadata_only(item, ["image_grid_thw", "not_there"])
    assert list(light) == ["image_grid_thw"] and light["image_grid_thw"] is item["image_grid_thw"]


def test_payload_nbytes():
    item = _qwen_item()
    assert item_payload_nbytes(item) == 16 * 1176 * 4 + 24
    item["sizes"] = FieldElem([RawTensor("bfloat16", (2,), b"\0" * 4), 3], FieldSpec.shared(1))
    item["absent"] = FieldElem(None, FieldSpec.batched())
    assert item_payload_nbytes(item) == 16 * 1176 * 4 + 24 + 4 + 8


def test_field_spec_rules():
    assert FieldSpec.flat([slice(0, 4), [4, 8, 2]], dim=1).slices == [(0, 4, None), (4, 8, 2)]
    assert FieldSpec.flat([(0, 4)]).factory_kw() == {"keep_on_cpu": False, "slices": [[0, 4, None]], "dim": 0}
    # vLLM's flat_from_sizes form: one slice per dimension for each item
    nested = FieldSpec.flat(flat_slices([308, 100]))
    assert nested.slices == [((0, 308, None),), ((308, 408, None),)]
    assert nested.factory_kw()["slices"] == [[[0, 308, None]], [[308, 408, None]]]
    assert flat_slices([3, 4], dim=1) == [((None, None, None), (0, 3, None)), ((None, None, None), (3, 7, None))]
    assert FieldSpec.shared(2).factory_kw() == {"keep_on_cpu": False, "batch_size": 2}
    with pytest.raises(ValueError, match="unknown field factory"):
        FieldSpec("stacked")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs slices"):
        FieldSpec("flat")
    with pytest.raises(ValueError, match="only apply to flat"):
        FieldSpec("batched", slices=[(0, 1, None)])
    with pytest.raises(ValueError, match="batch_size"):
        FieldSpec("shared")
    with pytest.raises(ValueError, match="must be \\[start, stop, step\\] with integers or null"):
        FieldSpec.flat([(0, 1.5, None)])

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.codecs import transforms


@given(st.sampled_from([2, 4, 8]), st.data())
@settings(max_examples=300, deadline=None)
def test_transforms_invert_exactly(elem, data):
    n = data.draw(st.integers(0, 200)) * elem
    new = data.draw(st.binary(min_size=n, max_size=n))
    base = data.draw(st.binary(min_size=n, max_size=n))
    for apply, undo in ((transforms.apply_xor, transforms.undo_xor), (transforms.apply_sub, transforms.undo_sub),
                        (transforms.apply_gsub, transforms.undo_gsub)):
        assert undo(apply(new, base, elem).tobytes(), base, elem).tobytes() == new


def test_small_float_changes_become_small_integers():
    x = np.array([1.0, -1.0, 3.5, -0.0, 1e-40], dtype=np.float32)
    y = np.nextafter(x, np.float32(np.inf))
    z = transforms.apply_sub(y.tobytes(), x.tobytes(), 4)
    assert (z <= 4).all()
    assert transforms.apply_sub(x.tobytes(), x.tobytes(), 4).max() == 0


def test_gsub_groups_by_the_base_exponent():
    base = np.array([1.0, 1e-3, 2.0, 1e-3, -1.0], dtype=np.float32)
    order = transforms.group_order(base.tobytes(), 4)
    assert order.tolist() == [1, 3, 0, 4, 2]  # stable: equal keys (1.0 and -1.0: the sign is not in the key) keep their order
    new = np.nextafter(base, np.float32(np.inf))
    d = transforms.apply_gsub(new.tobytes(), base.tobytes(), 4)
    assert d.tolist() == transforms.apply_sub(new.tobytes(), base.tobytes(), 4)[order].tolist()

"""fxstab.capture.flat: an operator call's (args, kwargs) as leaves and back, as pytree does it."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils import _pytree as pytree

from fxstab.capture.flat import flatten_call, unflatten_call

_NT = collections.namedtuple("_NT", "a b")
_X = torch.randn(2)


@pytest.mark.parametrize("args,kwargs", [
    ((_X, 1.0), {}),                                     # no containers: a slice
    ((_X, 1.0), {"alpha": 2}),
    ((_X, [4, 64, 64]), {}),                             # view(x, sizes)
    ((_X, [1], True), {"dtype": None}),                  # sum(x, dims, keepdim, dtype=)
    ((_X, ()), {"k": [_X, (1, [2, None])]}),             # nested, empty tuple, None
    ((None, [None, _X]), {"memory_format": torch.contiguous_format}),
    (([], {}), {"a": {}}),                               # empty containers
    ((_NT(1, _X), [3]), {}),                             # a namedtuple: pytree rebuilds it
    ((_X, {1: _X}), {}),                                 # a dict keyed by an int: pytree too
    ((), {}),
])
def test_a_call_comes_back_as_it_was_with_pytrees_leaves(args, kwargs):
    leaves, spec = flatten_call(args, kwargs)
    ref, ref_spec = pytree.tree_flatten((args, kwargs))
    assert len(leaves) == len(ref) and all(a is b for a, b in zip(leaves, ref))
    new = [object() if isinstance(v, torch.Tensor) else v for v in leaves]  # fresh leaves
    a, k = unflatten_call(new, spec)
    want_a, want_k = pytree.tree_unflatten(new, ref_spec)
    assert type(a) is tuple and type(k) is dict
    assert repr((a, k)) == repr((want_a, want_k))
    for got, want in zip(pytree.tree_leaves((a, k)), pytree.tree_leaves((want_a, want_k))):
        assert got is want  # the leaves given, not copies
    assert [type(v) for v in pytree.tree_flatten((a, k))[0]] == \
        [type(v) for v in pytree.tree_flatten((want_a, want_k))[0]]
    if args and isinstance(args[0], _NT):
        assert type(a[0]) is _NT

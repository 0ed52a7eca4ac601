"""Fused fast paths expanded into the operators they fuse, for the samples to run.

``torch._transformer_encoder_layer_fwd`` (the eval fast path of ``nn.TransformerEncoderLayer``)
is one node in the captured graph; its samples run its composite instead, each operator named
as the unfused module names it, so the digit map reads the same with or without the fast path.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx

from ..capture.naming import module_path, qualified_name
from ..capture.opsets import COMPOSITE_KINDS, node_kind

__all__ = ["expand_composites"]

class _SubGraph:
    """Emits the composite of one fused node into a graph: each operator carries the fused
    node's metadata with the submodule it belongs to (``layers.0`` + ``.self_attn``), so its
    stable name is the one the unfused module gives it (``layers.0.self_attn/...#0``)."""

    def __init__(self, graph: torch.fx.Graph, fused: torch.fx.Node) -> None:
        self.graph, self.fused, self.kinds = graph, fused, []
        stack = dict(fused.meta.get("nn_module_stack") or {})
        self.stack = stack
        self.raw = str(list(stack.values())[-1][0]) if stack else ""

    def call(self, sub: str, fn: Callable, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(fn, args, kwargs)
        node.meta = {k: v for k, v in self.fused.meta.items() if k != "example_value"}
        if sub:
            path = f"{self.raw}.{sub}" if self.raw else sub
            node.meta["nn_module_stack"] = {**self.stack, f"fxstab.{sub}": (path, torch.nn.Module)}
        self.kinds.append(node_kind(node))
        return node


def _encoder_layer_composite(b: _SubGraph, src, embed_dim, num_heads, qkv_weight, qkv_bias,
                             proj_weight, proj_bias, use_gelu, norm_first, eps, norm_weight_1,
                             norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                             ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """``torch._transformer_encoder_layer_fwd`` (the eval fast path of
    ``nn.TransformerEncoderLayer``, batch first) as the operators the module runs without the
    fast path: self-attention (``F.multi_head_attention_forward``), residual adds, layer
    norms, the feed-forward linears and activation. Dropout is the identity there (eval)."""
    import torch.nn.functional as F

    def attention(x):
        q = b.call("self_attn", torch.transpose, x, 1, 0)
        kw: dict = {}
        if mask is not None:
            if mask_type == 1:
                kw["key_padding_mask"] = mask
            elif mask_type == 2:  # merged [B, H, T, S] -> [B * H, T, S]
                kw["attn_mask"] = b.call("self_attn", torch.flatten, mask, 0, 1)
            else:
                kw["attn_mask"] = mask
        out = b.call("self_attn", F.multi_head_attention_forward, q, q, q, embed_dim, num_heads,
                     qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias,
                     training=False, need_weights=False, **kw)
        out = b.call("self_attn", operator.getitem, out, 0)
        return b.call("self_attn", torch.transpose, out, 1, 0)

    def feed_forward(x):
        h = b.call("linear1", F.linear, x, ffn_weight_1, ffn_bias_1)
        h = b.call("", F.gelu if use_gelu else F.relu, h)
        return b.call("linear2", F.linear, h, ffn_weight_2, ffn_bias_2)

    def norm(sub, x, w, bias):
        return b.call(sub, F.layer_norm, x, (embed_dim,), w, bias, eps)

    x = src
    if norm_first:
        x = b.call("", operator.add, x, attention(norm("norm1", x, norm_weight_1, norm_bias_1)))
        return b.call("", operator.add, x, feed_forward(norm("norm2", x, norm_weight_2,
                                                              norm_bias_2)))
    x = norm("norm1", b.call("", operator.add, x, attention(x)), norm_weight_1, norm_bias_1)
    return norm("norm2", b.call("", operator.add, x, feed_forward(x)), norm_weight_2, norm_bias_2)


_COMPOSITES = {"transformer_encoder_layer_fwd": _encoder_layer_composite}


def expand_composites(graph: torch.fx.Graph, composites: dict) -> torch.fx.Graph:
    """The graph the stochastic path runs: ``graph`` itself, or a copy in which each fused
    operator of :data:`fxstab.capture.opsets.COMPOSITE_KINDS` is replaced by its composite;
    ``composites`` gets, per fused node name, (kind, the composite's kinds, qualified name)."""
    if not any(n.op == "call_function" and node_kind(n) in COMPOSITE_KINDS for n in graph.nodes):
        return graph
    new = torch.fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        kind = node_kind(node)
        if node.op == "call_function" and kind in COMPOSITE_KINDS:
            b = _SubGraph(new, node)
            args = torch.fx.node.map_arg(node.args, lambda m: env[m])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda m: env[m])
            env[node] = _COMPOSITES[kind](b, *args, **kwargs)
            composites[node.name] = (kind, tuple(b.kinds),
                                     qualified_name(module_path(node), kind))
        else:
            env[node] = new.node_copy(node, lambda m: env[m])
    return new

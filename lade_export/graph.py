"""The exportable decoder step and its ONNX export (parity checks: :mod:`lade_export.export.parity`).

:class:`DecoderStep` re-expresses a transformers ``LlamaForCausalLM`` forward pass with
the inputs lookahead decoding needs (see :mod:`lade_export.specs` for the contract):

    input_ids        int64 [batch, step]
    position_ids     int64 [batch, step]            RoPE positions, need not be contiguous
    attention_mask   bool  [batch, 1, step, past+step]  True = may attend
    logits_positions int64 [batch, n_logits]         rows of the step whose logits are read
    past_key_values.{i}.key/.value  float [batch, past, kv_heads, head_dim]

and the outputs

    logits           float [batch, n_logits, vocab]
    next_token_ids   int64 [batch, n_logits]         argmax of logits
    present.{i}.key/.value  float [batch, step, kv_heads, head_dim]   this step only

The cache is sequence-major ([batch, seq, kv_heads, head_dim]): the runtime keeps one
buffer per tensor and feeds the filled prefix ``buffer[:, :past]``, which is contiguous,
so no step copies the context on the host. Attention reads the cache and this step's
keys/values as two blocks (scores over ``[past | step]`` concatenated, the value
products summed), so the graph never concatenates the cache either.

It reuses the checkpoint's own modules (embedding, RMSNorm, projections, MLP, LM head,
rotary inverse frequencies), so weights are shared, tied embeddings stay tied and the
arithmetic is the reference's. Attention follows the LLaMA formulation (Touvron et al.
2023, arXiv 2302.13971): RoPE (Su et al. 2021, arXiv 2104.09864) on queries and keys,
grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) by repeating each
key/value head ``heads / kv_heads`` times, softmax in float32.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.onnx.operators
from torch import nn

from .feeds import example_feeds
from .specs import (
    ModelDims,
    dynamic_axes,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
    step_io_specs,
)
from .export.rope import plan_rope

def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: Tokens of rotary table past the declared context in a ``group-query-attention`` graph:
#: the widest decode step it accepts (a profile's ``max_step``).
STEP_ROOM = 1024

#: ``DecoderStep(attention=...)``: attention as ONNX operators (every engine) or as ONNX
#: Runtime's fused ``com.microsoft.GroupQueryAttention`` (ONNX Runtime only).
ATTENTION_KINDS = ("onnx-ops", "group-query-attention")


class _GroupQueryAttention(torch.autograd.Function):
    """One layer's RoPE + grouped-query attention over a shared, head-major KV cache buffer,
    exported as ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (ContribOperators.md).

    Inputs: ``q`` float [b, step, heads·hd], ``k``/``v`` float [b, step, kv_heads·hd] (before
    RoPE); ``past_k``/``past_v`` float [b, kv_heads, capacity, hd], the first
    ``total − step`` positions filled; ``seqlens_k`` int32 [b] = total − 1; ``total`` int32
    scalar = past + step; ``cos_cache``/``sin_cache`` float [max_context + STEP_ROOM, hd/2] (already
    times the rope attention scale); ``position_ids`` int64 [b, step]; ``bias`` float
    [b, 1, step, total], 0 where the lookahead mask allows a column and the float minimum
    where it does not.

    Returns ``(out [b, step, heads·hd], present_k, present_v)``: the presents are the cache
    buffers with this step's (rotated) keys and values at ``[past, total)``. ONNX Runtime
    writes them in place when the caller binds each present output to its past input's
    memory; the eager forward here returns updated copies (it is the reference, not the
    fast path). ONNX Runtime's kernel also masks columns after a row's own position
    (causal over the feed order); every lookahead mask is lower-triangular over the step,
    so the bias alone decides.
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias,
                heads: int, kv_heads: int, scale: float):
        b, s, _ = q.shape
        hd = past_k.shape[-1]
        end = int(total)
        cos = cos_cache[position_ids]  # [b, step, hd/2]
        sin = sin_cache[position_ids]
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(2)  # [b, step, 1, hd]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(2)
        q = q.view(b, s, heads, hd)
        k = k.view(b, s, kv_heads, hd)
        q = q * cos + _rotate_half(q, hd // 2) * sin
        k = k * cos + _rotate_half(k, hd // 2) * sin
        present_k, present_v = past_k.clone(), past_v.clone()
        present_k[:, :, end - s:end] = k.transpose(1, 2)
        present_v[:, :, end - s:end] = v.view(b, s, kv_heads, hd).transpose(1, 2)
        group = heads // kv_heads
        keys = present_k[:, :, :end].repeat_interleave(group, dim=1)  # [b, heads, total, hd]
        values = present_v[:, :, :end].repeat_interleave(group, dim=1)
        scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)) * scale + bias  # [b, heads, step, total]
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(b, s, heads * hd)
        return out, present_k, present_v

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache, position_ids, bias,
                 heads, kv_heads, scale):
        out, present_k, present_v = g.op(
            "com.microsoft::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total, cos_cache, sin_cache,
            position_ids, bias, num_heads_i=heads, kv_num_heads_i=kv_heads, do_rotary_i=1, scale_f=scale, outputs=3)
        out.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


class DecoderStep(nn.Module):
    """One decoder forward pass over ``step`` new tokens with an external KV cache.

    Args:
        hf_model: a transformers ``LlamaForCausalLM`` (float32, eval mode).

    Attributes:
        rope: the :class:`lade_export.export.rope.RopePlan` of the checkpoint's rotary embedding.
        dims: :class:`ModelDims`, with ``max_context`` = ``rope.declared_context`` (the
            context over which the graph is exact against transformers).

    Raises:
        ModelSourceError: a rope configuration the export refuses (:func:`lade_export.export.rope.plan_rope`).

    ``forward(input_ids, position_ids, attention_mask, logits_positions, *past)`` takes
    ``past`` as ``2·num_layers`` tensors (key, value per layer) and returns
    ``(logits, next_token_ids, *present)`` — shapes in the module docstring.
    """

    def __init__(self, hf_model, attention: str = "onnx-ops"):
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        self.attention = attention
        config = hf_model.config
        self.rope = plan_rope(config)
        # The declared context stops where transformers' rope starts to depend on the call (see lade_export.export.rope).
        self.dims = dataclasses.replace(ModelDims.from_config(config), max_context=self.rope.declared_context)
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        rotary = inner.rotary_emb
        # The frequencies as initialised: transformers overwrites ``inv_freq`` in place after a call past a
        # longrope/dynamic threshold, while ``original_inv_freq`` keeps the values every shorter call uses.
        inv_freq = getattr(rotary, "original_inv_freq", None)
        inv_freq = rotary.inv_freq if inv_freq is None else inv_freq
        self.register_buffer("inv_freq", inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.scale = 1.0 / math.sqrt(self.dims.head_dim)
        if attention == "group-query-attention":
            # cos/sin of every position a step can reach, computed as forward() computes them for one position. ONNX
            # Runtime's kernel wants a row per key (past + step ≤ rows): the declared context plus room for the
            # widest step that starts near its end (the runtime refuses profiles wider than STEP_ROOM on it).
            rows = self.dims.max_context + STEP_ROOM
            angles = torch.arange(rows, dtype=torch.float32).unsqueeze(-1) * self.inv_freq.float()
            self.register_buffer("cos_cache", angles.cos() * self.rope_scale, persistent=False)  # [rows, hd/2]
            self.register_buffer("sin_cache", angles.sin() * self.rope_scale, persistent=False)

    @property
    def kv_layout(self) -> str:
        """``"sequence-major"`` (past [b, past, kv, hd], presents this step only) or
        ``"head-major-shared"`` (past and present: the same [b, kv, capacity, hd] buffer)."""
        return "head-major-shared" if self.attention == "group-query-attention" else "sequence-major"

    def _attention(self, layer, h, cos, sin, mask, past_k, past_v, b, s, past_len):
        d = self.dims
        attn = layer.self_attn
        q = attn.q_proj(h).view(b, s, d.heads, d.head_dim)  # [b, step, heads, hd]
        k = attn.k_proj(h).view(b, s, d.kv_heads, d.head_dim)  # [b, step, kv, hd]
        v = attn.v_proj(h).view(b, s, d.kv_heads, d.head_dim)  # [b, step, kv, hd]
        q = q * cos + _rotate_half(q, d.head_dim // 2) * sin  # cos, sin [b, step, 1, hd]
        k = k * cos + _rotate_half(k, d.head_dim // 2) * sin
        group = d.heads // d.kv_heads
        # Grouped-query attention: query head j reads kv head j // group.
        q = q.transpose(1, 2).reshape(b, d.kv_heads, group * s, d.head_dim)  # [b, kv, group*step, hd]
        # Scores against the cache and against this step, side by side: [b, kv, group*step, past+step].
        scores = torch.cat([torch.matmul(q, past_k.permute(0, 2, 3, 1)),  # cache [b, past, kv, hd] -> [b, kv, hd, past]
                            torch.matmul(q, k.permute(0, 2, 3, 1))], dim=-1) * self.scale
        scores = scores.view(b, d.kv_heads, group, s, -1)
        scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)  # mask [b,1,1,step,total]
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(b, d.kv_heads, group * s, -1)
        out = (torch.matmul(probs[..., :past_len], past_v.transpose(1, 2))  # [b, kv, group*step, hd]
               + torch.matmul(probs[..., past_len:], v.transpose(1, 2)))
        out = out.view(b, d.heads, s, d.head_dim).transpose(1, 2).reshape(b, s, d.heads * d.head_dim)
        return attn.o_proj(out), k, v

    def forward(self, input_ids, position_ids, attention_mask, logits_positions, *past):
        h = self.embed_tokens(input_ids)  # [b, step, hidden]
        # Angles in float32 whatever the compute dtype (as transformers does): float16 holds integers only to 2048.
        freqs = position_ids.unsqueeze(-1).float() * self.inv_freq.float()  # [b, step, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).unsqueeze(2).to(h.dtype)  # [b, step, 1, hd]
        sin = (emb.sin() * self.rope_scale).unsqueeze(2).to(h.dtype)
        presents = []
        # Shapes read once: the exporter then emits one Shape chain for all layers.
        b, s = input_ids.shape
        if self.attention == "group-query-attention":
            return self._forward_fused(h, position_ids, attention_mask, logits_positions, past, b)
        past_len = past[0].shape[1]
        for i, layer in enumerate(self.layers):
            a, k, v = self._attention(
                layer, layer.input_layernorm(h), cos, sin, attention_mask, past[2 * i], past[2 * i + 1], b, s, past_len
            )
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            presents += [k, v]
        return self._head(h, logits_positions, presents)

    def _head(self, h, logits_positions, presents):
        # Only the rows the decoder reads go through the final norm and the LM head.
        index = logits_positions.unsqueeze(-1).expand(-1, -1, h.shape[-1])  # [b, n_logits, hidden]
        h = self.norm(torch.gather(h, 1, index))
        logits = self.lm_head(h)  # [b, n_logits, vocab]
        return (logits, torch.argmax(logits, dim=-1), *presents)

    def _forward_fused(self, h, position_ids, attention_mask, logits_positions, past, b):
        """``forward`` with each layer's RoPE and attention as one ``GroupQueryAttention``
        over head-major cache buffers [b, kv_heads, capacity, hd] (see :class:`_GroupQueryAttention`)."""
        d = self.dims
        total = torch.onnx.operators.shape_as_tensor(attention_mask)[3].to(torch.int32)  # past + step
        seqlens_k = (total - 1).reshape(1).expand(b)
        bias = torch.where(attention_mask, 0.0, torch.finfo(h.dtype).min).to(h.dtype)  # [b, 1, step, total]
        cos_cache, sin_cache = self.cos_cache.to(h.dtype), self.sin_cache.to(h.dtype)
        presents = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            out, k, v = _GroupQueryAttention.apply(
                attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), past[2 * i], past[2 * i + 1], seqlens_k, total,
                cos_cache, sin_cache, position_ids, bias, d.heads, d.kv_heads,
                self.scale)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            presents += [k, v]
        return self._head(h, logits_positions, presents)


def run_torch_step(step_module: DecoderStep, feeds: dict, want_logits: bool = True) -> dict:
    """Run the PyTorch step on numpy feeds; returns numpy outputs keyed by output name."""
    d = step_module.dims
    past = []
    for i in range(d.num_layers):
        past += [torch.from_numpy(np.ascontiguousarray(feeds[past_key_name(i)])),
                 torch.from_numpy(np.ascontiguousarray(feeds[past_value_name(i)]))]
    with torch.inference_mode():
        outs = step_module(
            torch.from_numpy(feeds["input_ids"]),
            torch.from_numpy(feeds["position_ids"]),
            torch.from_numpy(feeds["attention_mask"]),
            torch.from_numpy(feeds["logits_positions"]),
            *past,
        )
    names = ["logits", "next_token_ids"]
    for i in range(d.num_layers):
        names += [present_key_name(i), present_value_name(i)]
    return {n: o.numpy() for n, o in zip(names, outs)}


def export_onnx(step_module: DecoderStep, path: str | Path, external_data_threshold_bytes: int = 64 << 20,
                opset: int = 17, slim: bool = True, fuse: bool = True) -> Path:
    """Export ``step_module`` to ONNX at ``path`` and run ``onnx.checker`` on it.

    With ``slim`` (default) the exporter's shape arithmetic is folded away with onnxslim
    (:func:`lade_export.export.sanitize.slim_model`): on SmolLM2 that removes over half of the
    nodes and makes an ONNX Runtime step faster, for greedy and lookahead alike
    (bench/results/design-figures.md, *Graph export*).
    With ``fuse`` (default) the MatMuls that share an input (query/key/value, gate/up)
    become one MatMul each (:func:`lade_export.export.fusion.fuse_sibling_matmuls`).

    Weights go to an external data file ``<name>.data`` beside the model when the
    parameters exceed ``external_data_threshold_bytes``. Uses the TorchScript-based
    exporter (``dynamo=False``) with dynamic axes for batch, step, past and n_logits.

    Returns:
        the ONNX model path.

    Raises:
        onnx.checker.ValidationError: the exported graph is invalid.
    """
    import onnx

    path = Path(path)
    d = step_module.dims
    layout = getattr(step_module, "kv_layout", "sequence-major")  # wrappers (reduced precision) are onnx-ops
    fused_attention = getattr(step_module, "attention", "onnx-ops") == "group-query-attention"
    inputs, outputs = step_io_specs(d.num_layers, d.kv_heads, d.head_dim, d.vocab, kv_layout=layout)
    feeds = example_feeds(d, step=3, past=2, kv_layout=layout)
    args = tuple(torch.from_numpy(feeds[s.name]) for s in inputs)
    tmp = path.with_name(path.name + ".raw")
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        # The fused step's eager forward reads its total length as a Python int, which the trace
        # warns about from this module; the exported op takes that length from its input instead
        # (the parity checks against PyTorch and transformers hold the graph to account).
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"lade_export\.graph")
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export",
                                category=DeprecationWarning)  # dynamo=False is chosen (see above)
        torch.onnx.export(
            step_module,
            args,
            str(tmp),
            input_names=[s.name for s in inputs],
            output_names=[s.name for s in outputs],
            dynamic_axes=dynamic_axes(inputs + outputs),
            opset_version=opset,
            do_constant_folding=True,
            custom_opsets={"com.microsoft": 1} if fused_attention else None,
            dynamo=False,
        )
    model = onnx.load(str(tmp))
    if d.tied_embeddings:
        _retie_embeddings(model)
    if slim:
        from .export.sanitize import slim_model

        model = slim_model(model)
    if fuse:
        from .export.fusion import fuse_sibling_matmuls, pack_qkv_into_attention

        fuse_sibling_matmuls(model)
        if fused_attention:
            pack_qkv_into_attention(model)
    _stamp_io_shapes(model, inputs + outputs)
    onnx.helper.set_model_props(model, {**{k: str(v) for k, v in d.as_dict().items()},
                                        "attention": "group-query-attention" if fused_attention else "onnx-ops",
                                        "kv_layout": layout,
                                        **({"step_room": str(STEP_ROOM)} if layout != "sequence-major" else {})})
    nbytes = sum(p.numel() * p.element_size() for p in step_module.parameters())
    external = nbytes > external_data_threshold_bytes
    data_name = path.name + ".data"
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    for leftover in tmp.parent.glob(tmp.name + "*"):
        leftover.unlink()
    onnx.checker.check_model(str(path), full_check=True)
    return path


def _stamp_io_shapes(model, specs) -> None:
    """Write the declared symbolic/fixed dims of every graph input and output (the
    exporter leaves generated names such as ``Addpresent.0.key_dim_3`` on some outputs)."""
    by_name = {s.name: s for s in specs}
    for value in list(model.graph.input) + list(model.graph.output):
        spec = by_name.get(value.name)
        if spec is None:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for sym in spec.shape:
            dim = dims.add()
            if isinstance(sym, str):
                dim.dim_param = sym
            else:
                dim.dim_value = sym


def _retie_embeddings(model) -> None:
    """Keep tied embeddings tied in the ONNX file.

    Constant folding turns the LM head's ``embed_tokens.weight`` transpose into a second
    [hidden, vocab] initializer, doubling the largest tensor on disk. Replace that
    initializer by a ``Transpose`` node of the embedding (ONNX Runtime folds it once at
    session creation).
    """
    import onnx
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    embed = inits.get("embed_tokens.weight")
    if embed is None:
        return
    vocab, hidden = embed.dims
    embed_arr = numpy_helper.to_array(embed)
    for init in list(model.graph.initializer):
        if list(init.dims) == [hidden, vocab] and np.array_equal(numpy_helper.to_array(init), embed_arr.T):
            model.graph.initializer.remove(init)
            node = onnx.helper.make_node("Transpose", ["embed_tokens.weight"], [init.name], perm=[1, 0],
                                         name="lm_head_tied_transpose")
            model.graph.node.insert(0, node)

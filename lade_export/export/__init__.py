"""The export side: from a checkpoint to a built artifact. Needs the ``export`` extra
(torch, transformers, onnx, onnxscript); decoding a built artifact needs none of it.

==========================  ===============================================================
module                      job
==========================  ===============================================================
``model_source``            load a checkpoint: HF directory, GGUF file, hub id, shipped name
``gguf_repair``             mend GGUF metadata transformers' loader refuses
``rope``                    every LLaMA rope variant, exact over the declared context
``fusion``                  sibling MatMuls (q/k/v, gate/up) fused into one each
``sanitize``                onnxslim folding and graph clean-up
``quantize``                int4/int8 graphs (``MatMulNBits`` or this project's kernels), quality report
``quantized_ops``           the ONNX nodes of quantized MatMuls and embeddings
``weight_blocks``           block quantization grids and the kernels' lane packing (numpy)
``attention_rows``          the int8 path's attention swapped for the kernels' ``AttentionRows``,
                            then each layer's for one ``RotaryAttentionRows``
``row_fusion``              the int8 path's norms, SwiGLU and residual adds folded into ``MatMulBlockQ``
``graph_match``             the lookups and checks those two rewrites share
``precision``               graphs exported in float16/bfloat16 for TensorRT
``parity``                  ONNX Runtime against PyTorch and transformers on real prompts
``optimization_profiles``   TensorRT optimization profiles (min/opt/max shapes) per lookahead profile
``tensorrt_build``          TensorRT engines built from the step graph (``backends.tensorrt`` runs them)
``build_options``           the build's flags and the checks that they go together
``build_checks``            the build's tokenizer and transformers parity checks
``build``                   the pipeline that writes an artifact (``lade-export build``)
``check``                   re-validate a built artifact (``lade-export check``)
``torch_engine``            the PyTorch reference engine (``backend="torch"``)
==========================  ===============================================================

The exportable step itself is :mod:`lade_export.graph` (the design card's path). Importing
this package registers the PyTorch reference engine with :mod:`lade_export.backends`
(the engines package imports no export code); torch itself is imported only when that
engine is opened.
"""

from ..backends import register_backend


def _open_torch(artifact, **options):
    from .torch_engine import open_torch_engine

    return open_torch_engine(artifact, **options)


register_backend("torch", _open_torch)

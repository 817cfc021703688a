"""Quantization: the format table (formats.py), the math (quantizer.py, the single source of truth;
kernels/ its fused Triton INT8 version), checkpoint streaming (quantize.py), the compressed-tensors
`quantization_config` (quant_config.py) and which linears stay BF16 (mixed.py). Pure torch: no engine
imports; quantize, profile, verify, tune and the runtime all go through here."""

"""Fused GPU kernels for the hot path of a weight sync (same math as flashrl_tools/quant/quantizer.py)."""

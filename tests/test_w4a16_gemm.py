"""flashrl's few-rows W4A16 GEMM (`quant/kernels/w4a16_gemm.py`, issue 75's tail): the float32 product of the
same dequantized weights to the output's 16-bit step, on the checkpoint's own packed layout, for tiles that do not
divide the layer (rows, output channels, a last K tile of fewer groups) and a bias; its refusals. On CPU through
Triton's interpreter (its own process: Triton reads TRITON_INTERPRET at import); on a GPU the compiled kernel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashrl_tools.quant import quantizer
from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.quant.kernels import w4a16_gemm
from flashrl_tools.quant.packing import pack_int4

REPO = Path(__file__).resolve().parents[1]
CASES = [  # rows, out, in, bias, tiles (None: default_config's)
    (1, 64, 256, False, None),
    (5, 96, 384, True, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}),
    (16, 40, 512, False, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}),
    (33, 32, 256, True, None),
    (70, 136, 384, True, None),  # past MAX_ROWS: tiles of rows, the last one partial
    (7, 96, 384, True, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SWAP_AB": True}),  # out^T = W . x^T
    (3, 40, 640, True, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 3}),  # 5 K tiles in 3 splits (2, 2, 1)
    (9, 64, 512, False, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP_AB": True}),
    (70, 40, 384, True, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8}),  # more splits than tiles: 3
]


def _layer(n: int, k: int, dtype: torch.dtype, device: str, seed: int):
    """A W4A16 layer as the package's quantizer makes it: packed codes, group scales (and its BF16 source)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
    q = quantizer.quantize_weight(QuantFn.w4a16, w)
    return w, pack_int4(q.weight), q.weight_scale.contiguous(), q


def _check(dtype: torch.dtype, device: str) -> None:
    for i, (m, n, k, has_bias, cfg) in enumerate(CASES):
        w, packed, scale, q = _layer(n, k, dtype, device, i)
        x = torch.randn(m, k, device=device).to(dtype)
        bias = (torch.randn(n, device=device) * 0.1).to(dtype) if has_bias else None
        out = w4a16_gemm.w4a16_mm(x, packed, scale, bias, cfg)
        ref = w4a16_gemm.reference(x, packed, scale, bias)
        step = 2.0 ** -(10 if dtype == torch.float16 else 7)  # one 16-bit step of the largest output
        assert out.dtype == dtype and out.shape == (m, n)
        assert float((out.float() - ref).abs().max()) <= step * float(ref.abs().max()), (m, n, k, has_bias)
        # the reference is the quantizer's own dequantization (up to the 16-bit rounding of code x scale)
        deq = quantizer.dequantize(QuantFn.w4a16, q).float()
        direct = x.float() @ deq.T + (bias.float() if has_bias else 0)
        assert float((direct - ref).abs().max()) <= step * float(ref.abs().max())
        assert torch.equal(out, w4a16_gemm.w4a16_mm(x, packed, scale, bias, cfg))  # one summation order
        plain = {**(cfg or w4a16_gemm.default_config(m, n, k)), "MAGIC": False}  # int -> float: the same weights
        assert torch.equal(out, w4a16_gemm.w4a16_mm(x, packed, scale, bias, plain))


def _interpreted_check() -> None:
    """Run inside a process started with TRITON_INTERPRET=1: FP16 (the interpreter multiplies BF16 as integers;
    the GPU test covers BF16)."""
    _check(torch.float16, "cpu")


def test_w4a16_few_rows_matches_the_float32_reference():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU: test_w4a16_few_rows_compiled_matches_the_reference runs the kernel itself")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_w4a16_gemm import "
            "_interpreted_check; _interpreted_check()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernel)")
def test_w4a16_few_rows_compiled_matches_the_reference():
    _check(torch.bfloat16, "cuda")
    _check(torch.float16, "cuda")


def test_w4a16_few_rows_takes_only_packed_layers():
    """A layout that is not a packed W4A16 layer's is refused in one line."""
    _, packed, scale, _ = _layer(32, 256, torch.float16, "cpu", 0)
    x = torch.randn(2, 256).half()
    for args in [(torch.randn(2, 384).half(), packed, scale),  # K does not match the codes
                 (x, packed, scale.float()),  # scales of another dtype than the activations
                 (x, packed.to(torch.int64), scale),
                 (x, packed, scale[:, :1])]:
        with pytest.raises(ValueError, match="not a packed W4A16 layer's layout"):
            w4a16_gemm.w4a16_mm(*args)
    with pytest.raises(ValueError, match="not a multiple of the 128-column group"):
        w4a16_gemm.w4a16_mm(x, packed, scale, None, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64})


def test_small_m_w4a16_benchmark_refuses_without_a_hopper_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU: the benchmark runs there")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "small_m_w4a16.py"), "--shapes", "7b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs a Hopper GPU" in r.stderr and "Traceback" not in r.stderr


class _Config:  # what vLLM's MPLinearLayerConfig says of a compressed-tensors W4A16 layer
    group_size, zero_points, has_g_idx, act_type = w4a16_gemm.GROUP, False, False, torch.float16
    weight_type = "uint4b8"  # vLLM's scalar_types.uint4b8 prints so

    def __init__(self, k: int = 256, n: int = 48):
        self.partition_weight_shape = (k, n)  # [in, out]


class _Machete:
    w_q_name, w_s_name = "weight_packed", "weight_scale"

    def __init__(self, k: int = 256, n: int = 48):
        self.config = _Config(k, n)


def _machete_must_not_run(*args, **kwargs):
    raise AssertionError("Machete ran")


def _hooked_layer_check() -> None:
    """Run with TRITON_INTERPRET=1 and FLASHRL_W4A16_GEMM=1: a Machete layer under the hooks keeps the checkpoint's
    packed layout and its forward is flashrl's GEMM (the custom op), at few rows and past MAX_ROWS."""
    from flashrl_tools.runtime.vllm import w4a16_gemm as hook

    hook.on_gpu = lambda w: True  # the interpreter runs the GPU path on CPU tensors
    _, packed, scale, _ = _layer(48, 256, torch.float16, "cpu", 3)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(packed.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    assert hook.process_weights_after_loading(_machete_must_not_run, _Machete(), layer) is None
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_scale, scale)
    assert hook.apply_weights(_machete_must_not_run, _Machete(), layer, torch.randn(0, 256).half()).shape == (0, 48)
    bias = torch.randn(48).half()
    for rows in (3, 70):
        x = torch.randn(2, rows, 256).half()  # vLLM's activations may carry leading dimensions
        out = hook.apply_weights(_machete_must_not_run, _Machete(), layer, x, bias)
        ref = w4a16_gemm.reference(x.reshape(-1, 256), packed, scale, bias).reshape(2, rows, 48)
        assert out.shape == (2, rows, 48)
        assert float((out.float() - ref).abs().max()) <= 2 ** -10 * float(ref.abs().max())


def test_machete_layers_keep_their_layout_and_run_flashrls_gemm_under_the_switch():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU: the engine tests run the switch")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_w4a16_gemm import "
            "_hooked_layer_check; _hooked_layer_check()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "FLASHRL_W4A16_GEMM": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("switch", ["0", "1"])
def test_machete_keeps_its_own_path_unless_the_switch_takes_the_layer(monkeypatch, switch):
    """Switch off, or a layer it does not take (a CPU tensor; zero points; GPTQ's transposed layout; scales not of
    the activations' dtype): Machete's processing and forward run."""
    from flashrl_tools.runtime.vllm import w4a16_gemm as hook

    monkeypatch.setenv("FLASHRL_W4A16_GEMM", switch)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.int32), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(8, 1).half(), requires_grad=False)
    calls = []
    machete = _Machete(128, 8)
    assert hook.process_weights_after_loading(lambda *a: calls.append("process") or "p", machete, layer) == "p"
    assert hook.apply_weights(lambda *a: calls.append("apply") or "a", machete, layer, torch.ones(1, 128)) == "a"
    assert calls == ["process", "apply"]
    monkeypatch.setattr(hook, "on_gpu", lambda w: True)
    zero_points = _Machete(128, 8)
    zero_points.config.zero_points = True
    assert hook.serves(machete, layer) is (switch == "1") and not hook.serves(zero_points, layer)
    assert not hook.serves(_Machete(128 * 8, 16), layer)  # GPTQ's [K / 8, N] codes: not the layout the kernel reads
    layer.weight_scale = torch.nn.Parameter(torch.ones(8, 1), requires_grad=False)  # scales of another dtype
    assert not hook.serves(machete, layer)


def test_w4a16_gemm_switch_is_vllms_and_refused_on_sglang():
    """FLASHRL_W4A16_GEMM=1 is read as a switch; SGLang (its Marlin kernel) refuses it at start in one line."""
    from flashrl_tools.config.settings import Settings
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.core.adapter import check_settings
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES as SGLANG
    from flashrl_tools.runtime.vllm.capabilities import GPU

    on = Settings.read({"FLASHRL_W4A16_GEMM": "1"})
    assert on.w4a16_gemm and not Settings.read({}).w4a16_gemm
    check_settings(GPU, on, "test")
    check_settings(SGLANG, Settings.read({"FLASHRL_W4A16_GEMM": "0"}), "test")
    with pytest.raises(FlashRLError, match="FLASHRL_W4A16_GEMM=1 is not honoured on SGLang"):
        check_settings(SGLANG, on, "test")


def _hopper_ptx(block_m: int, block_n: int, block_k: int, swap: bool, warps: int = 4, split: int = 1) -> str:
    """The kernel compiled for sm_90 on this host (Triton's NVIDIA backend and its bundled ptxas; no GPU), with the
    divisibility the JIT gives a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = w4a16_gemm._kernels()[0]
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32"}
    const = dict(HAS_BIAS=False, GROUP_K=w4a16_gemm.GROUP, SWAP_AB=swap, SPLIT_K=split, MAGIC=True, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block_k)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")}
    return triton.compile(ASTSource(k, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=3)).asm["ptx"]


def test_w4a16_kernel_compiles_for_hopper_and_swapped_tiles_take_the_warpgroup_mma():
    """The kernel builds for sm_90 with 16-byte asynchronous copies of the codes and activations (split-K too); at few rows
    SWAP_AB makes the dequantized weights the 64-row operand of Hopper's warpgroup MMA (m64n16), the plain
    orientation an MMA of 16 rows; past MAX_ROWS the rows' tiles take the warpgroup MMA as they are."""
    pytest.importorskip("triton.backends.nvidia")
    swapped, plain = _hopper_ptx(16, 64, 256, True), _hopper_ptx(16, 64, 256, False)
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in swapped and "wgmma" not in plain
    assert "mma.sync.aligned" in plain
    wide = _hopper_ptx(64, 128, 128, False, warps=8)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in wide
    for ptx in (swapped, plain, wide, _hopper_ptx(16, 32, 256, False, split=4)):  # a split starts on a whole tile
        assert "0x10" in set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]+\], \[[^]]+\], (0x\w+)", ptx))


@pytest.mark.parametrize("dtype,base,offset", [(torch.bfloat16, 0x4300, 136.0), (torch.float16, 0x6400, 1032.0)])
def test_magic_dequantization_gives_the_codes_exactly(dtype, base, offset):
    """MAGIC's bit trick: `base | n` read as a 16-bit float is 2^7 + n (BF16) / 2^10 + n (FP16), so subtracting
    `offset` gives the code n - 8 exactly for every nibble (the interpreter test runs FP16; a GPU, BF16 too)."""
    n = torch.arange(16, dtype=torch.int16)
    assert torch.equal((n | base).view(dtype) - offset, (n - 8).to(dtype))

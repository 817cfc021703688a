# ruff: noqa  (an experiment; its results: benchmarks/results/decode_attention/where_time_goes.json)
"""Compile a lab kernel for sm_90 on this CPU host (Triton's bundled ptxas): compile errors and SASS counts without a GPU."""
import sys
import re
sys.path.insert(0, 'lab'); sys.path.insert(0, '.')
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import da_vconv as v

def compile_variant(km, vm, rs, bn, nw, ns, hpp=2, group=4, splits=2):
    sig = {n: '*fp8e4nv' if n in ('q_ptr', 'k_ptr', 'v_ptr') else '*i32' if n in ('bt_ptr', 'lens_ptr', 'qsl_ptr')
           else '*fp32' for n in ('q_ptr','k_ptr','v_ptr','bt_ptr','lens_ptr','qsl_ptr','qs_ptr','ks_ptr','vs_ptr','out_ptr','part_ptr','lse_ptr')}
    sig['out_ptr'] = '*bf16'
    sig['sm_scale'] = 'fp32'
    for n in ('stride_qt','stride_qh','stride_kb','stride_ks','stride_kh','stride_vb','stride_vs','stride_vh','stride_bt','stride_ot','stride_oh','q_heads'):
        sig[n] = 'i32'
    const = dict(GROUP=group, GROUP_PAD=16, D=128, PAGE=16, BLOCK_N=bn, SPLITS=splits, HPP=hpp, K_MODE=km, V_MODE=vm, RANGE_STAGES=rs)
    for k in const: sig[k] = 'constexpr'
    attrs = {(i,): [['tt.divisibility', 16]] for i, n in enumerate(sig) if n.endswith('_ptr') or n.startswith('stride') and n not in ()}
    src = ASTSource(v.split_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget('cuda', 90, 32), options=dict(num_warps=nw, num_stages=ns))

if __name__ == '__main__':
    for name, cfg in v.VARIANTS.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]: continue
        try:
            k = compile_variant(*cfg)
            sass = k.asm.get('sass', '') or ''
            ptx = k.asm['ptx']
            cnt = {op: len(re.findall(op, ptx)) for op in ('cp.async', 'ldmatrix', 'ld.shared', 'st.shared', 'mma.sync', 'cvt.rn.f16x2.e4m3x2', 'wgmma', 'ld.global')}
            print(name, 'ok', 'regs', k.n_regs if hasattr(k,'n_regs') else '?', 'smem', k.metadata.shared, cnt, flush=True)
        except Exception as e:
            print(name, 'FAIL', str(e)[-600:], flush=True)

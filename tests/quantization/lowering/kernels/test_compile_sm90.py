"""The activation kernels compile for Hopper (sm90) without a GPU: Triton's compiler front end
rejects code the interpreter runs (it did: two return types from one jit function in the fp8 path),
so CI compiles every specialization the CUDA converter launches, in a process without
TRITON_INTERPRET."""

from __future__ import annotations

from tests.quantization.lowering.kernels.kernel_cases import compile_without_interpreter

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compress.quantization.lowering.kernels import quant as q

def comp(fn, ptrs, const):
    names = list(fn.arg_names)
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert len(k.asm["cubin"]) > 0
    print("compiled", fn.__name__, const.get("FP8"), const.get("SINGLE"))

for fp8 in (True, False):
    codes = "*fp8e4nv" if fp8 else "*i8"
    lo, hi = (-448.0, 448.0) if fp8 else (-128, 127)
    for single in (True, False):
        comp(q._per_token_kernel, {"x_ptr": "*fp16", "q_ptr": codes, "scale_ptr": "*fp32", "pqs_ptr": "*fp32"},
             {"QMIN": lo, "QMAX": float(hi), "EPS": 1e-7, "BLOCK_K": 4096, "SINGLE": single, "HAS_PQS": fp8, "FP8": fp8})
    comp(q._static_kernel, {"x_ptr": "*bf16", "q_ptr": codes, "scale_ptr": "*fp32", "pqs_ptr": "*fp32"},
         {"QMIN": lo, "QMAX": hi, "BLOCK": 1024, "HAS_PQS": False, "FP8": fp8})
comp(q._qdq_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", "scale_ptr": "*fp32"}, {"QMIN": 0, "QMAX": 255, "BLOCK": 1024})
'''


def test_activation_kernels_compile_for_sm90() -> None:
    assert compile_without_interpreter(SCRIPT).count("compiled") == 7

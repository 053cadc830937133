"""What a fused epilogue's launch config costs on an H100 / H200 (sm_90), without a GPU: each
launch is compiled ahead of time for sm_90 (Triton's own ptxas) with the arguments the engine
would pass, and its registers, shared memory, programs per SM (occupancy), load widths,
asynchronous copies (cp.async, ``LDGSTS``: a pipelined loop) and tensor-core instructions are
read from the cubin. Latency-bound launches (the LoRA expand at decode sizes) are decided by how
many bytes each SM keeps in flight, which these figures bound; times still come from the GPU
sweeps (epilogue_configs.py, norm_configs.py).

    python -m benchmarks.kernel_resources [--rank 64] [--tokens 32] [--loras 8]
                                          [--b-layout rank-major|column-major]

Llama-3-8B shapes, bf16. The launch is captured where the kernel wrapper calls Triton (the
wrapper runs on CPU tensors, nothing executes), and specialised as Triton's launcher would:
integer arguments equal to 1 become constants, multiples of 16 and tensors are marked 16-byte
divisible. Runs wherever Triton can compile for CUDA (its wheel ships ptxas), e.g. the CI image.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.runtime.jit import JITFunction

from loraplex.engine.model.kernels.add_rmsnorm import NormConfig, lora_add_rmsnorm_triton
from loraplex.engine.model.kernels.qkv_rope import QKVRopeConfig, lora_qkv_rope_triton
from loraplex.engine.model.kernels.silu_mul import SiluMulConfig, lora_silu_mul_triton
from loraplex.engine.model.lora.mapping import LoRAMapping

H, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
SM_REGS, SM_SMEM, SM_WARPS = 65536, 228 * 1024, 64  # sm_90 per-SM limits
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass
class Launch:
    fn: JITFunction
    args: tuple
    kwargs: dict


def capture(call) -> list[Launch]:
    """The Triton launches ``call()`` makes, not run."""
    seen: list[Launch] = []
    real = JITFunction.run

    def fake(self, *args, grid, warmup, **kwargs):  # noqa: ARG001
        seen.append(Launch(self, args, kwargs))

    JITFunction.run = fake
    try:
        call()
    finally:
        JITFunction.run = real
    return seen


def compile_sm90(launch: Launch):
    """The launch compiled for sm_90 with the launcher's specialisations."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, names = launch.fn, launch.fn.arg_names
    options = {
        k: launch.kwargs[k]
        for k in ("num_warps", "num_stages", "enable_fp_fusion")
        if k in launch.kwargs
    }
    values = dict(zip(names, launch.args, strict=False))
    values.update({k: v for k, v in launch.kwargs.items() if k in names})
    const_names = {p.name for p in fn.params if p.is_constexpr}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if name in const_names:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _DTYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v).__name__}")
    return triton.compile(
        ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )


def resources(kernel) -> dict:
    """Registers, shared memory, programs per SM and instruction counts of a compiled kernel."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        run = [os.path.join(tools, "cuobjdump")]
        usage = subprocess.run(
            [*run, "--dump-resource-usage", path], capture_output=True, text=True
        )
        sass = subprocess.run([*run, "-sass", path], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    warps = kernel.metadata.num_warps
    smem = kernel.metadata.shared
    programs = min(
        SM_REGS // (-(-max(regs, 1) // 8) * 8 * 32 * warps),  # per thread in units of 8
        SM_WARPS // warps,
        SM_SMEM // smem if smem else SM_WARPS,
    )
    loads = collections.Counter(re.findall(r"\bLDG\.E(?:\.(?:64|128|U16|U8|S16))?", sass))
    return {
        "regs": regs,
        "smem_kb": smem / 1024,
        "warps": warps,
        "programs_per_sm": programs,
        "ldg128": loads.get("LDG.E.128", 0),
        "ldg_narrow": sum(n for k, n in loads.items() if k != "LDG.E.128"),
        "ldgsts": sass.count("LDGSTS"),
        "hmma": sass.count("HMMA"),
    }


def _b(loras: int, n: int, rank: int, column_major: bool) -> torch.Tensor:
    b = torch.zeros(loras, rank, n, dtype=torch.bfloat16).permute(0, 2, 1)  # (L, n, R)
    return b.contiguous() if column_major else b


def launches(op: str, cfg, t: int, loras: int, rank: int, column_major: bool) -> list[Launch]:
    """The launches of epilogue ``op`` (silu_mul, add_rmsnorm, qkv_rope) under ``cfg``."""
    slots = LoRAMapping(torch.arange(t, dtype=torch.int32) * loras // t)
    bf = torch.bfloat16

    def lora(n: int) -> dict:
        return {"lora_b": _b(loras, n, rank, column_major)}

    if op == "silu_mul":
        y = torch.zeros(t, 2 * INTER + 2 * loras * rank, dtype=bf)
        kw, out = lora(2 * INTER), torch.empty(t, INTER, dtype=bf)
        return capture(lambda: lora_silu_mul_triton(y, mapping=slots, out=out, config=cfg, **kw))
    if op == "add_rmsnorm":
        y = torch.zeros(t, H + loras * rank, dtype=bf)
        kw, res = lora(H), torch.zeros(t, H, dtype=bf)
        w, out = torch.ones(H, dtype=bf), torch.empty(t, H, dtype=bf)
        return capture(
            lambda: lora_add_rmsnorm_triton(
                y, res, mapping=slots, norm_weight=w, eps=1e-5, out=out, config=cfg, **kw
            )
        )
    n = (HQ + 2 * HKV) * D
    y = torch.zeros(t, n + 3 * loras * rank, dtype=bf)
    kw = lora(n)
    pos, cos, sin = torch.arange(t), torch.zeros(4096, D), torch.zeros(4096, D)
    kc = torch.zeros(t, 16, HKV, D, dtype=bf)
    vc, q = torch.zeros_like(kc), torch.empty(t, HQ, D, dtype=bf)
    smap = torch.arange(t) * 16
    return capture(
        lambda: lora_qkv_rope_triton(
            y,
            mapping=slots,
            positions=pos,
            cos=cos,
            sin=sin,
            k_cache=kc,
            v_cache=vc,
            slot_mapping=smap,
            q_out=q,
            config=cfg,
            **kw,
        )  # fmt: skip
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--loras", type=int, default=8)
    ap.add_argument("--b-layout", choices=["rank-major", "column-major"], default="rank-major")
    args = ap.parse_args()
    column_major = args.b_layout == "column-major"
    cases = [("silu_mul", None)]
    cases += [("silu_mul", SiluMulConfig(16, bn, 4, 0)) for bn in (128, 64)]
    cases += [("silu_mul", SiluMulConfig(16, 128, 4, 32))]
    cases += [
        ("qkv_rope", None),
        ("qkv_rope", QKVRopeConfig(2, 4)),
        ("qkv_rope", QKVRopeConfig(16, 4)),
    ]
    cases += [("add_rmsnorm", None)]
    cases += [("add_rmsnorm", NormConfig(bt, 1024, 8, True)) for bt in (1, 2)]
    print(
        f"sm_90, Triton {triton.__version__}, T {args.tokens}, {args.loras} slots of rank "
        f"{args.rank}, B {args.b_layout}"
    )
    print(
        "| op | config | regs | smem KB | warps | programs/SM | LDG.128 | narrower LDG | LDGSTS | HMMA |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op, cfg in cases:
        for launch in launches(op, cfg, args.tokens, args.loras, args.rank, column_major):
            r = resources(compile_sm90(launch))
            name = "engine default" if cfg is None else repr(cfg).split("(", 1)[1].rstrip(")")
            print(
                f"| {op} | {name} | {r['regs']} | {r['smem_kb']:.0f} | {r['warps']} | "
                f"{r['programs_per_sm']} | {r['ldg128']} | {r['ldg_narrow']} | {r['ldgsts']} | "
                f"{r['hmma']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Compile Pallas-Triton kernels' Triton IR to sm_90 (H100 / H200) machine code on a machine without a GPU.

Run as a script, in its own process (`triton`'s LLVM must not share a process with jaxlib's):

    python qwen_mtp/tools/sm90_compile.py < kernels.json > report.json

Input: a JSON list of {"name", "ir" (Triton IR text), "num_warps", "num_stages"}; output: per kernel
{"name", "shared" (bytes of shared memory per block), "registers" (per thread), "local" (bytes of local
memory per thread: register spills), "loops", "error"}; "loops" (when the input has "loops": true) lists each
loop of the machine code (a backward branch) as {"instructions": n, "opcodes": {opcode: count}}, the smallest
first (where loops nest, the innermost): the instruction mix per iteration that the kernels' modules quote. It
uses the `triton` package's compiler and the cuobjdump it ships; XLA compiles the same IR with its own copy of Triton on the GPU, so this is a close proxy, not XLA's
exact pipeline. qwen_mtp.tools.lowering.compile_sm90 is the caller.
"""

import json
import os
import re
import subprocess
import sys
import tempfile


def _compile(kernel, workdir):
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, re.sub(r"[^\w]", "_", kernel["name"]) + ".ttir")
    with open(path, "w") as f:
        f.write(kernel["ir"])
    _make_ttir(path)
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
    cubin = path[:-5] + ".cubin"
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage.split("Function", 1)[1]).group(1))
    out = {"name": kernel["name"], "shared": int(compiled.metadata.shared), "registers": field("REG"),
           "local": field("LOCAL"), "stack": field("STACK"), "error": None}
    if kernel.get("loops"):
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        out["loops"] = loops(sass)
    return out


def _make_ttir(path):
    """Run Triton's own TTIR passes (make_ttir: canonicalize, combine, CSE, ...) on the IR file in place, as
    XLA's Triton pipeline does before lowering it: triton.compile takes an IR file as that stage's output and
    starts after it, so without this a dot's accumulation (dot(a, b, 0) + acc -> dot(a, b, acc)) stays apart."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    context = ir.context()
    ir.load_dialects(context)
    triton.compiler.compiler.make_backend(GPUTarget("cuda", 90, 32)).load_dialects(context)
    module = ir.parse_mlir_module(path, context)
    module.context = context
    CUDABackend.make_ttir(module, {}, None, 90)
    with open(path, "w") as f:
        f.write(str(module))


def loops(sass: str) -> list:
    """Each backward branch's range of the disassembly, with its instruction count and opcode mix (predicates
    and modifiers dropped: "@P0 LDG.E.128" counts as LDG), smallest range first."""
    code = [(int(m.group(1), 16), m.group(2).split()) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for addr, words in code:
        target = re.search(r"0x([0-9a-f]+)", " ".join(words)) if "BRA" in " ".join(words) else None
        if target and int(target.group(1), 16) < addr:
            ops = {}
            for a, w in code:
                if int(target.group(1), 16) <= a <= addr:
                    op = next(x for x in w if not x.startswith("@")).split(".")[0]
                    ops[op] = ops.get(op, 0) + 1
            found.append({"instructions": sum(ops.values()), "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
    return sorted(found, key=lambda r: r["instructions"])


def main():
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # XLA's Triton fuses multiply-adds too
    kernels = json.load(sys.stdin)
    out = []
    with tempfile.TemporaryDirectory() as workdir:
        for kernel in kernels:
            try:
                out.append(_compile(kernel, workdir))
            except Exception as e:  # reported per kernel, the caller decides
                out.append({"name": kernel["name"], "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

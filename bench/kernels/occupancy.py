"""The decode path's Triton kernels compiled for Hopper (sm_90) on a machine without a GPU: each
variant's registers, stack (spills), shared memory, the programs per SM those allow, and for the
split-KV decode kernel how many K/V tiles its software pipeline buffers and keeps in flight while
it computes one. What a tile config or a kernel change does to occupancy and pipelining, known
before a GPU run (bench/history/2026-11-24.md, 2026-11-24k: 64x4x3 buffers one tile and waits for
all of it; 32x4x6 fits five programs per SM, 32x4x7 four).

Needs only Triton (`pip install triton`: its wheel carries ptxas and cuobjdump); no GPU, no CUDA
driver. Shapes are Qwen3-0.6B's layer (hidden 1024, 16 heads, 8 KV heads, head_dim 128,
intermediate 3072, KV blocks of 16); the persistent kernels' constants are the ones their
constructors pick by default on a 132-SM part (the same functions compute them). Pointers and the
integers Triton would specialize are marked 16-byte divisible, as the engine's launches are.

    python3 bench/kernels/occupancy.py --decode-configs 64x4x3,32x4x6,32x4x7 --persistent

CI runs it (tests/test_occupancy.py) and checks the occupancy the decode path is built on: the
split-KV decode at the engine's own config four programs per SM (bench/history/2026-11-23.md,
2026-11-23l: fewer lose), and so the batch decode's attention kernel (rope folded in; its
half-size tiles two buffered, 2026-11-28d), the layer kernel and `--deterministic`'s few-row
batch kernel two (a layer's programs get scheduled, with PDL, beside the layer before;
2026-12-02c), no kernel spilling. It reaches into the kernel
modules' private kernels (`_decode_kernel`, `_splitk_kernel`, ...): compiling them is its job.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import write_json  # noqa: E402
from report import print_table  # noqa: E402

SM_REGS, SM_SHARED, BLOCK_RESERVED = 65536, 228 * 1024, 1024  # H100 / H200, per SM
P = 132  # SMs of an H100 SXM / H200
H, HKV, D, HID, INTER, BLOCK = 16, 8, 128, 1024, 3072, 16
BF16 = "*bf16"
OPTIONS = ("num_warps", "num_stages", "launch_cooperative_grid", "launch_pdl", "enable_fp_fusion")


def _jit(fn: object) -> triton.runtime.jit.JITFunction:
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn  # engine.kernels.launcher.Launcher
    return fn


def compile_sm90(fn: object, types: dict[str, str], consts: dict[str, object], options: dict[str, object],
                 not_divisible: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    """Compile one variant (a Triton or a Gluon kernel): every non-constexpr argument typed by
    `types` (int32 by default)."""
    jit = _jit(fn)
    sig, attrs, constexprs = {}, {}, {}
    # constexpr parameters left out take their defaults, as a launch does
    consts = {**{p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}, **consts}
    for i, name in enumerate(jit.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
            continue
        sig[name] = types.get(name, "i32")
        if name not in not_divisible and sig[name] != "fp32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    if jit.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(fn=jit, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{jit.__name__}.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    shared = kernel.metadata.shared
    threads = 32 * kernel.metadata.num_warps
    return {
        "regs": regs, "stack": stack, "shared": shared,
        "per_sm_regs": SM_REGS // (threads * -(-regs // 8) * 8),
        "per_sm_shared": SM_SHARED // (shared + BLOCK_RESERVED),
        "ttgir": kernel.asm["ttgir"],
    }  # fmt: skip


def decode_kernel(config: tuple[int, int, int]) -> dict[str, object]:
    """The backend's split-KV decode as the batch decode launches it (PDL, one split)."""
    from engine.kernels import attention_decode as td

    block_n, warps, stages = config
    types = {n: BF16 for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", count_ptr="*i32",
                 part_out_ptr="*fp32", part_lse_ptr="*fp32", sm_scale_log2="fp32")  # fmt: skip
    consts = dict(NUM_HEADS=H, GROUP=H // HKV, BLOCK_H=16, HEAD_DIM=D, BLOCK_SIZE=BLOCK, BLOCK_N=block_n, IEEE=False,
                  USE_PDL=True, LINE=64, MERGE=0, stamp_ptr=None, TIMING=False)  # fmt: skip
    out = compile_sm90(td._decode_kernel, types, consts, {"num_warps": warps, "num_stages": stages, "launch_pdl": True},
                       ("num_splits", "stride_bt", "mixed"))  # fmt: skip
    return _pipeline(out, block_n)


def _pipeline(out: dict[str, object], block_n: int) -> dict[str, object]:
    """A split-KV kernel's report with its K/V ring: `buffers` [buffers, BLOCK_N, D] shared tiles,
    and `in_flight`, the tiles the loop's wait leaves in flight (three copy groups per tile: K, V
    and the next page-table load)."""
    ring = re.findall(rf"memdesc<(\d+)x{block_n}x{D}xbf16", out["ttgir"])
    loop = out["ttgir"].split("scf.for", 1)[-1]
    wait = re.search(r"async_wait .*?\{num = (\d+)", loop)
    out["buffers"] = int(ring[0]) if ring else 0
    out["in_flight"] = int(wait.group(1)) // 3 if wait else 0
    return out


def persistent_kernels() -> dict[str, dict[str, object]]:
    """The batch decode's two kernels (persistent, with its `--deterministic` variant; attention),
    the layers' attention kernel (the same on the qkv output), the split-K parts and their norm
    (splitk_kernels) and the fused decode's persistent kernel, with the constants their launches
    take by default (batch_consts.kernel_consts, rope_decode.kernel_consts, fused_decode.layer_consts)."""
    import torch

    from engine.decode import batch_consts, batch_decode, fused_decode
    from engine.decode.rules import LayerShape
    from engine.kernels import rope_decode
    from engine.kernels.batch_kernel import batch_layer_kernel
    from engine.kernels.layer_kernel import decoder_layer_kernel
    from engine.kernels.rope_decode import rope_decode_kernel

    shape = LayerShape(hidden=HID, inter=INTER, nh=H, nkv=HKV, d=D, eps=1e-6, qk_norm=True, device=torch.device("cuda"),
                       dtype=torch.bfloat16)  # fmt: skip
    fp32 = ("o_part_ptr", "down_part_ptr", "qkv_part_ptr", "cos_sin_ptr", "down_prev_ptr", "part_o_ptr", "part_lse_ptr", "down_ptr",
            "ws_m_ptr", "ws_l_ptr", "ws_acc_ptr")
    types = {n: "*fp32" for n in fp32}
    types.update(pos_ptr="*i64", slot_ptr="*i64", t_ptr="*i64", ids_ptr="*i64", bar_ptr="*i32", bt_ptr="*i32", seq_lens_ptr="*i32",
                 eps="fp32", qk_eps="fp32", sm_scale_log2="fp32")  # fmt: skip
    for jit in (batch_layer_kernel, decoder_layer_kernel, rope_decode_kernel):
        types.update({n: BF16 for n in _jit(jit).arg_names if n.endswith("_ptr") and n not in types})
    batch = batch_consts.kernel_consts(shape, P, batch_decode.MAX_ROWS, use_pdl=True)
    batch.update(HEAD=False, TAIL=False, TIMING=False)
    narrow = batch_consts.kernel_consts(shape, P, batch_decode.MAX_ROWS, True, bn=batch_consts.GEMV_BN_FEW)  # steps of few rows
    narrow.update(HEAD=False, TAIL=False, TIMING=False)
    invariant = batch_consts.kernel_consts(shape, P, batch_decode.MAX_ROWS, use_pdl=False, invariant=True)
    invariant.update(HEAD=False, TAIL=False, TIMING=False)
    b = batch_consts  # steps of few rows: 16-row tiles, the fixed-split attention in the launch (ATTEND)
    few = b.kernel_consts(shape, P, batch_decode.MAX_ROWS, use_pdl=True, bk=b.FEW_BK, stages=b.FEW_STAGES, invariant=True, bm=b.FEW_BM,
                          attend_block=BLOCK, everywhere_rows=1)  # fmt: skip
    few.update(HEAD=False, TAIL=False, TIMING=False)
    layer = fused_decode.layer_consts(shape, P, fused_decode.MAX_ROWS, BLOCK, use_pdl=True)
    layer.update(HAS_QKV_BIAS=False, KS_PREV=layer["KS_D"], NORM_EVERYWHERE=True, TIMING=False)
    qkv = (H + 2 * HKV) * D
    tiles = rope_decode.batch_tile_config(D, 2, batch_decode.MAX_ROWS)  # the tile of many rows
    attention = rope_decode.kernel_consts(H, HKV, D, batch["KS_Q"], batch["MAX_M"] * qkv, False, True, BLOCK, 2, True, tiles)
    types.update(part_ptr="*fp32", block_tables_ptr="*i32", count_ptr="*i32", part_out_ptr="*fp32")
    return {
        **splitk_kernels(),
        **logits_kernels(),
        "batch_layer_kernel": compile_sm90(batch_layer_kernel, types, *_split(batch), ("M",)),
        "batch_layer_kernel (few rows)": compile_sm90(batch_layer_kernel, types, *_split(narrow), ("M",)),
        "batch_layer_kernel (--deterministic)": compile_sm90(batch_layer_kernel, types, *_split(invariant), ("M",)),
        "batch_layer_kernel (--deterministic, few rows)": compile_sm90(
            batch_layer_kernel, types, *_split(few), ("M", "stride_bt", "pieces", "slots")
        ),
        "rope_decode_kernel": _pipeline(
            compile_sm90(rope_decode_kernel, types, *_split(attention), ("num_splits", "stride_bt")), tiles[0]
        ),
        # The layers' DecodeAttention: the same kernel on the qkv linear's bf16 output, one part.
        "rope_decode_kernel (layers)": layers_attention(D, 2),
        "decoder_layer_kernel": compile_sm90(decoder_layer_kernel, types, *_split(layer), ("M", "num_splits", "stride_bt", "has_next")),
    }


def splitk_kernels() -> dict[str, dict[str, object]]:
    """The 8B shape's o_proj / down_proj at 64 rows as split-K parts (kernels/splitk_linear.py) and
    the fused RMSNorm that sums them (its hidden 4096), at their launch constants."""
    from engine.kernels import fused_ops, splitk_linear

    s = splitk_linear
    consts = dict(BLOCK_M=s.MAX_ROWS, BLOCK_N=s.BLOCK_N, BLOCK_K=s.BLOCK_K, KS=s.KS, USE_PDL=True)
    types = dict(x_ptr=BF16, w_ptr=BF16, part_ptr="*fp32", res_ptr=BF16, out_ptr=BF16, inv_n="fp32", eps="fp32")
    norm = dict(HAS_RESIDUAL=True, BLOCK=4096, USE_PDL=True, KS=s.KS)
    return {
        "_splitk_kernel (64 rows)": compile_sm90(s._splitk_kernel, types, consts, dict(num_warps=s.NUM_WARPS, num_stages=s.NUM_STAGES), ("M", "R")),
        "_rms_norm_kernel (split-K parts)": compile_sm90(fused_ops._rms_norm_kernel, types | dict(x_ptr="*fp32"), norm,
                                                         dict(num_warps=fused_ops.norm_warps(4096), launch_pdl=True)),
    }  # fmt: skip


def logits_kernels() -> dict[str, dict[str, object]]:
    """A decode graph's logits with the sampler's pieces (kernels/logits_linear.py) at 16 and 64
    rows of the 0.6B lm_head (the vocabulary a multiple of 16, as Qwen's), at its launch constants."""
    from engine.kernels import logits_linear as ll

    types = dict(x_ptr=BF16, w_ptr=BF16, out_ptr=BF16, t_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", arg_ptr="*i64")
    cfg = ll.CONFIG
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=True)
    return {
        f"_logits_kernel ({rows} rows)": compile_sm90(ll._logits_kernel, types, dict(
            K=HID, BLOCK_M=rows, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], USE_PDL=True, PREFETCH_LINES=ll._PREFETCH_LINES, LINE=64,
        ), options, ("M",))
        for rows in (16, 64)
    }  # fmt: skip


def layers_attention(d: int, elem_bytes: int) -> dict[str, object]:
    """The layers' DecodeAttention kernel (engine.kernels.rope_decode) for head_dim d and a cache of
    elem_bytes (2: bf16, 4: fp32), at the 0.6B shape's heads: every head dim the backend takes
    must compile (the tests' tiny checkpoints use 16)."""
    from engine.kernels import rope_decode
    from engine.kernels.rope_decode import rope_decode_kernel

    half = BF16 if elem_bytes == 2 else "*fp32"
    types = {n: half for n in _jit(rope_decode_kernel).arg_names if n.endswith("_ptr")}
    types.update(pos_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                 count_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", eps="fp32", sm_scale_log2="fp32")  # fmt: skip
    consts = rope_decode.kernel_consts(H, HKV, d, 1, 0, False, True, BLOCK, elem_bytes, True)
    return compile_sm90(rope_decode_kernel, types, *_split(consts), ("num_splits", "stride_bt"))


def _split(consts: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """A kernel's launch keywords as (constexprs, compile options)."""
    options = {k: consts[k] for k in OPTIONS if k in consts}
    return {k: v for k, v in consts.items() if k not in OPTIONS}, options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-configs", default="", help="','-separated BLOCK_NxWARPSxSTAGES of the split-KV decode "
                   "(default: the engine's own, attention_decode.decode_config)")  # fmt: skip
    p.add_argument("--persistent", action="store_true", help="also the batch and fused decodes' persistent kernels, the split-K "
                   "parts with their norm, and the decode graphs' logits")  # fmt: skip
    p.add_argument("--layers-head-dims", default="", help="','-separated head dims: the layers' attention kernel "
                   "for each, bf16 and fp32")  # fmt: skip
    p.add_argument("--json", help="write every variant's numbers here")
    args = p.parse_args()
    if not args.decode_configs:
        from engine.kernels.attention_decode import decode_config

        args.decode_configs = "x".join(str(v) for v in decode_config(D, 2))
    report: dict[str, dict[str, object]] = {}
    decode_rows = []
    for spec in args.decode_configs.split(","):
        r = report[f"decode {spec}"] = decode_kernel(tuple(int(v) for v in spec.split("x")))
        decode_rows.append([spec, r["regs"], r["stack"], r["shared"] / 1024, f"{r['per_sm_regs']} / {r['per_sm_shared']}",
                            r["buffers"], r["in_flight"]])
    print_table("split-KV decode for sm_90", ["BLOCK_N x warps x stages", "registers", "stack", "shared KB",
                "programs per SM (registers / shared)", "K/V tiles buffered", "tiles in flight while one computes"],
                decode_rows)
    if args.persistent:
        rows = []
        for name, r in persistent_kernels().items():
            rows.append([name, r["regs"], r["stack"], r["shared"] / 1024, f"{r['per_sm_regs']} / {r['per_sm_shared']}"])
            report[name] = r
        print_table("persistent decode kernels for sm_90", ["kernel", "registers", "stack", "shared KB",
                    "programs per SM (registers / shared)"], rows)
    if args.layers_head_dims:
        rows = []
        for d in (int(v) for v in args.layers_head_dims.split(",")):
            for elem_bytes, dtype in ((2, "bf16"), (4, "fp32")):
                r = report[f"layers attention {d} {dtype}"] = layers_attention(d, elem_bytes)
                rows.append([f"{d} / {dtype}", r["regs"], r["stack"], r["shared"] / 1024,
                             min(r["per_sm_regs"], r["per_sm_shared"])])
        print_table("the layers' attention kernel for sm_90", ["head_dim / cache dtype", "registers", "stack",
                    "shared KB", "programs per SM"], rows)
    if args.json:
        write_json(args.json, {k: {n: v for n, v in r.items() if n != "ttgir"} for k, r in report.items()})


if __name__ == "__main__":
    main()

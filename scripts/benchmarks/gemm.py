"""Block-scaled GEMM kernels (`pallas_kernels.gemm`, Mosaic GPU and Triton lowerings) against XLA's bf16, FP8
and INT8 dots and torch's (in a subprocess); errors against the float32 product of the dequantized operands."""

from __future__ import annotations

import dataclasses
import time

from .rows import emit, error_text, flags, subprocess_rows, write_json
from .timing import cupti_seconds

GEMM_SHAPES = ["4608x6144x6144", "4608x6144x18432", "4608x6144x32768", "4608x16384x6144", "1024x6144x6144",
               "16384x6144x6144"]
MX_FORMATS = ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1")


def gemm_benchmark(args) -> None:
    forwarded = flags(args, "shapes", "iters", "repeats")
    rows = subprocess_rows(args, "gemm-torch", forwarded) if args.torch else []
    rows += subprocess_rows(args, "gemm-jax", forwarded + flags(args, "backends", "sweep"))
    print(f"\n{'shape':<16} {'implementation':<84} {'TFLOP/s':>8} {'rel err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('shape', ''):<16} {r['name']:<84} error: {r['error']}")
        elif "fold_err" in r:
            print(f"{r['shape']:<16} {r['name']:<84} {'':>8} {r['fold_err']:8.1e}")
        elif r.get("s"):
            err = f"{r['rel_err']:8.1e}" if "rel_err" in r else f"{'':>8}"
            print(f"{r['shape']:<16} {r['name']:<84} {r['tflops']:8.0f} {err}")
    write_json(args, rows)


@dataclasses.dataclass
class _Shape:
    """One MxKxN shape's operands: x (m, k) bf16 and w (n, k), and their quantized forms."""

    shape: str
    m: int
    n: int
    flops: float
    x: object
    w: object
    x8: object  # fp8 per token, with its scales sx
    sx: object
    xb8: object  # fp8 per 1x128 block, with sxb
    sxb: object
    xi8: object  # int8 per token, with sxi
    sxi: object
    w_fp8: object  # fp8 per output channel
    ref_token: object  # the float32 product of x8 and w_fp8, dequantized


class _Recorder:
    """Times variants by CUPTI and keeps their rows; one failing variant does not hide the others' figures."""

    def __init__(self, iters: int, sweep: bool):
        self.iters, self.sweep, self.rows = iters, sweep, []

    def record(self, s: _Shape, name: str, fn, inputs, check=None) -> None:
        import jax
        import jax.numpy as jnp

        row = {"name": name, "shape": s.shape}
        try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*inputs))
            row["compile_s"] = time.perf_counter() - t0
            seconds, kernels = cupti_seconds(fn, *inputs, iterations=self.iters, by_kernel=True)
            row.update(s=seconds, tflops=s.flops / seconds / 1e12, kernels=kernels)
            if check is not None:
                row["rel_err"] = float(jnp.linalg.norm(out.astype(jnp.float32) - check) / jnp.linalg.norm(check))
        except Exception as e:
            row["error"] = error_text(e)
        self.rows.append(emit(row))

    def ours(self, s: _Shape, name: str, xq, xs, wq, backend: str, config=None, check=None) -> None:
        """`gemm.scaled_matmul` on these operands (its default tiles, or `config`), against the reference."""
        import jax

        from mxdit.pallas_kernels import gemm

        fn = jax.jit(lambda a, sa, ww: gemm.scaled_matmul(a, ww, sa, backend=backend, config=config))
        if check is None:
            check = jax.jit(_reference)(xq, xs, wq)
        label = f"{backend} {name}" + (f" {config}" if config is not None and self.sweep else "")
        self.record(s, label, fn, (xq, xs, wq), check)


def _reference(xq, xs, wq):
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm

    return gemm.scaled_matmul_reference(xq, xs, wq, out_dtype=jnp.float32)


def _operands(shape: str) -> _Shape:
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm

    m, k, n = map(int, shape.split("x"))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    x8, sx = gemm.quantize_activations(x, "token")
    xb8, sxb = gemm.quantize_activations(x, "block")
    xi8, sxi = gemm.quantize_activations(x, "token", "int8")
    w_fp8 = gemm.prepare_weight(w, "fp8_e4m3")
    return _Shape(shape, m, n, 2.0 * m * k * n, x, w, x8, sx, xb8, sxb, xi8, sxi, w_fp8,
                  jax.jit(_reference)(x8, sx, w_fp8))


def jax_gemm(args) -> list[dict]:
    """XLA's dots and our kernels on each of --shapes (--backends; --sweep: other tile configurations too, on the
    first shape and small-M ones); the fused epilogues on the first shape."""
    rec = _Recorder(args.iters, args.sweep)
    for shape in args.shapes:
        s = _operands(shape)
        _xla_rows(rec, s)
        sweep = args.sweep and (shape == args.shapes[0] or s.m <= 2048)
        if "mosaic" in args.backends:
            _mosaic_rows(rec, s, sweep)
            if shape == args.shapes[0]:
                _epilogue_rows(rec, s, sweep)
        if "triton" in args.backends:
            _triton_rows(rec, s, sweep)
        _fold_rows(rec, s)
    return rec.rows


def _xla_rows(rec: _Recorder, s: _Shape) -> None:
    """XLA's dots (bf16; FP8 without and with the scales applied; INT8) and the activation quantizers."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm

    def dot(preferred):
        return jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=preferred))

    @jax.jit
    def xla_fp8_scaled(a, sa, b, sb):
        y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
        return (y.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(jnp.bfloat16)

    rec.record(s, "XLA bf16 dot", jax.jit(lambda a, b: a @ b.T), (s.x, s.w))
    rec.record(s, "XLA fp8 dot, bf16 out (no scales)", dot(jnp.bfloat16), (s.x8, s.w_fp8.data))
    rec.record(s, "XLA fp8 dot + separate per-token/channel scaling", xla_fp8_scaled,
               (s.x8, s.sx, s.w_fp8.data, s.w_fp8.scale), s.ref_token)
    rec.record(s, "quantize x per token (bf16 -> fp8), one pass",
               jax.jit(lambda a: gemm.quantize_activations(a, "token")), (s.x,))
    rec.record(s, "quantize x per 1x128 block, one pass", jax.jit(lambda a: gemm.quantize_activations(a, "block")),
               (s.x,))
    rec.record(s, "XLA int8 dot, int32 out", dot(jnp.int32), (s.xi8, s.w_fp8.data.astype(jnp.int8)))


def _mosaic_rows(rec: _Recorder, s: _Shape, sweep: bool) -> None:
    """The Mosaic GPU kernel: FP8 x per token and per block, and MX weights folded to FP8 with one power-of-two
    scale per 128x128 tile (exact for ordinary weights: the fold_err rows), so the promotion is one scalar a K
    step. With `sweep`, tile configurations beside the defaults."""
    from mxdit.pallas_kernels import gemm

    mosaic_token = [None, gemm.MosaicConfig(64, 128, 4, compute_wgs=3),
                    gemm.MosaicConfig(64, 256, 3, compute_wgs=2, epi_tile_n=128),
                    gemm.MosaicConfig(64, 256, 3, compute_wgs=2, epi_tile_n=128, cluster_n=2)] if sweep else [None]
    mosaic_block = [None, gemm.MosaicConfig(64, 128, 4, compute_wgs=2),
                    gemm.MosaicConfig(64, 64, 4, compute_wgs=3)] if sweep else [None]
    for cfg in mosaic_token:
        rec.ours(s, "fp8 x per token, w per channel", s.x8, s.sx, s.w_fp8, "mosaic", cfg, s.ref_token)
    for cfg in mosaic_block:
        if cfg is None or s.m % (cfg.compute_wgs * cfg.tile_m) == 0:  # no padding
            rec.ours(s, "fp8 x per 1x128 block, w per channel", s.xb8, s.sxb, s.w_fp8, "mosaic", cfg)
    for fmt in MX_FORMATS:
        wq = gemm.prepare_weight(s.w, fmt, backend="mosaic", mx_fold_rows=128)
        configs = [None] + ([gemm.MosaicConfig(64, 128, 4, compute_wgs=2)] if sweep and fmt == "mxfp4_e2m1" else [])
        for cfg in configs:
            rec.ours(s, f"fp8 x per token, w {fmt} folded to fp8 x 128x128", s.x8, s.sx, wq, "mosaic", cfg)
        if fmt == "mxfp4_e2m1":
            rec.ours(s, f"fp8 x per 1x128 block, w {fmt} folded to fp8 x 128x128", s.xb8, s.sxb, wq, "mosaic")


def _epilogue_rows(rec: _Recorder, s: _Shape, sweep: bool) -> None:
    """The Mosaic kernel's fused epilogues against the reference: residual + gate * gelu(. + bias); the gated
    residual (Krea 2's out and down projections), its residual fetched after or during the main loop; SwiGLU
    (Krea 2's gate/up) in the epilogue against after the product; and the fast activation quantizer's bits."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm
    from mxdit.quant.formats import quantize

    kb, kg, kr = jax.random.split(jax.random.key(1), 3)
    bias, gate = jax.random.normal(kb, (s.n,)), jax.random.normal(kg, (s.n,))
    residual = jax.random.normal(kr, (s.m, s.n), jnp.bfloat16)
    for xq, xs, label in ((s.x8, s.sx, "per token"), (s.xb8, s.sxb, "per 1x128 block")):
        check = gemm.scaled_matmul_reference(xq, xs, s.w_fp8, bias=bias, activation="gelu_tanh", residual=residual,
                                             gate=gate, out_dtype=jnp.float32)
        rec.record(s, f"mosaic fp8 x {label} + epilogue residual + gate * gelu(. + bias)",
                   jax.jit(lambda a, sa, ww, b, g, r: gemm.scaled_matmul(
                       a, ww, sa, bias=b, activation="gelu_tanh", gate=g, residual=r, backend="mosaic")),
                   (xq, xs, s.w_fp8, bias, gate, residual), check)
    check = gemm.scaled_matmul_reference(s.x8, s.sx, s.w_fp8, residual=residual, gate=gate, out_dtype=jnp.float32)
    for cfg in ([None, gemm.MosaicConfig(64, 128, 4, compute_wgs=3),
                 gemm.MosaicConfig(64, 128, 4, compute_wgs=3, prefetch_residual=True)] if sweep else [None]):
        rec.record(s, "mosaic fp8 x per token + epilogue residual + gate * ." + (f" {cfg}" if cfg else ""),
                   jax.jit(lambda a, sa, ww, g, r, cfg=cfg: gemm.scaled_matmul(
                       a, ww, sa, gate=g, residual=r, backend="mosaic", config=cfg)),
                   (s.x8, s.sx, s.w_fp8, gate, residual), check)
    if s.n % (2 * gemm.SWIGLU_WIDTH) == 0:
        _swiglu_rows(rec, s)
    fast, _ = jax.jit(lambda a: gemm.quantize_activations(a, "token"))(s.x)
    exact = jax.jit(lambda a: quantize(a.astype(jnp.float32), "fp8_e4m3").data)(s.x)
    rec.rows.append(emit({
        "name": "fast activation quantizer: bytes differing from quant.formats", "shape": s.shape,
        "mismatches": int(jnp.sum(jax.lax.bitcast_convert_type(fast, jnp.uint8)
                                  != jax.lax.bitcast_convert_type(exact, jnp.uint8)))}))


def _swiglu_rows(rec: _Recorder, s: _Shape) -> None:
    """The stacked gate/up product then SwiGLU + FP8 in one pass, against SwiGLU in the GEMM's epilogue then FP8
    per token; and how many of their FP8 codes agree."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mxdit.pallas_kernels import activations, gemm

    halves = (gemm.prepare_weight(s.w[: s.n // 2], "fp8_e4m3"), gemm.prepare_weight(s.w[s.n // 2:], "fp8_e4m3"))
    stacked, paired = gemm.concat_weights(list(halves)), gemm.swiglu_weight(*halves)
    unfused = jax.jit(lambda a, sa, ww: activations.swiglu_fp8(gemm.scaled_matmul(a, ww, sa, backend="mosaic")[None]))
    fused = jax.jit(lambda a, sa, ww: activations.tokens_fp8(gemm.scaled_matmul(
        a, ww, sa, activation="swiglu", backend="mosaic")[None]))
    rec.record(s, "mosaic fp8 gate/up product, then swiglu_fp8", unfused, (s.x8, s.sx, stacked))
    rec.record(s, "mosaic fp8 gate/up with SwiGLU in the epilogue, then tokens_fp8", fused, (s.x8, s.sx, paired))
    if "error" not in rec.rows[-1] and "error" not in rec.rows[-2]:
        codes = [np.asarray(f(s.x8, s.sx, ww)[0].astype(jnp.float32))
                 for f, ww in ((unfused, stacked), (fused, paired))]
        rec.rows[-1]["codes_equal"] = float(np.mean(codes[0] == codes[1]))


def _triton_rows(rec: _Recorder, s: _Shape, sweep: bool) -> None:
    """The Triton kernel: FP8 x per token and per block, INT8, and MX weights unpacked in the kernel."""
    from mxdit.pallas_kernels import gemm

    triton_fp8 = [gemm.TritonConfig(128, 128, 8, 3), gemm.TritonConfig(128, 256, 8, 3),
                  gemm.TritonConfig(64, 128, 4, 4)] if sweep else [None]
    for cfg in triton_fp8:
        rec.ours(s, "fp8 x per token, w per channel", s.x8, s.sx, s.w_fp8, "triton", cfg, s.ref_token)
    rec.ours(s, "fp8 x per 1x128 block, w per channel", s.xb8, s.sxb, s.w_fp8, "triton")
    w_int8 = gemm.prepare_weight(s.w, "int8", backend="triton")
    rec.ours(s, "int8 x per token, w int8 per channel", s.xi8, s.sxi, w_int8, "triton")
    triton_mx = [gemm.TritonConfig(128, 64, 4, 3), gemm.TritonConfig(64, 64, 4, 3),
                 gemm.TritonConfig(64, 128, 4, 2)] if sweep else [None]
    for fmt in MX_FORMATS:
        wq = gemm.prepare_weight(s.w, fmt, backend="triton")
        for cfg in (triton_mx if fmt == "mxfp4_e2m1" else [None]):
            rec.ours(s, f"fp8 x per token, w {fmt} unpacked in kernel", s.x8, s.sx, wq, "triton", cfg)


def _fold_rows(rec: _Recorder, s: _Shape) -> None:
    """MX folding: how far the folded weight is from the MX weight it stands for."""
    import jax
    import jax.numpy as jnp

    from mxdit.pallas_kernels import gemm
    from mxdit.quant.formats import quantize

    for fmt in MX_FORMATS:
        q = jax.jit(lambda a: quantize(a, fmt))(s.w.astype(jnp.float32))
        for fold_rows in (1, 128):
            rec.rows.append(emit({"name": f"fold {fmt} -> fp8 x {fold_rows}x128: rel L2 vs the MX weight",
                                  "shape": s.shape, "fold_err": gemm.fold_mx_error(q, rows=fold_rows)}))

"""llmc's CUDA paged decode attention on a GPU: K/V bandwidth at long contexts, next to torch.

    python benchmarks/cuda_attention.py [--contexts 4096,8192,16384,32768] [--batches 1,8,32,64]
                                        [--iters 20] [--no-check] [--check-only] [--rope]
                                        [--library PATH]

Needs a CUDA GPU, torch with CUDA and nvcc (pip install 'llmc[cuda-build]'); CuPy, when present,
measures the copy bandwidth with a plain cudaMemcpy (torch's copy_ otherwise). Shape: Llama-3-8B's
attention (32 query heads, 8 KV heads, head dim 128), fp16, block size 16, every row decoding one
token after `context - 1` cached ones, its blocks scattered over the pool.

For each (context, batch) it prints the time of one llmc_paged_attention call (the one-token K/V
write plus attention) and the K/V bytes the attention must read (batch x context x 8 heads x 128 x
2 bytes, for K and V) per second, as a fraction of the device-to-device copy bandwidth measured
on a 2 GiB buffer (bytes read + bytes written per second: the DRAM rate a streaming kernel can
hope for). Next to it, torch's scaled_dot_product_attention on the same K/V already gathered
into contiguous [batch, 8, context, 128] tensors (the gather not timed): what a dense kernel
reaches on the same bytes. Small shapes cycle through several copies of their pool so that no
call finds its K/V in the 50 MB L2 left there by the previous one. With --rope, a further column
times the same call with the query/key RoPE fused (rotary dim 128, rotate halves), which should
cost next to nothing over the plain call.

Before timing, a correctness sweep runs the library against paged_attention.reference() (fp16
and bf16, block 16 and 32, GQA 1/4/8, contexts up to 32k, ragged rows, a prefill chunk, a sliding
window, and the fused RoPE in both pairings against cuda.apply_rotary + reference()); `--no-check`
skips it, `--check-only` runs only it. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile

import numpy as np

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
L2_BYTES = 50 << 20
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}  # max abs diff over the output's scale


def library(path: str | None):
    from llmc.plugins import cuda

    return cuda.load_library(path or cuda.build_shared_library(tempfile.mkdtemp(prefix="llmc-cuda-")))


class Call:
    """One llmc_paged_attention call over torch tensors, its arguments built once."""

    def __init__(self, lib, q, k, v, cache, out, past, qlens, tables, *, num_heads, num_kv_heads, scale,
                 window=0, softcap=0.0, rope=None):
        """rope: None, or (cos, sin, interleaved) with cos and sin [B, S, R/2] in q's dtype."""
        import torch

        from llmc.plugins import cuda

        self.lib, self.keep = lib, [q, k, v, cache, out, past, qlens, tables, rope]
        batch, _, seq, head_dim = q.shape
        self.args = cuda.PagedAttentionArgs(
            query=q.data_ptr(), key=k.data_ptr(), value=v.data_ptr(), cache=cache.data_ptr(), output=out.data_ptr(),
            past_lens=past.data_ptr(), query_lens=qlens.data_ptr(), block_tables=tables.data_ptr(), batch=batch,
            seq=seq, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=cache.shape[1],
            block_size=cache.shape[2], max_blocks=tables.shape[1], max_query_len=0,
            dtype=cuda.DTYPES["bf16" if q.dtype == torch.bfloat16 else "fp16"], scale=scale, softcap=softcap,
            sliding_window=window)
        if rope is not None:
            cos, sin, interleaved = rope
            self.args.rope_cos, self.args.rope_sin = cos.data_ptr(), sin.data_ptr()
            self.args.rotary_dim, self.args.rotary_interleaved = 2 * cos.shape[-1], int(interleaved)
        size = lib.llmc_paged_attention_workspace(ctypes.byref(self.args))
        self.workspace = torch.empty(max(size, 16), dtype=torch.uint8, device="cuda")
        self.args.workspace, self.args.workspace_size = self.workspace.data_ptr(), size
        self.splits_bytes = size

    def __call__(self):
        import torch

        from llmc.plugins import cuda

        status = self.lib.llmc_paged_attention(ctypes.byref(self.args), torch.cuda.current_stream().cuda_stream)
        if status:
            raise RuntimeError(cuda.status_message(self.lib, status))


def scattered_tables(gen, batch, blocks_per_row, spare=1):
    """Disjoint, shuffled block ids for each row (block 0 stays scratch) and the pool size."""
    import torch

    num_blocks = 1 + batch * (blocks_per_row + spare)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros((batch, blocks_per_row + spare), dtype=torch.int32)
    for b in range(batch):
        tables[b, :blocks_per_row] = order[b * (blocks_per_row + spare):b * (blocks_per_row + spare) + blocks_per_row]
    return tables, num_blocks


def timed(fn, iters: int) -> float:
    """Mean seconds per call over `iters` calls after 3 warm-up calls, by CUDA events."""
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(iters: int) -> float:
    """Device-to-device copy of a 2 GiB buffer: (read + written) bytes per second."""
    import torch

    size = 2 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    try:
        import cupy

        stream = torch.cuda.current_stream().cuda_stream

        def copy():
            cupy.cuda.runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), size,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream)
    except ImportError:
        def copy():
            dst.copy_(src)
    return 2 * size / timed(copy, iters)


class DecodeStep:
    """One decode step of `batch` rows, each `context - 1` tokens cached, in several copies of its
    pool and block tables: small shapes cycle through them, so that no call finds its K/V in the
    L2 left there by the previous one."""

    def __init__(self, context: int, batch: int):
        import torch

        gen = torch.Generator().manual_seed(context * 131 + batch)
        self.context, self.batch, self.blocks = context, batch, -(-context // BLOCK)
        self.kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2  # what the attention must read
        dev = dict(device="cuda", dtype=torch.float16)
        self.q = torch.randn((batch, HEADS, 1, HEAD_DIM), **dev)
        self.k_new = torch.randn((batch, KV_HEADS, 1, HEAD_DIM), **dev)
        self.v_new = torch.randn((batch, KV_HEADS, 1, HEAD_DIM), **dev)
        self.out = torch.empty_like(self.q)
        self.past = torch.full((batch,), context - 1, dtype=torch.int32, device="cuda")
        self.qlens = torch.ones((batch,), dtype=torch.int32, device="cuda")
        self.pools = []
        for _ in range(min(16, max(1, -(-4 * L2_BYTES // self.kv_bytes)))):
            tables, num_blocks = scattered_tables(gen, batch, self.blocks)
            self.pools.append((torch.randn((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), **dev), tables.cuda()))

    def calls(self, lib, rope=None) -> list[Call]:
        """One llmc call per copy of the pool."""
        return [Call(lib, self.q, self.k_new, self.v_new, pool, self.out, self.past, self.qlens, tables,
                     num_heads=HEADS, num_kv_heads=KV_HEADS, scale=HEAD_DIM ** -0.5, rope=rope)
                for pool, tables in self.pools]

    def dense(self) -> list[tuple]:
        """Each copy's K/V gathered contiguous for SDPA: [B, Hkv, T, D]."""
        shape = (self.batch, self.blocks * BLOCK, KV_HEADS, HEAD_DIM)
        gathered = []
        for pool, tables in self.pools:
            idx = tables[:, :self.blocks].long()
            gathered.append(tuple(pool[i][idx].reshape(shape)[:, :self.context].transpose(1, 2).contiguous()
                                  for i in (0, 1)))
        return gathered


def in_turn(fns):
    """A callable that calls fns[0], fns[1], ... round and round."""
    turn = iter(range(1 << 62))
    return lambda: fns[next(turn) % len(fns)]()


def decode_row(lib, context: int, batch: int, iters: int, copy_bw: float, rope: bool = False) -> str:
    import torch
    import torch.nn.functional as F

    step = DecodeStep(context, batch)
    kv_bytes, calls = step.kv_bytes, step.calls(lib)
    llmc_call = in_turn(calls)
    if rope:
        # RoPE tables of the step's one position per row (the values do not change the timing).
        angles = torch.rand((batch, 1, HEAD_DIM // 2), device="cuda") * 6.3
        rope_call = in_turn(step.calls(lib, rope=(angles.cos().half(), angles.sin().half(), False)))
    sdpa_call = in_turn([lambda k=k, v=v: F.scaled_dot_product_attention(step.q, k, v, scale=HEAD_DIM ** -0.5,
                                                                          enable_gqa=True)
                         for k, v in step.dense()])

    llmc_s = timed(llmc_call, iters)
    try:
        sdpa_s = timed(sdpa_call, iters)
        sdpa = f"{sdpa_s * 1e6:9.1f} | {kv_bytes / sdpa_s / 1e9:8.0f}"
    except (RuntimeError, TypeError) as exc:  # an old torch without enable_gqa, or out of memory
        sdpa = f"n/a ({type(exc).__name__}) | "
    splits = "yes" if calls[0].splits_bytes else "no"
    rope_col = f" {timed(rope_call, iters) * 1e6:9.1f} |" if rope else ""
    return (f"| {context:7d} | {batch:5d} | {splits:6} | {llmc_s * 1e6:9.1f} | {kv_bytes / llmc_s / 1e9:8.0f} | "
            f"{kv_bytes / llmc_s / copy_bw:6.0%} | {sdpa} |{rope_col}")


def check(lib, dtype: str, *, group: int, block: int, past: list[int], qlens: list[int], seq: int, window=0,
          seed=0, rotary=None) -> tuple[float, float]:
    """(max abs diff, output scale) of one ragged step against paged_attention.reference().
    rotary: None, or (rotary_dim, interleaved) for the fused RoPE, checked against q and k rotated
    by cuda.apply_rotary and rounded to the dtype before reference()."""
    import torch

    from llmc.plugins import cuda
    from llmc.plugins import paged_attention as pa

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, batch = 2 * group, 2, len(past)
    lengths = [p + q for p, q in zip(past, qlens)]
    tables, num_blocks = scattered_tables(gen, batch, -(-max(lengths) // block))

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(torch_dtype)

    q, k, v = rand(batch, heads, seq, HEAD_DIM), rand(batch, kv_heads, seq, HEAD_DIM), rand(batch, kv_heads, seq, HEAD_DIM)
    cache = rand(2, num_blocks, block, kv_heads, HEAD_DIM)
    past_t, qlens_t = torch.tensor(past, dtype=torch.int32), torch.tensor(qlens, dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    q_ref, k_ref, rope = q, k, None
    if rotary is not None:
        rotary_dim, interleaved = rotary
        pos = past_t[:, None].double() + torch.arange(seq, dtype=torch.float64)
        inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        angles = pos[..., None] * inv_freq
        cos, sin = angles.cos().to(torch_dtype), angles.sin().to(torch_dtype)
        q_ref, k_ref = (torch.from_numpy(cuda.apply_rotary(t.float().numpy(), cos.float().numpy(), sin.float().numpy(),
                                                           interleaved)).to(torch_dtype) for t in (q, k))
        rope = (cos.cuda(), sin.cuda(), interleaved)
    ref, _ = pa.reference(*(t.float().numpy() for t in (q_ref, k_ref, v, cache)), past_t.numpy(), qlens_t.numpy(),
                          tables.numpy(), num_heads=heads, num_kv_heads=kv_heads, scale=scale, sliding_window=window)
    dev = [t.cuda() for t in (q, k, v, cache)]
    out = torch.empty_like(dev[0])
    Call(lib, *dev, out, past_t.cuda(), qlens_t.cuda(), tables.cuda(), num_heads=heads, num_kv_heads=kv_heads,
         scale=scale, window=window, rope=rope)()
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    valid = np.zeros(got.shape, bool)
    for b, n in enumerate(qlens):
        valid[b, :, :n] = True
    if np.any(got[~valid] != 0):
        return float("inf"), 1.0
    return float(np.abs(got[valid] - ref[valid]).max()), float(np.abs(ref[valid]).max())


def correctness(lib) -> bool:
    print("| dtype | block | GQA | case | max abs diff | / output scale | ok |")
    print("|---|---|---|---|---|---|---|")
    cases = [(f"decode ctx {n}", dict(past=[n - 1, n // 3, 0], qlens=[1, 1, 0], seq=1))
             for n in (1, 1000, 4096, 16384, 32768)]
    cases += [("prefill 64 after 32k", dict(past=[32768 - 64, 100], qlens=[64, 10], seq=64)),
              ("window 4096 at 32k", dict(past=[32767, 5000], qlens=[1, 1], seq=1, window=4096))]
    cases += [(f"RoPE {kind} R={r} {name}", dict(rotary=(r, kind == "interleaved"), **kwargs))
              for kind in ("halves", "interleaved") for r in (HEAD_DIM, HEAD_DIM // 2)
              for name, kwargs in (("decode ctx 4096", dict(past=[4095, 1365, 0], qlens=[1, 1, 0], seq=1)),
                                   ("prefill 64 after 2k", dict(past=[2048 - 64, 100], qlens=[64, 10], seq=64)))]
    all_ok = True
    for dtype in ("fp16", "bf16"):
        tol = TOLERANCE[dtype]
        for block in (16, 32):
            for group in (1, 4, 8):
                for name, kwargs in cases:
                    err, scale = check(lib, dtype, group=group, block=block, **kwargs)
                    ok = err <= tol * max(scale, 1e-3)
                    all_ok &= ok
                    print(f"| {dtype} | {block} | {group} | {name} | {err:.2e} | {err / max(scale, 1e-3):.2e} | "
                          f"{'ok' if ok else 'FAIL'} |", flush=True)
    return all_ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-check", action="store_true", help="skip the correctness sweep")
    ap.add_argument("--check-only", action="store_true", help="run only the correctness sweep")
    ap.add_argument("--rope", action="store_true", help="also time each decode call with the RoPE fused")
    ap.add_argument("--library", help="a built libllmc_cuda_attention.so to load (default: build one now)")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and torch with CUDA")
    lib = library(args.library)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    if not args.no_check:
        ok = correctness(lib)
        print()
        if args.check_only:
            raise SystemExit(0 if ok else 1)
    copy_bw = copy_bandwidth(args.iters)
    torch.cuda.empty_cache()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    print(f"decode, Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} fp16, block {BLOCK}: K/V bytes read per second")
    print("| context | batch | splits | llmc µs | llmc GB/s | of copy | SDPA µs | SDPA GB/s |"
          + (" llmc+RoPE µs |" if args.rope else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.rope else ""))
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            print(decode_row(lib, context, batch, args.iters, copy_bw, rope=args.rope), flush=True)
            torch.cuda.empty_cache()  # the row's pools are garbage now; give their memory back


if __name__ == "__main__":
    main()

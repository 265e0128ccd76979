"""Two of the engine's decode-step choices side by side in one engine, alternating: a step of one
stream with the eleventh round's changes to what runs after the weights have flushed the caches
(``Runner._prepare_decodes``, ``sampler.ARGMAX_ROWS``, the logits from the native call) against the
same engine with them off; or (``--argmax``) the sampler taking the native step's argmax against
computing its own; or (``--one-region``) a native step's layers in one parallel region against
one region for each product and each attention; or (``--own-barrier``) a native step's team
meeting at its own barrier (``kernels/team_barrier.h``) against at libgomp's ``omp barrier`` (run
it under ``OMP_WAIT_POLICY=PASSIVE`` for what a served engine sees); or (``--kv-ahead``) a native
step whose products fetch the next layer's K/V against one whose attention fetches its own
(``kernels/kv_ahead.h``, ``decode_stack_set_kv_ahead``); or (``--prefetch``) the one-row products without
their software prefetches (AMD's default) against with them (``q4_gemv_set_prefetch`` for int4
modes, ``packed_gemv_set_prefetch`` for bfloat16); or (``--collapse``) oneDNN's packed weights
collapsed onto huge pages against a second engine left on 4 KiB pages; or (``--scheduler-steps
N``) N greedy decode steps a scheduling step against one (``num_scheduler_steps``, the same
engine switched between the two); or (``--kv-cache-dtype D``) the mode over its own dtype's KV
cache against a second engine over a D cache (``kv_cache_dtype``).

`python scripts/bench_step_ab.py [--mode bfloat16-native] [--rounds 20]`
`python scripts/bench_step_ab.py --argmax [--mode int4-native]`
`python scripts/bench_step_ab.py --one-region [--mode int4-native]`
`OMP_WAIT_POLICY=PASSIVE python scripts/bench_step_ab.py --own-barrier [--mode int4-native]`
`python scripts/bench_step_ab.py --kv-ahead [--mode int4-native]`
`python scripts/bench_step_ab.py --prefetch [--mode int4-native]`
`python scripts/bench_step_ab.py --collapse [--rounds 40]`
`python scripts/bench_step_ab.py --scheduler-steps 8 [--mode int4-native]`
`python scripts/bench_step_ab.py --kv-cache-dtype bfloat16 --mode int4-native [--context 1800] [--against float16]`

Each round times 20 engine steps of each variant (with ``--scheduler-steps N``: N tokens each way,
and the median of the rounds' paired ratios) (one stream, greedy, a 256-token prompt, the
context growing as it decodes) or, with ``--collapse``, 5 native steps and 5 LM-head products of
each engine at context 320. Prints the medians and their ratio (docs/performance.md, eleventh and
twelfth rounds, fourteenth for ``--prefetch``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def _native_switch(name: str):
    """One of decode_stack's on/off settings (``int f(int on)``, the setting now in force back)."""
    import ctypes

    from engine_service.model.native import native_library

    fn = getattr(native_library(), name)
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn


def steps_ab(mode: str, rounds: int, argmax_only: bool = False, one_region: bool = False,
             prefetch: bool = False, own_barrier: bool = False, kv_ahead: bool = False) -> None:
    import engine_service.model.runner as runner_module
    import engine_service.sampling.sampler as sampler_module
    from engine_service import LLM, SamplingParams
    from engine_service.bench.modes import MODES

    engine = LLM(None, **MODES[mode]).engine
    native = engine.runner.native_decode
    if native is None:
        raise SystemExit(f"bench_step_ab: {mode} has no native decode step on this machine")
    engine.add_request("p0", [100 + (j * 7) % 4000 for j in range(256)],
                       SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()
    few, argmax_rows, fuses = runner_module.FEW_DECODES, sampler_module.ARGMAX_ROWS, native.fuses_head
    execute, sampler = engine.runner.execute, engine.sampler
    given: list[bool] = []

    def without_argmax(chunks):  # the step as before: the sampler takes its own argmax
        out = execute(chunks)
        out.greedy_token_ids = None
        return out

    def counting(logits, requests, **kwargs):
        given.append(kwargs.get("argmax") is not None)
        return sampler(logits, requests, **kwargs)

    engine.sampler = counting
    if one_region:
        set_regions = _native_switch("decode_stack_set_one_region")
    if own_barrier:
        set_barrier = _native_switch("decode_stack_set_own_barrier")
    if kv_ahead:
        set_ahead = _native_switch("decode_stack_set_kv_ahead")
        ahead_lines = set_ahead(-1)  # the setting in force, put back at the end
        if ahead_lines == 0:
            raise SystemExit("bench_step_ab: decode_stack_set_kv_ahead is off; nothing to compare")
    if prefetch:
        from engine_service.model.native import native_library

        library = native_library()
        set_prefetch = library.q4_gemv_set_prefetch if "int4" in mode else library.packed_gemv_set_prefetch
    ms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for new in (False, True):
            if one_region:
                set_regions(int(new))
            elif own_barrier:
                set_barrier(int(new))
            elif kv_ahead:
                set_ahead(ahead_lines if new else 0)
            elif prefetch:
                set_prefetch(0 if new else 1)
            elif argmax_only:
                engine.runner.execute = execute if new else without_argmax
            else:
                runner_module.FEW_DECODES = few if new else 0
                sampler_module.ARGMAX_ROWS = argmax_rows if new else 0
                native.fuses_head = fuses and new
            for _ in range(3):
                engine.step()
            started = time.perf_counter()
            for _ in range(20):
                engine.step()
            ms[new].append((time.perf_counter() - started) / 20 * 1e3)
    if prefetch:
        set_prefetch(-1)
    if own_barrier:
        set_barrier(1)
    if kv_ahead:
        set_ahead(ahead_lines)
    old, new = statistics.median(ms[False]), statistics.median(ms[True])
    if prefetch:
        print(f"{mode}, one stream: a step {old:.3f} ms with the one-row products' software prefetches, "
              f"{new:.3f} ms without: {old / new:.3f}x (medians of {rounds} alternating rounds of 20 steps)")
        return
    what = ("the step in one parallel region" if one_region else "the team's own barrier" if own_barrier
            else "the next layer's K/V fetched during the products" if kv_ahead
            else "the native step's argmax" if argmax_only else "the changes")
    print(f"{mode}, one stream: a step {old:.3f} ms without {what}, {new:.3f} ms with: {old / new:.3f}x "
          f"(medians of {rounds} alternating rounds of 20 steps; the sampler took a given argmax in "
          f"{sum(given)} of {len(given)} steps)")


def scheduler_steps_ab(mode: str, rounds: int, steps: int) -> None:
    from engine_service import LLM, SamplingParams
    from engine_service.bench.modes import MODES

    engine = LLM(None, **{**MODES[mode], "num_scheduler_steps": steps}).engine
    if engine.scheduler.multi_step_max_rows == 0:
        raise SystemExit(f"bench_step_ab: {mode} has no native decode step with its head on this machine")
    prompt = [100 + (j * 7) % 4000 for j in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps * 16 + 1, ignore_eos=True)
    per_token: dict[int, list[float]] = {1: [], steps: []}
    ratios: list[float] = []
    # a fresh stream every 16 pairs, so the context stays 256-512 tokens; each ends on its max_tokens
    # with its 16th pair
    for r in range(rounds):
        if r % 16 == 0:
            engine.add_request(f"p{r}", prompt, params)
            req = engine.scheduler.get_request(f"p{r}")
            engine.step()  # the prefill
        pair = {}
        for n in ((1, steps) if r % 2 == 0 else (steps, 1)):
            engine.scheduler.num_scheduler_steps = n
            before, started = req.num_output_tokens, time.perf_counter()
            while req.num_output_tokens - before < steps:
                engine.step()
            pair[n] = (time.perf_counter() - started) / (req.num_output_tokens - before) * 1e3
            per_token[n].append(pair[n])
        ratios.append(pair[1] / pair[steps])
    one, many = statistics.median(per_token[1]), statistics.median(per_token[steps])
    print(f"{mode}, one stream: {one:.3f} ms a token one step at a time, {many:.3f} with {steps} steps a "
          f"scheduling step; the median of {rounds} paired ratios {statistics.median(ratios):.3f}x "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}; "
          f"{steps} tokens each way a pair, in turn first; contexts 256-512)")


def collapse_ab(rounds: int) -> None:
    import engine_service.model.prepacked as prepacked
    from engine_service import LLM
    from engine_service.bench.modes import MODES
    from engine_service.model.attention import AttentionMetadata

    collapse = prepacked.collapse_to_hugepages
    prepacked.collapse_to_hugepages = lambda buffers: 0
    plain = LLM(None, **MODES["bfloat16-native"], kv_cache_memory=128 << 20)
    prepacked.collapse_to_hugepages = collapse
    collapsed = LLM(None, **MODES["bfloat16-native"], kv_cache_memory=128 << 20)

    def step(llm, context: int = 320):
        runner = llm.engine.runner
        native, block_size = runner.native_decode, runner.kv_caches[0][0].shape[1]
        runner.model.rotary.ensure_positions(context)
        positions = torch.tensor([context - 1])
        meta = AttentionMetadata(slot_mapping=positions.clone(), prefills=[], decode_token_index=None,
                                 decode_block_tables=torch.arange(-(-context // block_size)).unsqueeze(0),
                                 decode_context_lens=positions + 1)
        ids, hidden = torch.zeros(1, dtype=torch.long), torch.randn(1, runner.model.config.hidden_size).bfloat16()

        def run() -> tuple[float, float]:
            started = time.perf_counter()
            native(ids, positions, meta)
            middle = time.perf_counter()
            runner.model.lm_head(hidden)
            return middle - started, time.perf_counter() - middle
        return run

    runs = [step(plain), step(collapsed)]
    gc.disable()
    ms = [([], []), ([], [])]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            times = [run() for _ in range(5)]
            ms[i][0].append(statistics.median(t[0] for t in times) * 1e3)
            ms[i][1].append(statistics.median(t[1] for t in times) * 1e3)
    (step4k, head4k), (step2m, head2m) = [(statistics.median(a), statistics.median(b)) for a, b in ms]
    print(f"native step: {step4k:.3f} ms on 4 KiB pages, {step2m:.3f} collapsed ({step4k / step2m:.3f}x); "
          f"LM head: {head4k:.3f} against {head2m:.3f} ({head4k / head2m:.3f}x); medians of {rounds} rounds")


def kv_cache_dtype_ab(mode: str, rounds: int, kv_cache_dtype: str, context: int, base: str = "auto") -> None:
    """Two engines of ``mode``, one over its own dtype's KV cache and one over ``kv_cache_dtype``'s,
    each decoding one stream from a ``context``-token prompt; rounds of 20 steps alternate between
    them (which goes first alternates too), and the median of the rounds' paired ratios is printed."""
    from engine_service import LLM, SamplingParams
    from engine_service.bench.modes import MODES

    prompt = [100 + (j * 7) % 4000 for j in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=rounds * 23 + 8, ignore_eos=True)
    engines = {}
    if base == kv_cache_dtype:
        raise SystemExit("bench_step_ab: --kv-cache-dtype and --against name the same cache")
    for cache in (base, kv_cache_dtype):
        engine = LLM(None, **{**MODES[mode], "kv_cache_dtype": cache}, enable_prefix_caching=False,
                     max_num_seqs=1, max_num_batched_tokens=max(2048, context)).engine
        engine.add_request("p", prompt, params)
        while engine.scheduler.get_request("p").num_output_tokens == 0:
            engine.step()
        engines[cache] = engine
    ms: dict[str, list[float]] = {cache: [] for cache in engines}
    ratios = []
    for r in range(rounds):
        for cache in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            engine = engines[cache]
            for _ in range(3):
                engine.step()
            started = time.perf_counter()
            for _ in range(20):
                engine.step()
            ms[cache].append((time.perf_counter() - started) / 20 * 1e3)
        ratios.append(ms[base][-1] / ms[kv_cache_dtype][-1])
    base_dtype = str(engines[base].kv_cache_dtype).removeprefix("torch.")
    print(f"{mode}, one stream from a {context}-token prompt: a step {statistics.median(ms[base]):.3f} ms over a "
          f"{base_dtype} KV cache, {statistics.median(ms[kv_cache_dtype]):.3f} ms over a {kv_cache_dtype} one: "
          f"{statistics.median(ratios):.3f}x (median of {rounds} paired rounds of 20 steps; the context grows "
          f"to {context + rounds * 23})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--collapse", action="store_true", help="huge pages for oneDNN's packed weights, on and off")
    parser.add_argument("--argmax", action="store_true",
                        help="the native step's argmax handed to the sampler, on and off (twelfth round)")
    parser.add_argument("--one-region", action="store_true",
                        help="the native step's layers in one parallel region, on and off (twelfth round; int4: fourteenth)")
    parser.add_argument("--own-barrier", action="store_true",
                        help="the native step's own barrier against libgomp's (under $OMP_WAIT_POLICY as set)")
    parser.add_argument("--kv-ahead", action="store_true",
                        help="the next layer's K/V fetched during the products, on and off")
    parser.add_argument("--prefetch", action="store_true",
                        help="the one-row products without their software prefetches against with them (fourteenth round)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="the mode over its own dtype's KV cache against over this one (two engines)")
    parser.add_argument("--context", type=int, default=1800, help="with --kv-cache-dtype: the prompt's tokens")
    parser.add_argument("--against", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="with --kv-cache-dtype: the other engine's cache (auto: the mode's own dtype)")
    parser.add_argument("--scheduler-steps", type=int, default=0, metavar="N",
                        help="N greedy decode steps a scheduling step against one (thirteenth round)")
    args = parser.parse_args(argv)
    if args.kv_cache_dtype:
        kv_cache_dtype_ab(args.mode, args.rounds or 20, args.kv_cache_dtype, args.context, args.against)
    elif args.scheduler_steps > 1:
        scheduler_steps_ab(args.mode, args.rounds or 64, args.scheduler_steps)
    elif args.collapse:
        collapse_ab(args.rounds or 40)
    else:
        steps_ab(args.mode, args.rounds or 20, argmax_only=args.argmax, one_region=args.one_region,
                 prefetch=args.prefetch, own_barrier=args.own_barrier, kv_ahead=args.kv_ahead)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

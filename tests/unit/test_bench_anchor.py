"""``sluice bench anchor``: without llama-cpp-python it says how to install it; with an anchor it runs
the systems in turn on the same prompts and writes the ratios (speed is never asserted). llama.cpp
itself is a benchmark dependency, not a test one: a stand-in takes its place here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import pytest

from sluice.cpuinfo import cpu_model
from sluice_bench import anchor

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _torch_threads_back():
    """The anchor sets the process's torch threads (``--threads``: a CLI's choice); the tests after
    these get theirs back, or every later step in the session would run on one thread."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    anchor.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_without_llama_cpp_it_names_the_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert anchor.run(_args()) == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python is not installed" in err and "pip install 'sluice[anchor]'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--output-len", "1"], "--output-len must be at least 2"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--modes", "int3"], "--modes must name modes of"),
    (["--modes", ","], "--modes must name modes of"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert anchor.run(_args(*argv)) == 2
    assert message in capsys.readouterr().err


class _StandIn:
    """llama.cpp's place: echoes the prompt's first tokens, a little slower per token than nothing."""

    calls: list[list[int]] = []

    def __init__(self, gguf, threads, n_ctx, extra_buffers=False) -> None:
        self.version = "stand-in"

    def run(self, prompt, output_len, row):
        _StandIn.calls.append(list(prompt))
        started = time.perf_counter()
        time.sleep(0.002)
        first = time.perf_counter()
        time.sleep(0.001 * (output_len - 1))
        if row is not None:
            row.add(first - started, time.perf_counter() - first, output_len - 1)
        return prompt[:output_len]


def test_the_systems_take_turns_on_the_same_prompts(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(anchor, "LlamaCppStream", _StandIn)
    monkeypatch.setattr(anchor, "find_gguf", lambda explicit: tmp_path / "model.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    prompts_seen: list[list[int]] = []
    real_run = anchor.SluiceStream.run
    monkeypatch.setattr(anchor.SluiceStream, "run",
                        lambda self, prompt, n, row: prompts_seen.append(list(prompt)) or real_run(self, prompt, n, row))
    sizes: list[int] = []
    real_read = anchor.read_bandwidth_gb_s
    monkeypatch.setattr(anchor, "read_bandwidth_gb_s",
                        lambda threads, mbytes=512: sizes.append(mbytes) or real_read(threads, mbytes, 0.05))
    _StandIn.calls = []
    out = tmp_path / "anchor.json"
    args = _args("--model", str(model_dir), "--modes", "float32", "--input-len", "16", "--output-len", "4",
                 "--num-iters", "2", "--threads", "1", "--json", str(out))
    assert anchor.run(args) == 0
    assert prompts_seen == _StandIn.calls and len(prompts_seen) == 3  # a warm-up, then 2 measured, same ids
    assert all(len(p) == 16 for p in prompts_seen)
    result = json.loads(out.read_text())
    llama, sluice = result["rows"]
    assert llama["system"].startswith("llama.cpp stand-in") and sluice["system"] == "sluice float32"
    assert len(sluice["decode_tok_s_runs"]) == 2 and llama["ratio_to_llama_cpp"] == 1.0
    assert sluice["ratio_to_llama_cpp"] == pytest.approx(sluice["decode_tok_s"] / llama["decode_tok_s"])
    # a reading before the first system and after each system's run, per measured iteration
    readings = result["read_bandwidth_runs_gb_s"]
    assert len(readings) == 2 * 3 and all(r > 0 for r in readings)
    assert result["read_bandwidth_gb_s"] == pytest.approx(statistics.median(readings))
    # each run's bound is the mean of the readings on either side of it; the share is the median
    assert sluice["read_bandwidth_beside_runs_gb_s"] == pytest.approx(
        [(readings[1] + readings[2]) / 2, (readings[4] + readings[5]) / 2])
    shares = [tok_s * sluice["weight_bytes_per_token"] / (gb_s * 1e9)
              for tok_s, gb_s in zip(sluice["decode_tok_s_runs"], sluice["read_bandwidth_beside_runs_gb_s"], strict=True)]
    assert sluice["share_of_bandwidth_bound_runs"] == pytest.approx(shares)
    assert sluice["share_of_bandwidth_bound"] == pytest.approx(statistics.median(shares))
    assert llama["share_of_bandwidth_bound"] is None
    # the working-set bound: a read of the mode's own weight bytes on either side of its run, and
    # none for llama.cpp, whose weights the bench does not count
    ws_mbytes = -(-sluice["weight_bytes_per_token"] // (1 << 20))
    assert sizes == [512, 512, ws_mbytes, ws_mbytes, 512] * 2
    assert len(sluice["working_set_read_beside_runs_gb_s"]) == 2
    ws_shares = [tok_s * sluice["weight_bytes_per_token"] / (gb_s * 1e9) for tok_s, gb_s
                 in zip(sluice["decode_tok_s_runs"], sluice["working_set_read_beside_runs_gb_s"], strict=True)]
    assert sluice["share_of_working_set_bound_runs"] == pytest.approx(ws_shares)
    assert sluice["share_of_working_set_bound"] == pytest.approx(statistics.median(ws_shares))
    assert llama["working_set_read_beside_runs_gb_s"] == [] and llama["share_of_working_set_bound"] is None
    assert len(result["agreement_with_llama_cpp"]["float32"]) == 2
    assert result["machine"]["cpu"] == cpu_model() != ""  # which machine a stored run came from
    text = capsys.readouterr().out
    assert "x llama.cpp" in text and "read bandwidth" in text and "of ws bound" in text


def test_weight_bytes_per_token_count_what_a_decode_step_reads(model_dir):
    from engine_service import LLM

    f32 = LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20).engine.runner.model
    params = sum(p.numel() for p in f32.parameters())  # tied: the embedding is the output projection
    assert anchor.decode_weight_bytes(f32) == params * 4
    int4 = LLM(str(model_dir), dtype="float32", quantization="int4", kv_cache_memory=16 << 20).engine.runner.model
    embedding = int4.model.embed_tokens.weight
    int4_bytes = anchor.decode_weight_bytes(int4)
    # 4-bit codes plus a bfloat16 scale and zero per 32 weights: 5 bits a weight, and float norms
    linear = params - embedding.numel()  # the decoder's projections and norms; the head is embedding-sized
    assert (linear + embedding.numel()) * 5 / 8 < int4_bytes < (linear + embedding.numel()) * 5 / 8 * 1.02 + 1e6

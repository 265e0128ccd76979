"""scripts/random_weights_model.py: a prepared directory of the default model's kind with seeded
random weights (what a GPU machine without the model runs its checks on)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.prepare import MARKER, is_prepared
from tests.file_modules import load_file

pytestmark = pytest.mark.model


def _script():
    return load_file("scripts/random_weights_model.py")


def _small_like(model_dir: Path, dest: Path) -> Path:
    """The default model's tokenizer files with a config cut to two narrow layers."""
    dest.mkdir()
    for name in ("generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, dest / name)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_seeded_random_model_is_prepared_varied_and_what_transformers_computes(model_dir, tmp_path):
    like = _small_like(model_dir, tmp_path / "like")
    out = tmp_path / "out"
    assert _script().main(["--like", str(like), "--out", str(out), "--seed", "3"]) == 0
    assert is_prepared(out) and "random weights (seed 3)" in json.loads((out / MARKER).read_text())["source"]
    assert json.loads((out / "config.json").read_text()) == json.loads((like / "config.json").read_text())

    llm = LLM(str(out), dtype="float32", enforce_eager=True, attention_backend="torch", kv_cache_memory=16 << 20)
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = llm.generate([ids], params)[0].outputs[0].token_ids
    assert len(set(ours)) >= 6, f"greedy decoding should not repeat one token: {ours}"

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert ours == theirs

    again = tmp_path / "again"
    assert _script().main(["--like", str(like), "--out", str(again), "--seed", "3"]) == 0
    assert LLM(str(again), dtype="float32", enforce_eager=True, attention_backend="torch",
               kv_cache_memory=16 << 20).generate([ids], params)[0].outputs[0].token_ids == ours


def test_a_like_directory_missing_a_file_is_refused(model_dir, tmp_path, capsys):
    like = _small_like(model_dir, tmp_path / "like")
    (like / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as exc:
        _script().main(["--like", str(like), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "lacks tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

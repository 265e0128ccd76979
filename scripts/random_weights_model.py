"""Write a model directory with the default model's architecture, tokenizer and chat template and
seeded random weights, prepared as `sluice model prepare` would leave it.

For a GPU machine that cannot fetch the default model (no network, and the weights are larger
than what travels to it): the speed of a forward does not depend on the weights' values (benches
ignore EOS), and the GPU tests compare our kernels with transformers on the same weights.
Nothing in the service reads this; the marker's ``source`` says the weights are random.

Usage: python scripts/random_weights_model.py --like DIR --out DIR [--seed N]
  --like: a directory holding config.json, generation_config.json, special_tokens_map.json,
          tokenizer.json and tokenizer_config.json (the default model's, copied from a prepared one)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_service.model.prepare import FORMAT_VERSION, MARKER, REQUIRED_FILES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    files = [f for f in REQUIRED_FILES if f != "model.safetensors"]
    missing = [f for f in files if not (args.like / f).is_file()]
    if missing:
        parser.error(f"--like {args.like} lacks {', '.join(missing)}")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.like)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # At transformers' own initialisation (normal(0, 0.02)) the residual stream stays the input
    # token's embedding and greedy decoding repeats one token, which a kernel bug could not change.
    # Unit-scale embeddings and every other matrix at 2 / sqrt(fan-in) give text-like variety at
    # any depth and width (each layer adds about as much as the embedding holds).
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        for param in model.parameters():
            if param.dim() == 2 and param is not embeddings:
                param.normal_(0.0, 2.0 / math.sqrt(param.shape[1]))
        embeddings.normal_(0.0, 1.0)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in files:
        shutil.copyfile(args.like / name, args.out / name)
    (args.out / MARKER).write_text(json.dumps({
        "format": FORMAT_VERSION,
        "source": f"random weights (seed {args.seed}) in the shape of {args.like / 'config.json'}",
        "prepared_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }))
    print(f"random_weights_model: {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

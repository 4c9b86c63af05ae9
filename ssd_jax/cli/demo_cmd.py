"""`ssd-jax demo`: the whole pipeline on a freshly made random Llama, with nothing to download.

Builds a small random Llama, writes it as a Hugging Face directory, loads it back, and decodes
a ragged batch greedily and with sampling, printing tokens and throughput."""

from __future__ import annotations

import os
import tempfile

from ssd_jax.cli.generate_cmd import print_result


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="end-to-end run on a random Llama (no download)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None, help="where to write the random HF checkpoint (default: temp dir)")
    parser.set_defaults(func=run)


def run(args) -> int:
    import jax
    import numpy as np

    import ssd_jax
    from checkpoints_convert import export_hf
    from ssd_jax.models.params import init_params

    config = ssd_jax.ModelConfig(
        model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=2048, eos_token_ids=(),
    )
    model = ssd_jax.Model(config=config, params=init_params(config, jax.random.PRNGKey(0), scale=0.2))
    out_dir = args.out or os.path.join(tempfile.mkdtemp(prefix="ssd_jax_demo_"), "random-llama")
    export_hf(model, out_dir, overwrite=True)
    model = ssd_jax.load(out_dir)
    print(f"random Llama with {config.num_params / 1e6:.1f}M parameters written to {out_dir}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, size=int(n)).tolist()
               for n in rng.integers(8, 48, size=args.batch_size)]
    for temperature in (0.0, 0.8):
        print(f"\n=== autoregressive, temperature {temperature}")
        out = ssd_jax.generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature,
                               key=jax.random.PRNGKey(1))
        print_result(out, None, as_json=False)
    return 0

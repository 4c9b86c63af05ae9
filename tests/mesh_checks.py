"""Sharded-model checks, run by tests/test_mesh.py in a subprocess with 8 fake CPU devices
(`--xla_force_host_platform_device_count=8`, read when jax starts; the rest of the suite keeps
one device). Prints one JSON line with the findings.

  python tests/mesh_checks.py meshes 2x4,1x8 [--sampled]  # random Llama (8 heads, 4 KV heads) loaded with
                                                         # load(path, mesh=...): bytes per device, AR/SD/
                                                         # GBV/LogitSpec/CSD tokens vs unsharded
  python tests/mesh_checks.py embedded 1x2,2x2 [methods]  # embedded pair with shard(): every method
  python tests/mesh_checks.py hlo                         # compiled decode at TP=4: collectives
  python tests/mesh_checks.py ssd                         # SSD, target on devices 0-3, draft on 4-7
  python tests/mesh_checks.py bad                         # bad meshes, rules and placements
  python tests/mesh_checks.py moe                         # Mixtral experts: default rules, expert parallel
  python tests/mesh_checks.py model_only                  # a mesh with only a "model" axis
  python tests/mesh_checks.py eagle                       # EAGLE: embedded target on 2x2, the head replicated
  python tests/mesh_checks.py hlo + ssd + bad             # several in one process: {"hlo": ..., ...}
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ssd_jax  # noqa: E402
from ssd_jax.models.params import init_params  # noqa: E402
from spec_models import noisy_copy  # noqa: E402

ALL_SYNC = ["ar", "sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd"]
MESH_METHODS = ["ar", "sd", "gbv", "logitspec", "csd"]
DRAFTED = ("sd", "bv", "specinfer", "spectr", "gbv", "csd")


def random_llama(seed: int) -> ssd_jax.Model:
    config = ssd_jax.ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                                 num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=256,
                                 eos_token_ids=(1,))
    return ssd_jax.Model(config=config, params=init_params(config, jax.random.PRNGKey(seed), scale=0.3))


def mesh_of(shape: str):
    data, model = (int(x) for x in shape.split("x"))
    return jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])


def method_for(name: str, adaptive: bool = True):
    """The method's default object for SD where `adaptive` (its draft_len="auto" loop, sharded),
    and otherwise the fixed lengths the sharding checks were written for (`method_options.FIXED`):
    compiling every method's adaptive loop on 8 fake devices costs about half a minute more."""
    from method_options import FIXED

    return ssd_jax.methods.METHOD_CLASSES[name](**({} if name == "sd" and adaptive else FIXED.get(name, {})))


def tokens_of(target, draft, prompts, name, temperature, adaptive: bool = True):
    """adaptive: SD's "auto" loop (False: fixed SD, for checks of sharding rules, whose adaptive
    loop the mesh check already runs sharded; its programs per cap cost ~40 s to compile here)."""
    draft = (draft if name in DRAFTED else None)
    if name == "csd" and target.tokenizer is None:  # Max-Gram's table for a model with no tokenizer
        vocab = target.config.vocab_size
        draft = (draft, ssd_jax.MaxGram(bigram=jnp.asarray(np.roll(np.arange(vocab, dtype=np.int32), -1))))
    out = ssd_jax.generate(target, prompts, method=method_for(name, adaptive), draft=draft, max_new_tokens=16,
                           temperature=temperature, key=jax.random.PRNGKey(3))
    return out.tokens


def greedy_reference(target, prompts):
    """The unsharded target's AR tokens: greedy, every lossless method's tokens are AR's (the
    identity tests prove it unsharded), so one unsharded program stands for all of them; a sharded
    method that differs fails against it just the same."""
    return tokens_of(target, None, prompts, "ar", 0.0)


def bytes_per_device(model) -> dict:
    per = {}
    for leaf in jax.tree.leaves(model.params):
        for shard in leaf.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return per


def check_meshes(shapes: list[str], sampled: bool) -> dict:
    from checkpoints_convert.convert import export_hf

    target, draft = random_llama(0), None
    draft = noisy_copy(target, 0.05, 7)
    prompts = [[5, 9, 17, 3, 44, 2], [7, 7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
    temperatures = (0.0, 1.0) if sampled else (0.0,)
    greedy = greedy_reference(target, prompts)
    reference = {(m, t): tokens_of(target, draft, prompts, m, t) if t else greedy
                 for m in MESH_METHODS for t in temperatures}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = export_hf(target, os.path.join(tmp, "t")), export_hf(draft, os.path.join(tmp, "d"))
        total = sum(x.nbytes for x in jax.tree.leaves(target.params))
        kv_bytes = sum(x.nbytes for x in jax.tree.leaves((target.params["layers"]["k"], target.params["layers"]["v"])))
        for shape in shapes:
            mesh = mesh_of(shape)
            t_sharded = ssd_jax.load(tdir, mesh=mesh)
            d_sharded = ssd_jax.load(ddir, mesh=mesh)
            per = bytes_per_device(t_sharded)
            same = {f"{m}@{t}": tokens_of(t_sharded, d_sharded, prompts, m, t) == reference[(m, t)]
                    for m in MESH_METHODS for t in temperatures}
            results[shape] = dict(same=same, total_bytes=total, max_device_bytes=max(per.values()),
                                  kv_bytes=kv_bytes, kv_heads=target.config.num_kv_heads,
                                  devices=len(per), model=int(mesh.shape["model"]),
                                  embed_spec=str(t_sharded.params["embed"].sharding.spec))
    return results


def check_embedded(shapes: list[str], methods: list[str]) -> dict:
    target, draft = ssd_jax.default_models()
    prompts = [target.tokenizer.encode(s).ids for s in ("def fibonacci(n):", "import os\nclass Foo:", "x = ")]
    results = {}
    reference = greedy_reference(target, prompts)
    for shape in shapes:
        mesh = mesh_of(shape)
        ts, ds = ssd_jax.shard(target, mesh), ssd_jax.shard(draft, mesh)
        results[shape] = {m: tokens_of(ts, ds, prompts, m, 0.0) == reference for m in methods}
    return results


def check_stream() -> dict:
    """Streamed calls on a 2x2 mesh (`ssd_jax.runtime.streaming`: the pieces' programs take the state,
    the piece and the cost inputs placed on the mesh): AR at T=0, and SD at a fixed length at
    T=1 against the same call unstreamed; the sink's tokens against the output."""
    target = random_llama(0)
    draft = noisy_copy(target, 0.05, 7)
    prompts = [[5, 9, 17, 3, 44, 2], [7, 7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]]
    mesh = mesh_of("2x2")
    ts, ds = ssd_jax.shard(target, mesh), ssd_jax.shard(draft, mesh)
    results = {}
    for name, method, temperature in (("ar", ssd_jax.AR(), 0.0), ("sd", ssd_jax.SD(draft_len=3), 1.0)):
        drafts = ds if name == "sd" else None
        options = dict(method=method, draft=drafts, max_new_tokens=24, temperature=temperature,
                       key=jax.random.PRNGKey(3))
        got = [[] for _ in prompts]

        def sink(tokens, counts, got=got):
            for row, count in enumerate(counts):
                got[row].extend(int(t) for t in tokens[row, :count])

        streamed = ssd_jax.generate(ts, prompts, stream=sink, **options)
        plain = ssd_jax.generate(ts, prompts, **options)
        results[name] = dict(same=streamed.tokens == plain.tokens, sink=got == streamed.tokens,
                             tokens=sum(map(len, got)))
    return results


def check_hlo() -> dict:
    model = ssd_jax.shard(random_llama(0), mesh_of("1x4"))
    tokens = jnp.asarray([[5, 9, 17, 3, 44, 2], [7, 7, 8, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([6, 3], jnp.int32)
    weight_shapes = set()
    from ssd_jax.models.transformer import decode_params

    for leaf in jax.tree.leaves(decode_params(model.params, model.config, fuse=False)):
        weight_shapes.add(tuple(leaf.shape))
    found = {}
    # Greedy, SD's tokens are AR's: generate's AR tokens stand for both (one adaptive program fewer).
    via_generate = ssd_jax.generate(model, [[5, 9, 17, 3, 44, 2], [7, 7, 8]], method=method_for("ar"),
                                    max_new_tokens=8, key=jax.random.PRNGKey(0)).tokens
    for name in ("ar", "sd"):
        def user_fn(target, draft, tokens, lengths, key, name=name):
            return ssd_jax.decode(target, tokens, lengths, method=method_for(name), max_new_tokens=8, key=key,
                                  draft=draft if name == "sd" else None, eos_ids=(1,))

        compiled = jax.jit(user_fn).lower(model, model, tokens, lengths, jax.random.PRNGKey(0)).compile()
        hlo = compiled.as_text()
        out = compiled(model, model, tokens, lengths, jax.random.PRNGKey(0))
        in_jit = [np.asarray(out.tokens[b, :int(out.num_tokens[b])]).tolist() for b in range(2)]
        gathers = [tuple(int(d) for d in dims.split(",") if d) for dims in
                   re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)]
        reduces = re.findall(r"all-reduce(?:-start)?\(", hlo)
        found[name] = dict(decode_equals_generate=in_jit == via_generate, all_reduces=len(reduces), all_gathers=[list(g) for g in gathers],
                           weight_gathers=[list(g) for g in gathers if g in weight_shapes])
    return found


def check_ssd() -> dict:
    target, draft = ssd_jax.default_models()
    prompts = [target.tokenizer.encode(s).ids for s in ("def fibonacci(n):", "import os\nclass Foo:")]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=24).tokens
    devices = jax.devices()
    t_mesh = jax.make_mesh((2, 2), ("data", "model"), devices=devices[:4])
    d_mesh = jax.make_mesh((2, 2), ("data", "model"), devices=devices[4:8])
    ts, ds = ssd_jax.shard(target, t_mesh), ssd_jax.shard(draft, d_mesh)
    out = ssd_jax.generate(ts, prompts, max_new_tokens=24, method=ssd_jax.SSD(), draft=ds)
    return dict(equal_to_ar=out.tokens == reference, hit_rate=out.stats["cache_hit_rate"],
                target_devices=out.stats["target_devices"], draft_devices=out.stats["draft_devices"],
                colocated=out.stats["colocated"],
                target_param_devices=sorted({d.id for d in ts.params["embed"].sharding.device_set}))


def check_model_only() -> dict:
    """A mesh with only a "model" axis (no "data"): AR and SD give the unsharded tokens."""
    target = random_llama(0)
    draft = noisy_copy(target, 0.05, 7)
    prompts = [[5, 9, 17, 3, 44, 2], [7, 7, 8], [100, 101, 102]]
    mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
    ts, ds = ssd_jax.shard(target, mesh), ssd_jax.shard(draft, mesh)
    reference = greedy_reference(target, prompts)
    return dict(same={m: tokens_of(ts, ds, prompts, m, 0.0, adaptive=False) == reference
                      for m in ("ar", "sd")}, q_spec=str(ts.params["layers"]["q"]["kernel"].sharding.spec))


def check_moe() -> dict:
    """A Mixtral-style target (4 experts, top 2) on a 1x4 mesh, by the default rules (each
    expert's MLP split over "model") and by expert parallelism (`{"experts": "model", "mlp": None}`:
    one expert per device): AR and SD give the unsharded tokens."""
    config = ssd_jax.ModelConfig(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=96,
                                 num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=128,
                                 mlp="moe", num_experts=4, experts_per_token=2, eos_token_ids=(1,))
    target = ssd_jax.Model(config=config, params=init_params(config, jax.random.PRNGKey(0), scale=0.3))
    draft = noisy_copy(target, 0.05, 1)
    prompts = [[5, 9, 17, 3, 44, 2], [7, 7, 8]]
    reference = greedy_reference(target, prompts)
    found = {}
    for name, rules in (("default_rules", None), ("expert_parallel", {"experts": "model", "mlp": None})):
        mesh = mesh_of("1x4")
        ts, ds = ssd_jax.shard(target, mesh, rules=rules), ssd_jax.shard(draft, mesh, rules=rules)
        experts = ts.params["layers"]["experts"]["gate"]["kernel"]
        found[name] = dict(same={m: tokens_of(ts, ds, prompts, m, 0.0, adaptive=False) == reference
                                 for m in ("ar", "sd")},
                           expert_spec=str(experts.sharding.spec),
                           expert_shard_shape=list(experts.addressable_shards[0].data.shape),
                           expert_shape=list(experts.shape))
    return found


def _error(fn) -> str:
    try:
        fn()
    except ssd_jax.InputError as err:
        return "InputError: " + str(err)
    except Exception as err:  # noqa: BLE001 - reported, the test asserts the type
        return f"{type(err).__name__}: {err}"
    return "no error"


def check_bad() -> dict:
    from jax.sharding import Mesh

    model = random_llama(0)
    target, draft = ssd_jax.default_models()
    devices = np.array(jax.devices())
    prompts = [[5, 6, 7]]
    return dict(
        no_model_axis=_error(lambda: ssd_jax.shard(model, jax.make_mesh((2, 2), ("data", "tensor")))),
        unknown_rule_axis=_error(lambda: ssd_jax.shard(model, mesh_of("1x2"), rules={"heads": "tensor"})),
        unknown_logical=_error(lambda: ssd_jax.shard(model, mesh_of("1x2"), rules={"head": "model"})),
        heads_not_divisible=_error(lambda: ssd_jax.shard(target, mesh_of("1x4"))),
        kv_replicated=str(ssd_jax.shard(model, mesh_of("1x8")).params["layers"]["k"]["kernel"].sharding.spec),
        not_a_mesh=_error(lambda: ssd_jax.shard(model, "1x2")),
        auto_mesh_works=str(ssd_jax.shard(model, Mesh(devices[:2].reshape(1, 2), ("data", "model")))
                            .params["embed"].sharding.spec),
        draft_elsewhere=_error(lambda: ssd_jax.generate(
            ssd_jax.shard(target, Mesh(devices[:2].reshape(1, 2), ("data", "model"))), prompts, max_new_tokens=4,
            method="sd", draft=ssd_jax.shard(draft, Mesh(devices[2:4].reshape(1, 2), ("data", "model"))))),
        ssd_overlap=_error(lambda: ssd_jax.generate(
            ssd_jax.shard(target, Mesh(devices[:2].reshape(1, 2), ("data", "model"))), prompts, max_new_tokens=4,
            method="ssd", draft=ssd_jax.shard(draft, Mesh(devices[1:3].reshape(1, 2), ("data", "model"))))),
    )


def check_coupling() -> dict:
    """Under the Gumbel coupling the embedded pair sharded over 2x2 gives the unsharded coupled AR
    tokens: SD at its defaults (draft_len "auto") and AR, T=1, 4 ragged rows ("data" splits them).
    The deterministic tuner plans "auto" without timing runs (what is tested here is the sharding;
    tests/test_coupling.py checks that measured timings leave the coupled tokens alone)."""
    target, draft = ssd_jax.default_models()
    texts = ("def fibonacci(n):", "import os\nclass Foo:", "x = ", "for i in range(10):\n")
    prompts = [target.tokenizer.encode(t).ids for t in texts]
    kw = dict(max_new_tokens=16, temperature=1.0, coupling="gumbel", key=jax.random.PRNGKey(4))
    reference = ssd_jax.generate(target, prompts, **kw).tokens
    mesh = mesh_of("2x2")
    ts, ds = ssd_jax.shard(target, mesh), ssd_jax.shard(draft, mesh)
    fixed = ssd_jax.Tuner(deterministic=True)
    return {name: ssd_jax.generate(ts, prompts, method=name, draft=d, tuner=fixed, **kw).tokens == reference
            for name, d in (("ar", None), ("sd", ds))}


def check_eagle() -> dict:
    """The embedded target sharded over 2x2 with the shipped head (replicated) gives the unsharded
    tokens: EAGLE at T=0 (AR's) and at T=1 (the unsharded EAGLE call's, same key)."""
    target, _ = ssd_jax.default_models()
    head = ssd_jax.default_eagle_head()
    prompts = [target.tokenizer.encode(t).ids for t in ("def fibonacci(n):", "import os\nclass Foo:", "x = ")]
    mesh_target = ssd_jax.shard(target, mesh_of("2x2"))
    results = {}
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=16, temperature=temperature, key=jax.random.PRNGKey(3),
                  method=ssd_jax.EAGLE(draft_len=3, topk=2))
        reference = ssd_jax.generate(target, prompts, draft=head, **kw).tokens
        if temperature == 0.0:
            assert reference == greedy_reference(target, prompts)
        results[f"eagle@{temperature:g}"] = ssd_jax.generate(mesh_target, prompts, draft=head, **kw).tokens == reference
    return results


def run_check(argv: list[str]) -> dict:
    check = argv[0]
    if check == "meshes":
        return check_meshes(argv[1].split(","), "--sampled" in argv)
    if check == "embedded":
        return check_embedded(argv[1].split(","), argv[2].split(",") if len(argv) > 2 else ALL_SYNC)
    return dict(hlo=check_hlo, ssd=check_ssd, bad=check_bad, moe=check_moe,
                model_only=check_model_only, stream=check_stream, coupling=check_coupling, eagle=check_eagle)[check]()


def main(argv: list[str]) -> dict:
    """One check, or several separated by "+" (one process: jax starts and the models load once),
    then a dict keyed by each check's name."""
    if "+" not in argv:
        return run_check(argv)
    groups, current = [], []
    for arg in argv + ["+"]:
        if arg == "+":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    return {group[0]: run_check(group) for group in groups if group}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))

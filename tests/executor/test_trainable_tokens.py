"""Trainable tokens served beside LoRA and DoRA (PEFT's trainable_token_indices) and alone (peft_type
TRAINABLE_TOKENS): real store and executor on loopback (Llama with its own lm_head at tp 1, Qwen2
with tied embeddings at tp 2), each row of batches mixing trainable-token, DoRA, plain LoRA and base
rows checked against transformers + PEFT alone, through loads and evictions; bad token ids and
malformed adapters refused with their status."""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import re

import pytest
import torch

from loraserve.errors import StatusError

from .conftest import BYTE_BOS, Cluster, check_against_reference, generate

CASES = {"llama-tp1": ("llama", 1, {}), "qwen2-tp2": ("qwen2", 2, dict(tie_word_embeddings=True))}
# trainable tokens alone, TrainableTokensConfig fields per case: the untied Llama's embedding with its
# own lm_head rows, and its embedding only (its lm_head keeps the base rows); the tied Qwen2's
# embedding (PEFT ties the lm_head's rows to it) and its lm_head only (the embedding keeps the base rows)
ALONE = {
    "llama-tp1": {
        "alone": dict(target_modules=["embed_tokens", "lm_head"], token_indices=[17, 200, 259]),
        "alone2": dict(token_indices=[5, 42]),
    },
    "qwen2-tp2": {"alone": dict(token_indices=[17, 200, 259]), "alone2": dict(target_modules=["lm_head"], token_indices=[5, 42])},
}
TOKENS = [5, 17, 200, 259]  # 259: past the byte tokenizer's ids, as a chat format's new token is
ADAPTERS = {  # name: LoraConfig fields
    "tok": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], trainable_token_indices=TOKENS),
    "dora_tok": dict(r=8, lora_alpha=8, target_modules=["v_proj", "o_proj"], use_dora=True, trainable_token_indices=[17, 42]),
    "lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}
# Four slots: the last two groups hold more adapters than slots, so adapters load, are evicted and
# move between slots within a group, and a batch holds trainable tokens alone beside LoRA with
# tokens, DoRA with tokens, plain LoRA and base rows.
SLOTS = 4
GROUPS = (
    ["tok", "lora", "", "dora_tok"],
    ["alone", "tok", "", "dora_tok", "alone2"],
    ["lora", "alone2", "", "alone", "dora_tok", "tok"],
    ["dora_tok", "", "alone", "lora", "tok", "alone2"],
)


@pytest.fixture(scope="module", params=list(CASES))
def case_name(request):
    return request.param


@pytest.fixture(scope="module")
def case(case_name):
    return CASES[case_name]


@pytest.fixture(scope="module")
def alone(case_name):
    return ALONE[case_name]


@pytest.fixture(scope="module")
def base(byte_model, case):
    family, _, overrides = case
    return byte_model(family, **overrides)


def make_adapter(model, directory, seed: int, **config):
    """A PEFT adapter with random trained values: LoraConfig's fields, or TrainableTokensConfig's
    (token_indices: trainable tokens alone)."""
    from peft import LoraConfig, TrainableTokensConfig, get_peft_model

    torch.manual_seed(seed)
    peft_config = TrainableTokensConfig(**config) if "token_indices" in config else LoraConfig(**config)
    peft = get_peft_model(copy.deepcopy(model), peft_config)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in n:
                p.mul_(0.5 + torch.rand_like(p))
            elif "trainable_tokens_delta" in n:
                p.normal_(0, 1.0)
    peft.save_pretrained(directory)


@pytest.fixture(scope="module")
def adapter_dirs(base, alone, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, config) in enumerate({**ADAPTERS, **alone}.items()):
        make_adapter(base[0], root / name, seed, **config)
    return root


@pytest.fixture(scope="module")
def references(base, alone, adapter_dirs):
    from peft import PeftModel

    refs = {"": base[0]}
    for name in [*ADAPTERS, *alone]:
        refs[name] = PeftModel.from_pretrained(copy.deepcopy(base[0]), adapter_dirs / name).eval()
    return refs


def prompt(i: int) -> list[int]:
    """Bytes with the trainable tokens among them."""
    g = torch.Generator().manual_seed(200 + i)
    return [BYTE_BOS, *torch.randint(0, 256, (3 + i,), generator=g).tolist(), 5, 17, 259, 42, 200]


def test_token_rows_match_transformers_peft_in_mixed_batches_across_slots(
    case, base, alone, adapter_dirs, references, module_loop_thread, tmp_path
):
    _, tp, _ = case
    c = Cluster(
        module_loop_thread,
        base[1],
        adapter_dirs,
        tmp_path / "store",
        [*ADAPTERS, *alone],
        tp_size=tp,
        cpu_threads=1,
        tp_timeout_s=60.0,
        enable_dora=True,
        enable_trainable_tokens=True,
        max_loras=SLOTS,
    )
    try:
        listed = {m.name: (m.kind, m.rank) for m in c.store_client().list()}
        assert listed == {
            "tok": ("lora+tokens", 4),
            "dora_tok": ("dora+tokens", 8),
            "lora": ("lora", 8),
            "alone": ("tokens", 0),
            "alone2": ("tokens", 0),
        }
        client = c.client()
        for group in GROUPS:
            jobs = [(name, prompt(i)) for i, name in enumerate(group)]
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                resps = list(pool.map(lambda j: generate(client, *j, 6), jobs))
            for (name, ids), resp in zip(jobs, resps):
                check_against_reference(references[name], ids, resp)
        # a token id past the base vocabulary: refused at registration, naming it
        make_adapter(base[0], adapter_dirs / "beyond", 9, r=4, target_modules=["q_proj"], trainable_token_indices=[3])
        cfg = adapter_dirs / "beyond" / "adapter_config.json"
        cfg.write_text(
            cfg.read_text().replace('"trainable_token_indices": [\n    3\n  ]', '"trainable_token_indices": [\n    300\n  ]')
        )
        with pytest.raises(StatusError) as e:
            c.store_client().register("beyond", str(adapter_dirs / "beyond"))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert "token id 300 is beyond base model 'tiny''s vocabulary of 260" in e.value.message
        # trainable tokens alone: an id past the vocabulary, and malformed files, refused naming the fault
        for edit, message in ALONE_REFUSALS:
            make_adapter(base[0], adapter_dirs / "bad", 9, token_indices=[3, 7])
            edit(adapter_dirs / "bad")
            with pytest.raises(StatusError) as e:
                c.store_client().register("bad", str(adapter_dirs / "bad"))
            assert e.value.code.name == "INVALID_ARGUMENT" and message in e.value.message, e.value.message
        # more token ids than a slot holds: refused at registration
        make_adapter(base[0], adapter_dirs / "wide", 9, token_indices=list(range(65)))
        with pytest.raises(StatusError) as e:
            c.store_client().register("wide", str(adapter_dirs / "wide"))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert "token_indices lists 65 token ids: at most 64 per adapter are served" in e.value.message
        # a tied model: lm_head rows unlike the embedding rows PEFT ties them to, refused at registration
        if case[2].get("tie_word_embeddings"):
            make_adapter(base[0], adapter_dirs / "untied_rows", 9, token_indices=[3, 7])
            _set_tensor(HEAD_DELTA, torch.zeros(2, 64))(adapter_dirs / "untied_rows")
            with pytest.raises(StatusError) as e:
                c.store_client().register("untied_rows", str(adapter_dirs / "untied_rows"))
            assert e.value.code.name == "INVALID_ARGUMENT"
            assert "ties lm_head to the embedding, but the adapter's lm_head trainable token rows differ" in e.value.message
        check_against_reference(references["alone"], prompt(1), generate(client, "alone", prompt(1), 4))  # still served
    finally:
        c.close()


def _set_config(**fields):
    def edit(directory):
        path = directory / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return edit


def _set_tensor(name, t):
    def edit(directory):
        from safetensors.torch import load_file, save_file

        tensors = load_file(directory / "adapter_model.safetensors")
        save_file({**tensors, name: t}, directory / "adapter_model.safetensors")

    return edit


HEAD_DELTA = "base_model.model.lm_head.trainable_tokens_delta"


ALONE_REFUSALS = [
    (_set_config(token_indices=[3, 300]), "token_indices: token id 300 is beyond base model 'tiny''s vocabulary of 260"),
    (_set_config(token_indices=None), "token_indices of a TRAINABLE_TOKENS adapter must be a non-empty list"),
    (_set_config(token_indices=[3]), "trainable_tokens_delta has shape [2, 64], token_indices lists 1 ids"),
    (
        _set_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64)),
        "a TRAINABLE_TOKENS adapter holds only trainable_tokens_delta rows",
    ),
]


def test_trainable_token_rows_that_do_not_fit_are_refused_before_any_slot_changes(hf_model):
    from loraserve.executor.model.loader import load_hf_checkpoint
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot

    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32, trainable_tokens=True))
    rows, hidden, vocab = model.token_rows, model.cfg.hidden_size, model.cfg.vocab_size
    ok = {"tokens.embed.ids": torch.tensor([1, 2], dtype=torch.int32), "tokens.embed.rows": torch.ones(2, hidden)}
    bad = {
        "token ids must lie in the vocabulary": {**ok, "tokens.embed.ids": torch.tensor([1, vocab], dtype=torch.int32)},
        "only one of tokens.embed.ids": {"tokens.embed.ids": ok["tokens.embed.ids"]},
        "a slot holds at most 64": {
            "tokens.embed.ids": torch.arange(65, dtype=torch.int32),
            "tokens.embed.rows": torch.ones(65, hidden),
        },
        "for hidden size": {**ok, "tokens.embed.rows": torch.ones(2, hidden + 1)},
        "unknown trainable-token tensors": {**ok, "tokens.wte.ids": ok["tokens.embed.ids"]},
    }
    for message, tensors in bad.items():
        with pytest.raises(ValueError, match=message):
            load_shard_into_slot(model, 0, tensors)
    assert rows.slots == [False, False] and (rows.table == -1).all()
    load_shard_into_slot(model, 1, ok)
    assert rows.slots == [False, True] and rows.table[1, :3].tolist() == [-1, 0, 1]
    load_shard_into_slot(model, 1, {})  # a shard without trainable tokens: the slot holds none again
    assert rows.slots == [False, False] and (rows.table == -1).all()


def test_without_enable_trainable_tokens_token_adapters_are_refused_and_no_table_is_built(
    case, base, alone, adapter_dirs, references, module_loop_thread, tmp_path
):
    """An executor started without --enable-trainable-tokens builds no token tables (no step does
    token work) and refuses every adapter with trainable tokens ("tokens", "lora+tokens",
    "dora+tokens") through LoadAdapter and Generate with FAILED_PRECONDITION naming the flag,
    keeping nothing of it; plain LoRA and base rows are served."""
    c = Cluster(
        module_loop_thread,
        base[1],
        adapter_dirs,
        tmp_path / "store",
        [*ADAPTERS, *alone],
        cpu_threads=1,
        enable_dora=True,
        max_loras=SLOTS,
    )
    try:
        model = c.parts.engine.model
        assert model.token_rows is None and not model.lora_spec.trainable_tokens
        assert not any("token" in name for name, _ in model.named_buffers())
        client = c.client()
        kinds = {m.name: m.kind for m in c.store_client().list()}
        for name in ("tok", "dora_tok", "alone"):
            assert kinds[name] in ("lora+tokens", "dora+tokens", "tokens")
            want = (
                f"adapter {name!r} has trainable tokens (trainable_token_indices): "
                "this executor was started without --enable-trainable-tokens"
            )
            for call in (lambda: client.load(name), lambda: generate(client, name, prompt(0), 2)):
                with pytest.raises(StatusError) as e:
                    call()
                assert e.value.code.name == "FAILED_PRECONDITION", e.value
                assert e.value.message == want
        for i, name in enumerate(("lora", "")):
            check_against_reference(references[name], prompt(i), generate(client, name, prompt(i), 4))
        held = {a.name: a for a in client.list()}
        for name in ("tok", "dora_tok", "alone"):
            assert name not in held or (held[name].slot < 0 and not held[name].in_cpu_cache), held[name]
    finally:
        c.close()


def test_slots_made_without_trainable_tokens_refuse_a_token_shard(hf_model):
    """LoraSpec.trainable_tokens off: the model has no token rows, and a shard with them loaded
    straight into the model is refused before any slot changes; a plain one loads."""
    from loraserve.executor.lora import lora_modules
    from loraserve.executor.model.loader import load_hf_checkpoint
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot

    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32))
    assert model.token_rows is None
    modules = lora_modules(model)
    name, m = next(iter(modules.items()))
    lora = {
        f"{name}.lora_a": torch.ones(m.lora_a.shape[1], 4, m.lora_a.shape[3]),
        f"{name}.lora_b": torch.ones(m.lora_b.shape[1], 4),
    }
    tokens = {"tokens.embed.ids": torch.tensor([3], dtype=torch.int32), "tokens.embed.rows": torch.ones(1, model.cfg.hidden_size)}
    with pytest.raises(
        ValueError, match=r"shard has trainable tokens \(tokens.embed.ids, ...\), but this model's slots were made without them"
    ):
        load_shard_into_slot(model, 0, {**lora, **tokens})
    assert not m.lora_a[0].any() and m.slot_ranks[0] == 0
    assert load_shard_into_slot(model, 0, lora) == 4


@pytest.mark.parametrize("scatter", ["per_tensor", "one_scatter"])
def test_a_tokens_only_shard_leaves_the_slots_lora_buffers_zero(hf_model, scatter):
    """Trainable tokens alone: a shard of token rows only, loaded over a LoRA adapter's slot (per-tensor
    copies as on the CPU, or the one scatter a CUDA load runs), zeroes the slot's A and B in every
    module, reads rank 0 and holds the rows."""
    from loraserve.executor.lora import lora_modules
    from loraserve.executor.model.loader import load_hf_checkpoint
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import copy_reference

    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32, trainable_tokens=True))
    kw = {"scatter": copy_reference.slot_scatter} if scatter == "one_scatter" else {}
    modules = lora_modules(model)
    gen = torch.Generator().manual_seed(0)
    lora = {}
    for name, m in modules.items():
        for part, buf in (("lora_a", m.lora_a), ("lora_b", m.lora_b)):
            shape = list(buf.shape[1:])
            shape[m.slot_rank_dim] = 8
            lora[f"{name}.{part}"] = torch.randn(shape, generator=gen)
    assert load_shard_into_slot(model, 1, lora, **kw) == 8
    assert all(m.lora_a[1].abs().sum() > 0 for m in modules.values())
    rows = torch.randn(2, model.cfg.hidden_size, generator=gen)
    tokens = {"tokens.embed.ids": torch.tensor([3, 7], dtype=torch.int32), "tokens.embed.rows": rows}
    assert load_shard_into_slot(model, 1, tokens, **kw) == 0
    for m in modules.values():
        assert not m.lora_a[1].any() and not m.lora_b[1].any() and m.slot_ranks[1] == 0
    assert model.token_rows.slots == [False, True] and torch.equal(model.token_rows.embed[1, :2], rows)


@pytest.mark.gpu
def test_token_rows_on_cuda_through_the_graphs_in_bf16(case, base, alone, adapter_dirs, references, loop_thread, tmp_path):
    """The same batches on CUDA in bf16 (decode steps replay the CUDA graphs, which always apply
    the slots' token rows): every row within bf16 tolerance of its own float32 PEFT reference."""
    from .conftest import check_bf16_rows, need_cuda_devices

    _, tp, _ = case
    need_cuda_devices(tp)
    c = Cluster(
        loop_thread,
        base[1],
        adapter_dirs,
        tmp_path / "store",
        [*ADAPTERS, *alone],
        tp_size=tp,
        device="cuda",
        dtype="bfloat16",
        tp_timeout_s=120.0,
        enable_dora=True,
        enable_trainable_tokens=True,
        max_loras=SLOTS,
    )
    try:
        client = c.client()
        for group in GROUPS:
            jobs = [(name, prompt(i)) for i, name in enumerate(group)]
            with cf.ThreadPoolExecutor(len(jobs)) as pool:
                resps = list(pool.map(lambda j: generate(client, *j, 6), jobs))
            check_bf16_rows(references, jobs, resps)
    finally:
        c.close()


def test_token_rows_apply_alike_with_and_without_the_step_slots_on_the_host(hf_model):
    """A captured graph's LoraMeta has no host_slots: the token rows then always apply, which gives
    what the eager step gives; base rows and other slots' rows keep the base embedding and logits."""
    from loraserve.executor.model.loader import load_hf_checkpoint
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot
    from loraserve.kernels import make_lora_meta

    _, path = hf_model("llama")
    model = load_hf_checkpoint(path, lora=LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32, trainable_tokens=True))
    hidden = model.cfg.hidden_size
    rows = torch.randn(2, hidden, generator=torch.Generator().manual_seed(0))
    load_shard_into_slot(model, 1, {"tokens.lm_head.ids": torch.tensor([4, 9], dtype=torch.int32), "tokens.lm_head.rows": rows})
    load_shard_into_slot(model, 0, {"tokens.embed.ids": torch.tensor([9], dtype=torch.int32), "tokens.embed.rows": rows[:1]})
    ids, slots = torch.tensor([9, 9, 9, 4]), torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    base = model.model.embed_tokens(ids)
    h = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1))
    plain = model.tp.all_gather(model.lm_head(h).float())
    for meta in (make_lora_meta(slots, 2, frozenset({0, 1})), make_lora_meta(slots, 2, None)):
        emb = model.token_rows.embed_rows(ids, base, meta)
        assert torch.equal(emb[0], rows[0]) and torch.equal(emb[1:], base[1:])  # slot 1 has no embedding rows
        logits = model.token_rows.logits(h, plain, meta)
        want = plain.clone()
        want[[1, 3], 4], want[[1, 3], 9] = h[[1, 3]] @ rows[0], h[[1, 3]] @ rows[1]
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


TIED = {  # on the tied Qwen2: LoraConfig fields
    "split": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "down_proj"],
        trainable_token_indices={"embed_tokens": [5, 17], "lm_head": [17, 42, 259]},
    ),
    "tok": ADAPTERS["tok"],
    "head_lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], trainable_token_indices=[5, 17]),
}


def test_a_tied_lm_head_serves_its_own_rows_for_other_ids_and_lora_on_it_is_refused(byte_model, module_loop_thread, tmp_path):
    """Qwen2 with tied embeddings at tp 2. trainable_token_indices per module with the lm_head's ids
    unlike the embedding's: PEFT ties neither, and each row of a batch beside tied-token, plain and
    base rows is PEFT's. LoRA on the lm_head with the embedding's rows tied to it (PEFT adds the LoRA
    to the replaced rows' logits): refused at registration naming the module."""
    from peft import PeftModel

    model, path = byte_model("qwen2", tie_word_embeddings=True)
    root = tmp_path / "adapters"
    for seed, (name, config) in enumerate(TIED.items()):
        make_adapter(model, root / name, seed, **config)
    refs = {"": model, **{n: PeftModel.from_pretrained(copy.deepcopy(model), root / n).eval() for n in ("split", "tok")}}
    c = Cluster(
        module_loop_thread, path, root, tmp_path / "store", ["split", "tok"], tp_size=2, cpu_threads=1, tp_timeout_s=60.0,
        enable_trainable_tokens=True, max_loras=2,
    )  # fmt: skip
    try:
        assert {m.name: m.kind for m in c.store_client().list()} == {"split": "lora+tokens", "tok": "lora+tokens"}
        jobs = [(name, prompt(i)) for i, name in enumerate(["split", "", "tok", "split"])]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            resps = list(pool.map(lambda j: generate(c.client(), *j, 6), jobs))
        for (name, ids), resp in zip(jobs, resps):
            check_against_reference(refs[name], ids, resp)
        with pytest.raises(StatusError) as e:
            c.store_client().register("head_lora", str(root / "head_lora"))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert "module 'lm_head' has LoRA and base model 'tiny' ties it to the embedding" in e.value.message
    finally:
        c.close()


def test_a_tied_models_slots_take_lm_head_rows_for_other_ids_and_refuse_lm_head_lora_under_tied_rows(hf_model):
    """Loaded straight into a tied model: a shard's lm_head rows for ids unlike its embedding's are the
    lm_head's own; lm_head LoRA beside lm_head rows (its own or the embedding's tied to it), and lm_head
    rows unlike the embedding's for the same ids, are refused before any slot changes."""
    from loraserve.executor.lora import lora_modules
    from loraserve.executor.model.loader import load_hf_checkpoint
    from loraserve.executor.slot_layout import LoraSpec
    from loraserve.executor.slot_load import load_shard_into_slot

    _, path = hf_model("qwen2", tie_word_embeddings=True)
    spec = LoraSpec(max_loras=2, max_rank=8, dtype=torch.float32, trainable_tokens=True, targets_embeddings=True)
    model = load_hf_checkpoint(path, lora=spec)
    rows, hidden = model.token_rows, model.cfg.hidden_size
    head = lora_modules(model)["lm_head"]
    lora = {
        "lm_head.lora_a": torch.ones(head.lora_a.shape[1], 4, head.lora_a.shape[3]),
        "lm_head.lora_b": torch.ones(head.lora_b.shape[1], 4),
    }
    embed = {"tokens.embed.ids": torch.tensor([3, 7], dtype=torch.int32), "tokens.embed.rows": torch.ones(2, hidden)}
    own = {"tokens.lm_head.ids": torch.tensor([7, 9], dtype=torch.int32), "tokens.lm_head.rows": torch.zeros(2, hidden)}
    bad = {
        re.escape(
            "shard has lm_head LoRA and lm_head trainable token rows (its own, or the embedding's the model ties to it), "
            "which are not served (PEFT adds the LoRA to those ids' logits; a slot's rows replace them whole). The store "
            "refuses such an adapter at registration only when it knows the base model: this shard came from a store "
            "started without --base-model-path (start it with one) or from an older store (upgrade it)"
        ): {**embed, **lora},
        "lm_head LoRA and lm_head trainable token rows": {**embed, **own, **lora},
        "lm_head token rows differ from its embedding's for the same ids": {
            **embed, "tokens.lm_head.ids": embed["tokens.embed.ids"], "tokens.lm_head.rows": torch.zeros(2, hidden)
        },
    }  # fmt: skip
    for message, tensors in bad.items():
        with pytest.raises(ValueError, match=message):
            load_shard_into_slot(model, 0, tensors)
    assert rows.slots == [False, False] and not head.lora_a[0].any()
    load_shard_into_slot(model, 0, {**embed, **own})
    assert rows.table[0, [3, 7, 9]].tolist() == [0, 1, -1] and rows.head_ids[0, :3].tolist() == [7, 9, -1]
    assert torch.equal(rows.head[0, :2], own["tokens.lm_head.rows"])

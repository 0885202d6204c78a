"""Model families from the Hub: random Llama 3 (llama3 rope scaling), Qwen2.5 (q/k/v biases),
Qwen3 (q/k norms, head_dim != hidden / heads, tied embeddings) and Mistral (head_dim !=
hidden / heads) built with transformers, loaded into parallel3d at tp 2 x pp 2 x dp 2 (8
gloo ranks, sequence parallelism): the masked loss of a packed batch equals transformers'
loss computed document by document, unpacked, with the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel3d.config import ParallelConfig
from parallel3d.data.batch import IGNORE_INDEX, MicroBatch
from parallel3d.models.llama import Llama
from parallel3d.models.llama.hf import config_from_hf, config_to_hf, name_from_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ = 97, 24  # odd vocabulary: tp pads it; SEQ divisible by tp for sequence parallelism
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _families():
    t = transformers
    return {
        "llama3": (t.LlamaForCausalLM, t.LlamaConfig(**SMALL, rope_parameters={"rope_theta": 5000.0,
                                                                               **LLAMA3_SCALING})),
        "qwen2.5": (t.Qwen2ForCausalLM, t.Qwen2Config(**SMALL)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=True)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**SMALL, head_dim=8)),
    }


def _hf_model(name: str):
    cls, cfg = _families()[name]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(11)
    model = cls(cfg).eval()
    with torch.no_grad():  # biases and norm weights away from 0 and 1, so they are exercised
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _packed_global_batch(seed: int):
    """4 windows of SEQ + 1 tokens, each 2-3 whole documents with a random loss mask (a
    document's first token never trained on). Returns the documents (tokens, mask) and
    the windows as (inputs, targets, positions)."""
    gen = torch.Generator().manual_seed(seed)
    docs, windows = [], []
    for lengths in ([7, 18], [25], [5, 9, 11], [13, 12]):
        assert sum(lengths) == SEQ + 1
        toks, trained = [], []
        for n in lengths:
            t = torch.randint(0, VOCAB, (n,), generator=gen)
            m = torch.rand(n, generator=gen) < 0.6
            m[0] = False
            docs.append((t, m))
            toks.append(t)
            trained.append(m)
        toks, trained = torch.cat(toks), torch.cat(trained)
        positions = torch.cat([torch.arange(n) for n in lengths])[:SEQ]
        targets = torch.where(trained[1:], toks[1:], IGNORE_INDEX)
        windows.append((toks[:-1], targets, positions))
    return docs, windows


def _reference_loss(hf, docs) -> float:
    """transformers, one document at a time: sum of the trained tokens' losses / their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for toks, trained in docs:
            logits = hf(toks[None, :-1]).logits[0]
            per_token = F.cross_entropy(logits.double(), toks[1:], reduction="none")
            total += float(per_token[trained[1:]].sum())
            count += int(trained[1:].sum())
    return total / count


def _packed_loss_3d(hf_config: dict, state: dict, windows: list) -> float:
    """On each of 8 ranks: the model at tp 2 x pp 2 x dp 2 with sequence parallelism, this
    dp rank's two windows as micro-batches of one, the step's loss as the trainer forms it."""
    from parallel3d.distributed import all_reduce
    from parallel3d.models.llama.parallelize import activation_shape, parallelize_llama
    from parallel3d.pipeline import build_schedule
    from parallel3d.topology import Topology

    topo = Topology(2, 2, 2)
    par = ParallelConfig(tp=2, pp=2, dp=2, sequence_parallel=True, schedule="1f1b")
    cfg = config_from_hf(hf_config)
    model = Llama(cfg)
    model.load_state_dict(state, strict=True)
    model, loss_fn = parallelize_llama(model, topo, par)
    schedule = build_schedule(model, loss_fn, topo, par, device=torch.device("cpu"),
                              activation_shape=activation_shape(cfg, 1, SEQ, 2, True))
    supervised = sum(int((t != IGNORE_INDEX).sum()) for _, t, _ in windows)
    mine = windows[2 * topo.dp_rank: 2 * topo.dp_rank + 2]
    batches = [MicroBatch(x[None], t[None], p[None], supervised / topo.dp) for x, t, p in mine]
    loss = schedule.run(batches)  # summed over the pipeline: every rank holds it
    return float(all_reduce(loss.clone(), topo.dp_group) / topo.dp)


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3", "mistral"])
def test_packed_masked_loss_at_2x2x2_equals_transformers_per_document(pools, family):
    hf = _hf_model(family)
    hf_config = hf.config.to_dict()
    cfg = config_from_hf(hf_config)
    assert (cfg.qk_norm, cfg.qkv_bias) == (family == "qwen3", family == "qwen2.5")
    if family in ("qwen3", "mistral"):
        assert cfg.head_dim * cfg.n_heads != cfg.dim
    state = {name_from_hf(k): v for k, v in hf.state_dict().items()}
    docs, windows = _packed_global_batch(seed=len(family))
    want = _reference_loss(hf, docs)
    got = pools(8).run(_packed_loss_3d, hf_config, state, windows)
    # fp32 against a float64 sum of transformers' fp32 logits: the same ops in another
    # order (tp all-reduces, the vocab-parallel softmax, dp mean) differ by ulps; 1e-5
    # relative is the bar.
    for rank_loss in got:
        assert abs(rank_loss - want) / want < 1e-5, (family, rank_loss, want)


def test_family_configs_round_trip_and_refusals():
    for name in ("qwen3", "mistral", "qwen2.5"):
        cfg = config_from_hf(_families()[name][1].to_dict())
        assert config_from_hf(config_to_hf(cfg)) == cfg, name
    biased = config_from_hf(transformers.LlamaConfig(**SMALL, attention_bias=True).to_dict())
    assert biased.qkv_bias and biased.o_bias
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_hf(transformers.Qwen3Config(**SMALL, use_sliding_window=True,
                                                sliding_window=8).to_dict())
    with pytest.raises(ValueError, match=r"unsupported Hugging Face architecture \['Gemma2ForCausalLM'\]"):
        config_from_hf({**config_to_hf(biased), "architectures": ["Gemma2ForCausalLM"]})


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_logits_equal_transformers_packed_and_unpacked(family):
    """One process: logits equal transformers' on whole sequences, and a packed window's
    logits equal each document's own (positions restart, no attention across)."""
    hf = _hf_model(family)
    cfg = config_from_hf(hf.config.to_dict())
    ours = Llama(cfg).eval()
    ours.load_state_dict({name_from_hf(k): v for k, v in hf.state_dict().items()}, strict=True)
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(12), torch.arange(18)]).expand(2, -1)
    with torch.no_grad():
        # fp32, same ops: equal up to reassociation inside SDPA (as test_model_hf.py)
        assert (ours(tokens) - hf(tokens).logits).abs().max() < 1e-5
        packed = ours(tokens, positions=positions)
        alone = torch.cat([hf(tokens[:, :12]).logits, hf(tokens[:, 12:]).logits], dim=1)
        assert (packed - alone).abs().max() < 1e-5
